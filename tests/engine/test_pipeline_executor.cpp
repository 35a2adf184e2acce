// The pipeline executor in one process: running a schedule's F / B / W steps chunk by chunk
// (pp = 1: DualPipeV's two chunks, or one 1F1B chunk) gives, in float64, the losses and
// every gradient of the whole-model forward_backward over the same micro-batches; the layer
// partition gives edge chunks fewer layers; and on several ranks each rank's sends arrive in
// the order pipeline_messages() predicts (the contract of the ordered NCCL transport).
#include <gtest/gtest.h>

#include <algorithm>

#include <latch>
#include <mutex>
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

void expect_schedule_matches_whole_model(const PipelineSchedule& s, bool tied, bool overlap = true) {
  SCOPED_TRACE(s.name + (tied ? " tied" : " untied") + (overlap ? " overlapped" : " sequential"));
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
    aux += l.aux_loss;
  }

  const std::vector<ChunkSpec> chunks = partition_layers(c.num_hidden_layers, s.num_chunks);
  Qwen3MoeModel piped(c, DType::F64, Device::cpu(), pipeline_placement(chunks, s, 0, {}));
  piped.init_weights(3);
  for (Parameter& p : piped.parameters()) p.grad.fill_(NAN);  // every gradient must be written
  PipelineExecutor ex(piped, d, nullptr, chunks);
  ex.set_overlap(overlap);
  const PipelineExecutor::Result r = ex.train(s, batches, 1.0 / targets, 1.0 / n);
  EXPECT_TRUE(r.has_head);
  EXPECT_NEAR(r.ce_sum, ce, 1e-12 * ce);
  EXPECT_NEAR(r.aux_loss, aux, 1e-12 * aux);
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
  int f = 0, b = 0, w = 0, fb = 0;
  for (const PipeOp& op : s.ops[0]) {
    f += op.kind == PipeOpKind::F;
    b += op.kind == PipeOpKind::B;
    w += op.kind == PipeOpKind::W;
    fb += op.kind == PipeOpKind::FB;
  }
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

// The ordered transport posts each step's receives in each sender's order, computed from the
// schedule: run the executor on Gloo ranks (threads), log what each rank really sends, and
// compare every receiver's incoming order with pipeline_messages().
TEST(PipelineExecutor, SendsFollowTheOrderTheNcclTransportExpects) {
  for (const PipelineSchedule& s : {make_dualpipev(2, 4), make_dualpipev(3, 7), make_1f1b(3, 4), make_1f1b(2, 5)}) {
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
    for (int to = 0; to < s.pp; ++to) {
      std::vector<std::pair<int, uint32_t>> actual, expected;
      for (int from = 0; from < s.pp; ++from) {
        for (const auto& [dest, tag] : sent[from]) {
          if (dest == to) actual.push_back({from, tag});
        }
      }
      for (const OrderedTransport::Expected& e : pipeline_messages(s, to, rows)) expected.push_back({e.from, e.tag});
      EXPECT_EQ(actual, expected) << "messages to rank " << to;
      EXPECT_FALSE(expected.empty());
    }
  }
}

// Two GPUs: both pipeline ranks post their receive before they send, each on its own link
// (rank 0 from rank 1 on one communicator, rank 1 from rank 0 on another). NCCL connects two
// ranks at their first exchange, and the host waits there for the peer; unless the links
// are connected up front, each rank would wait on a different link for the other and both
// would hang until the timeout.
TEST(PipelineTransportNccl, BothRanksReceivingFirstDoNotWaitOnEachOther) {
  if (!(nccl_built() && cuda::available() && cuda::device_count() >= 2)) GTEST_SKIP() << "needs NCCL and 2 GPUs";
  const auto timeout = std::chrono::seconds(20);
  auto store = Store::open("memory", 0, timeout);
  const int64_t H = 8, totals = 6, rows = 3;
  std::vector<std::string> errors(2);
  std::latch done(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Communicator> pp = connect_nccl(store, r, 2, r, testing::test_options(timeout));
        OrderedTransport t(*pp, Device::cuda(r), H, DType::BF16, totals);
        const int other = 1 - r;
        for (int step = 0; step < 2; ++step) {
          t.begin_step({{other, 7u, rows}});
          t.send(other, 7u, Tensor::full({rows, H}, 10.0 * r + step, DType::BF16, Device::cuda(r)),
                 Tensor::full({totals}, 100.0 * r + step, DType::F64, Device::cuda(r)));
          const auto [hidden, sums] = t.receive(7u);
          t.end_step();
          EXPECT_EQ(hidden.to(Device::cpu()).to_double_vector(),
                    std::vector<double>(static_cast<size_t>(rows * H), 10.0 * other + step));
          EXPECT_EQ(sums.to(Device::cpu()).to_double_vector(), std::vector<double>(totals, 100.0 * other + step));
        }
        pp->synchronize();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
      done.arrive_and_wait();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace
}  // namespace moetrain
