// Pipeline schedules: 1F1B and DualPipeV orders validate for many (pp, micro-batches), the
// validator rejects broken orders with errors that name the rank and op, and the simulated
// bubbles match the closed forms (docs/pipeline.md has the printed numbers).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include "core/error.h"
#include "engine/pipeline/schedule.h"

namespace moetrain {
namespace {

// The message of the Error that fn throws ("" if it throws none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << "in: " << (text)

TEST(PipelineSchedule, OneFOneBValidates) {
  for (int pp : {1, 2, 3, 4, 8}) {
    for (int m = 1; m <= 3 * pp; ++m) {
      const PipelineSchedule s = make_1f1b(pp, m);
      EXPECT_NO_THROW(validate(s)) << "pp=" << pp << " M=" << m;
      for (int r = 0; r < pp; ++r) EXPECT_EQ(s.ops[r].size(), 3u * m);
    }
  }
}

TEST(PipelineSchedule, DualPipeVValidates) {
  for (int pp : {1, 2, 3, 4, 8}) {
    for (int m = 2 * pp; m <= 4 * pp + 1; ++m) {
      const PipelineSchedule s = make_dualpipev(pp, m);
      EXPECT_NO_THROW(validate(s)) << "pp=" << pp << " M=" << m;
      ASSERT_EQ(s.num_chunks, 2 * pp);
      for (int r = 0; r < pp; ++r) {
        EXPECT_EQ(s.chunks_of_rank(r), (std::vector<int>{r, 2 * pp - 1 - r}));
        // Steady state: rank r runs 2(M - 2pp + r + 1) + (pp - r - 1) overlapped pairs, one
        // fewer on the last rank (its first pair runs unpaired).
        const int fb = static_cast<int>(std::count_if(s.ops[r].begin(), s.ops[r].end(),
                                                      [](const PipeOp& o) { return o.kind == PipeOpKind::FB; }));
        EXPECT_EQ(fb, 2 * (m - 2 * pp + r + 1) + (pp - r - 1) - (r == pp - 1 ? 1 : 0)) << "pp=" << pp << " r=" << r;
      }
    }
  }
  const std::string e = error_of([] { make_dualpipev(4, 7); });
  EXPECT_HAS(e, "micro_batches >= 2*pp = 8");
  EXPECT_HAS(e, "pp = 4");
  EXPECT_HAS(e, "micro_batches = 7");
}

TEST(PipelineSchedule, ForwardOnlyValidates) {
  for (int pp : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 5, 17}) {
      for (bool v : {false, true}) {
        const PipelineSchedule s = make_forward_only(pp, m, v);
        EXPECT_NO_THROW(validate(s)) << "pp=" << pp << " M=" << m << " v=" << v;
        for (int r = 0; r < pp; ++r) EXPECT_EQ(s.ops[r].size(), static_cast<size_t>(m) * (v ? 2 : 1));
      }
    }
  }
  // A forward-only schedule with a backward step in it is rejected.
  PipelineSchedule s = make_forward_only(2, 2, false);
  s.ops[1].push_back(PipeOp{PipeOpKind::B, 1, 0});
  EXPECT_HAS(error_of([&] { validate(s); }), "rank 1 op 2 (B1.0): a forward-only schedule has no B or W ops");
}

