// Multi-tensor AdamW on f32 master weights and f32 (or bf16) moments.
//
// Floor: the step is memory-bound. Per element it reads grad, master, m, v (16 B) and writes
// master, m, v (12 B) plus the bf16 weight (2 B): 30 B, so 2.63e9 parameters (the bench
// model) move 79 GB, 24 ms at the H100's 3.35 TB/s. A split master (the bf16 weight and a
// 16-bit low half: adamw_math.h) reads and writes 4 B for master and weight: 28 B, 74 GB.
// bf16 moments ([optimizer].moments = "bf16") read and write 4 B less each. The arithmetic (f32, ~15
// operations, a division and a square root an element: ops/adamw_math.h) is hidden on the
// whole GPU; on the few multiprocessors of a capped launch it is what bounds each of them.
//
// Work split: a launch carries up to kMaxSegments segments in its parameters; each segment is
// cut into chunks of kChunk elements, a block per chunk (the kernel would also stride over
// them), so one launch covers a whole expert stack or the whole model. A capped launch
// (max_sms) instead runs one 1024-thread block on each of max_sms multiprocessors, sweeping
// the segments together (adamw_sweep_kernel), and leaves the others to other streams.
// Threads of a block take 4 consecutive elements (16-byte accesses) when the segment is
// aligned. No reduction: the result does not depend on the launch shape.
#include "ops/cuda/adamw_launch.h"
#include "ops/cuda/vec_io.cuh"
#include "ops/stochastic_round.h"

namespace moetrain::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kCappedThreads = 1024;
constexpr int64_t kChunk = 16384;  // elements per block task: 64 per thread
constexpr int kMaxSegments = 40;   // 40 x 72 B + chunk offsets + args: within the 4 KB parameter space

struct SegmentBatch {
  AdamWSegment seg[kMaxSegments];
  int64_t first_chunk[kMaxSegments + 1];  // prefix sums of the segments' chunk counts
  int count;
};
static_assert(sizeof(SegmentBatch) + sizeof(AdamWArgs) <= 4096, "a launch's segments must fit its parameters");

