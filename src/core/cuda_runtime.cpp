#include "core/cuda_runtime.h"

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <cstring>

#include "core/error.h"

#if MOETRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moetrain::cuda {
namespace {
std::atomic<int64_t> g_live{0}, g_peak{0};
std::atomic<bool> g_poison{false};
std::atomic<int64_t> g_host_waits{0};
std::atomic<int64_t> g_pinned{0};
std::mutex g_pinned_mutex;
std::unordered_map<void*, size_t> g_pinned_sizes;

void track_alloc(int64_t bytes) {
  int64_t live = g_live.fetch_add(bytes) + bytes;
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
}
}  // namespace

DeviceMemoryStats device_memory_stats() { return {g_live.load(), g_peak.load()}; }
void reset_device_peak() { g_peak.store(g_live.load()); }
void set_poison_allocations(bool on) { g_poison = on; }
int64_t host_waits() { return g_host_waits.load(); }
int64_t pinned_host_bytes() { return g_pinned.load(); }

#if MOETRAIN_WITH_CUDA

void check(int status, const char* what, const char* file, int line) {
  if (status == cudaSuccess) return;
  auto e = static_cast<cudaError_t>(status);
  throw_error(file, line, fmt::format("CUDA error {} ({}) in {}", cudaGetErrorName(e), cudaGetErrorString(e), what));
}

bool available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::string unavailable_reason() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return fmt::format("CUDA runtime reports {}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
  if (n == 0) return "no CUDA device";
  return "";
}

int device_count() {
  int n = 0;
  MT_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

int current_device() {
  int d = 0;
  MT_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
void set_device(int device) { MT_CUDA_CHECK(cudaSetDevice(device)); }

std::string device_name(int device) {
  cudaDeviceProp p{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return p.name;
}

int64_t device_total_memory(int device) {
  cudaDeviceProp p{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return static_cast<int64_t>(p.totalGlobalMem);
}

namespace {
// One stream per host thread, created on first use; the pool's release threshold is
// raised once so freed memory stays cached in the pool.
struct ThreadStream {
  cudaStream_t s = nullptr;
  bool set = false;
};
thread_local ThreadStream t_stream;

void configure_pool_once() {
  static bool done = [] {
    int dev = 0;
    MT_CUDA_CHECK(cudaGetDevice(&dev));
    cudaMemPool_t pool;
    MT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t threshold = UINT64_MAX;
    MT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    return true;
  }();
  (void)done;
}
}  // namespace

Stream current_stream() {
  if (!t_stream.set) {
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&t_stream.s, cudaStreamNonBlocking));
    t_stream.set = true;
  }
  return t_stream.s;
}

void set_current_stream(Stream s) {
  t_stream.s = static_cast<cudaStream_t>(s);
  t_stream.set = true;
}

Stream create_stream() {
  cudaStream_t s;
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

Stream create_high_priority_stream() {
  int least = 0, greatest = 0;
  MT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s;
  MT_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
  return s;
}

void destroy_stream(Stream s) { MT_CUDA_CHECK(cudaStreamDestroy(static_cast<cudaStream_t>(s))); }
void stream_synchronize(Stream s) {
  ++g_host_waits;
  MT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
}
void device_synchronize() {
  ++g_host_waits;
  MT_CUDA_CHECK(cudaDeviceSynchronize());
}

void* device_alloc(size_t bytes, Stream stream) {
  configure_pool_once();
  void* p = nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, s);
  if (e == cudaErrorMemoryAllocation) {
    size_t free_b = 0, total_b = 0;
    cudaGetLastError();
    cudaMemGetInfo(&free_b, &total_b);
    MT_THROW("out of GPU memory allocating {:.1f} MiB ({:.1f} MiB live in tensors, {:.1f} of {:.1f} GiB free)",
             bytes / 1048576.0, g_live.load() / 1048576.0, free_b / 1073741824.0, total_b / 1073741824.0);
  }
  MT_CUDA_CHECK(e);
  if (g_poison) MT_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, bytes, s));
  track_alloc(static_cast<int64_t>(bytes));
  return p;
}

void device_free(void* p, size_t bytes, Stream stream) {
  if (!p) return;
  MT_CUDA_CHECK(cudaFreeAsync(p, static_cast<cudaStream_t>(stream)));
  g_live.fetch_sub(static_cast<int64_t>(bytes));
}

void copy_host_to_device(void* dst, const void* src, size_t bytes) {
  auto s = static_cast<cudaStream_t>(current_stream());
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  ++g_host_waits;
  MT_CUDA_CHECK(cudaStreamSynchronize(s));  // src may be pageable and freed right after
}

void copy_device_to_host(void* dst, const void* src, size_t bytes) {
  auto s = static_cast<cudaStream_t>(current_stream());
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  ++g_host_waits;
  MT_CUDA_CHECK(cudaStreamSynchronize(s));
}

void copy_device_to_host_async(void* dst, const void* src, size_t bytes) {
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(current_stream())));
}

