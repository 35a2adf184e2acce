// BatchLoader: cuts micro-batches of next-token-prediction examples out of one token stream.
//
// Each batch holds `micro_batch` sequences of `seq_len` tokens: inputs[t] = tokens[s + t],
// targets[t] = tokens[s + t + 1], positions[t] = t (0..seq_len-1 per sequence), where s is
// the sequence's start offset.
//   Mode::Random      each start is drawn uniformly from moetrain::Rng (training); the
//                     state is the generator's counter, so position()/set_position() let a
//                     checkpoint resume the exact same batches.
//   Mode::Sequential  non-overlapping windows from the start of the stream, wrapping around
//                     (validation); reset() starts over, position() is the next window.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain {

struct Batch {
  Tensor inputs, targets, positions;  // i32 [batch * seq], sequence-major
  int64_t batch = 0, seq = 0;
  int64_t num_targets = 0;  // targets that count in the loss (all of them, for now)
};

class BatchLoader {
 public:
  enum class Mode { Random, Sequential };

  // Keeps its own copy of `tokens` (pass an rvalue to move it in). Throws when the stream
  // is shorter than seq_len + 1 tokens.
  BatchLoader(std::vector<int32_t> tokens, int64_t micro_batch, int64_t seq_len, uint64_t seed, Mode mode);

  Batch next();

  // Random: the generator counter; Sequential: the index of the next window.
  uint64_t position() const;
  void set_position(uint64_t position);
  void reset() { set_position(0); }

  // Sequential: how many distinct windows the stream holds before wrapping.
  int64_t num_windows() const { return num_windows_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  std::vector<int32_t> tokens_;
  int64_t micro_batch_, seq_len_;
  Mode mode_;
  Rng rng_;
  int64_t num_windows_;
  uint64_t window_ = 0;  // Sequential cursor
};

}  // namespace moetrain
