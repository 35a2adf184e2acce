// Launcher of the multi-tensor AdamW kernel (adamw.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/adamw_math.h"

namespace moetrain::ops::cuda {

// n elements that lie back to back in every role: f32 master weights, gradients, moments
// (f32, or bf16 when AdamWArgs::bf16_moments), and optionally the bf16 weight that receives
// the updated master rounded. A split master (low not null, param null): value and low are
// its two halves (adamw_math.h), read and written.
struct AdamWSegment {
  float* param;
  const float* grad;
  void* m;
  void* v;
  __nv_bfloat16* value;  // may be null (not with low)
  int64_t n;
  double weight_decay;
  int64_t index_base;  // m's storage offset: bf16 rounding keys on index_base + k, not on k
  int16_t* low;        // the low halves of a split master, or null
};

struct AdamWArgs {
  AdamWConstants c;
  int64_t step;       // seeds the stochastic rounding of bf16 moments
  bool bf16_moments;  // m and v of every segment are bf16, stored by stochastic rounding
};

// In place, each element as the CPU reference (ops/adamw_math.h, the same bits), value =
// bf16(p) (bf16 moments: rounded stochastically, stochastic_round.h, keyed by the element's
// index in its segment).
// All segments in a few launches (segments travel in the kernel's parameters). max_sms > 0:
// at most that many blocks of 1024 threads, one per multiprocessor, sweep the segments, and
// the other multiprocessors stay free; 0: a 256-thread block per chunk, all of them.
void launch_adamw(const AdamWSegment* segments, int count, const AdamWArgs& args, int max_sms, cudaStream_t s);

}  // namespace moetrain::ops::cuda
