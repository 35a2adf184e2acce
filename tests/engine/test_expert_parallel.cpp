// AllToAllDispatcher and AllGatherDispatcher (expert parallelism) against LocalDispatcher
// on the concatenated batch.
//
// EP ranks run as threads of this process, each with its own Gloo communicator. Each rank
// routes its own tokens; the reference is one LocalDispatcher over every rank's tokens
// concatenated in rank order. By the dispatchers' order contract, rank r's grouped rows
// are exactly the reference's rows for experts [r E/P, (r+1) E/P), bitwise, and so are the
// routes' copies. The sums: bitwise for the all-to-all (the same sums in the same order),
// within rounding for the all-gather (partial sums per rank, then over the ranks).
//
// The routings include an expert that gets no token, a rank that sends no row to the
// last rank, a rank with no token at all, and one local expert per rank (where arrival
// order is already expert-major and the regroup is skipped). With two GPUs the same runs
// go over NCCL with a communication stream (immediate and deferred waits).
#include <gtest/gtest.h>

#include <cstring>

#include <algorithm>
#include <cmath>
#include <latch>
#include <set>
#include <span>
#include <thread>

#include "comm/comm_test_util.h"
#include "comm/nccl_communicator.h"
#include "core/cuda_runtime.h"
#include "engine/parallel/all_gather_dispatch.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::run_ranks;

void expect_contains(const std::string& text, const std::string& part, const std::string& what = "") {
  EXPECT_NE(text.find(part), std::string::npos) << what << ": \"" << text << "\" lacks \"" << part << "\"";
}

struct Case {
  int ep;
  int64_t experts, top_k, hidden;
  std::vector<int64_t> tokens;  // per rank
};

// One layer's inputs on every rank, and the single-process results they must reproduce.
struct Layer {
  int64_t E = 0, K = 0, H = 0;
  std::vector<Tensor> x, topk, dout;  // per rank
  std::vector<int64_t> token_offset;  // first token of each rank in the concatenation
  Tensor all_x, all_topk;
  Tensor ref_rows, ref_counts;   // LocalDispatcher::dispatch on the concatenation
  Tensor ref_combined;           // combine of f(ref_rows), f(row of expert e) = row * (1 + e)
  Tensor all_dout, ref_drows;    // combine_backward of the concatenated dout
  Tensor all_drows, ref_dx;      // dispatch_backward of random row gradients
  std::vector<int64_t> expert_offset;  // first reference row of each expert
  // The weighted combine (the exchange's own): per rank the routing weights, the residual
  // and dy; the reference's output, d weights and d expert rows of the concatenation.
  std::vector<Tensor> weight, residual, dy;
  Tensor ref_y, ref_dweight, ref_weighted_drows;
};

Tensor concat(const std::vector<Tensor>& parts, int64_t cols, DType dtype) {
  int64_t rows = 0;
  for (const Tensor& p : parts) rows += p.size(0);
  Tensor out = Tensor::empty({rows, cols}, dtype);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    if (p.size(0) > 0) out.slice(at, at + p.size(0)).copy_from(p);
    at += p.size(0);
  }
  return out;
}

// Rows of `rows` (grouped by expert, `counts` per expert) times (1 + expert id + first).
Tensor times_expert(const Tensor& rows, const std::vector<int64_t>& counts, int64_t first) {
  Tensor out = rows.clone();
  float* p = out.data<float>();
  const int64_t H = rows.size(1);
  int64_t r = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int64_t i = 0; i < counts[e]; ++i, ++r) {
      for (int64_t h = 0; h < H; ++h) p[r * H + h] *= static_cast<float>(1 + first + static_cast<int64_t>(e));
    }
  }
  return out;
}

