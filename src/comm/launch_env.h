// LaunchEnv: who this process is in the job, read from the variables its launcher set.
//
// Launchers, first match wins (a torchrun or `moetrain launch` inside a SLURM allocation
// sets its own variables over the allocation's):
//   torchrun / moetrain launch: RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
//   OpenMPI (mpirun):           OMPI_COMM_WORLD_RANK _SIZE _LOCAL_RANK _LOCAL_SIZE
//   SLURM (srun):               SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NTASKS_PER_NODE
//                               (or SLURM_TASKS_PER_NODE with SLURM_NODEID), MASTER_ADDR or
//                               the first host of SLURM_JOB_NODELIST
// None of them: one process, rank 0 of 1. A malformed or inconsistent value is an Error
// naming the variable.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace moetrain {

struct LaunchEnv {
  std::string launcher = "none";  // "torchrun", "openmpi", "slurm" or "none"
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // empty when the launcher gave none
  int master_port = 0;      // 0 when the launcher gave none
  // MOETRAIN_STORE: where ranks rendezvous (see open_store); empty means the default.
  std::string store;
  // Identifies this run among others on the same machines (job id, restart count), so the
  // default file store of one run never meets another run's keys.
  std::string run_id;
  // How many times the job was restarted before this start (TORCHELASTIC_RESTART_COUNT,
  // set by torchrun and by `moetrain launch --max-restarts`; SLURM_RESTART_COUNT).
  int restart_generation = 0;
  // When the failure that ended the previous generation happened (seconds since the epoch;
  // MOETRAIN_FAILURE_AT, set by `moetrain launch`); 0 when unknown or none.
  double failure_at = 0;

  bool single_node() const { return local_world_size == world_size; }
  std::string str() const;  // "rank 3 of 8 (local 3 of 4, torchrun)"

  // Reads the process environment.
  static LaunchEnv from_environment();
  // Reads variables through `lookup` (nullopt: not set), for tests.
  using Lookup = std::function<std::optional<std::string>(const std::string&)>;
  static LaunchEnv parse(const Lookup& lookup);
};

// The first host of a SLURM node list: "gpu[03-05,9],cpu1" -> "gpu03".
std::string first_slurm_host(const std::string& nodelist);
// Tasks on node `node` from SLURM_TASKS_PER_NODE's form "4(x2),3" -> {4, 4, 3}[node].
// Throws naming `variable` when the text is malformed or too short.
int slurm_tasks_on_node(const std::string& tasks_per_node, int node, const char* variable);

}  // namespace moetrain
