// ParallelContext: this process's place in a multi-rank job, and the communicators of its
// mesh. Built from the launcher's environment (torchrun, SLURM, OpenMPI, moetrain launch)
// and [parallel]; one process without a launcher is a world of one, with no communicator.
#pragma once

#include <memory>

#include "comm/launch_env.h"
#include "comm/mesh.h"
#include "core/device.h"
#include "engine/parallel/layout.h"
#include "engine/parallel/replica_bridge.h"
#include "engine/run_config.h"

namespace moetrain {

// The GPU of the rank with this LOCAL_RANK among `visible` GPUs: GPU local_rank, or GPU 0
// where each rank sees only its own (SLURM's --gpus-per-task, or a launcher that sets
// CUDA_VISIBLE_DEVICES per rank). An Error naming the numbers when neither fits.
int gpu_for_local_rank(int local_rank, int visible);

struct ParallelContext {
  LaunchEnv env;
  std::unique_ptr<MeshComms> comms;  // null for a world of one (unless a replica group of live FT)
  Device device = Device::cpu();     // this rank's device: the CPU, or gpu_for_local_rank's GPU
  int rank = 0, world = 1;
  // Where this rank is and what it holds: experts, rows of a micro-batch, sharding groups.
  Layout layout;

  bool distributed() const { return world > 1; }
  // What crosses replica groups (HSDP's gradient all-reduce, the batch-wide sums): one
  // object, rebuilt when a replica group leaves or joins; a no-op with one replica group.
  std::unique_ptr<ReplicaBridge> bridge = std::make_unique<ReplicaBridge>();
  // This replica group's ranks that hold different data (dp x cp x tp x ep of a pipeline
  // stage, within the replica group; tp ranks hold different sequence-parallel slices of the
  // same rows): summed losses and token counts, then over the bridge.
  Communicator* data_group() const { return comms ? comms->stage.get() : nullptr; }
  // The tensor-parallel ranks of this rank (nullptr: tp = 1).
  Communicator* tp_group() const { return comms && layout.tp() > 1 ? comms->tp.get() : nullptr; }
  // The pipeline stages of this rank's replica (nullptr: pp = 1).
  Communicator* pp_group() const { return comms && layout.pp() > 1 ? comms->pp.get() : nullptr; }

  // Reads the environment, checks [parallel] against the world size (an error names the
  // numbers), connects the world (NCCL for [training].device = "cuda", else Gloo) and
  // splits it along the mesh.
  static ParallelContext build(const RunConfig& cfg);
};

}  // namespace moetrain
