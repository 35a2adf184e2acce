// Checkpointer: saves a training run's state into committed, numbered checkpoint
// directories, asynchronously, and finds the one to resume from.
//
// A save copies the state to host memory (pinned when a GPU is in use) and returns; a
// background thread writes the files into `<dir>/.tmp-step-N`, fsyncs them, renames the
// directory to `<dir>/step-N` (the commit), fsyncs `<dir>`, then moves the `latest` pointer
// and deletes the oldest committed checkpoints beyond `keep`. A crash at any point leaves
// every earlier committed checkpoint intact and loadable; a half-written `.tmp-*` directory
// is never read and is removed by the next run. The next save waits only if the previous
// one is still being written.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/optim/adamw.h"
#include "engine/parameters.h"

namespace moetrain {

// The live tensors a training run checkpoints, by name: model values under their canonical
// names; f32 masters, Adam moments as "<name>.master", "<name>.exp_avg", "<name>.exp_avg_sq".
struct CheckpointItems {
  std::vector<std::pair<std::string, Tensor>> model, optimizer;
};
CheckpointItems checkpoint_items(ParameterList& params, AdamW* opt);

// Loads model weights by canonical name from a moetrain checkpoint or an HF folder, cast to
// each parameter's dtype (a parameter with a master gets the master from "<name>.master"
// when the checkpoint has it, else from the model tensor, and its value is rounded from
// it). Tied embeddings may lack lm_head.weight. Errors name the tensor.
void load_model_weights(CheckpointReader& reader, ParameterList& params);
// Loads the Adam moments and the masters (resume).
void load_optimizer_state(CheckpointReader& reader, ParameterList& params, AdamW& opt);

struct SaveStats {
  int64_t step = 0;
  double stall_s = 0;       // the caller's wait: previous save + copy to host
  uint64_t bytes = 0;
};

class Checkpointer {
 public:
  Checkpointer(std::string dir, int64_t keep, bool async);
  ~Checkpointer();  // waits for a save in flight (an error is logged, not thrown)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Allocates the host snapshot buffers for `items` now (pinned memory is slow to allocate:
  // about as slow as the copy itself), so the first save stalls training no longer than
  // the others. save() does it when the items changed since.
  void prepare(const CheckpointItems& items);
  // Snapshots `items` and commits them as step-N with `trainer_state` beside them.
  SaveStats save(int64_t step, const CheckpointItems& items, const nlohmann::json& trainer_state);
  // Blocks until the last save is committed; rethrows its error.
  void wait();
  const std::string& dir() const { return dir_; }

  // The committed checkpoint directories under `dir`, oldest first (step-N with an index).
  static std::vector<std::pair<int64_t, std::string>> committed(const std::string& dir);
  // The directory name of step N ("step-00000100").
  static std::string step_dir_name(int64_t step);

 private:
  struct Host {  // the snapshot: host copies of every item
    std::vector<TensorSlice> model, optimizer;
  };
  void commit(int64_t step, const Host& host, const nlohmann::json& state);
  void worker();

  std::string dir_;
  int64_t keep_;
  bool async_;
  Host host_;  // reused across saves while the shapes stay the same

  std::mutex mu_;
  std::condition_variable cv_;
  bool busy_ = false, stop_ = false;
  int64_t pending_step_ = -1;
  nlohmann::json pending_state_;
  std::exception_ptr error_;
  std::thread thread_;
};

// Which checkpoint a run starts from, given [checkpoint].resume: "auto" (the newest
// committed step in dir, or none), "never" (none; an error when dir already holds committed
// checkpoints, which a fresh run would otherwise overwrite or interleave with), or a path to
// a step directory. Returns "" for a fresh start. Removes stale .tmp-* directories.
std::string resolve_resume(const std::string& dir, const std::string& resume);

}  // namespace moetrain
