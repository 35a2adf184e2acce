// Pipeline schedules: the 1F1B and DualPipeV orders, their validator and the bubble
// simulator. See schedule.h for the rules and docs/pipeline.md for the notation.
#include "engine/pipeline/schedule.h"

#include <algorithm>
#include <cmath>
#include <deque>

#include "core/error.h"

namespace moetrain {

namespace {

PipeOp make_op(PipeOpKind kind, int chunk, int mb) { return PipeOp{kind, chunk, mb, -1, -1}; }

std::string prefix(const PipelineSchedule& s) {
  return fmt::format("pipeline schedule '{}' (pp={}, micro_batches={})", s.name, s.pp, s.micro_batches);
}

char kind_letter(PipeOpKind k) {
  return k == PipeOpKind::F ? 'F' : k == PipeOpKind::B ? 'B' : k == PipeOpKind::H ? 'H' : 'W';
}
// The single steps' slots in per-kind tables: F, B, W, H.
constexpr int kSingleKinds = 4;
int kind_index(PipeOpKind k) { return k == PipeOpKind::H ? 3 : static_cast<int>(k); }

// Costs of the walk: per chunk's F, B, W; an H; and what the head adds to the last chunk's F.
// helped_mbs: with a head helper, the micro-batches below it have their H placed (the later
// ones' B steps do not wait for one: add_head_helper's partial schedules).
struct Costs {
  double f = 1, b = 1, w = 1, h = 1, head_f = 0;
  int helped_mbs = 1 << 30;
};

// An event is one half-step: F, B or W of one (chunk, mb). A pair (FB, FF, BB) is two events.
struct Event {
  PipeOpKind kind;
  int chunk, mb;
};

std::string to_string(const Event& e) { return fmt::format("{}{}.{}", kind_letter(e.kind), e.chunk, e.mb); }

// The events an op performs: one, or two for a pair (its first half first).
int events_of(const PipeOp& op, Event out[2]) {
  PipeOp h[2];
  const int n = op.halves(h);
  for (int i = 0; i < n; ++i) out[i] = {h[i].kind, h[i].chunk, h[i].mb};
  return n;
}

// Structure: sizes, ranges, placement, and exactly one F (B, W) per (chunk, mb). Runs before
// the dependency walk, which indexes by (chunk, mb) and trusts these.
void check_structure(const PipelineSchedule& s) {
  const std::string pre = prefix(s);
  MT_CHECK(s.pp >= 1 && s.micro_batches >= 1, "{}: pp and micro_batches must be >= 1", pre);
  const int want_chunks = s.v_shape ? 2 * s.pp : s.pp;
  MT_CHECK(s.num_chunks == want_chunks, "{}: num_chunks is {}, expected {} ({})", pre, s.num_chunks,
           want_chunks, s.v_shape ? "2*pp in a V" : "pp");
  MT_CHECK(static_cast<int>(s.ops.size()) == s.pp, "{}: has op lists for {} ranks, expected {}", pre,
           s.ops.size(), s.pp);
  const int M = s.micro_batches;
  const int last = s.num_chunks - 1;
  MT_CHECK(s.head_helper < 0 || (!s.forward_only() && s.head_helper < s.pp && s.head_helper != s.rank_of_chunk(last)),
           "{}: head helper rank {} must be another rank than the head's ({}) in a training schedule", pre,
           s.head_helper, s.rank_of_chunk(last));
  // count[kind][chunk*M + mb]: how many times that F, B, W or H appears.
  std::vector<int> count[kSingleKinds];
  for (auto& c : count) c.assign(static_cast<size_t>(s.num_chunks) * M, 0);
  for (int r = 0; r < s.pp; ++r) {
    for (size_t i = 0; i < s.ops[r].size(); ++i) {
      const PipeOp& op = s.ops[r][i];
      const std::string at = fmt::format("{}: rank {} op {} ({})", pre, r, i, to_string(op));
      Event ev[2];
      const int n = events_of(op, ev);
      for (int e = 0; e < n; ++e) {
        MT_CHECK(ev[e].chunk >= 0 && ev[e].chunk < s.num_chunks, "{}: chunk {} out of range [0, {})", at,
                 ev[e].chunk, s.num_chunks);
        MT_CHECK(ev[e].mb >= 0 && ev[e].mb < M, "{}: micro-batch {} out of range [0, {})", at, ev[e].mb, M);
        if (ev[e].kind == PipeOpKind::H) {
          MT_CHECK(s.head_helper >= 0, "{}: an H step in a schedule without a head helper", at);
          MT_CHECK(ev[e].chunk == last && r == s.head_helper,
                   "{}: an H step is the last chunk's ({}) on the head helper (rank {})", at, last, s.head_helper);
        } else {
          MT_CHECK(s.rank_of_chunk(ev[e].chunk) == r, "{}: chunk {} is held by rank {}, not rank {}", at,
                   ev[e].chunk, s.rank_of_chunk(ev[e].chunk), r);
        }
        MT_CHECK(!s.forward_only() || ev[e].kind == PipeOpKind::F,
                 "{}: a forward-only schedule has no B or W ops", at);
        int& c = count[kind_index(ev[e].kind)][static_cast<size_t>(ev[e].chunk) * M + ev[e].mb];
        MT_CHECK(++c == 1, "{}: repeats {} (each (chunk, mb) runs its F, B and W exactly once)", at,
                 to_string(ev[e]));
      }
    }
  }
  const int kinds = s.forward_only() ? 1 : 3;
  if (s.head_helper >= 0) {
    for (int m = 0; m < M; ++m) {
      MT_CHECK(count[kind_index(PipeOpKind::H)][static_cast<size_t>(last) * M + m] == 1,
               "{}: the head helper (rank {}) lacks H{}.{} (each micro-batch's head rows once)", pre, s.head_helper,
               last, m);
    }
  }
  for (int k = 0; k < kinds; ++k) {
    for (int c = 0; c < s.num_chunks; ++c) {
      for (int m = 0; m < M; ++m) {
        const Event e{static_cast<PipeOpKind>(k), c, m};
        MT_CHECK(count[k][static_cast<size_t>(c) * M + m] == 1,
                 "{}: rank {} lacks {} (each (chunk, mb) runs its F{} exactly once)", pre, s.rank_of_chunk(c),
                 to_string(e), s.forward_only() ? "" : ", B and W");
      }
    }
  }
}

// Walks the ranks' lists as the hardware would: each rank in order, an op starting when the
// rank is free and every event it needs has finished. Returns the makespan and each rank's
// busy time; throws on a deadlock, naming each blocked rank's next op and what it waits for.
struct Walk {
  double makespan = 0;
  std::vector<double> busy;
  std::vector<std::vector<double>> finish;  // per rank, each op's finish time
};

Walk walk(const PipelineSchedule& s, const Costs& costs, bool w_in_pairs) {
  const int M = s.micro_batches;
  const int last_chunk = s.num_chunks - 1;
  const bool helped = s.head_helper >= 0;
  std::vector<double> end[kSingleKinds];  // < 0: not done yet
  for (auto& e : end) e.assign(static_cast<size_t>(s.num_chunks) * M, -1.0);
  auto finish = [&](const Event& e) -> double& {
    return end[kind_index(e.kind)][static_cast<size_t>(e.chunk) * M + e.mb];
  };
  // What an event needs (at most two events). A pair's halves are marked done together when
  // it ends, so a pair whose second half needs its first (F3.1+B3.1) never starts: a deadlock.
  auto needs = [&](const Event& e, Event out[2]) -> int {
    switch (e.kind) {
      case PipeOpKind::F:
        if (e.chunk == 0) return 0;
        out[0] = {PipeOpKind::F, e.chunk - 1, e.mb};
        return 1;
      case PipeOpKind::B:
        out[0] = {PipeOpKind::F, e.chunk, e.mb};
        if (e.chunk == last_chunk) {
          if (!helped || e.mb >= costs.helped_mbs) return 1;
          out[1] = {PipeOpKind::H, e.chunk, e.mb};  // the helper's rows' gradient
          return 2;
        }
        out[1] = {PipeOpKind::B, e.chunk + 1, e.mb};
        return 2;
      case PipeOpKind::H:
        out[0] = {PipeOpKind::F, e.chunk, e.mb};
        return 1;
      default:
        out[0] = {PipeOpKind::B, e.chunk, e.mb};
        return 1;
    }
  };
  auto event_cost = [&](const Event& e) {
    switch (e.kind) {
      case PipeOpKind::F: return costs.f + (e.chunk == last_chunk ? costs.head_f : 0.0);
      case PipeOpKind::B: return costs.b;
      case PipeOpKind::W: return costs.w;
      case PipeOpKind::H: return costs.h;
      default: return 0.0;
    }
  };
  auto op_cost = [&](const PipeOp& op) {
    Event ev[2];
    double c = 0;
    for (int e = 0, n = events_of(op, ev); e < n; ++e) c += event_cost(ev[e]);
    return c;
  };

  std::vector<size_t> next(s.pp, 0);
  std::vector<double> free_at(s.pp, 0.0);
  Walk out;
  out.busy.assign(s.pp, 0.0);
  out.finish.assign(s.pp, {});
  // Each pass runs every op that can run; ranks wait on each other, so repeat until a pass
  // runs nothing. Start times depend only on finish times, not on the order of passes.
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < s.pp; ++r) {
      while (next[r] < s.ops[r].size()) {
        const PipeOp& op = s.ops[r][next[r]];
        Event ev[2], dep[2];
        const int n = events_of(op, ev);
        double start = free_at[r];
        bool ready = true;
        for (int e = 0; e < n && ready; ++e) {
          const int nd = needs(ev[e], dep);
          for (int d = 0; d < nd && ready; ++d) {
            const double t = finish(dep[d]);
            ready = t >= 0;
            start = std::max(start, t);
          }
        }
        if (!ready) break;
        const double t = start + op_cost(op);
        for (int e = 0; e < n; ++e) finish(ev[e]) = t;
        // w_in_pairs: the W right after its FB belongs to the pair, whose outputs leave only
        // now. The W runs at once (its B is done), before another rank reads these times.
        if (w_in_pairs && op.kind == PipeOpKind::W && next[r] > 0) {
          const PipeOp& prev = s.ops[r][next[r] - 1];
          if (prev.kind == PipeOpKind::FB && prev.chunk2 == op.chunk && prev.mb2 == op.mb) {
            finish({PipeOpKind::F, prev.chunk, prev.mb}) = t;
            finish({PipeOpKind::B, prev.chunk2, prev.mb2}) = t;
          }
        }
        free_at[r] = t;
        out.finish[r].push_back(t);
        out.busy[r] += op_cost(op);
        out.makespan = std::max(out.makespan, t);
        ++next[r];
        moved = true;
      }
    }
  }

