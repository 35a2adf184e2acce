#include "engine/ft/replica_manager.h"

#include <nlohmann/json.hpp>
#include <cstring>
#include <future>
#include <random>
#include <thread>

#include "comm/gloo_communicator.h"
#include "comm/nccl_communicator.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "engine/ft/fault.h"

namespace moetrain {

DataShare replica_data_share(const FaultToleranceConfig& ft, int data_rank, int data_world) {
  if (!ft.enabled()) return {data_rank, data_world};
  return {static_cast<int>(ft.replica_id) * data_world + data_rank, static_cast<int>(ft.replica_groups) * data_world};
}

namespace {

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

nlohmann::json to_json(const QuorumAnswer& a) {
  nlohmann::json members = nlohmann::json::array();
  for (const QuorumMember& m : a.quorum.members) members.push_back({m.replica_id, m.incarnation, m.step});
  return {{"id", a.quorum.id},         {"members", members},         {"max_step", a.quorum.max_step}, {"alive", a.quorum.alive},
          {"index", a.index},          {"recover_from", a.recover_from}, {"recover_to", a.recover_to},
          {"store", a.store},          {"prefix", a.store_prefix}};
}

QuorumAnswer from_json(const nlohmann::json& j) {
  QuorumAnswer a;
  a.quorum.id = j["id"];
  for (const auto& m : j["members"]) a.quorum.members.push_back({m[0], m[1], m[2], 0});
  a.quorum.max_step = j["max_step"];
  a.quorum.alive = j["alive"];
  a.index = j["index"];
  a.recover_from = j["recover_from"];
  a.recover_to = j["recover_to"].get<std::vector<int>>();
  a.store = j["store"];
  a.store_prefix = j["prefix"];
  return a;
}

// The step, the optimizer's count and the loader's position, as one i64 header and the
// position's text in i32 words (what a healing peer is sent before the tensors).
struct StateHeader {
  int64_t step = 0, optimizer_steps = 0, position_bytes = 0, tensors = 0;
};

}  // namespace

ReplicaManager::ReplicaManager(const FaultToleranceConfig& cfg, TrainContext& ctx)
    : cfg_(cfg), ctx_(ctx), group_(*ctx.par.comms->world) {
  MT_CHECK(ctx.fsdp != nullptr, "fault tolerance: the replica group has no sharded optimizer to heal");
  std::random_device rd;
  incarnation_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  ctx.par.bridge->set_tolerant(true);
  if (group_.rank() == 0) {
    client_ = std::make_unique<LighthouseClient>(cfg.lighthouse, std::to_string(cfg.replica_id),
                                                 std::chrono::milliseconds(cfg.heartbeat_interval_ms),
                                                 static_cast<int>(cfg.replica_groups));
  }
  spdlog::info("fault tolerance: replica group {} of {} planned, lighthouse {}", cfg.replica_id, cfg.replica_groups,
               cfg.lighthouse);
}

ReplicaManager::~ReplicaManager() {
  if (!wait_sends()) spdlog::warn("fault tolerance: a state copy to another group failed at exit");
  if (client_) discard_early();
}

QuorumAnswer ReplicaManager::ask(int64_t step, bool fresh) {
  std::string text;
  if (client_) {
    if (fresh && early_.valid()) {  // asked with the incarnation that failed: answered, but not followed
      try {
        early_.get();
      } catch (const std::exception&) {
      }
    }
    // Asked when the last step committed (formed by now, as a rule), else now. The early
    // answer is followed even were its step not this one: the other groups follow it too.
    if (early_.valid() && early_step_ != step) {
      spdlog::warn("fault tolerance: the quorum was asked for at step {}, the group is at step {}", early_step_, step);
    }
    const QuorumAnswer a = early_.valid() ? early_.get()
                                          : client_->quorum(incarnation_, step, group_.size(),
                                                            millis(cfg_.quorum_timeout_s));
    text = to_json(a).dump();
    fault_point("ft_quorum", step + 1);  // the lighthouse counts this group in; the others will look for it
  }
  broadcast_bytes(group_, text, 0, ctx_.par.device);
  return from_json(nlohmann::json::parse(text));
}

void ReplicaManager::begin_step(TrainState& state, DataLoader& loader) {
  const auto t0 = SteadyClock::now();
  step_ = state.step + 1;
  ReplicaBridge& bridge = *ctx_.par.bridge;
  // After a failure this group asks as a new member, so that the quorum (and every group's
  // communicator) is made anew. A failure after the vote (in validation) may have reached
  // only some ranks: the group agrees first.
  std::vector<double> failed{bridge.failed() ? 1.0 : 0.0};
  all_reduce_doubles(group_, failed, ctx_.par.device);
  const bool fresh = rejoin_ || failed[0] > 0;
  if (fresh) ++incarnation_;
  rejoin_ = false;
  const QuorumAnswer a = ask(state.step, fresh);
  last_ = a;
  report_ = StepReport{};
  report_.replicas = static_cast<int>(a.quorum.members.size());
  report_.quorum_id = a.quorum.id;
  if (a.store_prefix != prefix_ || bridge.failed()) connect(a);
  report_.quorum_ms = seconds_since(t0) * 1e3;
  if (a.recover_from >= 0) {
    heal_from(a.recover_from, state, loader);
    step_ = state.step + 1;  // the step this group trains now is the peer's next
    report_.recovered_from = a.quorum.members[a.recover_from].replica_id;
  } else if (!a.recover_to.empty()) {
    send_to(a.recover_to, state, loader);
  }
  fault_point("ft_step", step_);
}

void ReplicaManager::connect(const QuorumAnswer& a) {
  ReplicaBridge& bridge = *ctx_.par.bridge;
  bridge.rebuild(nullptr);  // the old communicator closes first: its peers are gone or moving on
  prefix_ = a.store_prefix;
  const int n = static_cast<int>(a.quorum.members.size());
  if (n == 1) return;
  CommOptions opt = default_comm_options(ctx_.par.env);
  opt.timeout = millis(cfg_.timeout_s);
  opt.abort_process_on_error = false;
  const std::string name = fmt::format("replicas(q{})", a.quorum.id);
  try {
    auto store = Store::open(a.store, /*rank=*/1, opt.timeout)->prefixed(fmt::format("{}/r{}", a.store_prefix, group_.rank()));
    std::shared_ptr<Communicator> comm =
        ctx_.par.device.is_cpu()
            ? std::shared_ptr<Communicator>(GlooCommunicator::connect(store, a.index, n, opt, name))
            : std::shared_ptr<Communicator>(connect_nccl(store, a.index, n, ctx_.par.device.index, opt, name));
    bridge.rebuild(comm);
  } catch (const Error& e) {
    bridge.fail(fmt::format("connecting the replica groups of quorum {}: {}", a.quorum.id, e.what()));
  }
  spdlog::info("fault tolerance: quorum {}: {} replica groups, this one index {}{}", a.quorum.id, n, a.index,
               bridge.failed() ? " (connection failed: the step will be discarded)" : "");
}

std::vector<Tensor> ReplicaManager::state_tensors() {
  std::vector<Tensor> out;
  FsdpContext& f = *ctx_.fsdp;
  for (const Parameter& p : f.shard_params()) {
    out.push_back(p.value);
    if (p.has_master()) out.push_back(p.master_low);
  }
  for (const Tensor& m : f.optimizer().exp_avg()) out.push_back(m);
  for (const Tensor& v : f.optimizer().exp_avg_sq()) out.push_back(v);
  for (const NamedBuffer& b : ctx_.model->buffers()) out.push_back(b.value);
  return out;
}

namespace {

// A rank's state goes as few messages: every tensor of at least kAlone bytes on its own,
// the many small ones (norm gains, biases, their moments) packed into one buffer.
constexpr size_t kAlone = 1 << 20;

size_t padded(size_t bytes) { return (bytes + 3) / 4 * 4; }

// The small tensors' bytes back to back (each padded to 4), as i32 words on `where`.
Tensor pack_small(const std::vector<Tensor>& tensors, Device where) {
  size_t total = 0;
  for (const Tensor& t : tensors) total += t.nbytes() < kAlone ? padded(t.nbytes()) : 0;
  Tensor out = Tensor::zeros({static_cast<int64_t>(total / 4)}, DType::I32, where);
  char* dst = static_cast<char*>(out.raw());
  for (const Tensor& t : tensors) {
    if (t.nbytes() >= kAlone) continue;
    if (where.is_cpu()) std::memcpy(dst, t.to(Device::cpu()).raw(), t.nbytes());
    else cuda::copy_device_to_device(dst, t.raw(), t.nbytes());
    dst += padded(t.nbytes());
  }
  return out;
}

void unpack_small(const Tensor& packed, std::vector<Tensor>& tensors) {
  const char* src = static_cast<const char*>(packed.raw());
  for (Tensor& t : tensors) {
    if (t.nbytes() >= kAlone) continue;
    if (t.device().is_cpu()) std::memcpy(t.raw(), src, t.nbytes());
    else cuda::copy_device_to_device(t.raw(), src, t.nbytes());
    src += padded(t.nbytes());
  }
}

}  // namespace

void ReplicaManager::send_to(const std::vector<int>& peers, const TrainState& state, const DataLoader& loader) {
  send_comm_ = ctx_.par.bridge->shared();
  Communicator* comm = send_comm_.get();
  if (comm == nullptr) return;  // the connection failed: the step is discarded anyway
  ctx_.settle();
  const std::string position = loader.position().dump();
  const std::vector<Tensor> tensors = state_tensors();
  const Device where = comm->backend() == "gloo" ? Device::cpu() : ctx_.par.device;
  send_buffers_.clear();
  send_buffers_.push_back(Tensor::from_vector(std::vector<int64_t>{state.step, ctx_.optimizer().steps_taken(),
                                                                   static_cast<int64_t>(position.size()),
                                                                   static_cast<int64_t>(tensors.size())},
                                              {4})
                              .to(where));
  send_buffers_.push_back(bytes_as_words(position, static_cast<int64_t>(position.size()), where));
  send_buffers_.push_back(pack_small(tensors, where));
  try {
    for (int peer : peers) {
      uint32_t tag = 0;
      for (const Tensor& t : send_buffers_) sends_.push_back(comm->isend(t, peer, tag++));
      fault_point("ft_heal_send", step_);
      for (const Tensor& t : tensors) {
        if (t.nbytes() >= kAlone) sends_.push_back(comm->isend(t, peer, tag++));
      }
      spdlog::info("fault tolerance: sending this group's state at step {} to replica group index {}", state.step,
                   peer);
    }
  } catch (const Error& e) {
    send_failed_ = true;
    spdlog::warn("fault tolerance: sending the state to a group behind: {}", e.what());
  }
}

void ReplicaManager::heal_from(int peer, TrainState& state, DataLoader& loader) {
  Communicator* comm = ctx_.par.bridge->comm();
  const auto t0 = SteadyClock::now();
  std::string failure = comm == nullptr ? ctx_.par.bridge->failure() : "";
  StateHeader h;
  std::string position;
  int64_t bytes = 0;
  if (comm != nullptr) {
    try {
      const Device where = comm->backend() == "gloo" ? Device::cpu() : ctx_.par.device;
      Tensor header = Tensor::zeros({4}, DType::I64, where);
      comm->irecv(header, peer, 0)->wait();
      const std::vector<double> hv = header.to_double_vector();
      h = {static_cast<int64_t>(hv[0]), static_cast<int64_t>(hv[1]), static_cast<int64_t>(hv[2]),
           static_cast<int64_t>(hv[3])};
      std::vector<Tensor> tensors = state_tensors();
      MT_CHECK(static_cast<int64_t>(tensors.size()) == h.tensors,
               "the peer sends {} state tensors, this rank holds {}: replica groups need the same layout", h.tensors,
               tensors.size());
      // Every receive posted before the first wait: the messages stream back to back.
      Tensor words = bytes_as_words("", h.position_bytes, where);
      Tensor small = pack_small(tensors, where);
      std::vector<std::unique_ptr<P2pRequest>> recvs;
      recvs.push_back(comm->irecv(words, peer, 1));
      recvs.push_back(comm->irecv(small, peer, 2));
      uint32_t tag = 3;
      for (Tensor& t : tensors) {
        if (t.nbytes() >= kAlone) recvs.push_back(comm->irecv(t, peer, tag++));
        bytes += static_cast<int64_t>(t.nbytes());
      }
      for (auto& r : recvs) r->wait();
      comm->synchronize();  // NCCL: the receives done (or their failure reported), not only enqueued
      unpack_small(small, tensors);
      position = words_as_bytes(words, h.position_bytes);
    } catch (const Error& e) {
      failure = e.what();
    }
  }
  // Every rank of the group healed, or none may train on: half-copied shards are not a model.
  std::vector<double> failed{failure.empty() ? 0.0 : 1.0};
  all_reduce_doubles(group_, failed, ctx_.par.device);
  MT_CHECK(failed[0] == 0,
           "fault tolerance: replica group {} could not copy its state from a peer ({} rank(s) failed{}); stopping so "
           "that its launcher restarts it",
           cfg_.replica_id, failed[0], failure.empty() ? "" : ": " + failure);
  ctx_.fsdp->gather_values();
  ctx_.optimizer().set_steps_taken(h.optimizer_steps);
  state.step = h.step;
  state.optimizer_steps = h.optimizer_steps;
  state.data_position = nlohmann::json::parse(position);
  loader.set_position(state.data_position);
  report_.heal_s = seconds_since(t0);
  report_.heal_bytes = bytes;
  spdlog::info("fault tolerance: healed from replica group index {}: step {}, {:.1f} MB in {:.3f} s ({:.2f} GB/s)", peer,
               state.step, bytes / 1e6, report_.heal_s, bytes / 1e9 / std::max(report_.heal_s, 1e-9));
}

bool ReplicaManager::wait_sends() {
  bool ok = !send_failed_;
  send_failed_ = false;
  try {
    for (auto& r : sends_) r->wait();
    if (send_comm_ && !sends_.empty()) send_comm_->synchronize();  // NCCL: sent, not only enqueued
  } catch (const Error& e) {
    spdlog::warn("fault tolerance: sending the state to a group behind: {}", e.what());
    ok = false;
  }
  sends_.clear();
  send_buffers_.clear();
  send_comm_.reset();
  return ok;
}

void ReplicaManager::finish(TrainState& state, DataLoader& loader) {
  // This group is done; groups still alive but behind (a restart that came back late, one
  // that lost a quorum) heal from it in rounds like a step's, without the step, so that every
  // group ends the run with the same state.
  const auto until = SteadyClock::now() + millis(cfg_.quorum_timeout_s);
  while (true) {
    // The group leaves together (the first rank whose clock says so decides), so that no rank
    // leaves while another asks again.
    std::vector<double> expired{SteadyClock::now() >= until ? 1.0 : 0.0};
    all_reduce_doubles(group_, expired, ctx_.par.device, ReduceOp::Max);
    if (expired[0] > 0) break;
    begin_step(state, loader);
    bool all_there = last_.quorum.members.size() >= static_cast<size_t>(last_.quorum.alive);
    for (const QuorumMember& m : last_.quorum.members) all_there = all_there && m.step == state.step;
    if (vote_without_step(state, /*ask_next=*/!all_there) && all_there) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  spdlog::warn("fault tolerance: the run ends while other replica groups may still be behind (none caught up within "
               "[fault_tolerance].quorum_timeout_s = {})",
               cfg_.quorum_timeout_s);
}

bool ReplicaManager::should_commit(bool ask_next) {
  // The peers behind read this group's state: it may change only once they have it.
  double failed = wait_sends() ? 0.0 : 1.0;
  ReplicaBridge& bridge = *ctx_.par.bridge;
  if (bridge.failed()) failed = 1.0;
  fault_point("ft_commit", step_);
  // Two rounds inside the group around one across the groups, so that all ranks of a group
  // decide alike even when only some of them saw the cross-group vote fail.
  std::vector<double> v{failed};
  all_reduce_doubles(group_, v, ctx_.par.device);
  bridge.all_reduce_doubles(v, ctx_.par.device);
  if (bridge.failed()) v[0] += 1;
  all_reduce_doubles(group_, v, ctx_.par.device);
  const bool commit = v[0] == 0;
  if (!commit) {
    rejoin_ = true;
    spdlog::warn("fault tolerance: step discarded ({} failure(s) across the quorum's ranks)", v[0]);
  } else if (ask_next && client_) {
    // The next quorum is asked for now, in the background: the groups vote together, so they
    // all ask at once and it forms while they log, validate, save and load their batches.
    early_step_ = step_;
    early_ = std::async(std::launch::async, [this, step = step_, incarnation = incarnation_] {
      return client_->quorum(incarnation, step, group_.size(), millis(cfg_.quorum_timeout_s));
    });
  }
  return commit;
}

bool ReplicaManager::vote_without_step(const TrainState& state, bool ask_next) {
  step_ = state.step;  // nothing was trained: the next quorum is asked with the step the group is at
  return should_commit(ask_next);
}

void ReplicaManager::discard_early() {  // at the end: the client is done
  if (!early_.valid()) return;
  client_->cancel();
  try {
    early_.get();
  } catch (const std::exception&) {
    // cancelled, or the lighthouse gone: nothing waits for this answer
  }
}

}  // namespace moetrain
