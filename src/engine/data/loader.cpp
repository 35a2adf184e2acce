#include "engine/data/loader.h"

#include <cstring>

#include "core/error.h"
#include "ops/ops.h"

namespace moetrain {

Batch Batch::allocate(int64_t batch, int64_t seq, bool with_segments) {
  Batch b;
  b.batch = batch;
  b.seq = seq;
  b.inputs = Tensor::empty({batch * seq}, DType::I32);
  b.targets = Tensor::empty({batch * seq}, DType::I32);
  b.positions = Tensor::empty({batch * seq}, DType::I32);
  if (with_segments) b.segment_ids = Tensor::empty({batch * seq}, DType::I32);
  return b;
}

void Batch::count_targets() {
  const int32_t* tg = targets.data<int32_t>();
  num_targets = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) num_targets += tg[i] != ops::kIgnoreIndex;
}

void Batch::fill_row(int64_t row, const int32_t* tokens) {
  const int64_t S = seq;
  std::memcpy(inputs.data<int32_t>() + row * S, tokens, S * sizeof(int32_t));
  std::memcpy(targets.data<int32_t>() + row * S, tokens + 1, S * sizeof(int32_t));
  int32_t* pos = positions.data<int32_t>() + row * S;
  for (int64_t t = 0; t < S; ++t) pos[t] = static_cast<int32_t>(t);
}

std::vector<int32_t> zigzag_places(int64_t seq, int64_t cp, int64_t rank) {
  MT_CHECK(cp >= 1 && rank >= 0 && rank < cp, "zigzag_places: CP rank {} is not in [0, cp = {})", rank, cp);
  MT_CHECK(seq % (2 * cp) == 0,
           "context parallelism: [training].seq_len ({}) must be a multiple of 2 x [parallel].cp ({}): each sequence "
           "is cut into 2 cp equal chunks",
           seq, 2 * cp);
  const int64_t chunk = seq / (2 * cp);
  std::vector<int32_t> places;
  for (int64_t c : {rank, 2 * cp - 1 - rank}) {
    for (int64_t i = 0; i < chunk; ++i) places.push_back(static_cast<int32_t>(c * chunk + i));
  }
  return places;
}

Batch Batch::to(Device device) const {
  Batch b = *this;
  if (device.is_cpu()) return b;
  for (Tensor* t : {&b.inputs, &b.targets, &b.positions, &b.segment_ids, &b.places, &b.slice_targets}) {
    if (t->defined()) *t = t->to(device);
  }
  for (Tensor& t : b.ahead_inputs) t = t.to(device);
  for (Tensor& t : b.ahead_targets) t = t.to(device);
  return b;
}

Batch TensorSliceLoader::next() { return tensor_slice_batch(inner_->next(), tp_, rank_); }

Batch tensor_slice_batch(Batch b, int64_t tp, int64_t rank) {
  MT_CHECK(b.targets.device().is_cpu(), "tensor slices: the batch must be on the CPU (mark it before moving it)");
  const int64_t T = b.targets.numel();
  MT_CHECK(T % tp == 0, "tensor parallelism: a micro-batch of {} tokens does not split over tp = {} ranks", T, tp);
  const int64_t lo = T / tp * rank, hi = lo + T / tp;
  b.slice_targets = b.targets.clone();
  int32_t* t = b.slice_targets.data<int32_t>();
  b.num_targets = 0;
  for (int64_t i = 0; i < T; ++i) {
    if (i < lo || i >= hi) t[i] = ops::kIgnoreIndex;
    else if (t[i] != ops::kIgnoreIndex) ++b.num_targets;
  }
  return b;
}

Batch zigzag_batch(const Batch& b, int64_t cp, int64_t rank, Tensor* places, int64_t mtp_depth) {
  MT_CHECK(b.inputs.device().is_cpu(), "zigzag_batch: the batch must be on the CPU (cut it before moving it)");
  const std::vector<int32_t> mine = zigzag_places(b.seq, cp, rank);
  const int64_t n = static_cast<int64_t>(mine.size());
  // Row r's token i of the cut batch is token mine[i] of row r: one index for every tensor.
  std::vector<int32_t> from(static_cast<size_t>(b.batch * n)), place(from.size());
  for (int64_t r = 0; r < b.batch; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      place[static_cast<size_t>(r * n + i)] = mine[static_cast<size_t>(i)];
      from[static_cast<size_t>(r * n + i)] = static_cast<int32_t>(r * b.seq + mine[static_cast<size_t>(i)]);
    }
  }
  const Tensor index = Tensor::from_vector(from, {b.batch * n});
  Batch out;
  out.batch = b.batch;
  out.seq = n;
  out.inputs = ops::take_rows(b.inputs, index);
  out.targets = ops::take_rows(b.targets, index);
  out.positions = ops::take_rows(b.positions, index);
  if (b.segment_ids.defined()) out.segment_ids = ops::take_rows(b.segment_ids, index);
  if (places) *places = Tensor::from_vector(place, {b.batch * n});
  for (int64_t k = 1; k <= mtp_depth; ++k) {  // as MtpModule shifts a whole row (mtp.cpp)
    out.ahead_inputs.push_back(ops::take_rows(ops::shift_tokens(b.inputs, b.segment_ids, b.batch, k, 0), index));
    out.ahead_targets.push_back(
        ops::take_rows(ops::shift_tokens(b.targets, b.segment_ids, b.batch, k, ops::kIgnoreIndex), index));
  }
  out.count_targets();
  return out;
}