  std::string blocked;
  for (int r = 0; r < s.pp; ++r) {
    if (next[r] == s.ops[r].size()) continue;
    const PipeOp& op = s.ops[r][next[r]];
    Event ev[2], dep[2];
    std::string missing;
    const int n = events_of(op, ev);
    for (int e = 0; e < n; ++e) {
      const int nd = needs(ev[e], dep);
      for (int d = 0; d < nd; ++d) {
        if (finish(dep[d]) < 0) missing += (missing.empty() ? "" : ", ") + to_string(dep[d]);
      }
    }
    blocked += fmt::format("{}rank {} blocked at op {} ({}) waiting for {}", blocked.empty() ? "" : "; ", r,
                           next[r], to_string(op), missing);
  }
  MT_CHECK(blocked.empty(), "{}: deadlock (a rank's op needs a step that runs after it): {}", prefix(s),
           blocked);
  return out;
}

ScheduleTimes run_times(const PipelineSchedule& s, const Costs& costs, bool w_in_pairs) {
  check_structure(s);
  const Walk wk = walk(s, costs, w_in_pairs);
  ScheduleTimes t;
  t.makespan = wk.makespan;
  for (double busy : wk.busy) {
    t.work += busy;
    t.idle.push_back(wk.makespan - busy);
  }
  const double total = s.pp * wk.makespan;
  t.bubble_fraction = total > 0 ? (total - t.work) / total : 0;
  return t;
}

}  // namespace

