// The CUDA runtime as core sees it: checked calls, the current stream, device memory from
// CUDA's stream-ordered allocator (cudaMallocAsync pools), and copies. In a build without
// CUDA every function here exists and available() is false; the others throw saying so.
//
// Streams are passed as opaque handles so that code including this header needs no CUDA
// headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moetrain::cuda {

using Stream = void*;  // cudaStream_t; nullptr is the legacy default stream

// True when this build has CUDA and a device answers. Never throws.
bool available();
// Why available() is false (no CUDA in this build, no device, driver error), for skip messages.
std::string unavailable_reason();
int device_count();
std::string device_name(int device = 0);
int64_t device_total_memory(int device);  // bytes
// The calling thread's current device (cudaGetDevice / cudaSetDevice): where its
// allocations, streams and kernels go.
int current_device();
void set_device(int device);

// The stream ops launch on, per host thread (starts as a stream created for the thread).
Stream current_stream();
void set_current_stream(Stream s);
Stream create_stream();  // non-blocking
// A non-blocking stream whose pending blocks the hardware dispatches before those of
// ordinary streams (the greatest priority the device offers).
Stream create_high_priority_stream();
void destroy_stream(Stream s);
void stream_synchronize(Stream s);
void device_synchronize();

// Device memory on `stream` through the device's default memory pool. The pool keeps freed
// blocks for reuse (release threshold raised to unlimited), so steady-state steps do not
// call the driver.
void* device_alloc(size_t bytes, Stream stream);
void device_free(void* p, size_t bytes, Stream stream);
// When on, every new allocation is filled with 0xFF bytes (NaN as bf16/f32/f64) so a test
// sees any element a kernel failed to write.
void set_poison_allocations(bool on);

// Copies on the current stream; the device-to-host one waits for the copy to finish.
void copy_host_to_device(void* dst, const void* src, size_t bytes);
void copy_device_to_host(void* dst, const void* src, size_t bytes);
void copy_device_to_device(void* dst, const void* src, size_t bytes);
// `rows` rows of `width` bytes each, from rows `src_pitch` bytes apart to rows `dst_pitch` apart.
void copy_device_to_device_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                              size_t rows);
// Enqueues a copy into pinned host memory on the current stream and returns; the caller
// synchronizes the stream before reading dst.
void copy_device_to_host_async(void* dst, const void* src, size_t bytes);
// Page-locked host memory (cudaMallocHost): device-to-host copies into it run at full
// PCIe speed and can be asynchronous.
void* pinned_alloc(size_t bytes);
void pinned_free(void* p);
void memset_device(void* dst, int value, size_t bytes);

// Device memory that other processes of this host can map (cudaMalloc, outside the pool),
// and peers' memory: for copies straight into another GPU's buffers over NVLink, which the
// copy engines run without taking SMs (engine/parallel/peer_arena.h).
void* shareable_alloc(size_t bytes);
void shareable_free(void* p);
constexpr size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t
// The handle of a shareable allocation, as bytes another process opens.
std::string ipc_handle(void* p);
// The pointer in this process to a peer process's allocation (peer access enabled); close
// it with close_ipc_handle before the peer frees it.
void* open_ipc_handle(const std::string& handle);
void close_ipc_handle(void* p);
// Lets the current device read and write device `peer`'s memory directly; false when the
// hardware cannot (already enabled counts as done).
bool enable_peer_access(int peer);

// Timing events (cudaEvent_t as an opaque handle).
using Event = void*;
Event create_event();
void destroy_event(Event e);
void record_event(Event e, Stream s);
// Milliseconds between two recorded events; waits for `end` to complete.
float elapsed_ms(Event start, Event end);
// An event for ordering streams only (no timing: cheaper to record and wait on).
Event create_sync_event();
// Work enqueued on `s` after this call waits until `e` (as last recorded) has completed;
// the host does not wait.
void stream_wait_event(Stream s, Event e);
// Whether the work before the event's last record has finished (never waits).
bool event_done(Event e);
// The host waits until the work before the event's last record has finished (a host wait).
void event_synchronize(Event e);

// Makes `s` the calling thread's current stream for a scope, so the ops, copies and
// allocations inside it go to `s`; restores the previous one at exit.
class CurrentStreamScope {
 public:
  explicit CurrentStreamScope(Stream s) : previous_(current_stream()) { set_current_stream(s); }
  ~CurrentStreamScope() { set_current_stream(previous_); }
  CurrentStreamScope(const CurrentStreamScope&) = delete;
  CurrentStreamScope& operator=(const CurrentStreamScope&) = delete;

 private:
  Stream previous_;
};

// How many times this process has waited for the device (a copy to or from the host, a
// stream or device synchronisation, elapsed_ms): a test counts the waits a piece of work makes.
int64_t host_waits();

struct DeviceMemoryStats {
  int64_t live_bytes = 0, peak_bytes = 0;  // tensors live on the device, and their peak
};
DeviceMemoryStats device_memory_stats();
void reset_device_peak();
// What the current device's memory pool holds from the driver (live tensors, freed blocks
// kept for reuse, fragmentation): what the process takes on the card. 0 without CUDA.
int64_t device_reserved_bytes();
// Page-locked host memory this process holds (pinned_alloc).
int64_t pinned_host_bytes();

// Throws moetrain::Error naming `what` when `status` (a cudaError_t) is not success.
void check(int status, const char* what, const char* file, int line);

}  // namespace moetrain::cuda

#define MT_CUDA_CHECK(call) ::moetrain::cuda::check(static_cast<int>(call), #call, __FILE__, __LINE__)
