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

SmHalves probe(cudaStream_t stream) {
  SmHalves out;
  int dev = 0, sms = 0, l2 = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) ||
      cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) || sms <= 0 || sms > kMaxSms) {
    cudaGetLastError();
    return out;
  }
  const size_t chain_bytes = l2_probe_chain_bytes();
  const size_t flush_bytes = 2 * static_cast<size_t>(l2);
  const size_t small_bytes = kMaxSms * sizeof(int) + 2 * kMaxSms * sizeof(unsigned) + kMaxSms * sizeof(long long);
  char* small = static_cast<char*>(moetrain::cuda::device_alloc(small_bytes, stream));
  unsigned* chains = static_cast<unsigned*>(moetrain::cuda::device_alloc(chain_bytes, stream));
  void* flush = moetrain::cuda::device_alloc(flush_bytes, stream);
  int* claimed = reinterpret_cast<int*>(small);
  unsigned* sink = reinterpret_cast<unsigned*>(claimed + kMaxSms);
  long long* cycles = reinterpret_cast<long long*>(sink + 2 * kMaxSms);
  std::vector<long long> host(static_cast<size_t>(sms));
  cudaMemsetAsync(claimed, 0, kMaxSms * sizeof(int), stream);
  cudaMemsetAsync(flush, 1, flush_bytes, stream);  // whatever the pool's blocks held leaves the L2
  launch_l2_probe(sms, chains, claimed, sink, cycles, stream);
  std::vector<int> claimed_host(static_cast<size_t>(sms));
  cudaMemcpyAsync(host.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(claimed_host.data(), claimed, sms * sizeof(int), cudaMemcpyDeviceToHost, stream);
  const cudaError_t err = cudaStreamSynchronize(stream);
  moetrain::cuda::device_free(flush, flush_bytes, stream);
  moetrain::cuda::device_free(chains, chain_bytes, stream);
  moetrain::cuda::device_free(small, small_bytes, stream);
  if (err != cudaSuccess) {
    moetrain::cuda::check(err, "L2 half probe", __FILE__, __LINE__);  // a sticky error: report it
  }
  std::vector<uint8_t> half;
  const bool every_sm = std::all_of(claimed_host.begin(), claimed_host.end(), [](int c) { return c == 1; });
  if (!every_sm || !split_l2_halves(host, half, out.count)) {
    spdlog::info("L2 halves: no clear split of the {} multiprocessors (grouped GEMMs use one tile queue)", sms);
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