int PipeOp::halves(PipeOp out[2]) const {
  if (!paired()) {
    out[0] = *this;
    return 1;
  }
  out[0] = make_op(kind == PipeOpKind::BB ? PipeOpKind::B : PipeOpKind::F, chunk, mb);
  out[1] = make_op(kind == PipeOpKind::FF ? PipeOpKind::F : PipeOpKind::B, chunk2, mb2);
  return 2;
}

std::string to_string(const PipeOp& op) {
  Event ev[2];
  if (events_of(op, ev) == 2) return to_string(ev[0]) + "+" + to_string(ev[1]);
  return to_string(ev[0]);
}

int PipelineSchedule::rank_of_chunk(int chunk) const {
  if (!v_shape) return chunk;
  return chunk < pp ? chunk : 2 * pp - 1 - chunk;
}

std::vector<int> PipelineSchedule::chunks_of_rank(int rank) const {
  if (!v_shape) return {rank};
  return {rank, 2 * pp - 1 - rank};
}

std::string PipelineSchedule::describe(int rank) const {
  std::string out;
  for (const PipeOp& op : ops.at(rank)) {
    if (!out.empty()) out += ' ';
    out += to_string(op);
  }
  return out;
}

PipelineSchedule make_1f1b(int pp, int micro_batches) {
  MT_CHECK(pp >= 1 && micro_batches >= 1, "1f1b schedule: pp ({}) and micro_batches ({}) must be >= 1", pp,
           micro_batches);
  PipelineSchedule s{"1f1b", pp, micro_batches, pp, false, {}};
  s.ops.resize(pp);
  for (int r = 0; r < pp; ++r) {
    auto& ops = s.ops[r];
    // Rank r's first B can come only after the micro-batch has gone down the pp - r - 1
    // ranks below it and back, so it runs that many forwards ahead; no more, which bounds the
    // activations it holds to pp - r micro-batches.
    const int warmup = std::min(pp - r - 1, micro_batches);
    int fwd = 0, bwd = 0;
    auto backward = [&] {
      ops.push_back(make_op(PipeOpKind::B, r, bwd));
      ops.push_back(make_op(PipeOpKind::W, r, bwd++));
    };
    while (fwd < warmup) ops.push_back(make_op(PipeOpKind::F, r, fwd++));
    while (fwd < micro_batches) {
      ops.push_back(make_op(PipeOpKind::F, r, fwd++));
      backward();
    }
    while (bwd < micro_batches) backward();
  }
  return s;
}

