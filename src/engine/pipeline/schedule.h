// Pipeline-parallel schedules as data: for each pipeline rank, the ordered list of forward,
// input-gradient and weight-gradient steps of (model chunk, micro-batch) it runs in one
// optimizer step. The executor walks these lists; nothing here touches tensors.
//
// Two training schedules (1F1B, DualPipeV) and a forward-only one, a validator that checks
// a schedule covers every step exactly once on the right rank and cannot deadlock, and a
// unit-cost simulator that measures the pipeline bubble. docs/pipeline.md has the notation
// and the measured bubbles.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
namespace moetrain {

// F: forward of (chunk, micro-batch). B: input gradient (dgrad) of (chunk, mb). W: weight
// gradient (wgrad) of (chunk, mb), deferrable after its B. FB: the F of (chunk, mb) run
// overlapped with the B of (chunk2, mb2) (DualPipeV's paired steps: one micro-batch's
// compute hides the other's all-to-all). FF, BB: two forwards, two input gradients, paired
// the same way (the one-rank DualPipeV's first and last steps). H: the head's share of
// micro-batch mb's token rows that a helper rank computes (chunk: the last; see
// add_head_helper): the cross-entropy of those rows, their hidden-state gradient and the
// head's weight gradient, in one step.
enum class PipeOpKind { F, B, W, FB, FF, BB, H };
struct PipeOp {
  PipeOpKind kind = PipeOpKind::F;
  int chunk = -1, mb = -1;    // F, B, W; for a pair its first half (FB: the forward)
  int chunk2 = -1, mb2 = -1;  // pairs only: the second half (FB: the backward)
  bool paired() const { return kind == PipeOpKind::FB || kind == PipeOpKind::FF || kind == PipeOpKind::BB; }
  // The single F, B or W steps this op runs: itself, or a pair's two halves (first first).
  // Returns how many it wrote (1 or 2).
  int halves(PipeOp out[2]) const;
};

struct PipelineSchedule {
  std::string name;        // "1f1b", "dualpipev", "forward"
  int pp = 1;              // ranks (stages)
  int micro_batches = 1;   // per optimizer step
  int num_chunks = 1;      // model chunks: pp for 1f1b, 2*pp for dualpipev
  bool v_shape = false;    // dualpipev placement: rank r holds chunks r and 2*pp-1-r
  std::vector<std::vector<PipeOp>> ops;  // per rank, in execution order
  // The head split (add_head_helper): the rank that runs the H steps (-1: none) and the share
  // of each micro-batch's token rows whose head it computes (the last rows).
  int head_helper = -1;
  double head_share = 0;

