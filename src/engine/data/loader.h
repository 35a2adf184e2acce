// Batches of next-token-prediction examples, and the loaders that make them.
//
// Batch: `batch` sequences of `seq` tokens, sequence-major. inputs[t] predicts targets[t];
// a target of -100 (ops::kIgnoreIndex) is not trained. segment_ids, when defined, confines
// attention to tokens of the same segment (one packed document each); undefined means plain
// causal attention over the whole sequence.
//
// DataLoader: the interface the trainer draws micro-batches from. Every loader follows the
// data-parallel contract: built with (data_rank, data_world), each next() deterministically
// forms the GLOBAL micro-batch of micro_batch * data_world sequences, the same on every
// rank, and returns rows [data_rank * micro_batch, (data_rank + 1) * micro_batch) of it. So
// data_world ranks of micro_batch see exactly what one process of micro_batch * data_world
// sees, and position() (a JSON number or small object) is the same on every rank: a
// checkpoint stores it once and any layout resumes from it.
//
// BatchLoader: the loader of one in-memory token stream (the "text" data kind):
//   Mode::Random      each sequence starts at an offset drawn from moetrain::Rng
//                     (training); the position is the generator's counter.
//   Mode::Sequential  non-overlapping windows from the start of the stream, wrapping
//                     around (validation); reset() starts over, the position is the next
//                     window.
// inputs[t] = tokens[s + t], targets[t] = tokens[s + t + 1], positions[t] = t.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <memory>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain {

struct Batch {
  Tensor inputs, targets, positions;  // i32 [batch * seq], sequence-major
  Tensor segment_ids;                 // i32 [batch * seq], or undefined: plain causal
  // Context parallelism: each token's place in its whole sequence (i32 [batch * seq]; this
  // rank holds some chunks of every sequence: zigzag_batch), or undefined: token i of a row
  // is at place i.
  Tensor places;
  // Context parallelism with multi-token prediction: for depth k (element k - 1), the
  // inputs and targets k places ahead in the whole row (ops::shift_tokens of the row before
  // it was cut: a chunk's last tokens look into another rank's chunk), at this rank's places.
  std::vector<Tensor> ahead_inputs, ahead_targets;
  // Tensor parallelism: the targets with every row outside this tp rank's sequence-parallel
  // slice set to -100, the rows whose loss it counts (num_targets counts them; every tp rank
  // still needs every row's target for its vocabulary columns' gradient). Undefined: all.
  Tensor slice_targets;
  int64_t batch = 0, seq = 0;
  int64_t num_targets = 0;  // targets that count in the loss (!= -100)

  // Empty tensors of batch x seq; the caller fills them.
  static Batch allocate(int64_t batch, int64_t seq, bool with_segments);
  // Sets num_targets from the targets.
  void count_targets();
  // The batch with every tensor on `device` (itself when that is the CPU).
  Batch to(Device device) const;
  // Row `row` of a next-token batch from seq + 1 consecutive tokens: inputs the first seq,
  // targets the last seq, positions 0 .. seq - 1.
  void fill_row(int64_t row, const int32_t* tokens);
};

// Context parallelism (docs/memory.md): the places in a sequence of `seq` tokens that CP rank
// `rank` of `cp` holds: the sequence cut into 2 cp equal chunks, the rank taking chunks rank
// and 2 cp - 1 - rank (the zigzag: every rank as much causal attention work), in order. An
// Error names the numbers when seq is not a multiple of 2 cp.
std::vector<int32_t> zigzag_places(int64_t seq, int64_t cp, int64_t rank);
// The rows of `b` at CP rank `rank`'s places (inputs, targets, positions, segments), each row
// seq / cp tokens; `places` (i32 [batch * seq / cp]) gets each token's place in its sequence,
// which the attention over blocks masks by (ops::AttentionPlaces). num_targets: this rank's.
// mtp_depth: the multi-token prediction modules whose shifted tokens (Batch::ahead_inputs,
// ahead_targets) it cuts too.
Batch zigzag_batch(const Batch& b, int64_t cp, int64_t rank, Tensor* places, int64_t mtp_depth = 0);

