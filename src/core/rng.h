// Counter-based random numbers: value i of stream `key` is a pure function of (key, i).
//
// So a parameter is initialised from the stream keyed by (seed, canonical name) and any
// slice of it can be drawn alone: every parallel layout starts from bitwise the same
// model. The mixer is SplitMix64's finaliser applied twice (good avalanche, no state).
#pragma once

#include <cstdint>
#include <string_view>

#include "core/tensor.h"

namespace moetrain {

uint64_t hash_string(std::string_view s);  // FNV-1a, 64 bit
uint64_t mix64(uint64_t x);
inline uint64_t stream_key(uint64_t seed, std::string_view name) { return mix64(seed ^ mix64(hash_string(name))); }

// Uniform in (0, 1), never exactly 0 or 1.
double uniform_at(uint64_t key, uint64_t counter);
// Standard normal by Box-Muller on counters 2i and 2i+1.
double normal_at(uint64_t key, uint64_t counter);

// Fills `t` with N(0, std^2) drawn from stream `key`, element j of `t` taking counter
// first_element + j: a shard starting at element e of the full tensor passes e and draws
// exactly the numbers the whole tensor holds there.
void fill_normal(Tensor& t, uint64_t key, double std, int64_t first_element = 0);
// Fills `t` with the box of a tensor of `whole` shape that starts at `start` (t's shape): each
// element takes the counter of its place in the whole, as fill_normal of the whole would.
void fill_normal_box(Tensor& t, uint64_t key, double std, const Shape& whole, const Shape& start);

// A small sequential generator for host-side choices (data sampling), seeded by a key.
class Rng {
 public:
  explicit Rng(uint64_t key) : key_(key) {}
  uint64_t next_u64() { return mix64(key_ + 0x9e3779b97f4a7c15ull * ++counter_); }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next_u64() % n; }
  double uniform() { return uniform_at(key_, ++counter_); }
  uint64_t counter() const { return counter_; }
  void set_counter(uint64_t c) { counter_ = c; }

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
};

}  // namespace moetrain