// Random top-k routing (distinct experts per token) that never picks `zero_expert`, and
// on rank 0 never the last rank's experts, so rank 0 sends that peer nothing.
Layer make_layer(const Case& c, uint64_t seed) {
  Layer L;
  L.E = c.experts;
  L.K = c.top_k;
  L.H = c.hidden;
  const int64_t El = c.experts / c.ep, zero_expert = c.experts / 2 + 1;
  int64_t offset = 0;
  for (int r = 0; r < c.ep; ++r) {
    const int64_t T = c.tokens[r];
    std::vector<int32_t> allowed;
    for (int64_t e = 0; e < c.experts; ++e) {
      if (e == zero_expert || (r == 0 && c.ep > 1 && e >= (c.ep - 1) * El)) continue;
      allowed.push_back(static_cast<int32_t>(e));
    }
    EXPECT_GE(static_cast<int64_t>(allowed.size()), c.top_k);
    Rng rng(mix64(seed * 131 + r));
    std::vector<int32_t> idx;
    for (int64_t t = 0; t < T; ++t) {
      std::set<int32_t> picked;
      while (static_cast<int64_t>(picked.size()) < c.top_k) {
        const int32_t e = allowed[rng.below(allowed.size())];
        if (picked.insert(e).second) idx.push_back(e);  // in draw order, not sorted
      }
    }
    L.topk.push_back(Tensor::from_vector(idx, {T, c.top_k}));
    L.x.push_back(testing::random_tensor({T, c.hidden}, DType::F32, seed * 1000 + r));
    L.dout.push_back(testing::random_tensor({T * c.top_k, c.hidden}, DType::F32, seed * 2000 + r));
    L.token_offset.push_back(offset);
    offset += T;
  }
  L.all_x = concat(L.x, c.hidden, DType::F32);
  L.all_topk = concat(L.topk, c.top_k, DType::I32);
  L.all_dout = concat(L.dout, c.hidden, DType::F32);

  LocalDispatcher local;
  DispatchState st;
  DispatchOut out = local.dispatch(L.all_x, L.all_topk, c.experts, st);
  L.ref_rows = out.rows;
  L.ref_counts = out.counts;
  const std::vector<int64_t> counts = out.counts.to_vector<int64_t>();
  EXPECT_EQ(counts[zero_expert], 0);
  L.expert_offset.assign(c.experts + 1, 0);
  for (int64_t e = 0; e < c.experts; ++e) L.expert_offset[e + 1] = L.expert_offset[e] + counts[e];
  L.ref_combined = local.combine(times_expert(out.rows, counts, 0), st);
  L.ref_drows = local.combine_backward(L.all_dout, st);
  L.all_drows = testing::random_tensor(out.rows.shape(), DType::F32, seed * 3000);
  L.ref_dx = local.dispatch_backward(L.all_drows, st);
  // The weighted combine on the concatenation, in one process: y = residual + sum_k w * out.
  for (int r = 0; r < c.ep; ++r) {
    const int64_t T = c.tokens[r];
    L.weight.push_back(testing::random_tensor({T, c.top_k}, DType::F32, seed * 4000 + r));
    L.residual.push_back(testing::random_tensor({T, c.hidden}, DType::F32, seed * 5000 + r));
    L.dy.push_back(testing::random_tensor({T, c.hidden}, DType::F32, seed * 6000 + r));
  }
  DispatchState wst;
  local.dispatch(L.all_x, L.all_topk, concat(L.weight, c.top_k, DType::F32), c.experts, wst);
  local.combine_start(times_expert(out.rows, counts, 0), wst);
  L.ref_y = local.combine_finish(concat(L.residual, c.hidden, DType::F32), wst);
  ExpertDispatcher::CombineGrads g = local.combine_backward_weighted(concat(L.dy, c.hidden, DType::F32), wst);
  L.ref_dweight = g.d_weight;
  L.ref_weighted_drows = g.d_rows;
  // The same by hand, from the unweighted routes: the exchange's combine adds nothing else.
  const std::vector<float> rc = L.ref_combined.to_vector<float>(), w = concat(L.weight, c.top_k, DType::F32).to_vector<float>();
  const std::vector<float> res = concat(L.residual, c.hidden, DType::F32).to_vector<float>(), y = L.ref_y.to_vector<float>();
  const int64_t all_t = L.all_x.size(0);
  for (int64_t t = 0; t < all_t; ++t) {
    for (int64_t h = 0; h < c.hidden; ++h) {
      double want = res[t * c.hidden + h];
      for (int64_t k = 0; k < c.top_k; ++k) want += w[t * c.top_k + k] * rc[(t * c.top_k + k) * c.hidden + h];
      EXPECT_NEAR(y[t * c.hidden + h], want, 1e-5 * (1 + std::abs(want))) << "token " << t << " h " << h;
    }
  }
  return L;
}

// Bitwise equality of two f32 tensors (both hold copies or identically ordered sums).
void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> a = got.to_vector<float>(), b = want.to_vector<float>();
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.size() << " elements differ";
}

// Within `rel` of the reference, elementwise (arithmetic on the GPU against the CPU's: the
// same sums, rounded in another order).
void expect_close(const Tensor& got, const Tensor& want, double rel, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> a = got.to_vector<float>(), b = want.to_vector<float>();
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) bad += std::abs(a[i] - b[i]) > rel * (1.0 + std::abs(b[i]));
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.size() << " elements differ by more than " << rel;
}

// One rank's dispatch / combine / backwards of `L`, checked against the reference.
// `device`: where the rank's tensors live (the reference is on the host).
struct RankRun {
  const Layer& L;
  int rank, ep;
  Device device;
  bool exact_sums = true;  // false: the all-gather's sums, compared within rounding
  DispatchState st;
  DispatchOut out;

