// Quorum: how the lighthouse decides, from the replica groups that ask and those that are
// alive, which groups train the next step together. Pure logic with the clock passed in, so
// every rule is tested without a network (the gRPC server in lighthouse.h wraps it).
//
// Rules, checked every time something changes:
//   - alive: a group heard from (a heartbeat or a request) within heartbeat_timeout;
//   - a quorum needs at least min_replicas asking groups, and more than half of the alive
//     ones or of the groups the run is planned for, whichever is more (two halves of a
//     partitioned job, or of a job whose lighthouse just restarted and has not heard from
//     everyone, can never both train);
//   - it forms at once when every member of the previous quorum asks again (the fast path
//     of a healthy run) or when every alive group asks; otherwise once join_timeout has
//     passed since the round's first request from a member of the previous quorum (a group
//     left out of it asks at once, while the members are still training the step: timed from
//     its request, a join timeout shorter than a step would leave one group out round after
//     round), or since the round's first request when no member of it is alive; the first
//     quorum of a lighthouse (just started or restarted, it has not heard from every group
//     yet) always waits join_timeout;
//   - its id is the previous id + 1 when the members (or an incarnation) changed, else the same
//     (steps advance every round and do not count);
//   - the members at the highest step are up to date; each member below it copies its state
//     from one of them, spread round-robin in replica_id order.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace moetrain {

struct QuorumMember {
  std::string replica_id;
  uint64_t incarnation = 0;
  int64_t step = 0;
  int32_t group_size = 0;
  bool operator==(const QuorumMember&) const = default;
};

struct QuorumRules {
  int min_replicas = 1;
  std::chrono::milliseconds join_timeout{100};
  std::chrono::milliseconds heartbeat_timeout{5000};
};

struct Quorum {
  int64_t id = 0;
  std::vector<QuorumMember> members;  // sorted by replica_id
  int64_t max_step = 0;
  std::vector<int> recover_from;      // per member: the index it copies from, or -1
  int alive = 0;                      // groups alive when it formed (members or not)

  int index_of(const std::string& replica_id) const;  // -1 when not a member
  std::vector<int> recover_to(int index) const;       // the members that copy from `index`
};

class QuorumState {
 public:
  using Clock = std::chrono::steady_clock;
  explicit QuorumState(QuorumRules rules) : rules_(rules) {}

  void heartbeat(const std::string& replica_id, Clock::time_point now);
  // A group asks for the next quorum (also a heartbeat). Asking again replaces its request.
  // `planned_groups`: the run's planned replica groups as the group knows them (0: unknown).
  void request(const QuorumMember& m, Clock::time_point now, int planned_groups = 0);
  // A request withdrawn (its caller gave up).
  void withdraw(const std::string& replica_id);
  // Forms the quorum when the rules allow: the asking groups become its members and stop
  // asking. nullopt: not yet (`why` says what it waits for).
  std::optional<Quorum> try_form(Clock::time_point now, std::string* why = nullptr);

  const Quorum& last() const { return last_; }
  bool asking(const std::string& replica_id) const { return pending_.count(replica_id) > 0; }
  int alive(Clock::time_point now) const;

 private:
  QuorumRules rules_;
  std::map<std::string, Clock::time_point> seen_;   // last heard from
  std::map<std::string, QuorumMember> pending_;     // this round's requests (sorted by id)
  std::optional<Clock::time_point> round_start_;    // the round's first request
  std::optional<Clock::time_point> member_start_;   // ... from a member of the previous quorum
  int planned_ = 0;                                 // the most planned groups any request said
  Quorum last_;
};

}  // namespace moetrain
