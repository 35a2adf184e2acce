#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/cuda_runtime.h"
#include "core/log.h"
#include "ops/cuda/l2_halves.h"
#include "ops/cuda/l2_halves_launch.h"

namespace moetrain::ops::cuda {
namespace {

constexpr int kLines = kL2ProbeLines;

bool disabled_by_env() {
  const char* v = std::getenv("MOETRAIN_L2_HALVES");
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// Device memory on `stream` for the probe's lifetime.
struct ProbeBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  cudaStream_t stream = nullptr;
  ProbeBuffer(size_t n, cudaStream_t s) : p(moetrain::cuda::device_alloc(n, s)), bytes(n), stream(s) {}
  ~ProbeBuffer() {
    try {
      moetrain::cuda::device_free(p, bytes, stream);
    } catch (const std::exception& e) {
      spdlog::error("L2 half probe: freeing its buffer: {}", e.what());
    }
  }
  ProbeBuffer(const ProbeBuffer&) = delete;
  ProbeBuffer& operator=(const ProbeBuffer&) = delete;
};

void check_probe(cudaError_t e, const char* what) { moetrain::cuda::check(e, what, __FILE__, __LINE__); }

// Throws (out of memory, a failed launch) and lets the caller fall back to one queue.
SmHalves run_probe(cudaStream_t stream, int sms, int l2) {
  SmHalves out;
  const size_t flush_bytes = 2 * static_cast<size_t>(l2);
  const size_t small_bytes = kMaxSms * sizeof(int) + 2 * kMaxSms * sizeof(unsigned) + kMaxSms * sizeof(long long);
  ProbeBuffer small(small_bytes, stream), chains(l2_probe_chain_bytes(), stream), flush(flush_bytes, stream);
  int* claimed = static_cast<int*>(small.p);
  unsigned* sink = reinterpret_cast<unsigned*>(claimed + kMaxSms);
  long long* cycles = reinterpret_cast<long long*>(sink + 2 * kMaxSms);
  std::vector<long long> host(static_cast<size_t>(sms));
  std::vector<int> claimed_host(static_cast<size_t>(sms));
  check_probe(cudaMemsetAsync(claimed, 0, kMaxSms * sizeof(int), stream), "L2 half probe: clearing its flags");
  // Whatever the pool's blocks held leaves the L2.
  check_probe(cudaMemsetAsync(flush.p, 1, flush_bytes, stream), "L2 half probe: flushing the L2");
  launch_l2_probe(sms, static_cast<unsigned*>(chains.p), claimed, sink, cycles, stream);
  check_probe(cudaGetLastError(), "L2 half probe: launching its kernels");
  check_probe(cudaMemcpyAsync(host.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost, stream),
              "L2 half probe: reading its times");
  check_probe(cudaMemcpyAsync(claimed_host.data(), claimed, sms * sizeof(int), cudaMemcpyDeviceToHost, stream),
              "L2 half probe: reading its flags");
  check_probe(cudaStreamSynchronize(stream), "L2 half probe: waiting for its kernels");
  if (!std::all_of(claimed_host.begin(), claimed_host.end(), [](int c) { return c == 1; })) {
    spdlog::info("L2 halves: not every one of the {} multiprocessors ran the probe (grouped GEMMs use one tile "
                 "queue)", sms);
    return out;
  }
  std::vector<uint8_t> half;
  if (!split_l2_halves(host, half, out.count)) {
    spdlog::info("L2 halves: no clear split of the {} multiprocessors' re-read times, {} to {} cycles a line "
                 "(grouped GEMMs use one tile queue)", sms, *std::min_element(host.begin(), host.end()) / kLines,
                 *std::max_element(host.begin(), host.end()) / kLines);
    return out;
  }
  // Lives as long as the process (a few hundred bytes per device).
  auto* map = static_cast<uint8_t*>(moetrain::cuda::device_alloc(kMaxSms, stream));
  std::vector<uint8_t> padded(kMaxSms, 0);
  std::copy(half.begin(), half.end(), padded.begin());
  moetrain::cuda::copy_host_to_device(map, padded.data(), kMaxSms);
  out.device_map = map;
  spdlog::info("L2 halves: {} + {} multiprocessors (re-read {} / {} cycles a line)", out.count[0], out.count[1],
               *std::min_element(host.begin(), host.end()) / kLines,
               *std::max_element(host.begin(), host.end()) / kLines);
  return out;
}

SmHalves probe(cudaStream_t stream) {
  int dev = 0, sms = 0, l2 = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) ||
      cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) || sms <= 0 || sms > kMaxSms) {
    cudaGetLastError();
    return {};
  }
  try {
    return run_probe(stream, sms, l2);
  } catch (const std::exception& e) {
    // ~170 MB for a moment at the first grouped GEMM: without it the kernels only lose the
    // split, so a failure here is not the run's.
    spdlog::warn("L2 halves: the probe did not run ({}); grouped GEMMs use one tile queue", e.what());
    return {};
  }
}

}  // namespace

bool split_l2_halves(const std::vector<long long>& cycles, std::vector<uint8_t>& half, int count[2]) {
  const int n = static_cast<int>(cycles.size());
  std::vector<long long> sorted = cycles;
  std::sort(sorted.begin(), sorted.end());
  int cut = 0;
  long long gap = 0;
  for (int i = 1; i < n; ++i) {
    if (sorted[i] - sorted[i - 1] > gap) {
      gap = sorted[i] - sorted[i - 1];
      cut = i;
    }
  }
  if (n < 8 || gap * 10 < sorted[0] || cut < n / 4 || n - cut < n / 4) return false;
  const long long threshold = sorted[cut];  // times >= threshold: the other group
  half.assign(n, 0);
  const bool sm0_slow = cycles[0] >= threshold;
  count[0] = count[1] = 0;
  for (int s = 0; s < n; ++s) {
    half[s] = static_cast<uint8_t>((cycles[s] >= threshold) != sm0_slow);
    ++count[half[s]];
  }
  return true;
}

const SmHalves& sm_l2_halves(cudaStream_t stream) {
  static std::mutex mu;
  static SmHalves cached[16];
  static bool probed[16] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) {
    cudaGetLastError();
    static const SmHalves none;
    return none;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (!probed[dev]) {
    probed[dev] = true;
    if (!disabled_by_env()) cached[dev] = probe(stream);
  }
  return cached[dev];
}

}  // namespace moetrain::ops::cuda
