// Next-token batches of random ids for the model tests.
#pragma once

#include <vector>

#include "engine/data/loader.h"
#include "ops/ops.h"
#include "test_util.h"

namespace moetrain::testing {

// `rows` x `seq` random ids in [0, vocab) with random targets (streams `seed` and `seed` + 1),
// positions restarting at 0 in every row; target `ignored` (when >= 0) is -100.
inline Batch random_batch(int64_t rows, int64_t seq, int32_t vocab, uint64_t seed, int64_t ignored = -1) {
  Batch b;
  b.batch = rows;
  b.seq = seq;
  b.inputs = random_ints({rows * seq}, 0, vocab, seed);
  b.targets = random_ints({rows * seq}, 0, vocab, seed + 1);
  if (ignored >= 0) b.targets.data<int32_t>()[ignored] = ops::kIgnoreIndex;
  std::vector<int32_t> pos(static_cast<size_t>(rows * seq));
  for (int64_t i = 0; i < rows * seq; ++i) pos[i] = static_cast<int32_t>(i % seq);
  b.positions = Tensor::from_vector(pos, {rows * seq});
  b.count_targets();
  return b;
}

}  // namespace moetrain::testing