TEST(PipelineSchedule, RejectsDeadlock) {
  // Rank 1 starts with B1.0 before its F1.0; rank 0 then waits at its first B for rank 1.
  PipelineSchedule s = make_1f1b(2, 4);
  std::swap(s.ops[1][0], s.ops[1][1]);
  const std::string e = error_of([&] { validate(s); });
  EXPECT_HAS(e, "pipeline schedule '1f1b' (pp=2, micro_batches=4): deadlock");
  EXPECT_HAS(e, "rank 0 blocked at op 2 (B0.0) waiting for B1.0");
  EXPECT_HAS(e, "rank 1 blocked at op 0 (B1.0) waiting for F1.0");

  // In the V: rank 1 (chunks 1 and 2) runs F2.0 before the F1.0 it needs; rank 0 then
  // waits at F3.0 for F2.0. simulate() reports it as validate() does.
  PipelineSchedule v = make_dualpipev(2, 4);
  ASSERT_EQ(to_string(v.ops[1][0]), "F1.0");
  ASSERT_EQ(to_string(v.ops[1][1]), "F2.0");
  std::swap(v.ops[1][0], v.ops[1][1]);
  const std::string ev = error_of([&] { simulate(v, 1, 2, 1); });
  EXPECT_HAS(ev, "rank 1 blocked at op 0 (F2.0) waiting for F1.0");
  EXPECT_HAS(ev, "rank 0 blocked at op 3 (F3.0) waiting for F2.0");

  // An FB whose backward half needs its own forward half can never start.
  PipelineSchedule one = make_dualpipev(1, 2);
  std::vector<PipeOp> ops;
  for (int m = 0; m < 2; ++m) {
    ops.push_back({PipeOpKind::F, 0, m});
    ops.push_back({PipeOpKind::FB, 1, m, 1, m});
    ops.push_back({PipeOpKind::W, 1, m});
    ops.push_back({PipeOpKind::B, 0, m});
    ops.push_back({PipeOpKind::W, 0, m});
  }
  one.ops[0] = ops;
  EXPECT_HAS(error_of([&] { validate(one); }), "rank 0 blocked at op 1 (F1.0+B1.0) waiting for F1.0");

  // So can two forwards (two backwards) of one micro-batch, the second needing the first.
  one = make_dualpipev(1, 2);
  ASSERT_EQ(to_string(one.ops[0][1]), "F1.0+F0.1");
  one.ops[0][0] = PipeOp{PipeOpKind::FF, 0, 0, 1, 0};
  one.ops[0][1] = PipeOp{PipeOpKind::F, 0, 1};
  EXPECT_HAS(error_of([&] { validate(one); }), "rank 0 blocked at op 0 (F0.0+F1.0) waiting for F0.0");
  one = make_dualpipev(1, 2);
  ASSERT_EQ(to_string(one.ops[0][4]), "B1.1+B0.0");
  one.ops[0][4] = PipeOp{PipeOpKind::BB, 1, 1, 0, 1};
  one.ops[0][7] = PipeOp{PipeOpKind::B, 0, 0};
  EXPECT_HAS(error_of([&] { validate(one); }), "rank 0 blocked at op 4 (B1.1+B0.1) waiting for B1.1");
}

TEST(PipelineSchedule, RejectsMissingOrRepeatedOrMisplacedOps) {
  PipelineSchedule s = make_dualpipev(2, 4);
  ASSERT_EQ(to_string(s.ops[1].back()), "W1.3");
  s.ops[1].pop_back();
  EXPECT_HAS(error_of([&] { validate(s); }), "rank 1 lacks W1.3 (each (chunk, mb) runs its F, B and W exactly once)");

  s = make_1f1b(2, 2);
  s.ops[0].push_back(s.ops[0][0]);
  EXPECT_HAS(error_of([&] { validate(s); }), "rank 0 op 6 (F0.0): repeats F0.0");

  // F1.0 moved from rank 1 to rank 0.
  s = make_1f1b(2, 2);
  ASSERT_EQ(to_string(s.ops[1][0]), "F1.0");
  s.ops[0].insert(s.ops[0].begin(), s.ops[1][0]);
  s.ops[1].erase(s.ops[1].begin());
  EXPECT_HAS(error_of([&] { validate(s); }), "rank 0 op 0 (F1.0): chunk 1 is held by rank 1, not rank 0");

  // The V's way-up chunk on the wrong rank: chunk 3 lives on rank 0 when pp = 2.
  s = make_dualpipev(2, 4);
  ASSERT_EQ(to_string(s.ops[1][7]), "F2.2+B1.0");
  s.ops[1][7].chunk2 = 3;
  EXPECT_HAS(error_of([&] { validate(s); }), "rank 1 op 7 (F2.2+B3.0): chunk 3 is held by rank 0, not rank 1");

  s = make_1f1b(2, 2);
  s.ops[1][0].mb = 2;
  EXPECT_HAS(error_of([&] { validate(s); }), "rank 1 op 0 (F1.2): micro-batch 2 out of range [0, 2)");
}

