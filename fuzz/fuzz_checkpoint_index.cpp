// libFuzzer harness: a moetrain checkpoint's index.json (CheckpointReader, engine/checkpoint/
// checkpoint_format.h). The rest of the checkpoint is real and fixed: two ranks' files written
// once at start-up (a tensor split in rows across the ranks, a flat optimizer piece, a whole
// bf16 tensor); only the index is the fuzzer's. Any input must end in a clear moetrain::Error or
// a reader whose every tensor reads back; the index cannot make a tensor larger than the files
// it lists hold (checked below against their bytes).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "fuzz_input.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

// The checkpoint folder: written on first use, removed at exit. Its index.json is the seed
// committed in fuzz/corpus/checkpoint_index (made as said below).
struct CheckpointFolder {
  std::string dir = "/dev/shm/moetrain-fuzz-" + std::to_string(::getpid()) + "-ckpt";
  CheckpointFolder() {
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (int rank = 0; rank < 2; ++rank) {
      Tensor rows = Tensor::from_vector(std::vector<float>{1.f * rank, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
      TensorSlice split = whole_slice("w", rows);
      split.global_shape = {4, 3};
      split.start = {2 * rank, 0};
      TensorSlice flat =
          whole_slice("w.exp_avg", Tensor::from_vector(std::vector<float>{7.f, 8.f, 9.f, 10.f, 11.f, 12.f}, {6}));
      flat.global_shape = {4, 3};
      flat.flat_begin = 6 * rank;
      std::vector<TensorSlice> model = {split};
      if (rank == 0) model.push_back(whole_slice("b", Tensor::from_vector(std::vector<float>{1.f, -1.f}, {2}).to(DType::BF16)));
      write_rank_files(dir, rank, model, {flat});
    }
    write_index(dir, 2, nlohmann::json{{"step", 1}});
    // The seed: `MOETRAIN_FUZZ_SEED=fuzz/corpus/checkpoint_index/two_ranks.json fuzz_checkpoint_index -runs=1`.
    if (const char* seed = std::getenv("MOETRAIN_FUZZ_SEED")) fs::copy_file(dir + "/index.json", seed);
  }
  ~CheckpointFolder() { fs::remove_all(dir); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const CheckpointFolder folder;
  const std::string& dir = folder.dir;
  {
    std::ofstream out(dir + "/index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    CheckpointReader reader(dir);
    for (const std::string& name : reader.names()) {
      if (reader.read_whole(name).nbytes() > reader.total_bytes()) std::abort();  // the promised bound
    }
  } catch (const Error&) {
  }
  return 0;
}
