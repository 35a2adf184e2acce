// What every libFuzzer harness shares: the readers under test take paths, so each input is
// written to one file in /dev/shm (rewritten per input, removed at exit).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace moetrain::fuzz {

inline std::string input_file(const uint8_t* data, size_t size, const char* suffix) {
  struct Scratch {
    std::string path;
    ~Scratch() { std::remove(path.c_str()); }
  };
  static const Scratch scratch{"/dev/shm/moetrain-fuzz-" + std::to_string(::getpid()) + suffix};
  const std::string& path = scratch.path;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();  // no scratch file: the harness cannot run
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace moetrain::fuzz
