// Reads a TensorBoard event file back for tests: checks every record's framing (length and
// both masked CRC-32Cs) and decodes its Event with libprotobuf, independently of the writer's
// encoding path.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "engine/telemetry/tensorboard.h"
#include "tensorboard_event.pb.h"

namespace moetrain::testing {

inline std::vector<tb::Event> read_tensorboard_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.is_open()) << path;
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<tb::Event> events;
  size_t at = 0;
  auto u32 = [&](size_t p) {
    uint32_t v = 0;
    std::memcpy(&v, bytes.data() + p, 4);  // little-endian machines only, as the format
    return v;
  };
  while (at < bytes.size()) {
    if (bytes.size() - at < 12) {
      ADD_FAILURE() << path << ": a truncated record header at byte " << at;
      break;
    }
    uint64_t len = 0;
    std::memcpy(&len, bytes.data() + at, 8);
    EXPECT_EQ(u32(at + 8), masked_crc32c(bytes.data() + at, 8)) << path << ": length CRC at byte " << at;
    if (bytes.size() - at < 16 + len) {
      ADD_FAILURE() << path << ": a truncated record at byte " << at;
      break;
    }
    const std::string data = bytes.substr(at + 12, len);
    EXPECT_EQ(u32(at + 12 + len), masked_crc32c(data.data(), data.size())) << path << ": data CRC at byte " << at;
    tb::Event e;
    EXPECT_TRUE(e.ParseFromString(data)) << path << ": record at byte " << at << " is not an Event";
    events.push_back(e);
    at += 16 + len;
  }
  return events;
}

// The one event file in `dir`.
inline std::string only_event_file(const std::filesystem::path& dir) {
  std::vector<std::string> found;
  if (std::filesystem::is_directory(dir)) {
    for (const auto& f : std::filesystem::directory_iterator(dir)) {
      if (f.path().filename().string().rfind("events.out.tfevents.", 0) == 0) found.push_back(f.path().string());
    }
  }
  EXPECT_EQ(found.size(), 1u) << dir;
  return found.empty() ? std::string() : found[0];
}

}  // namespace moetrain::testing
