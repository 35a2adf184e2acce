// The moetrain checkpoint directory: what is in it and how to read any part of it back.
//
//   step-0000100/
//     model-r00000.safetensors       model tensors (canonical HF names) owned by rank 0
//     optimizer-r00000.safetensors   "<name>.master" (f32), "<name>.exp_avg", "<name>.exp_avg_sq"
//     manifest-r00000.json           what rank 0 wrote: its files (bytes, XXH3) and slices
//     index.json                     all ranks merged (below)
//     trainer_state.json             step, data position, optimizer step, config, version
//     config.json                    the model's HF config (from trainer_state's "hf_config")
//
// index.json keeps the keys of HF's model.safetensors.index.json ("metadata", "weight_map":
// model tensor -> file, a list of files when sliced) and adds "tensors" (each tensor's dtype,
// global shape and slices: file, start offset per dim, shape) and "files" (bytes, XXH3-64).
// A rank writes only the slices it owns; a reader asks for any box of any tensor and gets it
// assembled from whichever slices overlap it, so a checkpoint written under one layout loads
// under any other.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "engine/checkpoint/safetensors.h"

namespace moetrain {

// One box of a global tensor, held by the rank that writes it: a host tensor, or bytes that
// outlive the write (a tensor inside a mapped file: conversion copies nothing).
struct TensorSlice {
  std::string name;
  Shape global_shape;
  Shape start;  // per dim; empty means all zeros
  // When >= 0: the slice is not a box but the elements [flat_begin, flat_begin + numel) of
  // the row-major flattened tensor (a sharded optimizer's piece), held 1-D; start is unused.
  // It is stored as one 1-D entry and indexed as the boxes element_range_boxes gives.
  int64_t flat_begin = -1;
  Tensor data;  // host tensor, shape = the box's shape (or undefined, then:)
  const void* bytes = nullptr;
  DType dtype = DType::F32;
  Shape shape;

  DType slice_dtype() const { return data.defined() ? data.dtype() : dtype; }
  const Shape& slice_shape() const { return data.defined() ? data.shape() : shape; }
  const void* slice_bytes() const { return data.defined() ? data.raw() : bytes; }
};

// The fewest boxes (start, shape) that tile elements [begin, end) of a row-major tensor of
// `shape`, in memory order; each is contiguous in memory.
std::vector<std::pair<Shape, Shape>> element_range_boxes(const Shape& shape, int64_t begin, int64_t end);

// A tensor that is whole on this rank.
TensorSlice whole_slice(std::string name, Tensor host_data);
TensorSlice whole_slice(std::string name, DType dtype, Shape shape, const void* bytes);

// The name of one of a rank's files: rank_file_name("manifest", 3, "json") is
// "manifest-r00003.json"; kinds "model" and "optimizer" with "safetensors".
std::string rank_file_name(const char* kind, int rank, const char* ext);

// Writes `text` to `path` and fsyncs it; throws naming the path.
void write_text_synced(const std::filesystem::path& path, const std::string& text);
// The same under `path`.part, then renamed to `path`: a reader polling for the file (another
// rank) finds it whole or not at all.
void write_text_whole(const std::filesystem::path& path, const std::string& text);

// Writes rank `rank`'s files into `dir` (which must exist): model and optimizer safetensors
// (fsynced), then its manifest, atomically (written aside, then renamed): a manifest that
// exists is complete, which is how the committing rank knows this rank is done.
void write_rank_files(const std::string& dir, int rank, const std::vector<TensorSlice>& model,
                      const std::vector<TensorSlice>& optimizer);

// Merges the manifests of ranks 0..world-1 into dir/index.json and writes
// dir/trainer_state.json. Checks that the slices of every tensor tile its global shape
// exactly (no gap, no overlap) and that all ranks agree on dtype and global shape.
void write_index(const std::string& dir, int world, const nlohmann::json& trainer_state);

// Reads tensors out of a committed moetrain checkpoint directory or a Hugging Face model
// folder (model.safetensors, or shards listed by model.safetensors.index.json). Opening
// checks that every file exists with the size the index records; a file's XXH3 checksum is
// verified the first time a tensor is read from it. Every error names the file and tensor.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir);
  ~CheckpointReader();

  struct TensorInfo {
    std::string kind = "model";  // "model" or "optimizer"
    DType dtype = DType::F32;
    Shape shape;  // global
    struct Slice {
      std::string file;
      Shape start, shape;
      int64_t offset = 0;  // elements into the file's entry where this box begins
    };
    std::vector<Slice> slices;
  };

  const std::string& dir() const { return dir_; }
  bool is_hf() const { return hf_; }
  bool has(const std::string& name) const { return tensors_.count(name) > 0; }
  const TensorInfo& info(const std::string& name) const;
  std::vector<std::string> names() const;
  // Bytes of all the checkpoint's tensor files.
  uint64_t total_bytes() const;
  // trainer_state.json (an empty object for an HF folder).
  const nlohmann::json& trainer_state() const { return trainer_state_; }

  // Fills `dst` (host or device, any float dtype: converted from the stored one) with the
  // box of tensor `name` that starts at `start` (all zeros when empty) and has dst's shape.
  void read(const std::string& name, Tensor& dst, const Shape& start = {});
  // The whole tensor as stored (host, stored dtype).
  Tensor read_whole(const std::string& name);

 private:
  void read_index(const std::string& idx);
  const SafetensorsFile& open_file(const std::string& file);

  std::string dir_;
  bool hf_ = false;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, uint64_t> file_bytes_;
  std::map<std::string, std::string> file_xxh3_;  // empty for HF folders (no checksums there)
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
  nlohmann::json trainer_state_;
};

// fsyncs a directory (its entries: a rename into it, a file created in it).
void fsync_dir(const std::string& dir);

// Throws naming the directory when `dir` is not a moetrain checkpoint or HF model folder.
bool is_checkpoint_dir(const std::string& dir);
bool is_hf_model_dir(const std::string& dir);
// Whether the HF model folder `dir` holds a tensor named `name`, by its index's weight_map
// or model.safetensors' header alone: an FP8 folder too, which CheckpointReader refuses.
bool hf_folder_has_tensor(const std::string& dir, const std::string& name);

}  // namespace moetrain