  int rank_of_chunk(int chunk) const;          // 1f1b: chunk; V: chunk < pp ? chunk : 2*pp-1-chunk
  std::vector<int> chunks_of_rank(int rank) const;  // ascending chunk ids
  // One rank's order in a compact readable form, e.g. "F0.0 F0.1 F1.0 B1.0 W1.0 ..." where
  // "F<chunk>.<mb>", and an FB as "F<c>.<m>+B<c2>.<m2>".
  std::string describe(int rank) const;
  // Forward-only (name "forward"): exactly one F per (chunk, mb) and no B or W.
  bool forward_only() const { return name == "forward"; }
};

// One op as describe() writes it: "F3.1", "W0.2", "F1.4+B2.0".
std::string to_string(const PipeOp& op);

// 1F1B (PipeDream-flush / Megatron non-interleaved): pp chunks, rank r holds chunk r;
// warm-up of min(pp - r - 1, M) forwards, then alternate one F one B, then the remaining Bs.
// Every B is followed at once by its W. Any micro_batches >= 1.
PipelineSchedule make_1f1b(int pp, int micro_batches);
// DualPipeV (DeepSeek's "cut-in-half" DualPipe): 2*pp chunks in a V (rank r holds chunks r
// and 2*pp-1-r; micro-batches go down ranks 0..pp-1 through chunks 0..pp-1, turn on rank pp-1,
// and come back up through chunks pp..2pp-1 to rank 0, which holds the first chunk
// (embedding) and the last (head)). Overlapped FB pairs in the steady state, zero-bubble
// style deferred W where the published schedule defers them. Requires micro_batches >= 2*pp
// (an Error naming both numbers otherwise). pp == 1 must work too (2 chunks on one rank).
// An FB's backward half is a whole backward: its W follows the FB at once.
PipelineSchedule make_dualpipev(int pp, int micro_batches);
// Forward only (validation): every rank runs F of its chunks for every micro-batch, in an
// order that respects dependencies (no B or W).
PipelineSchedule make_forward_only(int pp, int micro_batches, bool v_shape);

// The head split: where the layers cannot balance the ranks (DualPipeV puts the embedding and
// the head both on rank 0, and a model of few layers has no layer to move), rank `helper`
// computes the head of the last `share` of each micro-batch's token rows, holding a copy of
// the head's weights. Each H(last chunk, mb) is placed in the helper's list where the
// simulation (costs below) ends the step soonest, in micro-batch order. Costs in units of
// one chunk's F (= B = W): the whole head's forward and backward of a micro-batch weigh
// `head_cost`; the head rank's F of the last chunk then costs 1 + (1 - share) head_cost and an
// H share head_cost. A training schedule with pp >= 2 and helper not the head's rank.
void add_head_helper(PipelineSchedule& s, int helper, double share, double head_cost);
// The share of the head's rows that evens out the two ranks' work, from each rank's work
// without the head (in any common unit) and the head's: clamped to [0, 1].
double balancing_head_share(double head_rank_work, double helper_work, double head_work);
// The token rows of a micro-batch of `rows` whose head the head rank computes itself (at
// least one, and one left to the helper); the helper computes the rest. The same on every rank.
int64_t head_rows_kept(int64_t rows, double share);

// Throws moetrain::Error (see src/core/error.h, MT_CHECK / MT_THROW) naming the rank, the op
// and the broken rule when: an op is on a rank that does not hold its chunk; a (chunk, mb)
// lacks or repeats its F, B or W (forward-only schedules: exactly one F, no B/W; with a head
// helper exactly one H per micro-batch, on the helper, and none without); the ranks'
// orders cannot all be executed (simulate: each rank runs its list in order, an op may start
// only when its dependencies are done: F(c,m) needs F(c-1,m); B(c,m) needs F(c,m) and
// B(c+1,m) (for the last chunk only F(c,m), and H(c,m) with a helper); H(c,m) needs F(c,m);
// W(c,m) needs B(c,m); an FB needs both halves'
// dependencies; a deadlock is an error naming each blocked rank's next op).
void validate(const PipelineSchedule& s);

// Unit-cost simulation: each rank runs its ops in order, an op starts when the rank is free and
// its dependencies (above) are done; communication is free. FB costs f + b (serially on the
// rank; the overlap hides communication, not compute). Returns the makespan, and the bubble:
// idle rank-time over total rank-time, (pp * makespan - work) / (pp * makespan).
// Validates the schedule first (same errors as validate()).
struct ScheduleTimes {
  double makespan = 0, work = 0, bubble_fraction = 0;
  std::vector<double> idle;  // per rank: makespan - its busy time
};
// An H costs h; the last chunk's F costs f + head_f (the head's part on its own rank).
ScheduleTimes simulate(const PipelineSchedule& s, double f, double b, double w, double h = 0, double head_f = 0);
// Each rank's ops' finish times in the unit-cost simulation (f = b = w = 1, per rank in its
// list's order): one valid execution of the whole schedule, from which the NCCL transport
// takes the one order of messages that every rank follows (executor.h).
std::vector<std::vector<double>> finish_times(const PipelineSchedule& s);
// As simulate(), but an FB timed as the published DualPipe code runs it: the pair computes
// its backward half's W inside it (one autograd call), so the W that follows an FB in these
// lists belongs to the pair and neither half's output leaves before that W is done. With
// f = b = w this gives the DualPipe paper's bubble (docs/pipeline.md).
ScheduleTimes simulate_w_in_pairs(const PipelineSchedule& s, double f, double b, double w);

}  // namespace moetrain