TEST(PipelineSchedule, OneFOneBBubbleMatchesFormula) {
  // Our W is its own op after its B, and the gradient leaves after B, not after W: an
  // upstream rank's B overlaps this rank's W, so the fill/drain costs f + b per stage:
  //   bubble = (pp-1)(f+b) / (M(f+b+w) + (pp-1)(f+b)),
  // the textbook (pp-1)(f+b+w) / ((M+pp-1)(f+b+w)) when w = 0.
  for (double w : {1.0, 0.0}) {
    const double f = 1, b = 2;
    for (auto [pp, m] : {std::pair{1, 3}, {2, 1}, {2, 4}, {3, 3}, {4, 8}, {4, 13}, {8, 16}, {8, 5}}) {
      const ScheduleTimes t = simulate(make_1f1b(pp, m), f, b, w);
      const double fill = (pp - 1) * (f + b);
      EXPECT_NEAR(t.bubble_fraction, fill / (m * (f + b + w) + fill), 1e-9) << "pp=" << pp << " M=" << m;
      EXPECT_NEAR(t.makespan, m * (f + b + w) + fill, 1e-9);
      EXPECT_NEAR(t.work, pp * m * (f + b + w), 1e-9);
      for (double idle : t.idle) EXPECT_NEAR(idle, fill, 1e-9);
      if (w == 0) {
        const double textbook = (pp - 1) * (f + b + w) / (m * (f + b + w) + (pp - 1) * (f + b + w));
        EXPECT_NEAR(t.bubble_fraction, textbook, 1e-9) << "pp=" << pp << " M=" << m;
      }
    }
  }
}

TEST(PipelineSchedule, DualPipeVBubbleBeatsOneFOneB) {
  // Costs per V chunk (half a 1F1B stage's layers): f = 1, b = 2, w = 1; the 1F1B stage of
  // the same model holds two V chunks, so its costs are doubled.
  const double f = 1, b = 2, w = 1;
  for (int pp : {2, 3, 4, 8}) {
    for (int m : {2 * pp, 3 * pp, 4 * pp, 4 * pp + 1}) {
      const ScheduleTimes v = simulate(make_dualpipev(pp, m), f, b, w);
      const ScheduleTimes o = simulate(make_1f1b(pp, m), 2 * f, 2 * b, 2 * w);
      const ScheduleTimes vp = simulate_w_in_pairs(make_dualpipev(pp, m), f, b, w);
      // The DualPipe paper's bubble for DualPipeV, (PP/2 - 1)(F&B + B - 3W) per rank, with
      // PP = 2pp chunk stages, F&B = f + b + w (a pair with a whole backward), B = b + w (a
      // whole backward), W = w: (pp - 1)(f + 2b - w) chunk-times.
      const double paper = (pp - 1) * (f + 2 * b - w);
      const double idle = *std::max_element(v.idle.begin(), v.idle.end());
      std::printf(
          "BUBBLE dualpipev pp=%d M=%d f=1 b=2 w=1: %.4f (idle %.0f of %.0f per rank; W in pairs %.4f, idle %.0f; "
          "paper idle %.0f) | 1f1b same layers: %.4f\n",
          pp, m, v.bubble_fraction, idle, v.makespan, vp.bubble_fraction, vp.idle[0], paper, o.bubble_fraction);
      EXPECT_LT(v.bubble_fraction, o.bubble_fraction) << "pp=" << pp << " M=" << m;
      EXPECT_LE(v.bubble_fraction, vp.bubble_fraction);
      // Every rank idles the same time: the V is balanced.
      for (double i : v.idle) EXPECT_NEAR(i, idle, 1e-9);
    }
  }
  // With equal chunk costs (f = b = w = 1) and the pair timed as published (its W inside the
  // pair), the simulation gives exactly the paper's (pp - 1)(f + 2b - w) = 2(pp - 1) idle
  // per rank, for every M; with our split W it is half that.
  for (int pp : {1, 2, 3, 4, 8}) {
    for (int m : {2 * pp, 2 * pp + 2, 4 * pp + 1, 6 * pp}) {
      const ScheduleTimes vp = simulate_w_in_pairs(make_dualpipev(pp, m), 1, 1, 1);
      const ScheduleTimes v = simulate(make_dualpipev(pp, m), 1, 1, 1);
      std::printf("BUBBLE dualpipev pp=%d M=%d f=b=w=1: %.4f (idle %.0f); W in pairs %.4f (idle %.0f, paper %d)\n", pp,
                  m, v.bubble_fraction, v.idle[0], vp.bubble_fraction, vp.idle[0], 2 * (pp - 1));
      for (double i : vp.idle) EXPECT_NEAR(i, 2.0 * (pp - 1), 1e-9) << "pp=" << pp << " M=" << m;
      for (double i : v.idle) EXPECT_NEAR(i, 1.0 * (pp - 1), 1e-9) << "pp=" << pp << " M=" << m;
    }
  }
}

