#include "engine/parallel/parallel_context.h"

#include "comm/gloo_communicator.h"
#include "comm/nccl_communicator.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "core/log.h"

namespace moetrain {

int gpu_for_local_rank(int local_rank, int visible) {
  if (local_rank < visible) return local_rank;
  MT_CHECK(visible == 1, "LOCAL_RANK {} but this process sees {} GPUs: start at most {} ranks on this machine, or give "
           "each rank its own GPU (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1)", local_rank, visible, visible);
  return 0;
}

ParallelContext ParallelContext::build(const RunConfig& cfg) {
  ParallelContext p;
  p.env = LaunchEnv::from_environment();
  p.rank = p.env.rank;
  p.world = p.env.world_size;
  const ParallelConfig& pc = cfg.parallel;
  const Mesh mesh = [&] {
    try {
      return Mesh(p.world, pc.pp, pc.dp, pc.cp, pc.ep, pc.tp);
    } catch (const Error& e) {
      MT_THROW("[parallel] does not fit {} ({}): {}", p.env.str(), p.world == 1 ? "start many ranks with moetrain launch -n N, torchrun, srun or mpirun" : "change pp, dp, cp, tp or ep", e.what());
    }
  }();
  MT_CHECK(mesh.dp() % pc.dp_replicate == 0,
           "[parallel].dp_replicate = {} must divide dp = {} ({}): HSDP splits the dp ranks into that many replica "
           "groups",
           pc.dp_replicate, mesh.dp(), mesh.str());
  const bool gpu = cfg.training.device == "cuda";
  if (gpu) {
    MT_CHECK(cuda::available(), "[training].device = \"cuda\" but no GPU is usable: {}", cuda::unavailable_reason());
    p.device = Device::cuda(gpu_for_local_rank(p.env.local_rank, cuda::device_count()));
    cuda::set_device(p.device.index);  // before this rank's first allocation, stream or handle
  }
  p.layout = Layout(mesh, p.rank, static_cast<int>(pc.dp_replicate), pc.fold_experts);
  // A replica group of live fault tolerance is a world even with one rank: its optimizer is
  // FSDP's, whose gradients the ReplicaBridge sums across the groups.
  const bool replica_group = cfg.fault_tolerance.enabled();
  if (p.world == 1 && !replica_group) return p;

  CommOptions opt = default_comm_options(p.env);
  auto store = Store::open(p.world == 1 ? "memory" : default_store_spec(p.env), p.rank, opt.timeout)->prefixed("train");
  std::shared_ptr<Communicator> world =
      gpu ? std::shared_ptr<Communicator>(connect_nccl(store, p.rank, p.world, p.device.index, opt))
          : std::shared_ptr<Communicator>(GlooCommunicator::connect(store, p.rank, p.world, opt));
  p.comms = std::make_unique<MeshComms>(MeshComms::build(world, mesh, static_cast<int>(pc.dp_replicate)));
  p.bridge->rebuild(p.comms->replicate);
  MT_CHECK(p.comms->dp_cp_ep->rank() == p.layout.data_rank() && p.comms->dp_cp_ep->size() == p.layout.data_world(),
           "parallel: the data group's rank {} of {} is not the layout's {} of {}", p.comms->dp_cp_ep->rank(),
           p.comms->dp_cp_ep->size(), p.layout.data_rank(), p.layout.data_world());
  spdlog::info("parallel: {} as {}{} ({} collectives)", p.env.str(), mesh.str(),
               p.comms->replicas > 1 ? fmt::format(", HSDP: {} replica groups of dp {}", p.comms->replicas,
                                                   mesh.dp() / p.comms->replicas)
                                     : std::string(),
               world->backend());
  return p;
}

}  // namespace moetrain
