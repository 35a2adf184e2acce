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
//
// Many ranks (docs/checkpoints.md): every rank snapshots and writes its own files into
// `<dir>/.tmp-step-N` (its manifest last, atomically); rank 0's writer then waits, by
// watching the directory, until all `world` manifests are there, merges them into the
// index and commits. Nothing here talks to other ranks through a communicator, so a save
// in flight never meets the training step's collectives.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/models/model.h"
#include "engine/optim/adamw.h"
#include "engine/parameters.h"

namespace moetrain {

// One live tensor a run checkpoints (or loads), by name, on the host or the device. `data`
// holds the elements this rank owns, and is either
//  - the whole tensor (global_shape empty, flat_begin < 0, start empty): {name, data};
//  - a piece of a sharded optimizer: the elements [flat_begin, flat_begin + data.numel()) of
//    the row-major flattened tensor of global_shape (data of any shape, usually 1-D);
//    written as the fewest boxes (element_range_boxes) and read back from them;
//  - a box: data's shape placed at `start` in the tensor of global_shape (flat_begin < 0).
// Each element of a tensor must be written by exactly one rank (write_index checks it).
struct CheckpointItem {
  std::string name;
  Tensor data;
  Shape global_shape;       // empty: data is the whole tensor
  int64_t flat_begin = -1;  // >= 0 for a piece
  Shape start;              // a box's first index per dim (global_shape given, flat_begin < 0)
  // Defined for a split f32 master (engine/parameters.h): data is its bf16 high half, low
  // (i16) the rest; the item is written as their f32 join.
  Tensor low;
};
// Model values under their canonical names; f32 masters and Adam moments as
// "<name>.master", "<name>.exp_avg", "<name>.exp_avg_sq".
struct CheckpointItems {
  std::vector<CheckpointItem> model, optimizer;
};
CheckpointItems checkpoint_items(ParameterList& params, AdamW* opt);
// The pieces one rank of a sharded optimizer owns: shard_params[i] holds elements
// [segments[i].begin, .end) of params[segments[i].param]; opt steps shard_params. A
// tensor-parallel piece's elements are saved as boxes of the whole tensor. `writes` (when
// given) says which parameters this rank saves (one tp rank saves what every tp rank holds).
CheckpointItems sharded_checkpoint_items(const ParameterList& params, ParameterList& shard_params,
                                         const std::vector<ShardSegment>& segments, AdamW& opt,
                                         const std::function<bool(size_t param)>& writes = {});
// Fills every item's data with its part of the checkpoint's tensor of that name, whatever
// layout wrote it (a piece is read as its boxes; any float dtype and device, converted).
// An error names the tensor when the checkpoint lacks it or holds it in another shape.
void load_slices(CheckpointReader& reader, const std::vector<CheckpointItem>& items);
// Fills the shard parameters (master, else value; the value is rounded from the master)
// and, given opt, their moments from a checkpoint, whatever layout wrote it. A master comes
// from "<name>.master" when the checkpoint has it, else from the model tensor.
void load_sharded_state(CheckpointReader& reader, const ParameterList& params, ParameterList& shard_params,
                        const std::vector<ShardSegment>& segments, AdamW* opt);

// Loads model weights by canonical name from a moetrain checkpoint or an HF folder, cast to
// each parameter's dtype (a parameter with a master gets the master from "<name>.master"
// when the checkpoint has it, else from the model tensor, and its value is rounded from
// it). Tied embeddings may lack lm_head.weight. Errors name the tensor.
void load_model_weights(CheckpointReader& reader, ParameterList& params);
// Loads the model's named buffers (routing biases) that the checkpoint holds; one it lacks
// keeps its value (a Qwen3-MoE folder has no routing bias: balancing starts from zero).
void load_model_buffers(CheckpointReader& reader, const std::vector<NamedBuffer>& buffers);
// Loads the Adam moments and the masters (resume).
void load_optimizer_state(CheckpointReader& reader, ParameterList& params, AdamW& opt);

struct SaveStats {
  int64_t step = 0;
  double stall_s = 0;       // the caller's wait: previous save + copy to host
  uint64_t bytes = 0;
};

// A commit done (rank 0): the step, the time from the snapshot to the commit (this rank's
// files written, every rank's manifest seen, the index and `latest` written and synced,
// older steps pruned), the step directory's bytes.
struct CommitStats {
  int64_t step = 0;
  double seconds = 0;
  uint64_t bytes = 0;
};

// Many ranks: each writes its own files into the step's temporary directory; rank 0 waits
// (in its writer thread, polling the directory, up to commit_timeout) until every rank's
// manifest is there, then writes the index and commits. The other ranks never commit or
// prune; their next save may start (into another .tmp-step-M) while rank 0 still commits.
// A rank that never writes fails rank 0's commit after commit_timeout with an error naming
// its rank and manifest (thrown by rank 0's next save or wait); earlier committed steps stay.
// A rank whose writer fails (a full disk) says so in `failed-rNNNNN.txt` in the step's
// temporary directory, and rank 0's commit fails at once naming it instead of waiting.
// A commit rank 0 gives up on says so in `commit-failed.txt` there, for the ranks waiting.
// Every rank must save the same steps; `trainer_state` is written by rank 0 only.
class Checkpointer {
 public:
  Checkpointer(std::string dir, int64_t keep, bool async, int rank = 0, int world = 1,
               std::chrono::seconds commit_timeout = std::chrono::seconds(600));
  ~Checkpointer();  // waits for a save in flight (an error is logged, not thrown)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Allocates the host snapshot buffers for `items` now (pinned memory is slow to allocate:
  // about as slow as the copy itself), so the first save stalls training no longer than
  // the others. save() does it when the items changed since.
  void prepare(const CheckpointItems& items);
  // Snapshots `items` and commits them as step-N with `trainer_state` beside them. A
  // synchronous save returns on every rank once the step is committed, so that a step
  // that returned is never lost with a node that dies right after it (an asynchronous
  // one returns at once everywhere; see wait()).
  SaveStats save(int64_t step, const CheckpointItems& items, const nlohmann::json& trainer_state);
  // Blocks until the last save is done and rethrows its error: on rank 0 until it is
  // committed, on the others until this rank's files are written (the commit is rank 0's).
  void wait();
  // Whether the last save is still being written (its background writer has not finished).
  bool busy();
  // The commit finished since the last call, if any (rank 0 only: the others never commit).
  std::optional<CommitStats> take_commit();
  const std::string& dir() const { return dir_; }
  // Called on rank 0 by the writer right after each commit (before pruning), with the
  // step and its directory: the remote tier's uploader takes it from there. It must return
  // quickly; an error it throws is logged and does not undo the commit.
  void set_on_commit(std::function<void(int64_t step, const std::string& step_dir)> f) { on_commit_ = std::move(f); }