  // A sum of copies: bitwise where exact_sums, else within f32 rounding (GPU: bf16 rows are
  // compared by the caller).
  void check_sum(const Tensor& got, const Tensor& want, const std::string& what) const {
    if (exact_sums) expect_same(got, want, what);
    else expect_close(got.to(DType::F32), want, 1e-5, what);
  }

  int64_t El() const { return L.E / ep; }
  int64_t first_row() const { return L.expert_offset[rank * El()]; }
  int64_t end_row() const { return L.expert_offset[(rank + 1) * El()]; }

  void dispatch(ExpertDispatcher& d) {
    out = d.dispatch(L.x[rank].to(device), L.topk[rank].to(device), L.E, st);
    d.wait(st);
  }
  // The same in two calls (other work, here another layer's dispatch, may come between).
  void dispatch_start(ExpertDispatcher& d) {
    d.dispatch_start(L.x[rank].to(device), L.topk[rank].to(device), Tensor(), L.E, st);
  }
  void dispatch_finish(ExpertDispatcher& d) {
    out = d.dispatch_finish(st);
    d.wait(st);
  }
  void check_dispatch() {
    const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(ep);
    expect_same(out.rows.to(Device::cpu()), L.ref_rows.slice(first_row(), end_row()), where + " rows");
    const std::vector<int64_t> all = L.ref_counts.to_vector<int64_t>();
    EXPECT_EQ(out.counts.to_vector<int64_t>(),
              std::vector<int64_t>(all.begin() + rank * El(), all.begin() + (rank + 1) * El()))
        << where << " counts";
  }
  void combine_and_backward(ExpertDispatcher& d) {
    const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(ep);
    const int64_t T = L.x[rank].size(0), t0 = L.token_offset[rank];
    const std::vector<int64_t> counts = out.counts.to_vector<int64_t>();
    Tensor y = times_expert(out.rows.to(Device::cpu()), counts, rank * El()).to(device);
    Tensor combined = d.combine(y, st);
    d.wait(st);
    expect_same(combined.to(Device::cpu()), L.ref_combined.slice(t0 * L.K, (t0 + T) * L.K), where + " combine");
    Tensor drows = d.combine_backward(L.dout[rank].to(device), st);
    d.wait(st);
    expect_same(drows.to(Device::cpu()), L.ref_drows.slice(first_row(), end_row()), where + " combine_backward");
    // In place: the rows as they come home, read through the order, are combine()'s; the
    // gradient given in their order goes back as combine_backward's.
    ExpertDispatcher::PlacedRows placed = d.combine_in_place(y, st);
    d.wait(st);
    if (!placed.order.defined()) {  // the all-gather's: combine() itself
      expect_same(placed.rows.to(Device::cpu()), L.ref_combined.slice(t0 * L.K, (t0 + T) * L.K),
                  where + " combine_in_place");
    } else {
      check_in_place(d, placed, T, t0, where);
    }
    Tensor dx = d.dispatch_backward(L.all_drows.slice(first_row(), end_row()).to(device), st);
    d.wait(st);
    check_sum(dx.to(Device::cpu()), L.ref_dx.slice(t0, t0 + T), where + " dispatch_backward");
  }
  void check_in_place(ExpertDispatcher& d, const ExpertDispatcher::PlacedRows& placed, int64_t T, int64_t t0,
                      const std::string& where) {
    const std::vector<int32_t> order = placed.order.to(Device::cpu()).to_vector<int32_t>();
    const Tensor home = placed.rows.to(Device::cpu());
    ASSERT_EQ(static_cast<int64_t>(order.size()), T * L.K) << where;
    Tensor read = Tensor::empty({T * L.K, home.size(1)}, home.dtype(), Device::cpu());
    for (int64_t i = 0; i < T * L.K; ++i) read.slice(i, i + 1).copy_from(home.slice(order[i], order[i] + 1));
    expect_same(read, L.ref_combined.slice(t0 * L.K, (t0 + T) * L.K), where + " combine_in_place");
    Tensor d_home = Tensor::zeros(home.shape(), home.dtype(), Device::cpu());
    const Tensor dout = L.dout[rank];
    for (int64_t i = 0; i < T * L.K; ++i) d_home.slice(order[i], order[i] + 1).copy_from(dout.slice(i, i + 1));
    Tensor drows_placed = d.combine_in_place_backward(d_home.to(device), st);
    d.wait(st);
    expect_same(drows_placed.to(Device::cpu()), L.ref_drows.slice(first_row(), end_row()),
                where + " combine_in_place_backward");
  }
  // The exchange's weighted combine: dispatch with the weights, combine_start/finish and its
  // backward, against the one-process reference.
  void weighted_combine(ExpertDispatcher& d) {
    const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(ep);
    const int64_t T = L.x[rank].size(0), t0 = L.token_offset[rank];
    DispatchState ws;
    DispatchOut in = d.dispatch(L.x[rank].to(device), L.topk[rank].to(device), L.weight[rank].to(device), L.E, ws);
    d.wait(ws);
    const std::vector<int64_t> counts = in.counts.to_vector<int64_t>();
    d.combine_start(times_expert(in.rows.to(Device::cpu()), counts, rank * El()).to(device), ws);
    // On the CPU the same ops in the same order: bitwise; on a GPU its kernels' rounding.
    auto check = [&](const Tensor& got, const Tensor& want, const std::string& what) {
      if (device.is_cpu()) check_sum(got.to(Device::cpu()), want, where + what);
      else expect_close(got.to(Device::cpu()).to(DType::F32), want, 1e-5, where + what);
    };
    Tensor y = d.combine_finish(L.residual[rank].to(device), ws);
    check(y, L.ref_y.slice(t0, t0 + T), " combine_finish");
    ExpertDispatcher::CombineGrads g = d.combine_backward_weighted(L.dy[rank].to(device), ws);
    d.wait(ws);
    check(g.d_weight, L.ref_dweight.slice(t0, t0 + T), " d weight");
    check(g.d_rows, L.ref_weighted_drows.slice(first_row(), end_row()), " combine_backward_weighted");
  }
};