namespace {

// One DualPipeV rank's order, built the way the published schedule counts: per phase
// (0: chunk r, going down; 1: chunk 2pp-1-r, coming back up) the next micro-batch to run
// forward and backward, FIFO, plus the queue of deferred Ws. Each call appends ops.
struct VRankBuilder {
  std::vector<PipeOp>& out;
  int chunk[2];
  int fwd[2] = {0, 0}, bwd[2] = {0, 0};
  std::deque<PipeOp> deferred_w;

  void F(int phase) { out.push_back(make_op(PipeOpKind::F, chunk[phase], fwd[phase]++)); }
  // A backward: B now and its W at once, or (zero bubble) W queued for a later weight().
  void B(int phase, bool zero_bubble) {
    const int mb = bwd[phase]++;
    out.push_back(make_op(PipeOpKind::B, chunk[phase], mb));
    const PipeOp w = make_op(PipeOpKind::W, chunk[phase], mb);
    if (zero_bubble) {
      deferred_w.push_back(w);
    } else {
      out.push_back(w);
    }
  }
  void weight() {
    out.push_back(deferred_w.front());
    deferred_w.pop_front();
  }
  // Forward of phase f overlapped with a whole backward of phase b (the pair is not split
  // into B and deferred W in the published schedule): FB then W.
  void FB(int f, int b) {
    const int mb = bwd[b]++;
    out.push_back(PipeOp{PipeOpKind::FB, chunk[f], fwd[f]++, chunk[b], mb});
    out.push_back(make_op(PipeOpKind::W, chunk[b], mb));
  }
};

}  // namespace

