#include "engine/data/loader.h"

#include <cstring>

#include "core/error.h"

namespace moetrain {

BatchLoader::BatchLoader(std::vector<int32_t> tokens, int64_t micro_batch, int64_t seq_len, uint64_t seed, Mode mode)
    : tokens_(std::move(tokens)), micro_batch_(micro_batch), seq_len_(seq_len), mode_(mode), rng_(mix64(seed)) {
  MT_CHECK(micro_batch > 0, "BatchLoader: micro_batch must be > 0, got {}", micro_batch);
  MT_CHECK(seq_len > 0, "BatchLoader: seq_len must be > 0, got {}", seq_len);
  const int64_t n = static_cast<int64_t>(tokens_.size());
  MT_CHECK(n >= seq_len + 1, "BatchLoader: the token stream has {} tokens, fewer than seq_len + 1 = {}", n,
           seq_len + 1);
  num_windows_ = (n - 1) / seq_len;
}

Batch BatchLoader::next() {
  const int64_t B = micro_batch_, S = seq_len_;
  Batch b;
  b.batch = B;
  b.seq = S;
  b.num_targets = B * S;
  b.inputs = Tensor::empty({B * S}, DType::I32);
  b.targets = Tensor::empty({B * S}, DType::I32);
  b.positions = Tensor::empty({B * S}, DType::I32);
  int32_t* in = b.inputs.data<int32_t>();
  int32_t* tg = b.targets.data<int32_t>();
  int32_t* pos = b.positions.data<int32_t>();
  const uint64_t max_start = tokens_.size() - static_cast<uint64_t>(S);  // start + S + 1 <= n
  for (int64_t i = 0; i < B; ++i) {
    uint64_t start;
    if (mode_ == Mode::Random) {
      start = rng_.below(max_start);
    } else {
      if (window_ >= static_cast<uint64_t>(num_windows_)) window_ = 0;
      start = window_++ * static_cast<uint64_t>(S);
    }
    std::memcpy(in + i * S, tokens_.data() + start, S * sizeof(int32_t));
    std::memcpy(tg + i * S, tokens_.data() + start + 1, S * sizeof(int32_t));
    for (int64_t t = 0; t < S; ++t) pos[i * S + t] = static_cast<int32_t>(t);
  }
  return b;
}

uint64_t BatchLoader::position() const { return mode_ == Mode::Random ? rng_.counter() : window_; }

void BatchLoader::set_position(uint64_t position) {
  if (mode_ == Mode::Random) {
    rng_.set_counter(position);
  } else {
    window_ = position % static_cast<uint64_t>(num_windows_);
  }
}

}  // namespace moetrain