void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  MT_CUDA_CHECK(cudaMallocHost(&p, bytes));
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  g_pinned_sizes[p] = bytes;
  g_pinned += static_cast<int64_t>(bytes);
  return p;
}
void pinned_free(void* p) {
  if (!p) return;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    auto it = g_pinned_sizes.find(p);
    if (it != g_pinned_sizes.end()) {
      g_pinned -= static_cast<int64_t>(it->second);
      g_pinned_sizes.erase(it);
    }
  }
  MT_CUDA_CHECK(cudaFreeHost(p));
}
int64_t device_reserved_bytes() {
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  MT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t reserved = 0;
  MT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  return static_cast<int64_t>(reserved);
}

void copy_device_to_device(void* dst, const void* src, size_t bytes) {
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(current_stream())));
}

void copy_device_to_device_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                              size_t rows) {
  MT_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice,
                                  static_cast<cudaStream_t>(current_stream())));
}

void memset_device(void* dst, int value, size_t bytes) {
  MT_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(current_stream())));
}

Event create_event() {
  cudaEvent_t e;
  MT_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}
void destroy_event(Event e) { MT_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(e))); }
void record_event(Event e, Stream s) {
  MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)));
}
float elapsed_ms(Event start, Event end) {
  ++g_host_waits;
  MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(end)));
  float ms = 0;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}
Event create_sync_event() {
  cudaEvent_t e;
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}
void stream_wait_event(Stream s, Event e) {
  MT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0));
}
bool event_done(Event e) {
  cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
  if (r == cudaErrorNotReady) return false;
  MT_CUDA_CHECK(r);
  return true;
}

void event_synchronize(Event e) {
  ++g_host_waits;
  MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e)));
}

void* shareable_alloc(size_t bytes) {
  void* p = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}
void shareable_free(void* p) { MT_CUDA_CHECK(cudaFree(p)); }
std::string ipc_handle(void* p) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes);
  cudaIpcMemHandle_t h;
  MT_CUDA_CHECK(cudaIpcGetMemHandle(&h, p));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}
void* open_ipc_handle(const std::string& handle) {
  MT_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t), "open_ipc_handle: a handle is {} bytes, got {}",
           sizeof(cudaIpcMemHandle_t), handle.size());
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  MT_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return p;
}
void close_ipc_handle(void* p) { MT_CUDA_CHECK(cudaIpcCloseMemHandle(p)); }
bool enable_peer_access(int peer) {
  int me = 0, can = 0;
  MT_CUDA_CHECK(cudaGetDevice(&me));
  if (peer == me) return true;
  MT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, me, peer));
  if (!can) return false;
  const cudaError_t r = cudaDeviceEnablePeerAccess(peer, 0);
  if (r == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // clear it
    return true;
  }
  MT_CUDA_CHECK(r);
  return true;
}

#else  // a build without CUDA

namespace {
[[noreturn]] void no_cuda() { MT_THROW("this moetrain was built without CUDA"); }
}  // namespace
void check(int status, const char* what, const char* file, int line) {
  if (status != 0) throw_error(file, line, fmt::format("CUDA error {} in {}", status, what));
}
bool available() { return false; }
std::string unavailable_reason() { return "this moetrain was built without CUDA"; }
int device_count() { return 0; }
std::string device_name(int) { no_cuda(); }
int64_t device_total_memory(int) { no_cuda(); }
int current_device() { no_cuda(); }
void set_device(int) { no_cuda(); }
Stream current_stream() { no_cuda(); }
void set_current_stream(Stream) { no_cuda(); }
Stream create_stream() { no_cuda(); }
Stream create_high_priority_stream() { no_cuda(); }
void destroy_stream(Stream) { no_cuda(); }
void stream_synchronize(Stream) { no_cuda(); }
void device_synchronize() { no_cuda(); }
void* device_alloc(size_t, Stream) { no_cuda(); }
void device_free(void*, size_t, Stream) { no_cuda(); }
void copy_host_to_device(void*, const void*, size_t) { no_cuda(); }
void copy_device_to_host(void*, const void*, size_t) { no_cuda(); }
void copy_device_to_device(void*, const void*, size_t) { no_cuda(); }
void copy_device_to_device_2d(void*, size_t, const void*, size_t, size_t, size_t) { no_cuda(); }
void copy_device_to_host_async(void*, const void*, size_t) { no_cuda(); }
void* pinned_alloc(size_t) { no_cuda(); }
void pinned_free(void*) { no_cuda(); }
int64_t device_reserved_bytes() { return 0; }
void memset_device(void*, int, size_t) { no_cuda(); }
Event create_event() { no_cuda(); }
void destroy_event(Event) { no_cuda(); }
void record_event(Event, Stream) { no_cuda(); }
float elapsed_ms(Event, Event) { no_cuda(); }
Event create_sync_event() { no_cuda(); }
void stream_wait_event(Stream, Event) { no_cuda(); }
bool event_done(Event) { no_cuda(); }
void event_synchronize(Event) { no_cuda(); }
void* shareable_alloc(size_t) { no_cuda(); }
void shareable_free(void*) { no_cuda(); }
std::string ipc_handle(void*) { no_cuda(); }
void* open_ipc_handle(const std::string&) { no_cuda(); }
void close_ipc_handle(void*) { no_cuda(); }
bool enable_peer_access(int) { no_cuda(); }

#endif

}  // namespace moetrain::cuda