void check_data_rank(const char* who, int64_t micro_batch, int data_rank, int data_world) {
  MT_CHECK(micro_batch > 0, "{}: micro_batch must be > 0, got {}", who, micro_batch);
  MT_CHECK(data_world >= 1 && data_rank >= 0 && data_rank < data_world,
           "{}: data rank {} is not in [0, data_world = {})", who, data_rank, data_world);
}

std::pair<int64_t, int64_t> epoch_position(const nlohmann::json& p, const char* key, const char* who) {
  const bool ok = p.is_object() && p.contains("epoch") && p.contains(key) && p["epoch"].is_number_integer() &&
                  p[key].is_number_integer();
  MT_CHECK(ok,
           "data position {} is not a position of the {} ({{\"epoch\": e, \"{}\": {}}}); was [data].kind changed "
           "since the checkpoint?",
           p.dump(), who, key, key[0]);
  const int64_t e = p["epoch"].get<int64_t>(), n = p[key].get<int64_t>();
  MT_CHECK(e >= 0 && n >= 0, "data position {}: negative", p.dump());
  return {e, n};
}

BatchLoader::BatchLoader(std::vector<int32_t> tokens, int64_t micro_batch, int64_t seq_len, uint64_t seed, Mode mode,
                         int data_rank, int data_world)
    : tokens_(std::move(tokens)),
      micro_batch_(micro_batch),
      seq_len_(seq_len),
      mode_(mode),
      rank_(data_rank),
      world_(data_world),
      rng_(mix64(seed)) {
  check_data_rank("BatchLoader", micro_batch, data_rank, data_world);
  MT_CHECK(seq_len > 0, "BatchLoader: seq_len must be > 0, got {}", seq_len);
  const int64_t n = static_cast<int64_t>(tokens_.size());
  MT_CHECK(n >= seq_len + 1, "BatchLoader: the token stream has {} tokens, fewer than seq_len + 1 = {}", n,
           seq_len + 1);
  num_windows_ = (n - 1) / seq_len;
}

Batch BatchLoader::next() {
  const int64_t B = micro_batch_, S = seq_len_;
  Batch b = Batch::allocate(B, S, false);
  b.num_targets = B * S;
  const uint64_t max_start = tokens_.size() - static_cast<uint64_t>(S);  // start + S + 1 <= n
  // Every rank draws the starts of the whole global batch (so the generator advances alike
  // everywhere) and copies only its own rows.
  const int64_t first = static_cast<int64_t>(rank_) * B;
  for (int64_t g = 0; g < B * world_; ++g) {
    uint64_t start;
    if (mode_ == Mode::Random) {
      start = rng_.below(max_start);
    } else {
      if (window_ >= static_cast<uint64_t>(num_windows_)) window_ = 0;
      start = window_++ * static_cast<uint64_t>(S);
    }
    if (g >= first && g < first + B) b.fill_row(g - first, tokens_.data() + start);
  }
  return b;
}

uint64_t BatchLoader::position_u64() const { return mode_ == Mode::Random ? rng_.counter() : window_; }

void BatchLoader::set_position(uint64_t position) {
  if (mode_ == Mode::Random) {
    rng_.set_counter(position);
  } else {
    window_ = position % static_cast<uint64_t>(num_windows_);
  }
}

void BatchLoader::set_position(const nlohmann::json& position) {
  MT_CHECK(position.is_number_unsigned() || (position.is_number_integer() && position.get<int64_t>() >= 0),
           "data position {} is not a position of the text loader (a non-negative integer); was [data].kind "
           "changed since the checkpoint?",
           position.dump());
  set_position(position.get<uint64_t>());
}

}  // namespace moetrain