PipelineSchedule make_dualpipev(int pp, int micro_batches) {
  MT_CHECK(pp >= 1, "dualpipev schedule: pp must be >= 1, got {}", pp);
  MT_CHECK(micro_batches >= 2 * pp,
           "dualpipev schedule: needs micro_batches >= 2*pp = {} (each of the pp = {} ranks holds two "
           "chunks), got micro_batches = {}",
           2 * pp, pp, micro_batches);
  const int P = pp, M = micro_batches;
  PipelineSchedule s{"dualpipev", P, M, 2 * P, true, {}};
  s.ops.resize(P);
  if (P == 1) {
    // One rank holds both chunks and nothing waits on other ranks, so every step but the
    // first and the last can be a pair (expert parallelism's exchanges of one micro-batch
    // under another's compute): F0.0, then F1.0 with F0.1, then in turn a forward of chunk 1
    // with the backward of chunk 1 one micro-batch behind and a forward of chunk 0 with the
    // backward of chunk 0 two behind; the two backwards left, then the last one.
    std::vector<PipeOp>& ops = s.ops[0];
    auto pair = [&](PipeOpKind k, int c1, int m1, int c2, int m2) { ops.push_back(PipeOp{k, c1, m1, c2, m2}); };
    auto w = [&](int c, int m) { ops.push_back(make_op(PipeOpKind::W, c, m)); };
    ops.push_back(make_op(PipeOpKind::F, 0, 0));
    pair(PipeOpKind::FF, 1, 0, 0, 1);
    for (int k = 1; k < M; ++k) {
      pair(PipeOpKind::FB, 1, k, 1, k - 1);
      w(1, k - 1);
      if (k + 1 < M) {
        pair(PipeOpKind::FB, 0, k + 1, 0, k - 1);
        w(0, k - 1);
      }
    }
    pair(PipeOpKind::BB, 1, M - 1, 0, M - 2);
    w(1, M - 1);
    w(0, M - 2);
    ops.push_back(make_op(PipeOpKind::B, 0, M - 1));
    w(0, M - 1);
    return s;
  }
  // The eight steps of DeepSeek's DualPipeV (dualpipe/dualpipev.py). Phase 0 is the chunk
  // on the way down, phase 1 the one on the way back up; `below` = ranks after r.
  for (int r = 0; r < P; ++r) {
    VRankBuilder v{s.ops[r], {r, 2 * P - 1 - r}};
    const int below = P - r - 1;
    // 1. nF0: fill the way down; the ranks further from the turn start earlier.
    for (int i = 0; i < 2 * below; ++i) v.F(0);
    // 2. nF0F1: the first micro-batches come back up; alternate both chunks' forwards.
    for (int i = 0; i < r + 1; ++i) {
      v.F(0);
      v.F(1);
    }
    // 3. nB1W1F1: the first backwards arrive on the way-up chunk; W right after B (the
    //    published code defers it through the zero-bubble queue and pops it at once).
    for (int i = 0; i < below; ++i) {
      v.B(1, true);
      v.weight();
      v.F(1);
    }
    // 4. nF0B1F1B0, the steady state: pairs of one micro-batch's forward with another's
    //    backward. The last rank's first pair is run unpaired (F0, then B1 and its W), as
    //    published: the rank above is waiting for that first gradient, which then leaves
    //    after B1 instead of at the end of a pair.
    for (int i = 0; i < M - 2 * P + r + 1; ++i) {
      if (i == 0 && r == P - 1) {
        v.F(0);
        v.B(1, false);
      } else {
        v.FB(0, 1);
      }
      v.FB(1, 0);
    }
    // 5. nB1F1B0: no phase-0 forwards left; drain the way-up forwards.
    for (int i = 0; i < below; ++i) {
      v.B(1, false);
      v.FB(1, 0);
    }
    // 6. nB1B0: backwards only. From the middle on, Ws are deferred (zero bubble) to fill
    //    the gaps of steps 7 and 8; odd ranks switch before the B1, even ones after it.
    bool zero_bubble = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) zero_bubble = true;
      v.B(1, zero_bubble);
      if (i == (r + 1) / 2 && r % 2 == 0) zero_bubble = true;
      v.B(0, zero_bubble);
    }
    // 7. nWB0: a deferred W while the next way-down gradient arrives, then that B0 (deferred).
    for (int i = 0; i < below; ++i) {
      v.weight();
      v.B(0, true);
    }
    // 8. nW: the remaining deferred Ws.
    while (!v.deferred_w.empty()) v.weight();
    MT_CHECK(v.fwd[0] == M && v.fwd[1] == M && v.bwd[0] == M && v.bwd[1] == M,
             "dualpipev schedule (pp={}, micro_batches={}): rank {} built {} and {} forwards, {} and {} "
             "backwards, expected {} each",
             P, M, r, v.fwd[0], v.fwd[1], v.bwd[0], v.bwd[1], M);
  }
  return s;
}

