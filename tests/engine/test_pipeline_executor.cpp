// The pipeline executor in one process: running a schedule's F / B / W steps chunk by chunk
// (pp = 1: DualPipeV's two chunks, or one 1F1B chunk) gives, in float64, the losses and
// every gradient of the whole-model forward_backward over the same micro-batches; the layer
// partition gives edge chunks fewer layers; and on several ranks each rank's sends leave in
// the order pipeline_message_order() predicts, an order every rank can follow without
// deadlock (the contract of the ordered NCCL transport).
#include <gtest/gtest.h>

#include <algorithm>

#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "comm/comm_test_util.h"
#include "comm/nccl_communicator.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/nccl_transport.h"
#include "model_batches.h"
#include "test_util.h"

namespace moetrain {
namespace {

Qwen3MoeConfig config(bool tied) {
  Qwen3MoeConfig c = testing::tiny_moe_config(23, 5);
  c.mlp_only_layers = {1};  // a dense layer inside a chunk
  c.tie_word_embeddings = tied;
  return c;
}

// Target 2 ignored: the loss counts only the others.
Batch batch_of(int64_t rows, int64_t seq, int32_t vocab, uint64_t seed) {
  return testing::random_batch(rows, seq, vocab, seed, /*ignored=*/2);
}

// wgrad_group: the experts' weight gradients of that many of a chunk's W steps in one pass.
void expect_schedule_matches_whole_model(const PipelineSchedule& s, bool tied, bool overlap = true,
                                         int64_t wgrad_group = 1) {
  SCOPED_TRACE(s.name + (tied ? " tied" : " untied") + (overlap ? " overlapped" : " sequential") +
               " expert weight gradients in groups of " + std::to_string(wgrad_group));
  const Qwen3MoeConfig c = config(tied);
  std::vector<Batch> batches;
  int64_t targets = 0;
  for (int m = 0; m < s.micro_batches; ++m) {
    batches.push_back(batch_of(2, 6, static_cast<int32_t>(c.vocab_size), 100 + 7 * m));
    targets += batches.back().num_targets;
  }
  const double n = static_cast<double>(batches.size());
  LocalDispatcher d;

  Qwen3MoeModel whole(c, DType::F64);
  whole.init_weights(3);
  double ce = 0, aux = 0;
  for (size_t m = 0; m < batches.size(); ++m) {
    MicroBatchLoss l = whole.forward_backward(batches[m], d, 1.0 / targets, 1.0 / n, m > 0);
    ce += l.ce_sum;
    aux += l.term("aux_loss");
  }

  const std::vector<ChunkSpec> chunks = partition_layers(c.num_hidden_layers, s.num_chunks);
  Qwen3MoeModel piped(c, DType::F64, Device::cpu(), pipeline_placement(chunks, s, 0, {}));
  piped.init_weights(3);
  piped.set_expert_wgrad_group(wgrad_group);
  for (Parameter& p : piped.parameters()) p.grad.fill_(NAN);  // every gradient must be written
  PipelineExecutor ex(piped, d, nullptr, chunks);
  ex.set_overlap(overlap);
  // Two steps of the same batches: the second's gradients overwrite the first's.
  ex.train(s, batches, 1.0 / targets, 1.0 / n);
  const PipelineExecutor::Result r = ex.train(s, batches, 1.0 / targets, 1.0 / n);
  EXPECT_TRUE(r.has_head);
  EXPECT_NEAR(r.ce_sum, ce, 1e-12 * ce);
  EXPECT_NEAR(term_value(r.terms, "aux_loss"), aux, 1e-12 * aux);
  EXPECT_EQ(r.expert_counts.size(), 4u);  // MoE layers 0, 2, 3, 4

  ASSERT_EQ(piped.parameters().size(), whole.parameters().size());
  for (size_t i = 0; i < whole.parameters().size(); ++i) {
    const Parameter& p = piped.parameters()[i];
    EXPECT_EQ(p.name, whole.parameters()[i].name);
    EXPECT_LT(testing::rel_error(p.grad, whole.parameters()[i].grad), 1e-12) << p.name;
  }

  // Forward only: the same cross-entropy without touching gradients.
  const PipelineSchedule fwd = make_forward_only(s.pp, s.micro_batches, s.v_shape);
  const PipelineExecutor::Result v = ex.forward(fwd, batches);
  double ce_eval = 0;
  for (const Batch& b : batches) ce_eval += whole.forward_loss(b, d).ce_sum;
  EXPECT_NEAR(v.ce_sum, ce_eval, 1e-12 * ce_eval);
}

// The pairs of DualPipeV's steady state run interleaved (F piece, B piece, ...) or one after
// the other: both give the whole model's numbers.
TEST(PipelineExecutor, DualPipeVOnOneRankMatchesTheWholeModel) {
  int pairs = 0;
  const PipelineSchedule five = make_dualpipev(1, 5);
  for (const PipeOp& op : five.ops[0]) pairs += op.kind == PipeOpKind::FB;
  EXPECT_GT(pairs, 0);
  for (bool tied : {false, true}) {
    for (bool overlap : {true, false}) {
      expect_schedule_matches_whole_model(make_dualpipev(1, 2), tied, overlap);
      expect_schedule_matches_whole_model(make_dualpipev(1, 5), tied, overlap);
    }
  }
}

// A chunk's W steps leave their experts' weight gradients to the group's last W (one pass,
// the first group writing, the others adding; the step's last W ends a short group): still
// the whole model's gradients after two steps (the second's first W overwrites what the
// first step's groups wrote), whatever the group's size against the step's micro-batches.
TEST(PipelineExecutor, ExpertWeightGradientsInGroupsMatchTheWholeModel) {
  for (int64_t group : {2, 3, 8}) {
    expect_schedule_matches_whole_model(make_dualpipev(1, 5), false, true, group);
    expect_schedule_matches_whole_model(make_1f1b(1, 5), false, true, group);
  }
}

// Timing (what bench reports): every op of the rank counted once, compute within the step.
TEST(PipelineExecutor, TimingCountsEveryOpWithinTheStep) {
  const PipelineSchedule s = make_dualpipev(1, 4);
  const Qwen3MoeConfig c = config(false);
  const std::vector<ChunkSpec> chunks = partition_layers(c.num_hidden_layers, s.num_chunks);
  Qwen3MoeModel model(c, DType::F32, Device::cpu(), pipeline_placement(chunks, s, 0, {}));
  model.init_weights(1);
  LocalDispatcher d;
  PipelineExecutor ex(model, d, nullptr, chunks);
  std::vector<Batch> batches;
  for (int m = 0; m < 4; ++m) batches.push_back(batch_of(2, 6, static_cast<int32_t>(c.vocab_size), 9 + m));
  ex.set_timing(true);
  ex.train(s, batches, 1e-2, 0.25);
  const PipelineExecutor::Timing& t = ex.last_timing();
  int f = 0, b = 0, w = 0, fb = 0;  // an FF counts as two F, a BB as two B
  for (const PipeOp& op : s.ops[0]) {
    f += op.kind == PipeOpKind::F ? 1 : op.kind == PipeOpKind::FF ? 2 : 0;
    b += op.kind == PipeOpKind::B ? 1 : op.kind == PipeOpKind::BB ? 2 : 0;
    w += op.kind == PipeOpKind::W;
    fb += op.kind == PipeOpKind::FB;
  }
  EXPECT_GT(fb, 0);
  EXPECT_LT(f, 4) << "the one-rank order pairs the forwards";
  EXPECT_EQ(t.f, f);
  EXPECT_EQ(t.b, b);
  EXPECT_EQ(t.w, w);
  EXPECT_EQ(t.fb, fb);
  EXPECT_GT(t.f_ms, 0);
  EXPECT_GT(t.busy_ms(), 0);
  EXPECT_LE(t.busy_ms(), t.step_ms);
}

TEST(PipelineExecutor, OneFOneBOnOneRankMatchesTheWholeModel) {
  expect_schedule_matches_whole_model(make_1f1b(1, 3), false);
}

// The head's weight for the partition: the bench model's shape, worked by hand. Per layer:
// q 2048 x 4096, k and v 2048 x 512, o 4096 x 2048, the router 2048 x 128, the norms
// (2 x 2048 + 2 x 128), and 8 routed experts of 3 x 2048 x 768; the head 32768 x 2048.
TEST(PipelineExecutor, TheHeadWeighsItsShareOfTheWeightsATokenMultiplies) {
  Qwen3MoeConfig c = testing::tiny_moe_config(23, 5);
  c.vocab_size = 32768;
  c.hidden_size = 2048;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 4;
  c.mlp_only_layers = {};
  const double layer = 2048.0 * 4096 + 2 * 2048.0 * 512 + 4096.0 * 2048 + 2048.0 * 128 + 2 * 2048 + 2 * 128 +
                       8 * 3 * 2048.0 * 768;
  EXPECT_NEAR(head_weight_in_layers(c), 32768.0 * 2048 / layer, 1e-12);
  EXPECT_NEAR(head_weight_in_layers(c), 1.18, 0.01);
}

TEST(PipelineExecutor, EdgeChunksGetFewerLayers) {
  // 49 layers in DualPipeV's 8 chunks of pp = 4: the leftover layer goes to a middle chunk.
  std::vector<ChunkSpec> p = partition_layers(49, 8);
  ASSERT_EQ(p.size(), 8u);
  EXPECT_TRUE(p.front().embed);
  EXPECT_TRUE(p.back().head);
  int64_t next = 0, most = 0;
  for (const ChunkSpec& c : p) {
    EXPECT_EQ(c.first_layer, next);
    next = c.last_layer;
    most = std::max(most, c.last_layer - c.first_layer);
  }
  EXPECT_EQ(next, 49);
  EXPECT_LT(p.back().last_layer - p.back().first_layer, most);
  // Costs are layers, + 1 for the head; ties go to the chunk with fewer layers, then to the
  // middle: so both edges get fewer.
  auto sizes = [](const std::vector<ChunkSpec>& q) {
    std::vector<int64_t> n;
    for (const ChunkSpec& c : q) n.push_back(c.last_layer - c.first_layer);
    return n;
  };
  EXPECT_EQ(sizes(partition_layers(10, 4)), (std::vector<int64_t>{2, 3, 3, 2}));
  EXPECT_EQ(sizes(partition_layers(9, 4)), (std::vector<int64_t>{2, 3, 2, 2}));
  EXPECT_EQ(sizes(partition_layers(48, 8)), (std::vector<int64_t>{6, 6, 6, 6, 6, 6, 6, 6}));  // costs 6 .. 7 either way
  EXPECT_EQ(sizes(partition_layers(4, 2)), (std::vector<int64_t>{2, 2}));
  // A head of 5.5 layers' work (Qwen3-30B-A3B's: head_weight_in_layers) in DualPipeV's 4
  // chunks of 48 layers: the last chunk gives up layers until every chunk costs about the
  // same (a pipeline rank of the V holds chunk r and its mirror).
  EXPECT_EQ(sizes(partition_layers(48, 4, 0, 5.5)), (std::vector<int64_t>{13, 14, 13, 8}));
  EXPECT_EQ(sizes(partition_layers(48, 4, 0, 1.0)), (std::vector<int64_t>{12, 12, 12, 12}));
  // A multi-token prediction module ends the last chunk (layer id 10) and weighs two layers
  // there: its chunk gets fewer of the main model's.
  const std::vector<ChunkSpec> mtp = partition_layers(10, 4, 1);
  EXPECT_EQ(sizes(mtp), (std::vector<int64_t>{3, 3, 3, 2}));
  EXPECT_EQ(mtp.back().first_layer, 9);
  EXPECT_EQ(mtp.back().last_layer, 11);
  EXPECT_TRUE(mtp.back().head);
  const std::string e = testing::error_of([] { partition_layers(3, 4); });
  EXPECT_NE(e.find("3 decoder layers cannot fill 4 chunks"), std::string::npos) << e;
}

TEST(PipelineExecutor, PlacementFollowsTheV) {
  const PipelineSchedule s = make_dualpipev(2, 4);
  const std::vector<ChunkSpec> chunks = partition_layers(8, 4);
  const ModelPlacement r0 = pipeline_placement(chunks, s, 0, {});
  const ModelPlacement r1 = pipeline_placement(chunks, s, 1, {});
  EXPECT_TRUE(r0.embed && r0.head);  // rank 0 holds the first and the last chunk
  EXPECT_FALSE(r1.embed || r1.head);
  std::vector<int64_t> all = r0.layers;
  all.insert(all.end(), r1.layers.begin(), r1.layers.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  const std::string e = testing::error_of([] {
    Qwen3MoeConfig c = config(true);
    ModelPlacement p;
    p.head = false;
    Qwen3MoeModel m(c, DType::F32, Device::cpu(), p);
  });
  EXPECT_NE(e.find("tie_word_embeddings needs the embedding and the head on one rank"), std::string::npos) << e;
}

PipelineSchedule with_head_helper(PipelineSchedule s, int helper, double share) {
  add_head_helper(s, helper, share, 2.0);
  return s;
}

// A head helper on another rank (Gloo ranks as threads, float64): the helper's copy of the
// head gets the head's weights at each step's start, computes the loss and gradients of the
// last rows of every micro-batch, and its weight gradient is added into the head's at the
// end. The losses summed over the ranks and every rank's gradients are the whole model's,
// after two steps (the second's first writes overwrite the first's), tied embeddings too.
TEST(PipelineExecutor, AHeadHelperOnAnotherRankMatchesTheWholeModel) {
  for (bool tied : {false, true}) {
    for (const PipelineSchedule& s : {with_head_helper(make_dualpipev(2, 4), 1, 0.5),
                                      with_head_helper(make_dualpipev(2, 5), 1, 0.3),
                                      with_head_helper(make_1f1b(2, 3), 0, 0.6)}) {
      if (tied && !s.v_shape) continue;  // tied embeddings need the embedding and head on one rank
      SCOPED_TRACE(s.name + (tied ? " tied" : " untied") + " share " + std::to_string(s.head_share));
      Qwen3MoeConfig c = config(tied);
      c.num_hidden_layers = std::max<int64_t>(s.num_chunks, 4);
      std::vector<Batch> batches;
      int64_t targets = 0;
      for (int m = 0; m < s.micro_batches; ++m) {
        batches.push_back(batch_of(2, 5, static_cast<int32_t>(c.vocab_size), 300 + 11 * m));
        targets += batches.back().num_targets;
      }
      const double n = static_cast<double>(batches.size());
      LocalDispatcher d;
      Qwen3MoeModel whole(c, DType::F64);
      whole.init_weights(4);
      double ce = 0;
      for (size_t m = 0; m < batches.size(); ++m) {
        ce += whole.forward_backward(batches[m], d, 1.0 / targets, 1.0 / n, m > 0).ce_sum;
      }
      const std::vector<ChunkSpec> chunks = partition_layers(c.num_hidden_layers, s.num_chunks);
      std::mutex mu;
      double ce_sum = 0;
      int checked = 0;
      testing::run_ranks(s.pp, [&](Communicator& pp) {
        Qwen3MoeModel model(c, DType::F64, Device::cpu(), pipeline_placement(chunks, s, pp.rank(), {}));
        model.init_weights(4);
        for (Parameter& p : model.parameters()) p.grad.fill_(NAN);  // every gradient must be written
        LocalDispatcher dd;
        PipelineExecutor ex(model, dd, &pp, chunks);
        ex.train(s, batches, 1.0 / targets, 1.0 / n);
        const PipelineExecutor::Result r = ex.train(s, batches, 1.0 / targets, 1.0 / n);
        std::lock_guard<std::mutex> lock(mu);
        ce_sum += r.ce_sum;
        for (const Parameter& p : model.parameters()) {
          for (const Parameter& q : whole.parameters()) {
            if (q.name != p.name) continue;
            EXPECT_LT(testing::rel_error(p.grad, q.grad), 1e-12) << p.name << " on rank " << pp.rank();
            ++checked;
          }
        }
      });
      EXPECT_NEAR(ce_sum, ce, 1e-12 * ce);
      EXPECT_EQ(checked, static_cast<int>(whole.parameters().size()));
    }
  }
}

// The ordered transport issues each rank's messages in one order all ranks share, computed
// from the schedule: run the executor on Gloo ranks (threads), log what each rank really
// sends, and compare every pair's traffic with pipeline_message_order() on both sides.
TEST(PipelineExecutor, SendsFollowTheOrderTheNcclTransportExpects) {
  for (const PipelineSchedule& s : {make_dualpipev(2, 4), make_dualpipev(3, 7), make_1f1b(3, 4), make_1f1b(2, 5),
                                    with_head_helper(make_dualpipev(2, 4), 1, 0.5),
                                    with_head_helper(make_1f1b(3, 4), 1, 0.3)}) {
    SCOPED_TRACE(s.name + " pp " + std::to_string(s.pp));
    Qwen3MoeConfig c = config(false);
    c.num_hidden_layers = s.num_chunks;
    const std::vector<ChunkSpec> chunks = partition_layers(c.num_hidden_layers, s.num_chunks);
    std::vector<Batch> batches;
    std::vector<int64_t> rows;
    int64_t targets = 0;
    for (int m = 0; m < s.micro_batches; ++m) {
      batches.push_back(batch_of(1, 4 + m % 2, static_cast<int32_t>(c.vocab_size), 40 + m));  // rows differ
      rows.push_back(batches.back().batch * batches.back().seq);
      targets += batches.back().num_targets;
    }
    std::mutex mu;
    std::vector<std::vector<std::pair<int, uint32_t>>> sent(static_cast<size_t>(s.pp));
    testing::run_ranks(s.pp, [&](Communicator& pp) {
      Qwen3MoeModel model(c, DType::F32, Device::cpu(), pipeline_placement(chunks, s, pp.rank(), {}));
      model.init_weights(2);
      LocalDispatcher d;
      PipelineExecutor ex(model, d, &pp, chunks);
      ex.train(s, batches, 1.0 / static_cast<double>(targets), 1.0 / s.micro_batches);
      std::lock_guard<std::mutex> lock(mu);
      sent[pp.rank()] = ex.sent();
    });
    for (int from = 0; from < s.pp; ++from) {
      for (int to = 0; to < s.pp; ++to) {
        if (to == from) continue;
        std::vector<uint32_t> actual, as_sent, as_received;
        for (const auto& [dest, tag] : sent[from]) {
          if (dest == to) actual.push_back(tag);
        }
        for (const OrderedTransport::Message& m : pipeline_message_order(s, from, rows)) {
          if (m.sending && m.peer == to) as_sent.push_back(m.tag);
        }
        for (const OrderedTransport::Message& m : pipeline_message_order(s, to, rows)) {
          if (!m.sending && m.peer == from) as_received.push_back(m.tag);
        }
        EXPECT_EQ(actual, as_sent) << "messages from rank " << from << " to rank " << to;
        EXPECT_EQ(as_received, as_sent) << "messages from rank " << from << " to rank " << to;
        if (std::abs(from - to) == 1) {
          EXPECT_FALSE(actual.empty());
        }
      }
    }
  }
}

// Every rank issues its part of the order as the transport does (a receive once every
// earlier message is issued, a send once its op has run), each rank's stream finishes its
// issued messages in order (a message completes when it is next on both ranks' streams),
// and each rank's host runs an op only once the op's inputs have arrived (the worst case:
// a host wait at every op). Every rank must get through its whole list, and every input
// must be issued by the time its op can first ask for it (receive() throws otherwise).
// Fails when the order is sorted by sender instead of by time.
TEST(PipelineMessageOrder, EveryRankFinishesIssuingItInOrder) {
  std::vector<PipelineSchedule> schedules;
  for (int pp : {2, 3, 4, 6}) {
    for (int m : {1, 2, 4, 5, 8, 13}) schedules.push_back(make_1f1b(pp, m));
    for (int m : {2 * pp, 2 * pp + 1, 3 * pp, 20}) schedules.push_back(make_dualpipev(pp, m));
    for (int m : {2 * pp, 16}) {
      schedules.push_back(with_head_helper(make_dualpipev(pp, m), 1, 0.5));
      schedules.push_back(with_head_helper(make_1f1b(pp, m), pp - 2, 0.4));
    }
    schedules.push_back(make_forward_only(pp, 6, false));
    schedules.push_back(make_forward_only(pp, 6, true));
  }
  for (const PipelineSchedule& s : schedules) {
    SCOPED_TRACE(s.name + " pp " + std::to_string(s.pp) + " micro-batches " + std::to_string(s.micro_batches));
    const int P = s.pp, last = s.num_chunks - 1;
    const std::vector<int64_t> rows(static_cast<size_t>(s.micro_batches), 8);
    struct Rank {
      std::vector<OrderedTransport::Message> order;
      std::map<std::pair<bool, uint32_t>, size_t> at;  // (sending, tag) -> position
      size_t op = 0, issued = 0, head = 0;              // next op; first not issued; first not done
      std::set<uint32_t> handed, arrived;
    };
    std::vector<Rank> ranks(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      ranks[r].order = pipeline_message_order(s, r, rows);
      for (size_t k = 0; k < ranks[r].order.size(); ++k) {
        ranks[r].at[{ranks[r].order[k].sending, ranks[r].order[k].tag}] = k;
      }
    }
    // An op's messages from or to other ranks: inputs (sending = false) and outputs.
    auto messages = [&](int r, const PipeOp& op, bool outputs) {
      std::vector<uint32_t> out;
      auto f = [&](int c, int m) {
        if (!outputs && c > 0 && s.rank_of_chunk(c - 1) != r) out.push_back(pipeline_message_tag(false, c, m));
        if (outputs && c < last && s.rank_of_chunk(c + 1) != r) out.push_back(pipeline_message_tag(false, c + 1, m));
      };
      auto b = [&](int c, int m) {
        if (!outputs && c < last && s.rank_of_chunk(c + 1) != r) out.push_back(pipeline_message_tag(true, c, m));
        if (outputs && c > 0 && s.rank_of_chunk(c - 1) != r) out.push_back(pipeline_message_tag(true, c - 1, m));
      };
      // The head helper: the last chunk's F sends it rows, its H sends their gradient back.
      const bool helped = s.head_helper >= 0;
      auto head_f = [&](int c, int m) {
        if (helped && outputs && c == last) out.push_back(pipeline_message_tag(false, last + 1, m));
      };
      auto head_b = [&](int c, int m) {
        if (helped && !outputs && c == last) out.push_back(pipeline_message_tag(true, last, m));
      };
      if (op.kind == PipeOpKind::F || op.kind == PipeOpKind::FB) f(op.chunk, op.mb), head_f(op.chunk, op.mb);
      if (op.kind == PipeOpKind::B) b(op.chunk, op.mb), head_b(op.chunk, op.mb);
      if (op.kind == PipeOpKind::FB) b(op.chunk2, op.mb2), head_b(op.chunk2, op.mb2);
      if (op.kind == PipeOpKind::H) {
        out.push_back(outputs ? pipeline_message_tag(true, last, op.mb) : pipeline_message_tag(false, last + 1, op.mb));
      }
      return out;
    };
    for (bool moved = true; moved;) {
      moved = false;
      for (Rank& k : ranks) {  // issue
        while (k.issued < k.order.size() && (!k.order[k.issued].sending || k.handed.count(k.order[k.issued].tag))) {
          ++k.issued;
          moved = true;
        }
      }
      for (int r = 0; r < P; ++r) {  // the streams: the message next on both
        Rank& k = ranks[r];
        if (k.head == k.issued) continue;
        const OrderedTransport::Message& m = k.order[k.head];
        Rank& q = ranks[m.peer];
        if (q.head == q.issued) continue;
        const OrderedTransport::Message& n = q.order[q.head];
        if (n.tag != m.tag || n.sending == m.sending || n.peer != r) continue;
        (m.sending ? q : k).arrived.insert(m.tag);
        ++k.head, ++q.head;
        moved = true;
      }
      for (int r = 0; r < P; ++r) {  // the hosts: one op each
        Rank& k = ranks[r];
        if (k.op == s.ops[r].size()) continue;
        const PipeOp& op = s.ops[r][k.op];
        bool ready = true;
        for (uint32_t t : messages(r, op, false)) {
          auto it = k.at.find({false, t});
          ASSERT_NE(it, k.at.end()) << "rank " << r << " op " << to_string(op) << ": input " << t
                                    << " not in the order";
          ASSERT_LT(it->second, k.issued) << "rank " << r << " op " << to_string(op) << " asks for input " << t
                                          << " before it is issued";
          ready = ready && k.arrived.count(t) > 0;
        }
        if (!ready) continue;
        for (uint32_t t : messages(r, op, true)) {
          ASSERT_TRUE(k.at.count({true, t})) << "rank " << r << " op " << to_string(op) << ": output " << t;
          k.handed.insert(t);
        }
        ++k.op;
        moved = true;
      }
    }
    for (int r = 0; r < P; ++r) {
      EXPECT_EQ(ranks[r].op, s.ops[r].size()) << "rank " << r << " stopped before op " << ranks[r].op;
      EXPECT_EQ(ranks[r].head, ranks[r].order.size()) << "rank " << r << ": messages left";
    }
  }
}

// Two GPUs, the traffic of a 1F1B step of four micro-batches on two ranks: rank 0 sends
// activations a0..a3 and receives gradients g0..g3, rank 1 the reverse, each rank waiting on
// the host for what it received before it sends (as a step's MoE layers wait for their token
// counts). The design before this one posted every receive up front, a direction per
// communicator and stream, and hung exactly here on two H100s (rank 0's posted receive held
// back its sends). Messages of a real step's size (16 MB; a larger message connects more of
// NCCL's channels), larger in the second step than in the first.
TEST(PipelineTransportNccl, OneFOneBTrafficOnTwoGpus) {
  if (!(nccl_built() && cuda::available() && cuda::device_count() >= 2)) GTEST_SKIP() << "needs NCCL and 2 GPUs";
  const auto timeout = std::chrono::seconds(20);
  auto store = Store::open("memory", 0, timeout);
  const int64_t H = 2048, totals = 6;
  // The executor's tags: activations into chunk 1, gradients into chunk 0.
  auto a = [](int m) { return pipeline_message_tag(false, 1, m); };
  auto g = [](int m) { return pipeline_message_tag(true, 0, m); };
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Communicator> pp = connect_nccl(store, r, 2, r, testing::test_options(timeout));
        OrderedTransport t(*pp, Device::cuda(r), H, DType::BF16, totals);
        const int other = 1 - r;
        for (int step = 0; step < 2; ++step) {
          const int64_t rows = step == 0 ? 1024 : 4096;
          // Rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3: the order is a0 a1 g0 a2 g1 a3 g2 g3.
          const std::vector<OrderedTransport::Message> order =
              pipeline_message_order(make_1f1b(2, 4), r, std::vector<int64_t>(4, rows));
          std::vector<std::pair<bool, uint32_t>> seen, expected = {{true, a(0)},  {true, a(1)},  {false, g(0)},
                                                                   {true, a(2)},  {false, g(1)}, {true, a(3)},
                                                                   {false, g(2)}, {false, g(3)}};
          for (const OrderedTransport::Message& m : order) seen.push_back({m.sending == (r == 0), m.tag});
          EXPECT_EQ(seen, expected) << "rank " << r;
          t.begin_step(order, rows);
          auto value = [&](uint32_t tag) {  // small integers, exact in bf16
            return static_cast<double>((tag & 0xff) + 16 * (tag >> 31) + 64 * step);
          };
          auto send = [&](uint32_t tag) {
            t.send(other, tag, Tensor::full({rows, H}, value(tag), DType::BF16, Device::cuda(r)),
                   Tensor::full({totals}, -value(tag), DType::F64, Device::cuda(r)));
          };
          auto receive = [&](uint32_t tag) {  // and wait for it on the host
            const auto [hidden, sums] = t.receive(tag);
            const std::vector<double> h = hidden.to(Device::cpu()).to_double_vector();
            EXPECT_TRUE(std::all_of(h.begin(), h.end(), [&](double x) { return x == value(tag); })) << "tag " << tag;
            EXPECT_EQ(sums.to(Device::cpu()).to_double_vector(), std::vector<double>(totals, -value(tag)));
          };
          if (r == 0) {
            send(a(0)), send(a(1)), receive(g(0)), send(a(2)), receive(g(1)), send(a(3)), receive(g(2)), receive(g(3));
          } else {
            for (int m = 0; m < 4; ++m) receive(a(m)), send(g(m));
          }
          t.end_step();
        }
        pp->synchronize();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace
}  // namespace moetrain
