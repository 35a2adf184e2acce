#include "engine/parallel/parallel_context.h"

#include "comm/gloo_communicator.h"
#include "comm/nccl_communicator.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "core/log.h"

namespace moetrain {

ParallelContext ParallelContext::build(const RunConfig& cfg) {
  ParallelContext p;
  p.env = LaunchEnv::from_environment();
  p.rank = p.env.rank;
  p.world = p.env.world_size;
  const ParallelConfig& pc = cfg.parallel;
  const Mesh mesh = [&] {
    try {
      return Mesh(p.world, pc.pp, pc.dp, pc.cp, pc.ep);
    } catch (const Error& e) {
      MT_THROW("[parallel] does not fit {} ({}): {}", p.env.str(), p.world == 1 ? "start many ranks with moetrain launch -n N, torchrun, srun or mpirun" : "change pp, dp, cp or ep", e.what());
    }
  }();
  MT_CHECK(mesh.dp() % pc.dp_replicate == 0,
           "[parallel].dp_replicate = {} must divide dp = {} ({}): HSDP splits the dp ranks into that many replica "
           "groups",
           pc.dp_replicate, mesh.dp(), mesh.str());
  const bool gpu = cfg.training.device == "cuda";
  if (gpu) {
    MT_CHECK(cuda::available(), "[training].device = \"cuda\" but no GPU is usable: {}", cuda::unavailable_reason());
    p.device = Device::cuda(p.env.local_rank);
  }
  p.ep = mesh.ep();
  p.ep_rank = mesh.coord(p.rank).ep;
  p.pp = mesh.pp();
  p.pp_rank = mesh.coord(p.rank).pp;
  if (p.world == 1) return p;

  CommOptions opt = default_comm_options(p.env);
  auto store = Store::open(default_store_spec(p.env), p.rank, opt.timeout)->prefixed("train");
  std::shared_ptr<Communicator> world =
      gpu ? std::shared_ptr<Communicator>(connect_nccl(store, p.rank, p.world, p.env.local_rank, opt))
          : std::shared_ptr<Communicator>(GlooCommunicator::connect(store, p.rank, p.world, opt));
  p.comms = std::make_unique<MeshComms>(MeshComms::build(world, mesh, static_cast<int>(pc.dp_replicate)));
  p.data_rank = p.comms->dp_cp_ep->rank();
  p.data_world = p.comms->dp_cp_ep->size();
  spdlog::info("parallel: {} as {}{} ({} collectives)", p.env.str(), mesh.str(),
               p.comms->replicas > 1 ? fmt::format(", HSDP: {} replica groups of dp {}", p.comms->replicas,
                                                   mesh.dp() / p.comms->replicas)
                                     : std::string(),
               world->backend());
  return p;
}

}  // namespace moetrain