PipelineSchedule make_forward_only(int pp, int micro_batches, bool v_shape) {
  MT_CHECK(pp >= 1 && micro_batches >= 1, "forward schedule: pp ({}) and micro_batches ({}) must be >= 1", pp,
           micro_batches);
  PipelineSchedule s{"forward", pp, micro_batches, v_shape ? 2 * pp : pp, v_shape, {}};
  s.ops.resize(pp);
  for (int r = 0; r < pp; ++r) {
    auto& ops = s.ops[r];
    if (!v_shape) {
      for (int m = 0; m < micro_batches; ++m) ops.push_back(make_op(PipeOpKind::F, r, m));
      continue;
    }
    // V: micro-batch m reaches the way-up chunk 2pp-1-r 2(pp-r)-1 steps after the way-down
    // chunk r, so rank r runs that many way-down forwards first, then alternates: the
    // pipeline stays full, as in DualPipeV's steps 1 and 2.
    const int up = 2 * pp - 1 - r;
    int down_mb = 0, up_mb = 0;
    for (; down_mb < std::min(micro_batches, 2 * (pp - r) - 1); ++down_mb)
      ops.push_back(make_op(PipeOpKind::F, r, down_mb));
    while (up_mb < micro_batches) {
      ops.push_back(make_op(PipeOpKind::F, up, up_mb++));
      if (down_mb < micro_batches) ops.push_back(make_op(PipeOpKind::F, r, down_mb++));
    }
  }
  return s;
}

void validate(const PipelineSchedule& s) {
  check_structure(s);
  walk(s, Costs{}, false);
}

std::vector<std::vector<double>> finish_times(const PipelineSchedule& s) {
  check_structure(s);
  return walk(s, Costs{}, false).finish;
}

ScheduleTimes simulate(const PipelineSchedule& s, double f, double b, double w, double h, double head_f) {
  return run_times(s, Costs{f, b, w, h, head_f}, false);
}

ScheduleTimes simulate_w_in_pairs(const PipelineSchedule& s, double f, double b, double w) {
  return run_times(s, Costs{f, b, w, 0, 0}, true);
}

double balancing_head_share(double head_rank_work, double helper_work, double head_work) {
  if (head_work <= 0) return 0;
  // head_rank_work + (1 - x) head = helper_work + x head
  return std::clamp((head_rank_work + head_work - helper_work) / (2 * head_work), 0.0, 1.0);
}

int64_t head_rows_kept(int64_t rows, double share) {
  if (rows < 2 || share <= 0) return rows;
  const auto helped = static_cast<int64_t>(std::llround(static_cast<double>(rows) * share));
  return rows - std::clamp<int64_t>(helped, 1, rows - 1);  // a row at least on each side
}

void add_head_helper(PipelineSchedule& s, int helper, double share, double head_cost) {
  const int last = s.num_chunks - 1;
  MT_CHECK(!s.forward_only() && s.pp >= 2 && helper >= 0 && helper < s.pp && helper != s.rank_of_chunk(last),
           "{}: a head helper needs a training schedule of pp >= 2 and a rank other than the head's ({}), got rank {}",
           prefix(s), s.rank_of_chunk(last), helper);
  MT_CHECK(s.head_helper < 0, "{}: already has a head helper", prefix(s));
  MT_CHECK(share > 0 && share <= 1 && head_cost >= 0, "{}: head share {} (want (0, 1]) / head cost {}", prefix(s),
           share, head_cost);
  s.head_helper = helper;
  s.head_share = share;
  Costs costs{1, 1, 1, share * head_cost, (1 - share) * head_cost};
  std::vector<PipeOp> list = s.ops[static_cast<size_t>(helper)];
  // Each H at the place (after the previous H, within a window) that ends the schedule so far
  // soonest: while H(m) is placed, the later micro-batches' B steps do not wait for theirs.
  size_t after = 0;
  const size_t window = 8 * static_cast<size_t>(s.num_chunks) + 8;
  for (int m = 0; m < s.micro_batches; ++m) {
    const PipeOp h{PipeOpKind::H, last, m, -1, -1};
    costs.helped_mbs = m + 1;
    double best = -1;
    size_t best_at = after;
    for (size_t pos = after; pos <= std::min(list.size(), after + window); ++pos) {
      std::vector<PipeOp> trial = list;
      trial.insert(trial.begin() + static_cast<std::ptrdiff_t>(pos), h);
      s.ops[static_cast<size_t>(helper)] = std::move(trial);
      try {
        const double t = walk(s, costs, false).makespan;
        if (best < 0 || t < best - 1e-12) {
          best = t;
          best_at = pos;
        }
      } catch (const Error&) {  // a place before its F can run: a deadlock
      }
    }
    MT_CHECK(best >= 0, "{}: no place for H{}.{} on rank {}", prefix(s), last, m, helper);
    list.insert(list.begin() + static_cast<std::ptrdiff_t>(best_at), h);
    after = best_at + 1;
  }
  s.ops[static_cast<size_t>(helper)] = std::move(list);
  check_structure(s);
  costs.helped_mbs = s.micro_batches;
  walk(s, costs, false);
}

}  // namespace moetrain