// Two layers per rank, interleaved as a forward then a backward pass would run them, so
// one dispatcher serves several states at once (two dispatches started before either
// finishes, as paired micro-batches do; then one in a single call).
void run_two_layers(RankRun& a, RankRun& b, ExpertDispatcher& d) {
  a.dispatch_start(d);
  b.dispatch_start(d);
  a.dispatch_finish(d);
  b.dispatch_finish(d);
  a.check_dispatch();
  b.check_dispatch();
  b.dispatch(d);
  a.check_dispatch();
  b.check_dispatch();
  b.combine_and_backward(d);
  a.combine_and_backward(d);
  a.weighted_combine(d);
  b.weighted_combine(d);
}

ExchangeOptions checked() {
  ExchangeOptions o;
  o.check_conservation = true;  // the group-wide check runs (and must pass) in these cases
  return o;
}

// kAllGatherPeerCopies: the all-gather with its token rows copied into the peers' memory
// (GPUs only; on the CPU the same as kAllGather).
enum class Kind { kAllToAll, kAllGather, kAllGatherPeerCopies };
const Kind kKinds[] = {Kind::kAllToAll, Kind::kAllGather};
const char* name(Kind k) {
  return k == Kind::kAllToAll ? "all-to-all" : k == Kind::kAllGather ? "all-gather" : "all-gather, peer copies";
}

std::unique_ptr<ExpertDispatcher> make_dispatcher(Kind kind, Communicator& comm, ExchangeOptions o) {
  if (kind == Kind::kAllToAll) return std::make_unique<AllToAllDispatcher>(comm, o);
  o.peer_copies = kind == Kind::kAllGatherPeerCopies;
  return std::make_unique<AllGatherDispatcher>(comm, o);
}

int64_t first_expert_of(ExpertDispatcher& d, int64_t E) { return dynamic_cast<GroupDispatcher&>(d).first_local_expert(E); }

void run_case(const Case& c, ExchangeOptions options = checked()) {
  const Layer L0 = make_layer(c, 1), L1 = make_layer(c, 2);
  // The all-gather twice: learning the token counts at each dispatch, and told a bound
  // (every block padded to it).
  const int64_t most = *std::max_element(c.tokens.begin(), c.tokens.end());
  for (auto [kind, max_tokens] : {std::pair{Kind::kAllToAll, int64_t{0}}, std::pair{Kind::kAllGather, int64_t{0}},
                                  std::pair{Kind::kAllGather, most + 3}}) {
    SCOPED_TRACE(fmt::format("{}, max_tokens {}", name(kind), max_tokens));
    run_ranks(c.ep, [&](Communicator& comm) {
      ExchangeOptions o = options;
      o.max_tokens = max_tokens;
      std::unique_ptr<ExpertDispatcher> d = make_dispatcher(kind, comm, o);
      EXPECT_EQ(d->num_local_experts(c.experts), c.experts / c.ep);
      EXPECT_EQ(first_expert_of(*d, c.experts), comm.rank() * (c.experts / c.ep));
      const bool exact = kind == Kind::kAllToAll;
      RankRun a{L0, comm.rank(), c.ep, Device::cpu(), exact}, b{L1, comm.rank(), c.ep, Device::cpu(), exact};
      run_two_layers(a, b, *d);
    });
  }
}