// Moments in f32, or in bf16 by stochastic rounding (stream 0 for m, 1 for v).
__device__ __forceinline__ void store_moment(float& dst, float x, int64_t, int64_t, uint32_t) { dst = x; }
__device__ __forceinline__ void store_moment(__nv_bfloat16& dst, float x, int64_t index, int64_t step,
                                             uint32_t stream) {
  dst = __ushort_as_bfloat16(bf16_bits_stochastic(__float_as_uint(x), rounding_bits(index, step, stream)));
}
__device__ __forceinline__ float load_moment(float x) { return x; }
__device__ __forceinline__ float load_moment(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename M>
__device__ __forceinline__ float adamw_one(float& p, float g, M& m, M& v, const AdamWArgs& a, float wd, int64_t k) {
  float mi = load_moment(m), vi = load_moment(v);
  adamw_element(p, g, mi, vi, wd, a.c);
  store_moment(m, mi, k, a.step, 0);
  store_moment(v, vi, k, a.step, 1);
  return p;
}

// Four moments at once: 16 bytes of f32 or 8 of bf16.
template <typename M>
struct Moments4;
template <>
struct Moments4<float> {
  float e[4];
  __device__ __forceinline__ void load(const float* src) { *reinterpret_cast<float4*>(e) = *reinterpret_cast<const float4*>(src); }
  __device__ __forceinline__ void store(float* dst) const { *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(e); }
};
template <>
struct Moments4<__nv_bfloat16> {
  __nv_bfloat16 e[4];
  __device__ __forceinline__ void load(const __nv_bfloat16* src) { *reinterpret_cast<uint2*>(e) = *reinterpret_cast<const uint2*>(src); }
  __device__ __forceinline__ void store(__nv_bfloat16* dst) const { *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(e); }
};

// Elements [lo, end) of segment g, shared by `lanes` threads of which this is `lane`: four
// consecutive elements a thread (16-byte accesses) when the segment is aligned, kGroups
// groups of four loaded before any is computed (more bytes in flight per thread).
// kSplit: the master is g.value and g.low (g.param is null).
template <typename M, int kGroups, bool kSplit>
__device__ __forceinline__ void update_range(const AdamWSegment& g, const AdamWArgs& a, int64_t lo, int64_t end,
                                             int64_t lane, int64_t lanes) {
  M* gm = static_cast<M*>(g.m);
  M* gv = static_cast<M*>(g.v);
  uint16_t* high = reinterpret_cast<uint16_t*>(g.value);
  const float wd = static_cast<float>(g.weight_decay);
  constexpr uintptr_t kMomentAlign = 4 * sizeof(M);
  const bool vec = (kSplit || aligned16(g.param)) && aligned16(g.grad) &&
                   reinterpret_cast<uintptr_t>(gm) % kMomentAlign == 0 &&
                   reinterpret_cast<uintptr_t>(gv) % kMomentAlign == 0 &&
                   (reinterpret_cast<uintptr_t>(g.value) & 7u) == 0 && (reinterpret_cast<uintptr_t>(g.low) & 7u) == 0;
  auto one = [&](int64_t k) {
    if constexpr (kSplit) {
      float p = master_join(high[k], g.low[k]);
      adamw_one(p, g.grad[k], gm[k], gv[k], a, wd, g.index_base + k);
      master_split(p, high[k], g.low[k]);
    } else {
      const float p = adamw_one(g.param[k], g.grad[k], gm[k], gv[k], a, wd, g.index_base + k);
      if (g.value) g.value[k] = __float2bfloat16_rn(p);
    }
  };
  if (!vec) {
    for (int64_t k = lo + lane; k < end; k += lanes) one(k);
    return;
  }
  // Four elements at i: update and store what load4 read.
  struct Four {
    float4 p, gr;
    Moments4<M> m, v;
  };
  auto load4 = [&](Four& f, int64_t i) {
    if constexpr (kSplit) {
      const uint2 h = *reinterpret_cast<const uint2*>(high + i), l = *reinterpret_cast<const uint2*>(g.low + i);
      f.p = make_float4(master_join(h.x & 0xffffu, static_cast<int16_t>(l.x & 0xffffu)),
                        master_join(h.x >> 16, static_cast<int16_t>(l.x >> 16)),
                        master_join(h.y & 0xffffu, static_cast<int16_t>(l.y & 0xffffu)),
                        master_join(h.y >> 16, static_cast<int16_t>(l.y >> 16)));
    } else {
      f.p = *reinterpret_cast<const float4*>(g.param + i);
    }
    f.gr = *reinterpret_cast<const float4*>(g.grad + i);
    f.m.load(gm + i);
    f.v.load(gv + i);
  };
  auto update4 = [&](Four& f, int64_t i) {
    adamw_one(f.p.x, f.gr.x, f.m.e[0], f.v.e[0], a, wd, g.index_base + i);
    adamw_one(f.p.y, f.gr.y, f.m.e[1], f.v.e[1], a, wd, g.index_base + i + 1);
    adamw_one(f.p.z, f.gr.z, f.m.e[2], f.v.e[2], a, wd, g.index_base + i + 2);
    adamw_one(f.p.w, f.gr.w, f.m.e[3], f.v.e[3], a, wd, g.index_base + i + 3);
    f.m.store(gm + i);
    f.v.store(gv + i);
    if constexpr (kSplit) {
      __align__(8) uint16_t h[4];
      __align__(8) int16_t l[4];
      master_split(f.p.x, h[0], l[0]);
      master_split(f.p.y, h[1], l[1]);
      master_split(f.p.z, h[2], l[2]);
      master_split(f.p.w, h[3], l[3]);
      *reinterpret_cast<uint2*>(high + i) = *reinterpret_cast<const uint2*>(h);
      *reinterpret_cast<uint2*>(g.low + i) = *reinterpret_cast<const uint2*>(l);
      return;
    }
    *reinterpret_cast<float4*>(g.param + i) = f.p;
    if (g.value) {
      __nv_bfloat162 h[2] = {__floats2bfloat162_rn(f.p.x, f.p.y), __floats2bfloat162_rn(f.p.z, f.p.w)};
      *reinterpret_cast<uint2*>(g.value + i) = *reinterpret_cast<const uint2*>(h);
    }
  };
  const int64_t stride = lanes * 4;
  int64_t i = lo + lane * 4;
  if constexpr (kGroups == 2) {
    for (; i + stride + 4 <= end; i += 2 * stride) {
      Four f0, f1;
      load4(f0, i);
      load4(f1, i + stride);
      update4(f0, i);
      update4(f1, i + stride);
    }
  }
  for (; i + 4 <= end; i += stride) {
    Four f;
    load4(f, i);
    update4(f, i);
  }
  // i lands on the last group's start (lo and the stride are multiples of 4) for exactly one
  // thread: it does the < 4 elements left.
  for (int64_t k = i; k < end; ++k) one(k);
}

// A block of kThreads per chunk. bf16 moments: two groups a trip (this kernel waits on DRAM
// latency with its occupancy capped by registers; bench_ops BM_AdamWExpertLayer/1: 2.53 ->
// 2.78 TB/s); with f32 moments a group already moves 56 bytes and a second one measured no
// faster.
template <typename M>
__global__ void __launch_bounds__(kThreads) adamw_chunks_kernel(const __grid_constant__ SegmentBatch b,
                                                                const AdamWArgs a) {
  const int64_t total = b.first_chunk[b.count];
  int s = 0;
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    while (c >= b.first_chunk[s + 1]) ++s;  // chunks ascend, so the segment only moves forward
    const int64_t begin = (c - b.first_chunk[s]) * kChunk;
    const int64_t end = min(b.seg[s].n, begin + kChunk);
    if (b.seg[s].low) update_range<M, sizeof(M) == 2 ? 2 : 1, true>(b.seg[s], a, begin, end, threadIdx.x, kThreads);
    else update_range<M, sizeof(M) == 2 ? 2 : 1, false>(b.seg[s], a, begin, end, threadIdx.x, kThreads);
  }
}