TEST(PipelineSchedule, DescribeMatchesHandWrittenOrders) {
  const PipelineSchedule o = make_1f1b(2, 4);
  EXPECT_EQ(o.describe(0), "F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 F0.3 B0.2 W0.2 B0.3 W0.3");
  EXPECT_EQ(o.describe(1), "F1.0 B1.0 W1.0 F1.1 B1.1 W1.1 F1.2 B1.2 W1.2 F1.3 B1.3 W1.3");

  // DualPipeV pp = 2, M = 4, worked by hand from the eight steps (docs/pipeline.md).
  const PipelineSchedule v = make_dualpipev(2, 4);
  EXPECT_EQ(v.describe(0),
            "F0.0 F0.1 F0.2 F3.0 B3.0 W3.0 F3.1 F0.3+B3.1 W3.1 F3.2+B0.0 W0.0 B3.2 W3.2 F3.3+B0.1 W0.1 "
            "B3.3 W3.3 B0.2 W0.2 B0.3 W0.3");
  EXPECT_EQ(v.describe(1),
            "F1.0 F2.0 F1.1 F2.1 F1.2 B2.0 W2.0 F2.2+B1.0 W1.0 F1.3+B2.1 W2.1 F2.3+B1.1 W1.1 "
            "B2.2 W2.2 B1.2 W1.2 B2.3 B1.3 W2.3 W1.3");
  // One rank: every step paired but the first and the last.
  EXPECT_EQ(make_dualpipev(1, 2).describe(0), "F0.0 F1.0+F0.1 F1.1+B1.0 W1.0 B1.1+B0.0 W1.1 W0.0 B0.1 W0.1");
  EXPECT_EQ(make_dualpipev(1, 4).describe(0),
            "F0.0 F1.0+F0.1 F1.1+B1.0 W1.0 F0.2+B0.0 W0.0 F1.2+B1.1 W1.1 F0.3+B0.1 W0.1 F1.3+B1.2 W1.2 "
            "B1.3+B0.2 W1.3 W0.2 B0.3 W0.3");
  EXPECT_EQ(make_forward_only(2, 3, true).describe(0), "F0.0 F0.1 F0.2 F3.0 F3.1 F3.2");
  EXPECT_EQ(make_forward_only(2, 3, true).describe(1), "F1.0 F2.0 F1.1 F2.1 F1.2 F2.2");
}

TEST(PipelineSchedule, EachChunkRunsMicroBatchesInOrder) {
  // The executor keeps per-chunk FIFOs of activations and gradients: on every rank each
  // chunk's F, B and W come in micro-batch order 0, 1, ..., M-1.
  std::vector<PipelineSchedule> all;
  for (int pp : {1, 2, 3, 4, 8}) {
    for (int m : {2 * pp, 2 * pp + 1, 4 * pp + 1}) {
      all.push_back(make_1f1b(pp, m));
      all.push_back(make_dualpipev(pp, m));
      all.push_back(make_forward_only(pp, m, true));
      all.push_back(make_forward_only(pp, m, false));
    }
  }
  for (const PipelineSchedule& s : all) {
    for (int r = 0; r < s.pp; ++r) {
      // next[kind][chunk]: the micro-batch that chunk's next F (B, W) must be.
      std::vector<std::vector<int>> next(3, std::vector<int>(s.num_chunks, 0));
      auto see = [&](PipeOpKind k, int c, int m) {
        EXPECT_EQ(m, next[static_cast<int>(k)][c]++)
            << s.name << " pp=" << s.pp << " M=" << s.micro_batches << " rank " << r << ": " << s.describe(r);
      };
      for (const PipeOp& op : s.ops[r]) {
        if (op.paired()) {  // the halves in order: FB, FF, BB
          see(op.kind == PipeOpKind::BB ? PipeOpKind::B : PipeOpKind::F, op.chunk, op.mb);
          see(op.kind == PipeOpKind::FF ? PipeOpKind::F : PipeOpKind::B, op.chunk2, op.mb2);
        } else {
          see(op.kind, op.chunk, op.mb);
        }
      }
      for (int c : s.chunks_of_rank(r)) {
        EXPECT_EQ(next[0][c], s.micro_batches);
        EXPECT_EQ(next[1][c], s.forward_only() ? 0 : s.micro_batches);
      }
    }
  }
}

