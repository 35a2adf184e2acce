#include "engine/ft/quorum.h"

#include <fmt/format.h>

#include <algorithm>

namespace moetrain {

int Quorum::index_of(const std::string& replica_id) const {
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].replica_id == replica_id) return static_cast<int>(i);
  }
  return -1;
}

std::vector<int> Quorum::recover_to(int index) const {
  std::vector<int> out;
  for (size_t i = 0; i < recover_from.size(); ++i) {
    if (recover_from[i] == index) out.push_back(static_cast<int>(i));
  }
  return out;
}

void QuorumState::heartbeat(const std::string& replica_id, Clock::time_point now) { seen_[replica_id] = now; }

void QuorumState::request(const QuorumMember& m, Clock::time_point now, int planned_groups) {
  heartbeat(m.replica_id, now);
  planned_ = std::max(planned_, planned_groups);
  if (pending_.empty()) round_start_ = now;
  if (!member_start_ && last_.index_of(m.replica_id) >= 0) member_start_ = now;
  pending_[m.replica_id] = m;
}

void QuorumState::withdraw(const std::string& replica_id) {
  pending_.erase(replica_id);
  if (pending_.empty()) round_start_.reset();
  bool member_asking = false;
  for (const auto& [id, m] : pending_) member_asking = member_asking || last_.index_of(id) >= 0;
  if (!member_asking) member_start_.reset();
}

int QuorumState::alive(Clock::time_point now) const {
  int n = 0;
  for (const auto& [id, t] : seen_) n += now - t <= rules_.heartbeat_timeout ? 1 : 0;
  return n;
}

std::optional<Quorum> QuorumState::try_form(Clock::time_point now, std::string* why) {
  auto wait = [&](std::string reason) -> std::optional<Quorum> {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  const int asking = static_cast<int>(pending_.size());
  const int live = alive(now);
  if (asking < rules_.min_replicas) return wait(fmt::format("{} of min_replicas {} asking", asking, rules_.min_replicas));
  if (2 * asking <= std::max(live, planned_)) {
    return wait(fmt::format("{} asking of {} alive and {} planned: not a majority", asking, live, planned_));
  }
  bool previous_all_back = !last_.members.empty();
  for (const QuorumMember& m : last_.members) previous_all_back = previous_all_back && pending_.count(m.replica_id);
  bool every_live_asking = true;
  for (const auto& [id, t] : seen_) {
    if (now - t <= rules_.heartbeat_timeout && !pending_.count(id)) every_live_asking = false;
  }
  // The join timeout runs from the first request of a member of the previous quorum while one
  // is alive (a group left out of it asks before the members have trained their step), else
  // from the round's first request.
  bool member_alive = false;
  for (const QuorumMember& m : last_.members) {
    const auto it = seen_.find(m.replica_id);
    member_alive = member_alive || (it != seen_.end() && now - it->second <= rules_.heartbeat_timeout);
  }
  const std::optional<Clock::time_point> start = member_alive ? member_start_ : round_start_;
  const bool timed_out = start && now - *start >= rules_.join_timeout;
  // A lighthouse that has formed no quorum yet (it just started) does not know every group
  // that is alive: its first quorum waits out the join timeout.
  const bool first = last_.members.empty();
  if (!previous_all_back && !(every_live_asking && !first) && !timed_out) {
    return wait(fmt::format("{} asking of {} alive, waiting up to join_timeout for the others", asking, live));
  }

  Quorum q;
  for (const auto& [id, m] : pending_) q.members.push_back(m);
  // The same groups in the same incarnations keep the id (and their communicator); their
  // steps advance every round.
  auto same_groups = [](const std::vector<QuorumMember>& a, const std::vector<QuorumMember>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const auto& x, const auto& y) {
             return x.replica_id == y.replica_id && x.incarnation == y.incarnation;
           });
  };
  q.id = last_.id + (same_groups(q.members, last_.members) ? 0 : 1);
  for (const QuorumMember& m : q.members) q.max_step = std::max(q.max_step, m.step);
  std::vector<int> up_to_date;
  for (size_t i = 0; i < q.members.size(); ++i) {
    if (q.members[i].step == q.max_step) up_to_date.push_back(static_cast<int>(i));
  }
  size_t next = 0;
  for (const QuorumMember& m : q.members) {
    q.recover_from.push_back(m.step == q.max_step ? -1 : up_to_date[next++ % up_to_date.size()]);
  }
  q.alive = live;
  pending_.clear();
  round_start_.reset();
  member_start_.reset();
  last_ = q;
  if (why) why->clear();
  return q;
}

}  // namespace moetrain
