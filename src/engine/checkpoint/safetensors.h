// The safetensors file format (Hugging Face's weight files), read and written by hand.
//
// Layout: 8 bytes little-endian N, then N bytes of JSON header, then the tensor bytes.
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets into the bytes after the header) and may hold "__metadata__": {string: string}.
// Readers here trust nothing: every field is checked, the offsets must tile the data
// region exactly (no gap, no overlap, as the reference implementation requires), and each
// error names the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

// "F32", "BF16", ...: the safetensors dtype names of the dtypes moetrain holds.
std::string safetensors_dtype_name(DType t);
// The inverse; false for a dtype moetrain does not hold (F16, F8_E4M3, U8, ...).
bool parse_safetensors_dtype(const std::string& name, DType* out);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;  // meaningless when f8_e4m3
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range within the data region
  // Stored as F8_E4M3 (DeepSeek's FP8 checkpoints: one byte an element, dequantized with a
  // weight_scale_inv by the importer, hf_convert.h); read() refuses it.
  bool f8_e4m3 = false;
};


// Writes one safetensors file. Tensors are added by reference to host bytes that must stay
// alive until write() returns; write() returns the file's size and its XXH3-64 checksum
// (computed on the bytes as they are written: no second read).
class SafetensorsWriter {
 public:
  void add(const std::string& name, DType dtype, const Shape& shape, const void* data);
  void add(const std::string& name, const Tensor& cpu_tensor);
  void set_metadata(std::map<std::string, std::string> metadata) { metadata_ = std::move(metadata); }

  struct Written {
    uint64_t bytes = 0;
    uint64_t xxh3 = 0;
  };
  // Writes `path` and fsyncs it when `sync` (a checkpoint commit needs the bytes on disk
  // before the directory is renamed).
  Written write(const std::string& path, bool sync = true) const;

 private:
  struct Item {
    std::string name;
    DType dtype;
    Shape shape;
    const void* data;
  };
  std::vector<Item> items_;
  std::map<std::string, std::string> metadata_;
};

// A safetensors file opened read-only through mmap. Opening parses and validates the header;
// tensor bytes are only touched when read.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in header order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when the file has no tensor of that name.
  const SafetensorsEntry* find(const std::string& name) const;
  // The tensor's bytes inside the mapping.
  const void* data(const SafetensorsEntry& e) const;
  // A CPU tensor holding a copy (dtype as stored).
  Tensor read(const std::string& name) const;
  // XXH3-64 of the whole file.
  uint64_t checksum() const;

 private:
  std::string path_;
  int fd_ = -1;
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// XXH3-64 of a byte range, and its 16-hex-digit text.
uint64_t xxh3_bytes(const void* data, size_t bytes);
std::string hex64(uint64_t v);

}  // namespace moetrain