TEST(ExpertParallel, TwoRanksMatchOneProcess) { run_case({2, 8, 2, 16, {37, 23}}); }

TEST(ExpertParallel, FourRanksMatchOneProcessWithAnEmptyRank) { run_case({4, 8, 2, 12, {19, 0, 31, 8}}); }

TEST(ExpertParallel, FourRanksManyExpertsPerRank) { run_case({4, 16, 4, 8, {40, 33, 1, 26}}); }

TEST(ExpertParallel, OneRankIsTheLocalPermutation) { run_case({1, 4, 2, 8, {21}}); }

TEST(ExpertParallel, OneLocalExpertPerRankNeedsNoRegroup) { run_case({4, 4, 2, 8, {9, 14, 6, 11}}); }

TEST(ExpertParallel, CheckOffAndStreamOptionsAreHarmlessOnTheCpu) {
  ExchangeOptions o;
  o.check_conservation = false;
  o.defer_wait = true;  // no stream on the CPU: wait() is a no-op
  run_case({2, 8, 2, 16, {12, 17}}, o);
}

// Exchange timing (the collective timer of bench and the metrics record): every exchange
// counted as its layer's dispatch or combine; on Gloo all of it is exposed. The all-gather's
// bytes are known exactly: (P - 1) x each gathered block, and (P - 1) / P of each
// reduce-scattered one. Without an active timer nothing is recorded.
TEST(ExpertParallel, ExchangeTimingCountsEveryExchangeAndItsBytes) {
  for (Kind kind : kKinds) {
    SCOPED_TRACE(name(kind));
    run_ranks(2, [&](Communicator& comm) {
      std::unique_ptr<ExpertDispatcher> d = make_dispatcher(kind, comm, {});
      CollectiveTimer timer(Device::cpu());
      const int64_t T = 9, K = 2, H = 4, E = 4;
      Tensor x = testing::random_tensor({T, H}, DType::F32, 3 + comm.rank());
      Tensor idx = testing::random_ints({T, K}, 0, static_cast<int32_t>(E), 5 + comm.rank());
      for (int64_t t = 0; t < T; ++t) idx.data<int32_t>()[t * K + 1] = (idx.data<int32_t>()[t * K] + 1) % E;
      auto exchange = [&] {
        DispatchState st;
        DispatchOut in = d->dispatch(x, idx, E, st);
        Tensor back = d->combine(in.rows, st);
        EXPECT_EQ(back.size(0), T * K);
      };
      exchange();  // no timer active: not counted
      CollectiveTimer::activate(&timer);
      exchange();
      CollectiveTimer::activate(nullptr);
      const auto t = timer.take();
      const CollectiveTotals& dispatch = t[static_cast<int>(Collective::kDispatch)];
      const CollectiveTotals& combine = t[static_cast<int>(Collective::kCombine)];
      EXPECT_EQ(dispatch.count, 1);
      EXPECT_EQ(combine.count, 1);
      for (const CollectiveTotals* c : {&dispatch, &combine}) {
        EXPECT_GT(c->ms, 0.0);
        EXPECT_DOUBLE_EQ(c->exposed_ms, c->ms);
        EXPECT_DOUBLE_EQ(c->hidden(), 0.0);
      }
      if (kind == Kind::kAllGather) {
        // dispatch: token counts (i64), ids (i32 [T, K]), x (f32 [T, H]); combine: [T K, H] f32 home
        EXPECT_DOUBLE_EQ(dispatch.bytes, 8.0 + T * K * 4 + T * H * 4);
        EXPECT_DOUBLE_EQ(combine.bytes, T * K * H * 4.0);
      } else {
        EXPECT_GT(dispatch.bytes, 0.0);
        EXPECT_GT(combine.bytes, 0.0);
      }
      for (const CollectiveTotals& c : timer.take()) EXPECT_EQ(c.count, 0);  // taken: reset
    });
  }
}

TEST(ExpertParallel, ExpertsMustSplitEvenly) {
  run_ranks(4, [](Communicator& comm) {
    AllToAllDispatcher d(comm);
    try {
      d.num_local_experts(6);
      ADD_FAILURE() << "6 experts over 4 ranks accepted";
    } catch (const Error& e) {
      expect_contains(e.what(), "[model] has 6 experts, which cannot be split evenly over 4 expert-parallel ranks ([parallel].tp x ep)");
    }
  });
}

