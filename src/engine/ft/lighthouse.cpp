#include "engine/ft/lighthouse.h"

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "comm/store.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/ft/lighthouse.grpc.pb.h"

namespace moetrain {

namespace pb = moetrain::lighthouse::v1;
using Clock = std::chrono::steady_clock;

namespace {

grpc::Status wrong_protocol(uint32_t got) {
  return {grpc::StatusCode::FAILED_PRECONDITION,
          fmt::format("lighthouse protocol {} asked, this lighthouse speaks {}: run the same moetrain version", got,
                      kLighthouseProtocol)};
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Server

class LighthouseServer::Impl final : public pb::Lighthouse::Service {
 public:
  explicit Impl(const LighthouseOptions& opt) : state_(opt.rules), store_(opt.store_port) {
    std::random_device rd;
    incarnation_ = fmt::format("{:08x}{:08x}", rd(), rd());
    grpc::ServerBuilder b;
    b.AddListeningPort(fmt::format("{}:{}", opt.bind, opt.port), grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(this);
    server_ = b.BuildAndStart();
    MT_CHECK(server_ && port_ > 0, "lighthouse: cannot listen on {}:{} (in use, or not an address of this machine)",
             opt.bind, opt.port);
    ticker_ = std::thread([this] { tick(); });
  }
  ~Impl() override {
    shutdown();
    if (ticker_.joinable()) ticker_.join();
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  void wait() { server_->Wait(); }
  int port() const { return port_; }
  int store_port() const { return store_.port(); }

  grpc::Status Heartbeat(grpc::ServerContext*, const pb::HeartbeatRequest* req, pb::HeartbeatReply*) override {
    if (req->protocol() != kLighthouseProtocol) return wrong_protocol(req->protocol());
    std::lock_guard<std::mutex> lk(mu_);
    state_.heartbeat(req->replica_id(), Clock::now());
    return grpc::Status::OK;
  }

  grpc::Status Quorum(grpc::ServerContext* ctx, const pb::QuorumRequest* req, pb::QuorumReply* reply) override {
    if (req->protocol() != kLighthouseProtocol) return wrong_protocol(req->protocol());
    if (req->replica_id().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "replica_id is empty"};
    std::unique_lock<std::mutex> lk(mu_);
    for (const QuorumMember& m : state_.last().members) {
      if (m.group_size != req->group_size()) {
        return {grpc::StatusCode::INVALID_ARGUMENT,
                fmt::format("replica group {} has {} ranks but group {} of the last quorum has {}: every replica "
                            "group of a run needs the same layout",
                            req->replica_id(), req->group_size(), m.replica_id, m.group_size)};
      }
    }
    const uint64_t ticket = ++tickets_;
    if (auto old = waiting_.find(req->replica_id()); old != waiting_.end()) superseded_.insert(old->second);
    waiting_[req->replica_id()] = ticket;
    state_.request({req->replica_id(), req->incarnation(), req->step(), req->group_size()}, Clock::now(),
                   req->planned_groups());
    spdlog::debug("lighthouse: {} asks (step {}, incarnation {})", req->replica_id(), req->step(), req->incarnation());
    form_if_ready();
    while (true) {
      if (auto a = answers_.find(ticket); a != answers_.end()) {
        fill(a->second, req->replica_id(), reply);
        answers_.erase(a);
        return grpc::Status::OK;
      }
      if (superseded_.erase(ticket)) {
        return {grpc::StatusCode::ABORTED, fmt::format("a newer request of replica group {} replaced this one",
                                                       req->replica_id())};
      }
      if (stopping_) {  // a lighthouse stopped on purpose: the group asks again, as after a crash
        return {grpc::StatusCode::UNAVAILABLE, "the lighthouse is stopping"};
      }
      if (ctx->IsCancelled() || std::chrono::system_clock::now() > ctx->deadline()) {
        if (auto w = waiting_.find(req->replica_id()); w != waiting_.end() && w->second == ticket) {
          waiting_.erase(w);
          state_.withdraw(req->replica_id());
        }
        return {grpc::StatusCode::DEADLINE_EXCEEDED, "no quorum formed before the call's deadline"};
      }
      cv_.wait_for(lk, std::chrono::milliseconds(5));
    }
  }

 private:
  // Under mu_: when the rules allow, the quorum formed and every waiting member answered.
  void form_if_ready() {
    std::string why;
    std::optional<moetrain::Quorum> q = state_.try_form(Clock::now(), &why);
    if (!q) {
      if (why != last_why_) spdlog::debug("lighthouse: waiting: {}", why);
      last_why_ = why;
      return;
    }
    last_why_.clear();
    std::string names;
    for (const QuorumMember& m : q->members) {
      names += fmt::format("{}{} (step {})", names.empty() ? "" : ", ", m.replica_id, m.step);
      answers_[waiting_.at(m.replica_id)] = *q;
      waiting_.erase(m.replica_id);
    }
    if (q->id != announced_) spdlog::info("lighthouse: quorum {}: {}", q->id, names);
    announced_ = q->id;
    cv_.notify_all();
  }

  void fill(const moetrain::Quorum& q, const std::string& replica_id, pb::QuorumReply* r) const {
    r->set_quorum_id(q.id);
    for (const QuorumMember& m : q.members) {
      pb::Member* pm = r->add_members();
      pm->set_replica_id(m.replica_id);
      pm->set_incarnation(m.incarnation);
      pm->set_step(m.step);
      pm->set_group_size(m.group_size);
    }
    r->set_max_step(q.max_step);
    const int index = q.index_of(replica_id);
    r->set_index(index);
    r->set_recover_from(q.recover_from[index]);
    for (int i : q.recover_to(index)) r->add_recover_to(i);
    r->set_store_port(store_.port());
    r->set_store_prefix(fmt::format("lh-{}/q{}", incarnation_, q.id));
    r->set_alive(q.alive);
  }

  // Join timeouts expire without a request arriving: look again every few milliseconds.
  void tick() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!stopping_) {
      if (!waiting_.empty()) form_if_ready();
      cv_.wait_for(lk, std::chrono::milliseconds(5));
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  QuorumState state_;
  TcpStoreServer store_;
  std::string incarnation_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  uint64_t tickets_ = 0;
  std::map<std::string, uint64_t> waiting_;           // replica id -> its waiting request
  std::map<uint64_t, moetrain::Quorum> answers_;      // request -> the quorum it is in
  std::set<uint64_t> superseded_;
  std::string last_why_;
  int64_t announced_ = -1;
  bool stopping_ = false;
  std::thread ticker_;
};

LighthouseServer::LighthouseServer(const LighthouseOptions& opt) : impl_(std::make_unique<Impl>(opt)) {}
LighthouseServer::~LighthouseServer() = default;
int LighthouseServer::port() const { return impl_->port(); }
int LighthouseServer::store_port() const { return impl_->store_port(); }
void LighthouseServer::wait() { impl_->wait(); }
void LighthouseServer::shutdown() { impl_->shutdown(); }

// ---------------------------------------------------------------------------------------
// Client

class LighthouseClient::Impl {
 public:
  Impl(const std::string& address, std::string replica_id, std::chrono::milliseconds interval, int planned_groups)
      : address_(address), replica_id_(std::move(replica_id)), interval_(interval), planned_groups_(planned_groups) {
    host_ = split_host_port(fmt::format("[fault_tolerance].lighthouse '{}'", address), address, 0).first;
    // A lighthouse that restarts is reached again within half a second, not after gRPC's
    // default backoff (up to two minutes): a group that is late to it may miss quorums.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    stub_ = pb::Lighthouse::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    beater_ = std::thread([this] { beat(); });
  }
  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    beater_.join();
  }

  QuorumAnswer quorum(uint64_t incarnation, int64_t step, int32_t group_size, std::chrono::milliseconds timeout) {
    pb::QuorumRequest req;
    req.set_protocol(kLighthouseProtocol);
    req.set_replica_id(replica_id_);
    req.set_incarnation(incarnation);
    req.set_step(step);
    req.set_group_size(group_size);
    req.set_planned_groups(planned_groups_);
    const auto until = std::chrono::system_clock::now() + timeout;
    grpc::Status last;
    while (std::chrono::system_clock::now() < until) {
      grpc::ClientContext ctx;
      ctx.set_deadline(until);
      ctx.set_wait_for_ready(true);  // a lighthouse that restarts: wait for it, up to the deadline
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (cancelled_) break;
        active_ = &ctx;
      }
      pb::QuorumReply r;
      last = stub_->Quorum(&ctx, req, &r);
      {
        std::lock_guard<std::mutex> lk(mu_);
        active_ = nullptr;
      }
      if (last.ok()) return answer(r);
      if (last.error_code() != grpc::StatusCode::UNAVAILABLE) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    MT_THROW("fault tolerance: replica group {} got no quorum from the lighthouse at {} within {} ms: {} ({})",
             replica_id_, address_, timeout.count(), last.error_message(), static_cast<int>(last.error_code()));
  }

  void cancel() {
    std::lock_guard<std::mutex> lk(mu_);
    cancelled_ = true;
    if (active_) active_->TryCancel();
  }

 private:
  QuorumAnswer answer(const pb::QuorumReply& r) const {
    QuorumAnswer a;
    a.quorum.id = r.quorum_id();
    for (const pb::Member& m : r.members()) {
      a.quorum.members.push_back({m.replica_id(), m.incarnation(), m.step(), m.group_size()});
    }
    a.quorum.max_step = r.max_step();
    a.quorum.alive = r.alive();
    a.index = r.index();
    a.recover_from = r.recover_from();
    a.recover_to.assign(r.recover_to().begin(), r.recover_to().end());
    MT_CHECK(a.index >= 0 && a.index < static_cast<int>(a.quorum.members.size()),
             "fault tolerance: the lighthouse at {} answered replica group {} with index {} of {} members", address_,
             replica_id_, a.index, a.quorum.members.size());
    a.store = fmt::format("tcp://{}:{}", host_, r.store_port());
    a.store_prefix = r.store_prefix();
    return a;
  }

  void beat() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!stopping_) {
      lk.unlock();
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + interval_ * 4);
      pb::HeartbeatRequest req;
      req.set_protocol(kLighthouseProtocol);
      req.set_replica_id(replica_id_);
      pb::HeartbeatReply r;
      const grpc::Status s = stub_->Heartbeat(&ctx, req, &r);
      if (!s.ok()) spdlog::debug("fault tolerance: heartbeat to {}: {}", address_, s.error_message());
      lk.lock();
      cv_.wait_for(lk, interval_, [this] { return stopping_; });
    }
  }

  std::string address_, host_, replica_id_;
  std::chrono::milliseconds interval_;
  int planned_groups_;
  std::unique_ptr<pb::Lighthouse::Stub> stub_;
  std::mutex mu_;  // stopping_, cancelled_, active_
  std::condition_variable cv_;
  bool stopping_ = false;
  bool cancelled_ = false;
  grpc::ClientContext* active_ = nullptr;  // the quorum call in flight
  std::thread beater_;
};

LighthouseClient::LighthouseClient(const std::string& address, std::string replica_id,
                                   std::chrono::milliseconds heartbeat_interval, int planned_groups)
    : impl_(std::make_unique<Impl>(address, std::move(replica_id), heartbeat_interval, planned_groups)) {}
LighthouseClient::~LighthouseClient() = default;
QuorumAnswer LighthouseClient::quorum(uint64_t incarnation, int64_t step, int32_t group_size,
                                      std::chrono::milliseconds timeout) {
  return impl_->quorum(incarnation, step, group_size, timeout);
}
void LighthouseClient::cancel() { impl_->cancel(); }

}  // namespace moetrain
