// A development tool, not part of moetrain: a CUPTI injection library that records when each
// kernel, memset and memcpy ran on the GPU, so that the idle time between them (launch gaps,
// host waits, stream dependencies) can be seen where Nsight Systems is not available.
//
//   CUDA_INJECTION64_PATH=/path/libkernel_timeline.so KERNEL_TIMELINE_OUT=run.tsv moetrain bench ...
//   python3 tools/timeline_gaps.py run.tsv
//
// One line per activity: start_ns, end_ns, stream, kind (K kernel, S memset, C memcpy), name.
// Written when the process exits. A "%r" in KERNEL_TIMELINE_OUT becomes the process's RANK
// (as `moetrain launch` and torchrun set it), so each rank of a job writes its own file.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Record {
  uint64_t start, end;
  uint32_t stream;
  char kind;
  std::string name;
};

std::mutex g_mutex;
std::vector<Record> g_records;
constexpr size_t kBufferBytes = 8u << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel9*>(rec);
        g_records.push_back({k->start, k->end, k->streamId, 'K', k->name != nullptr ? k->name : "?"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        g_records.push_back({m->start, m->end, m->streamId, 'S', "memset"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        g_records.push_back({m->start, m->end, m->streamId, 'C', "memcpy"});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void write_out() {
  cuptiActivityFlushAll(1);
  const char* env = std::getenv("KERNEL_TIMELINE_OUT");
  std::string path = env != nullptr ? env : "kernel_timeline.tsv";
  if (const size_t at = path.find("%r"); at != std::string::npos) {
    const char* rank = std::getenv("RANK");
    path.replace(at, 2, rank != nullptr ? rank : "0");
  }
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kernel_timeline: cannot write %s\n", path.c_str());
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const Record& r : g_records) {
    std::fprintf(f, "%llu\t%llu\t%u\t%c\t%s\n", static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.stream, r.kind, r.name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_timeline: %zu activities\n", g_records.size());
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kernel_timeline: CUPTI refused the activity trace\n");
    return 0;
  }
  // KERNEL_TIMELINE_KINDS=kernels leaves copies and memsets out: tracing copies into a peer
  // GPU's memory slows them several times over.
  const char* kinds = std::getenv("KERNEL_TIMELINE_KINDS");
  if (kinds == nullptr || std::string(kinds) != "kernels") {
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  }
  std::atexit(write_out);
  return 1;
}