TEST(ExpertParallel, ConservationViolationStopsEveryRankNamingTheNumbers) {
  const Case c{2, 8, 2, 8, {10, 12}};
  const Layer L = make_layer(c, 3);
  std::vector<std::string> errors(2);
  run_ranks(2, [&](Communicator& comm) {
    ExchangeOptions o = checked();
    // Rank 1 miscounts what rank 0 sends its first expert.
    if (comm.rank() == 1) o.tamper_received_counts = [](std::vector<int64_t>& got) { got[0] += 1; };
    AllToAllDispatcher d(comm, o);
    DispatchState st;
    st.layer = 7;
    try {
      d.dispatch(L.x[comm.rank()], L.topk[comm.rank()], c.experts, st);
    } catch (const Error& e) {
      errors[comm.rank()] = e.what();
    }
  });
  // Rank 0 sends rank 1 nothing (it avoids the last rank's experts); rank 1 now expects 1.
  for (int r = 0; r < 2; ++r) {
    const std::string who = "rank " + std::to_string(r);
    expect_contains(errors[r],
                    "expert dispatch of layer 7 on world: token conservation violated: rank 0 sends 0 rows to rank 1, "
                    "which expects 1 from it",
                    who);
    expect_contains(errors[r], fmt::format("in all {} rows sent, {} expected", (10 + 12) * 2, (10 + 12) * 2 + 1), who);
  }
}

// FP8 experts (DispatchState::fp8_rows): every dispatcher quantizes each token once, on its
// own rank, and moves its codes and scales in one packed row. Each rank's experts then get the
// codes and scales that one process gives the same rows of the concatenated batch, bit for bit,
// and as rows their values (not x: the weight gradient reads what the forward multiplied), so
// every layout hands over the same rows. The rows' exchange sends H + 4 ceil(H/128) bytes a row
// (208 here) where f32 rows take 4 H. Two ranks (one regroup-free local expert each: 8 / 2 =
// 4 here, regrouped) and four (a rank with no tokens); a partial last tile of 72 columns.
TEST(ExpertParallel, Fp8RowsAreTheTokensQuantizedOnce) {
  for (const Case& c : {Case{2, 8, 2, 200, {29, 41}}, Case{4, 8, 2, 200, {29, 41, 0, 17}}}) {
    SCOPED_TRACE("ep " + std::to_string(c.ep));
    const Layer L = make_layer(c, 9);
    const int64_t E = c.experts, El = E / c.ep, W = 200 + 4 * 2;
    LocalDispatcher local;
    DispatchState ref_st;
    ref_st.fp8_rows = true;
    const DispatchOut ref = local.dispatch(L.all_x, L.all_topk, E, ref_st);
    // One process: the rows' codes are the permuted rows quantized, the rows their values.
    const ops::Fp8Tensor want = ops::quantize_fp8(ops::permute_forward(L.all_x, ref_st.perm), ops::Fp8Blocks::kRows);
    ASSERT_TRUE(ref.rows_q.q.defined());
    ASSERT_EQ(ref.rows_q.q.shape(), want.q.shape());
    EXPECT_EQ(0, std::memcmp(ref.rows_q.q.raw(), want.q.raw(), want.q.nbytes()));
    EXPECT_EQ(ref.rows_q.scale.to_vector<float>(), want.scale.to_vector<float>());
    expect_same(ref.rows, ops::dequantize_fp8(ref.rows_q, DType::F32), "one process: rows");
    {  // bf16 tokens (the GPU's): bf16 rows, the values of the bf16 tokens' codes
      DispatchState bst;
      bst.fp8_rows = true;
      const Tensor xb = L.all_x.to(DType::BF16);
      const DispatchOut b = local.dispatch(xb, L.all_topk, E, bst);
      const ops::Fp8Tensor wb = ops::quantize_fp8(ops::permute_forward(xb, bst.perm), ops::Fp8Blocks::kRows);
      ASSERT_EQ(b.rows.dtype(), DType::BF16);
      EXPECT_EQ(0, std::memcmp(b.rows_q.q.raw(), wb.q.raw(), wb.q.nbytes()));
      EXPECT_EQ(b.rows.to_double_vector(), ops::dequantize_fp8(wb, DType::BF16).to_double_vector());
    }
    // Codes the caller gives (its norm's fused pass: DispatchState::tokens_q) are what the
    // dispatch moves, in place of quantizing x: given those of 2x, the rows are twice the
    // reference's (the scales double exactly, the codes stay).
    auto twice = [](const Tensor& t) {
      Tensor out = t.clone();
      for (float& v : std::span<float>(out.data<float>(), static_cast<size_t>(out.numel()))) v *= 2;
      return out;
    };
    for (const bool given : {false, true})
    for (Kind kind : kKinds) {
      SCOPED_TRACE(fmt::format("{}{}", name(kind), given ? ", codes given" : ""));
      run_ranks(c.ep, [&](Communicator& comm) {
        const int r = comm.rank();
        std::unique_ptr<ExpertDispatcher> d = make_dispatcher(kind, comm, {});
        CollectiveTimer timer(Device::cpu());
        CollectiveTimer::activate(&timer);
        DispatchState st;
        st.fp8_rows = true;
        if (given) st.tokens_q = ops::quantize_fp8(twice(L.x[r]), ops::Fp8Blocks::kRows);
        const DispatchOut out = d->dispatch(L.x[r], L.topk[r], E, st);
        CollectiveTimer::activate(nullptr);
        EXPECT_FALSE(st.tokens_q.q.defined()) << "the given codes are taken, not kept";
        const int64_t a = L.expert_offset[r * El], b = L.expert_offset[(r + 1) * El];
        const std::string who = fmt::format("rank {}", r);
        ASSERT_TRUE(out.rows_q.q.defined()) << who;
        ASSERT_EQ(out.rows_q.q.shape(), (Shape{b - a, c.hidden})) << who;
        EXPECT_EQ(0, std::memcmp(out.rows_q.q.raw(), ref.rows_q.q.slice(a, b).raw(), out.rows_q.q.nbytes())) << who;
        const Tensor want_scales = ref.rows_q.scale.columns(a, b), want_rows = ref.rows.slice(a, b);
        expect_same(out.rows_q.scale, given ? twice(want_scales) : want_scales, who + ": scales");
        expect_same(out.rows, given ? twice(want_rows) : want_rows, who + ": rows");
        const double bytes = timer.take()[static_cast<int>(Collective::kDispatch)].bytes;
        const int64_t T = c.tokens[static_cast<size_t>(r)], Tp = *std::max_element(c.tokens.begin(), c.tokens.end());
        if (kind == Kind::kAllToAll) {  // the counts (i64 per peer's local expert), then the rows
          int64_t sent = 0;
          for (int p = 0; p < c.ep; ++p) sent += p == r ? 0 : st.send_rows[static_cast<size_t>(p)];
          EXPECT_DOUBLE_EQ(bytes, (c.ep - 1) * El * 8.0 + sent * W) << who;
        } else {  // the token count, the ids and the packed rows, padded to the largest count
          EXPECT_DOUBLE_EQ(bytes, (c.ep - 1) * (8.0 + Tp * c.top_k * 4 + Tp * W)) << who << ", " << T << " tokens";
        }
      });
    }
  }
}