// The head helper: every micro-batch's H once, on the helper, in a place where the step ends
// sooner than with the whole head on its rank under DualPipeV (the head weighing two chunk
// Fs, about the bench model's: a layer per chunk) and no later under 1F1B; the validator refuses Hs that are missing, repeated,
// misplaced or placed before their F can run.
TEST(PipelineSchedule, AHeadHelperShortensTheStepOfAHeavyHead) {
  const double head = 2.0;
  for (int pp : {2, 3, 4}) {
    for (int M : {2 * pp, 16}) {
      for (bool v : {true, false}) {
        PipelineSchedule plain = v ? make_dualpipev(pp, M) : make_1f1b(pp, M), helped = plain;
        const int head_rank = plain.rank_of_chunk(plain.num_chunks - 1);
        const int helper = v ? 1 : pp - 2;
        SCOPED_TRACE(plain.name + " pp " + std::to_string(pp) + " micro-batches " + std::to_string(M));
        add_head_helper(helped, helper, 0.5, head);
        validate(helped);
        EXPECT_EQ(helped.head_helper, helper);
        for (int r = 0; r < pp; ++r) {
          int h = 0;
          for (const PipeOp& op : helped.ops[r]) h += op.kind == PipeOpKind::H;
          EXPECT_EQ(h, r == helper ? M : 0) << "rank " << r;
          if (r != helper) {
            EXPECT_EQ(helped.ops[r].size(), plain.ops[r].size());
          }
        }
        const double before = simulate(plain, 1, 1, 1, 0, head).makespan;
        const double after = simulate(helped, 1, 1, 1, 0.5 * head, 0.5 * head).makespan;
        std::printf("%s pp %d M %d: makespan %.1f with the head on rank %d, %.1f with half its rows on rank %d\n",
                    plain.name.c_str(), pp, M, before, head_rank, after, helper);
        // DualPipeV's head rank has slack to fill (its pairs); 1F1B's last rank runs F, B, W of
        // one micro-batch in a row, so the H sits on its path: no gain, no loss.
        if (v) {
          EXPECT_LT(after, before);
          if (M == 16) {
            EXPECT_LT(after, 0.93 * before);  // measured 115-117 against 128
          }
        }
        EXPECT_LE(after, before + 1e-9);
      }
    }
  }
}

TEST(PipelineSchedule, RejectsMisplacedOrMissingHeadSteps) {
  PipelineSchedule s = make_dualpipev(2, 4);
  add_head_helper(s, 1, 0.5, 2.0);
  validate(s);
  auto h_at = [](const PipelineSchedule& t, int r) {
    for (size_t i = 0; i < t.ops[r].size(); ++i) {
      if (t.ops[r][i].kind == PipeOpKind::H) return i;
    }
    return t.ops[r].size();
  };
  {  // missing
    PipelineSchedule t = s;
    t.ops[1].erase(t.ops[1].begin() + static_cast<std::ptrdiff_t>(h_at(t, 1)));
    EXPECT_HAS(error_of([&] { validate(t); }), "lacks H3.0");
  }
  {  // on the head's own rank
    PipelineSchedule t = s;
    const PipeOp h = t.ops[1][h_at(t, 1)];
    t.ops[1].erase(t.ops[1].begin() + static_cast<std::ptrdiff_t>(h_at(t, 1)));
    t.ops[0].push_back(h);
    EXPECT_HAS(error_of([&] { validate(t); }), "an H step is the last chunk's (3) on the head helper (rank 1)");
  }
  {  // before its F can run: the helper's first op, which rank 0's F3.0 waits on (via F2.0)
    PipelineSchedule t = s;
    const PipeOp h = t.ops[1][h_at(t, 1)];
    t.ops[1].erase(t.ops[1].begin() + static_cast<std::ptrdiff_t>(h_at(t, 1)));
    t.ops[1].insert(t.ops[1].begin(), h);
    EXPECT_HAS(error_of([&] { validate(t); }), "deadlock");
  }
  {  // an H where no helper was named
    PipelineSchedule t = make_dualpipev(2, 4);
    t.ops[1].push_back(PipeOp{PipeOpKind::H, 3, 0, -1, -1});
    EXPECT_HAS(error_of([&] { validate(t); }), "an H step in a schedule without a head helper");
  }
  EXPECT_HAS(error_of([] {
               PipelineSchedule t = make_dualpipev(2, 4);
               add_head_helper(t, 0, 0.5, 2.0);
             }),
             "a rank other than the head's (0)");
  EXPECT_NEAR(balancing_head_share(2, 2, 1.2), 0.5, 1e-12);
  EXPECT_NEAR(balancing_head_share(2, 3, 2.0), 0.25, 1e-12);
  EXPECT_EQ(balancing_head_share(1, 5, 1.0), 0.0);
  EXPECT_EQ(head_rows_kept(8192, 0.5), 4096);
  EXPECT_EQ(head_rows_kept(10, 0.26), 7);
}

}  // namespace
}  // namespace moetrain