// The capped grid: gridDim.x blocks of kCappedThreads (one per multiprocessor) sweep each
// segment together, front to back, two groups a thread in flight: with fewer resident threads
// a multiprocessor than the chunked launch (1024 against ~1500), each must keep more bytes
// outstanding. Measured against the alternatives on 32 multiprocessors (bench_ops
// BM_AdamWExpertLayer/0/32): 2.76 TB/s, where blocks taking whole chunks from a counter
// reached 2.26 (the barrier at each chunk empties the loads in flight) and blocks striding
// over chunks 2.09 (66 chunks 480 KB apart at once).
template <typename M>
__global__ void __launch_bounds__(kCappedThreads) adamw_sweep_kernel(const __grid_constant__ SegmentBatch b,
                                                                     const AdamWArgs a) {
  const int64_t lane = static_cast<int64_t>(blockIdx.x) * kCappedThreads + threadIdx.x;
  const int64_t lanes = static_cast<int64_t>(gridDim.x) * kCappedThreads;
  for (int s = 0; s < b.count; ++s) {
    if (b.seg[s].low) update_range<M, 2, true>(b.seg[s], a, 0, b.seg[s].n, lane, lanes);
    else update_range<M, 2, false>(b.seg[s], a, 0, b.seg[s].n, lane, lanes);
  }
}

// Dynamic shared memory that keeps kKernel's 1024-thread blocks one a multiprocessor: none
// when its registers already do (asked once per kernel, on the first device that launches it;
// a template on the kernel itself, so that each kernel has its own answer).
template <auto kKernel>
size_t alone_smem() {
  static const size_t bytes = [] {
    int blocks = 0, device = 0, smem = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kCappedThreads, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess) {
      return size_t{0};  // the launch reports any real error
    }
    if (blocks <= 1) return size_t{0};
    const int bytes = smem / 2 + 1024;
    if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) {
      return size_t{0};
    }
    return static_cast<size_t>(bytes);
  }();
  return bytes;
}

}  // namespace

void launch_adamw(const AdamWSegment* segments, int count, const AdamWArgs& args, int max_sms, cudaStream_t s) {
  for (int first = 0; first < count; first += kMaxSegments) {
    SegmentBatch b{};
    b.count = count - first < kMaxSegments ? count - first : kMaxSegments;
    b.first_chunk[0] = 0;
    for (int k = 0; k < b.count; ++k) {
      b.seg[k] = segments[first + k];
      b.first_chunk[k + 1] = b.first_chunk[k] + (b.seg[k].n + kChunk - 1) / kChunk;
    }
    const int64_t chunks = b.first_chunk[b.count];
    if (chunks == 0) continue;
    if (max_sms > 0) {
      // One block a multiprocessor, so the grid occupies at most max_sms of them: the block
      // scheduler spreads blocks over idle multiprocessors first, and a second one does not
      // fit beside the first (54-62 registers a thread on sm_90; where a build's kernel
      // needs fewer, dynamic shared memory of over half a multiprocessor's keeps it so).
      const int grid = static_cast<int>(chunks < max_sms ? chunks : max_sms);
      if (args.bf16_moments) {
        constexpr auto kKernel = adamw_sweep_kernel<__nv_bfloat16>;
        kKernel<<<grid, kCappedThreads, alone_smem<kKernel>(), s>>>(b, args);
      } else {
        constexpr auto kKernel = adamw_sweep_kernel<float>;
        kKernel<<<grid, kCappedThreads, alone_smem<kKernel>(), s>>>(b, args);
      }
      continue;
    }
    // A block per chunk (a few microseconds each) rather than a grid striding over them:
    // bench_ops BM_AdamWExpertLayer 2.81 -> 2.88 TB/s (f32 moments), 2.78 -> 2.90 (bf16).
    const int grid = static_cast<int>(chunks < INT32_MAX ? chunks : INT32_MAX);
    if (args.bf16_moments) adamw_chunks_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(b, args);
    else adamw_chunks_kernel<float><<<grid, kThreads, 0, s>>>(b, args);
  }
}

}  // namespace moetrain::ops::cuda