// Told a bound on the tokens, the all-gather refuses a batch beyond it, naming both.
TEST(ExpertParallel, AllGatherRefusesMoreTokensThanItsBound) {
  run_ranks(2, [](Communicator& comm) {
    ExchangeOptions o;
    o.max_tokens = 8;
    AllGatherDispatcher d(comm, o);
    DispatchState st;
    Tensor x = testing::random_tensor({9, 4}, DType::F32, 1);
    Tensor idx = Tensor::zeros({9, 2}, DType::I32);
    try {
      d.dispatch(x, idx, 4, st);
      ADD_FAILURE() << "9 tokens accepted under max_tokens = 8";
    } catch (const Error& e) {
      expect_contains(e.what(), "9 tokens, more than the 8 every rank was said to dispatch at most");
    }
  });
}

// The all-gather's group-wide check: an expert id no rank holds is a copy no expert takes.
TEST(ExpertParallel, AllGatherConservationViolationStopsEveryRank) {
  const Case c{2, 8, 2, 8, {10, 12}};
  const Layer L = make_layer(c, 3);
  std::vector<std::string> errors(2);
  run_ranks(2, [&](Communicator& comm) {
    AllGatherDispatcher d(comm, checked());
    DispatchState st;
    st.layer = 4;
    Tensor idx = L.topk[comm.rank()].clone();
    if (comm.rank() == 1) idx.data<int32_t>()[3] = static_cast<int32_t>(c.experts);  // out of range
    try {
      d.dispatch(L.x[comm.rank()], idx, c.experts, st);
    } catch (const Error& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    expect_contains(errors[r],
                    fmt::format("expert dispatch (all-gather) of layer 4 on world: token conservation violated: the 2 "
                                "ranks' experts took {} (token, expert) copies of the 22 tokens' {}",
                                22 * 2 - 1, 22 * 2),
                    "rank " + std::to_string(r));
  }
}

// ---- NCCL, two GPUs ---------------------------------------------------------------------

bool two_gpus() { return nccl_built() && cuda::available() && cuda::device_count() >= 2; }

void run_case_nccl(const Case& c, bool defer, DType dtype, Kind kind) {
  SCOPED_TRACE(name(kind));
  const Layer L0 = make_layer(c, 4), L1 = make_layer(c, 5);
  // One process's FP8 dispatch of the same tokens in `dtype` (their codes, scales and values).
  LocalDispatcher local;
  DispatchState fp8_st;
  fp8_st.fp8_rows = true;
  const DispatchOut fp8_ref = local.dispatch(L0.all_x.to(dtype), L0.all_topk, c.experts, fp8_st);
  auto store = Store::open("memory", 0, std::chrono::seconds(60));
  std::vector<std::string> errors(2);
  std::latch done(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> comm;
      cuda::Stream stream = nullptr, back = nullptr;
      try {
        comm = connect_nccl(store, r, 2, r, testing::test_options(std::chrono::seconds(60)));
        stream = cuda::create_stream();
        ExchangeOptions o = checked();
        o.comm_stream = stream;
        o.defer_wait = defer;
        if (defer) {  // the backward's exchanges on a stream of their own (the peer copies take it)
          back = cuda::create_stream();
          o.comm_stream_backward = back;
        }
        std::unique_ptr<ExpertDispatcher> dp = make_dispatcher(kind, *comm, o);
        ExpertDispatcher& d = *dp;
        const bool exact = kind == Kind::kAllToAll;
        RankRun a{L0, r, 2, Device::cuda(r), exact}, b{L1, r, 2, Device::cuda(r), exact};
        run_two_layers(a, b, d);
        if (kind == Kind::kAllGatherPeerCopies) {  // two GPUs of one host: the copies did run
          EXPECT_TRUE(dynamic_cast<AllGatherDispatcher&>(d).uses_peer_copies()) << "rank " << r;
        }
        // bf16 rows: the copies are exact, so the rows equal the f32 reference rounded.
        DispatchState st;
        DispatchOut out = d.dispatch(L0.x[r].to(dtype).to(Device::cuda(r)), L0.topk[r].to(Device::cuda(r)), c.experts, st);
        d.wait(st);
        expect_same(out.rows.to(Device::cpu()).to(DType::F32),
                    L0.ref_rows.slice(a.first_row(), a.end_row()).to(dtype).to(DType::F32), "bf16 rows");
        // FP8 experts: the packed codes and scales over NCCL are one process's (of the same bf16
        // tokens, on the CPU) for this rank's rows, and the rows their values.
        DispatchState fst;
        fst.fp8_rows = true;
        DispatchOut f = d.dispatch(L0.x[r].to(dtype).to(Device::cuda(r)), L0.topk[r].to(Device::cuda(r)), c.experts, fst);
        d.wait(fst);
        const int64_t r0 = a.first_row(), r1 = a.end_row();
        ASSERT_TRUE(f.rows_q.q.defined());
        const Tensor q = f.rows_q.q.to(Device::cpu());
        ASSERT_EQ(q.shape(), (Shape{r1 - r0, c.hidden}));
        EXPECT_EQ(0, std::memcmp(q.raw(), fp8_ref.rows_q.q.slice(r0, r1).raw(), q.nbytes())) << "fp8 codes";
        expect_same(f.rows_q.scale.to(Device::cpu()), fp8_ref.rows_q.scale.columns(r0, r1), "fp8 scales");
        expect_same(f.rows.to(Device::cpu()).to(DType::F32), fp8_ref.rows.slice(r0, r1).to(DType::F32), "fp8 rows");
        comm->synchronize(stream);
        cuda::device_synchronize();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
      done.arrive_and_wait();
      if (stream) cuda::destroy_stream(stream);
      if (back) cuda::destroy_stream(back);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(ExpertParallelNccl, TwoGpusOnACommStreamMatchOneProcess) {
  if (!two_gpus()) GTEST_SKIP() << "needs NCCL and 2 GPUs";
  for (Kind kind : {Kind::kAllToAll, Kind::kAllGather, Kind::kAllGatherPeerCopies}) {
    run_case_nccl({2, 8, 2, 64, {300, 257}}, /*defer=*/false, DType::BF16, kind);
  }
}

TEST(ExpertParallelNccl, DeferredWaitsMatchOneProcess) {
  if (!two_gpus()) GTEST_SKIP() << "needs NCCL and 2 GPUs";
  for (Kind kind : {Kind::kAllToAll, Kind::kAllGather, Kind::kAllGatherPeerCopies}) {
    run_case_nccl({2, 16, 4, 64, {129, 0}}, /*defer=*/true, DType::BF16, kind);
  }
}

}  // namespace
}  // namespace moetrain