class DataLoader {
 public:
  virtual ~DataLoader() = default;
  // This rank's rows of the next global micro-batch.
  virtual Batch next() = 0;
  // Back to the start (validation walks the same batches each time).
  virtual void reset() = 0;
  // Where the next global micro-batch starts: the same on every rank; set_position() of a
  // loader built on the same data continues with exactly the sequences that would have
  // come next. Throws naming the position when it does not fit the data.
  virtual nlohmann::json position() const = 0;
  virtual void set_position(const nlohmann::json& position) = 0;
};

// A loader whose batches are CP rank `rank`'s zigzag chunks of `inner`'s (the same rows on
// every rank of the CP group), with their places.
class ZigzagLoader final : public DataLoader {
 public:
  ZigzagLoader(std::unique_ptr<DataLoader> inner, int64_t cp, int64_t rank, int64_t mtp_depth = 0)
      : inner_(std::move(inner)), cp_(cp), rank_(rank), mtp_depth_(mtp_depth) {}
  Batch next() override {
    Tensor places;
    Batch b = zigzag_batch(inner_->next(), cp_, rank_, &places, mtp_depth_);
    b.places = std::move(places);
    return b;
  }
  void reset() override { inner_->reset(); }
  nlohmann::json position() const override { return inner_->position(); }
  void set_position(const nlohmann::json& position) override { inner_->set_position(position); }

 private:
  std::unique_ptr<DataLoader> inner_;
  int64_t cp_, rank_, mtp_depth_;
};

// Tensor parallelism: `b` (the same rows on every rank of the tp group) with tp rank `rank`'s
// slice of its token rows marked (Batch::slice_targets, and num_targets: the slice's).
Batch tensor_slice_batch(Batch b, int64_t tp, int64_t rank);

// A loader of `inner`'s batches as tensor_slice_batch marks them.
class TensorSliceLoader final : public DataLoader {
 public:
  TensorSliceLoader(std::unique_ptr<DataLoader> inner, int64_t tp, int64_t rank)
      : inner_(std::move(inner)), tp_(tp), rank_(rank) {}
  Batch next() override;
  void reset() override { inner_->reset(); }
  nlohmann::json position() const override { return inner_->position(); }
  void set_position(const nlohmann::json& position) override { inner_->set_position(position); }

 private:
  std::unique_ptr<DataLoader> inner_;
  int64_t tp_, rank_;
};

class BatchLoader final : public DataLoader {
 public:
  enum class Mode { Random, Sequential };

  // Keeps its own copy of `tokens` (pass an rvalue to move it in). Throws when the stream
  // is shorter than seq_len + 1 tokens.
  BatchLoader(std::vector<int32_t> tokens, int64_t micro_batch, int64_t seq_len, uint64_t seed, Mode mode,
              int data_rank = 0, int data_world = 1);

  Batch next() override;
  void reset() override { set_position(uint64_t{0}); }
  // Random: the generator counter; Sequential: the index of the next window.
  nlohmann::json position() const override { return position_u64(); }
  void set_position(const nlohmann::json& position) override;
  uint64_t position_u64() const;
  void set_position(uint64_t position);

  // Sequential: how many distinct windows the stream holds before wrapping.
  int64_t num_windows() const { return num_windows_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  std::vector<int32_t> tokens_;
  int64_t micro_batch_, seq_len_;
  Mode mode_;
  int rank_, world_;
  Rng rng_;
  int64_t num_windows_;
  uint64_t window_ = 0;  // Sequential cursor
};

// Checks (rank, world) and the micro-batch size, naming `who` in the error.
void check_data_rank(const char* who, int64_t micro_batch, int data_rank, int data_world);

// Reads a loader position {"epoch": e, <key>: n} (both non-negative integers); an error
// names the position and `who`'s expected form.
std::pair<int64_t, int64_t> epoch_position(const nlohmann::json& p, const char* key, const char* who);

}  // namespace moetrain