  // The committed checkpoint directories under `dir`, oldest first (step-N with an index).
  static std::vector<std::pair<int64_t, std::string>> committed(const std::string& dir);
  // The directory name of step N ("step-00000100").
  static std::string step_dir_name(int64_t step);
  // The step of a directory name step_dir_name gives; false for any other name.
  static bool parse_step_dir_name(const std::string& name, int64_t* step);

 private:
  struct Host {  // the snapshot: host copies of every item
    std::vector<TensorSlice> model, optimizer;
  };
  // Rank 0 returns what it committed; the other ranks return nothing once their files are written.
  std::optional<CommitStats> commit(int64_t step, const Host& host, const nlohmann::json& state);
  // A rank > 0 of a synchronous save: blocks until rank 0 has committed `step` (its
  // directory renamed into place), throws when rank 0 says the commit failed or after
  // twice commit_timeout (rank 0 may reach the commit later than this rank).
  void wait_for_commit(int64_t step) const;
  void worker();

  std::string dir_;
  int64_t keep_;
  bool async_;
  int rank_, world_;
  std::chrono::seconds commit_timeout_;
  std::function<void(int64_t, const std::string&)> on_commit_;
  Host host_;  // reused across saves while the shapes stay the same
  // Device f32: split masters are joined here on their way to the host, at most this many
  // elements at a time (64 MB).
  static constexpr int64_t kJoinPieceElements = int64_t{16} << 20;
  Tensor join_scratch_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool busy_ = false, stop_ = false;
  int64_t pending_step_ = -1;
  nlohmann::json pending_state_;
  std::exception_ptr error_;
  std::optional<CommitStats> committed_;  // the last commit not yet taken
  std::thread thread_;
};

// Which checkpoint a run starts from, given [checkpoint].resume: "auto" (the newest
// committed step in dir, or none), "never" (none; an error when dir already holds committed
// checkpoints, which a fresh run would otherwise overwrite or interleave with), or a path to
// a step directory. Returns "" for a fresh start. Removes stale .tmp-* directories when
// remove_stale. Many ranks: every rank calls it (they all get the same answer: committed
// directories are complete), only rank 0 with remove_stale = true, and the caller puts a
// barrier after it, so that no rank starts a save while rank 0 still removes .tmp-* ones.
std::string resolve_resume(const std::string& dir, const std::string& resume, bool remove_stale = true);

}  // namespace moetrain
