// TensorBoardWriter: the run's metrics as a TensorBoard event file, so `tensorboard --logdir
// <metrics.dir>/tb` shows them.
//
// The file (<dir>/events.out.tfevents.<unix seconds>.<host>) is a sequence of records, each
// [u64 length][u32 masked CRC-32C of the length][Event message][u32 masked CRC-32C of it],
// little-endian; the first Event names the format version ("brain.Event:2"), the others hold a
// step's scalars and histograms. The messages are encoded by libprotobuf
// (tensorboard_event.proto). Every step's records are flushed at once, so a crash loses
// nothing already written.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace moetrain {

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new event file in it (a resumed run adds a file; TensorBoard
  // reads every file of the folder in order). Throws naming the path if it cannot.
  explicit TensorBoardWriter(const std::string& dir);

  // One Event of scalars at `step` (tag, value).
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // One Event holding a histogram of `values` at `step`: one bucket per distinct integer
  // value range (count-like values: tokens per expert), at most `max_buckets`.
  void histogram(int64_t step, const std::string& tag, const std::vector<double>& values, int max_buckets = 30);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);

  std::string path_;
  std::ofstream out_;
};

// CRC-32C (Castagnoli) of `n` bytes, and TensorBoard's masked form of it
// (((crc >> 15) | (crc << 17)) + 0xa282ead8).
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

}  // namespace moetrain
