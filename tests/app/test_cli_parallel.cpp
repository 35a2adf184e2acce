// Every parallel layout against one process: `moetrain launch -n N -- train` under dp2,
// ep2, ep2 x dp2, ep4 and HSDP (two replica groups, with and without ep) (Gloo, CPU) gives the losses, gradient norms and final weights of
// the single-process run with N times the micro-batch, within 1e-5 relative; a checkpoint
// written under ep2 x dp2 resumes under ep4 and under one process. The same for pipeline
// parallelism: pp2 and pp4 under 1F1B and DualPipeV, pp2 x ep2, tied embeddings in the V,
// and a checkpoint of pp2 x ep2 resumed under pp4 and one process.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda_runtime.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "cli_run.h"
#include "engine/checkpoint/checkpointer.h"
#include "test_files.h"

namespace moetrain {
namespace {

using Result = moetrain::testing::CliResult;
inline Result run(const std::string& args) { return moetrain::testing::run_moetrain(args); }

std::vector<nlohmann::json> metrics(const std::string& dir) { return moetrain::testing::read_metrics(dir); }

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

class ParallelCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string text;
    for (int i = 0; i < 300; ++i) {
      text += "Pack my box with " + std::to_string(i * 7 % 13) + " dozen liquor jugs, number " + std::to_string(i) +
              ".\n%\n";
    }
    dir_.file("corpus.txt", text);
  }

  // A 3-step run of the tiny model: 4 sequences per micro-batch over all data ranks, two
  // micro-batches per step, z-loss on so every loss term is exercised. Adam's eps is 1e-6:
  // with 1e-8, an element whose gradient is ~1e-9 (a sum of larger terms that cancel) moves
  // by g / eps * lr, so the few-ulp differences of another summation order (ranks add their
  // gradients in rank order, one process adds them inside one GEMM) move a handful of
  // weights by ~1e-5 and whole tensors by up to ~4e-5 relative; eps = 1e-6 keeps that
  // amplification out of the comparison (measured: 9e-7 worst under ep4).
  // `model`: the config file and its model keys (default: the tiny Qwen3-MoE with the z-loss).
  std::string train_args(const std::string& name, int data_ranks, const std::string& extra = "",
                         const std::string& model = "") {
    const std::string m = model.empty() ? "--config " + std::string(MOETRAIN_SOURCE_DIR) +
                                              "/configs/tiny.toml --model.router_z_loss_coef=0.001"
                                        : model;
    return "train " + m + " --data.paths=" + (dir_ / "corpus.txt") +
           " --training.steps=3 --training.seq_len=32 --training.grad_accum_steps=2"
           " --training.micro_batch_size=" + std::to_string(4 / data_ranks) +
           " --training.eval_every=3 --training.eval_batches=2 --training.sample_tokens=8 --training.threads=1"
           " --optimizer.warmup_steps=1 --optimizer.eps=1e-6 --metrics.progress=false"
           " --data.val_fraction=0.2 --checkpoint.keep=0 --checkpoint.save_final=true --metrics.dir=" +
           (dir_ / name) + " " + extra;
  }
  Result launch(int ranks, const std::string& args) {
    return ranks == 1 ? run(args) : run("launch -n " + std::to_string(ranks) + " -- " + args);
  }

  // Losses, gradient norms and validation losses of two runs, and every weight of their
  // last checkpoints, within `tol` relative (weights within `weight_tol`, routed experts'
  // within `expert_tol`: on GPUs one token routed otherwise moves a rarely chosen expert's
  // few gradients a long way under Adam's first steps).
  void expect_same_run(const std::string& a, const std::string& b, double tol = 1e-5, double weight_tol = -1,
                       double expert_tol = -1) {
    if (weight_tol < 0) weight_tol = tol;
    if (expert_tol < 0) expert_tol = weight_tol;
    const auto ma = metrics(dir_ / a), mb = metrics(dir_ / b);
    ASSERT_EQ(ma.size(), 3u);
    ASSERT_EQ(mb.size(), ma.size());
    for (size_t i = 0; i < ma.size(); ++i) {
      for (const char* k : {"loss", "aux_loss", "grad_norm"}) {
        EXPECT_LT(rel(mb[i][k].get<double>(), ma[i][k].get<double>()), tol) << k << " at step " << i + 1;
      }
    }
    EXPECT_LT(rel(mb.back()["val_loss"].get<double>(), ma.back()["val_loss"].get<double>()), tol);
    CheckpointReader ra(Checkpointer::committed(dir_ / (a + "/checkpoints")).back().second);
    CheckpointReader rb(Checkpointer::committed(dir_ / (b + "/checkpoints")).back().second);
    int compared = 0;
    double worst = 0;
    std::string worst_name;
    for (const std::string& name : ra.names()) {
      if (ra.info(name).kind != "model") continue;
      ASSERT_TRUE(rb.has(name)) << name;
      const std::vector<double> x = ra.read_whole(name).to_double_vector(), y = rb.read_whole(name).to_double_vector();
      ASSERT_EQ(x.size(), y.size()) << name;
      double diff = 0, norm = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        diff += (x[i] - y[i]) * (x[i] - y[i]);
        norm += x[i] * x[i];
      }
      const double r = std::sqrt(diff / std::max(norm, 1e-30));
      EXPECT_LT(r, name.find(".mlp.experts.") != std::string::npos ? expert_tol : weight_tol) << name;
      if (r > worst) {
        worst = r;
        worst_name = name;
      }
      ++compared;
    }
    std::printf("%s against %s: weights within %.3g relative (worst %s)\n", b.c_str(), a.c_str(), worst,
                worst_name.c_str());
    EXPECT_GT(compared, 50);
  }

  testing::ScratchDir dir_;
};

TEST_F(ParallelCli, EveryLayoutMatchesOneProcess) {
  Result one = launch(1, train_args("one", 1));
  ASSERT_EQ(one.status, 0) << one.output;
  struct Layout {
    const char* name;
    int ranks, data_ranks;
    const char* flags;
  };
  // shard_weights = "auto" keeps these tiny weights whole (ZeRO-2); the ZeRO-3 path is
  // named where it must run.
  for (const Layout& l : {Layout{"dp2", 2, 2, "--parallel.dp=2 --parallel.shard_weights=true"},
                          Layout{"dp2_auto", 2, 2, "--parallel.dp=2"}, Layout{"ep2", 2, 2, "--parallel.ep=2"},
                          // The micro-batches as DualPipeV on one rank (two chunks, paired F/B).
                          Layout{"ep2_overlap", 2, 2, "--parallel.ep=2 --parallel.ep_overlap=true"},
                          Layout{"ep2dp2", 4, 4, "--parallel.ep=2 --parallel.dp=2 --parallel.shard_weights=true"},
                          Layout{"ep4", 4, 4, "--parallel.ep=4"},
                          // Tokens gathered to every EP rank, combined on the experts' side
                          // (top-2 here, so "auto" keeps the all-to-all).
                          Layout{"ep2_gather", 2, 2, "--parallel.ep=2 --parallel.ep_dispatch=all_gather"},
                          Layout{"ep4_gather_overlap", 4, 4,
                                 "--parallel.ep=4 --parallel.ep_dispatch=all_gather --parallel.ep_overlap=true"},
                          Layout{"hsdp", 4, 4, "--parallel.dp_replicate=2 --parallel.shard_weights=true"},
                          Layout{"hsdp_ep2_zero2", 4, 4,
                                 "--parallel.dp_replicate=2 --parallel.ep=2 --parallel.shard_weights=false"}}) {
    SCOPED_TRACE(l.name);
    Result r = launch(l.ranks, train_args(l.name, l.data_ranks, l.flags));
    ASSERT_EQ(r.status, 0) << r.output;
    expect_same_run("one", l.name);
  }
}

// FP8 training ([training].fp8: the tiny model's experts are 128 wide, so their forward and
// input gradient run in FP8 too) under data and expert parallelism, both dispatchers (each
// sends the tokens quantized once, as packed codes and scales), against one FP8 process. Not to rounding, as BF16 layouts are: the projections' weight gradients quantize
// along the tokens, 128 at a time, so a rank's half of a micro-batch is quantized in other
// tiles than the whole, and any rounding difference (another BLAS blocking, another
// summation order) can move a value across an e4m3 rounding boundary, a step of 6-12% of the
// value. So the training and validation losses are held to 0.3% (measured up to 0.12%; with
// each row's scales taken from the next row's token, 0.40%). ExpertParallel.Fp8RowsAreThe
// TokensQuantizedOnce checks the dispatchers' codes and rows bit for bit.
TEST_F(ParallelCli, Fp8LayoutsMatchOneProcess) {
  Result one = launch(1, train_args("fp8_one", 1, "--training.fp8=true"));
  ASSERT_EQ(one.status, 0) << one.output;
  const auto a = metrics(dir_ / "fp8_one");
  ASSERT_EQ(a.size(), 3u);
  for (const auto& [name, flags] : {std::pair{"fp8_dp2", "--parallel.dp=2"}, {"fp8_ep2", "--parallel.ep=2"},
                                    {"fp8_ep2_gather", "--parallel.ep=2 --parallel.ep_dispatch=all_gather"}}) {
    SCOPED_TRACE(name);
    Result r = launch(2, train_args(name, 2, std::string("--training.fp8=true ") + flags));
    ASSERT_EQ(r.status, 0) << r.output;
    const auto b = metrics(dir_ / name);
    ASSERT_EQ(b.size(), a.size());
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      for (const char* k : {"loss", "val_loss"}) {
        if (!a[i].contains(k) || !a[i][k].is_number()) continue;
        const double e = rel(b[i][k].get<double>(), a[i][k].get<double>());
        EXPECT_LT(e, 3e-3) << k << " at step " << i + 1;
        worst = std::max(worst, e);
      }
    }
    std::printf("%s against fp8_one: losses within %.3g relative\n", name, worst);
  }
  // and FP8 is what ran: the same run in BF16 lands elsewhere
  Result bf16 = launch(1, train_args("bf16_one", 1));
  ASSERT_EQ(bf16.status, 0) << bf16.output;
  const double apart = rel(a.back()["loss"].get<double>(), metrics(dir_ / "bf16_one").back()["loss"].get<double>());
  std::printf("fp8_one against bf16_one: last loss %.3g apart\n", apart);
  EXPECT_GT(apart, 1e-5);
}

TEST_F(ParallelCli, CheckpointOfEp2Dp2ResumesUnderEp4AndOneProcess) {
  Result one = launch(1, train_args("one", 1));
  ASSERT_EQ(one.status, 0) << one.output;
  // Two steps under ep2 x dp2, saved; the third under another layout from that checkpoint.
  for (const auto& [name, ranks, flags] :
       std::vector<std::tuple<std::string, int, std::string>>{{"to_ep4", 4, "--parallel.ep=4"}, {"to_one", 1, ""}}) {
    SCOPED_TRACE(name);
    Result first = launch(4, train_args(name, 4, "--parallel.ep=2 --parallel.dp=2 --training.stop_after_steps=2"));
    ASSERT_EQ(first.status, 0) << first.output;
    Result second = launch(ranks, train_args(name, ranks == 1 ? 1 : 4, flags));
    ASSERT_EQ(second.status, 0) << second.output;
    EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
    expect_same_run("one", name);
  }
}

TEST_F(ParallelCli, AReplicaCountThatDoesNotDivideDpIsNamed) {
  Result r = launch(2, train_args("bad", 2, "--parallel.dp_replicate=3"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("[parallel].dp_replicate = 3 must divide dp = 2"), std::string::npos) << r.output;
}

TEST_F(ParallelCli, ALayoutThatDoesNotFitTheWorldIsNamed) {
  Result r = launch(2, train_args("bad", 2, "--parallel.ep=4"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("[parallel] does not fit"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("pp * cp * tp * ep = 1 * 1 * 1 * 4"), std::string::npos) << r.output;
}

// torchrun's spellings carry over: --nproc_per_node and the other underscore forms.
TEST_F(ParallelCli, TorchrunSpellingsOfTheLaunchOptionsAreAccepted) {
  Result r = run("launch --nproc_per_node 2 --max_restarts 0 --monitor_interval 0.2 -- comm-selftest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 of 2 ok"), std::string::npos) << r.output;
  // --nnodes above 1 without a rendezvous endpoint says what is missing.
  Result bad = run("launch --nproc-per-node 1 --nnodes 2:4 -- comm-selftest");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--nnodes 2:4 needs --rdzv-endpoint"), std::string::npos) << bad.output;
}

// Pipelines: 8 layers (DualPipeV over 4 ranks has 8 chunks), 8 micro-batches per step
// (DualPipeV needs at least 2 pp).
const char* kPipe = "--model.num_hidden_layers=8 --training.grad_accum_steps=8 --training.sample_tokens=0";

TEST_F(ParallelCli, EveryPipelineScheduleMatchesOneProcess) {
  Result one = launch(1, train_args("one", 1, kPipe));
  ASSERT_EQ(one.status, 0) << one.output;
  struct Layout {
    const char* name;
    int ranks, data_ranks;
    const char* flags;
  };
  // DualPipeV with four layers (tiny.toml) leaves the head's rank a layer's work heavier than
  // it can be evened out by layers: by default rank 1 computes half the head's rows
  // (pipeline/schedule.h, add_head_helper); also off, and forced on under 1F1B.
  for (const Layout& l : {Layout{"pp2_1f1b", 2, 1, "--parallel.pp=2 --parallel.schedule=1f1b"},
                          Layout{"pp2_dualpipev", 2, 1, "--parallel.pp=2 --parallel.schedule=dualpipev"},
                          Layout{"pp2_dualpipev_whole_head", 2, 1,
                                 "--parallel.pp=2 --parallel.schedule=dualpipev --parallel.head_share=0"},
                          Layout{"pp2_1f1b_helper", 2, 1, "--parallel.pp=2 --parallel.schedule=1f1b "
                                                          "--parallel.head_share=0.3"},
                          Layout{"pp4_1f1b", 4, 1, "--parallel.pp=4 --parallel.schedule=1f1b"},
                          Layout{"pp4_dualpipev", 4, 1, "--parallel.pp=4 --parallel.schedule=dualpipev"},
                          Layout{"pp2_ep2", 4, 2, "--parallel.pp=2 --parallel.ep=2"}}) {
    SCOPED_TRACE(l.name);
    Result r = launch(l.ranks, train_args(l.name, l.data_ranks, std::string(kPipe) + " " + l.flags));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("pipeline: "), std::string::npos) << r.output;
    const std::string name = l.name;
    const std::string helper_line = name == "pp2_1f1b_helper" ? "pipeline: rank 0 computes the head of the last 30%"
                                    : name == "pp2_dualpipev" || name == "pp2_ep2" || name == "pp4_dualpipev"
                                        ? "pipeline: rank 1 computes the head of the last"
                                        : "";
    if (helper_line.empty()) {
      EXPECT_EQ(r.output.find("computes the head of the last"), std::string::npos) << r.output;
    } else {
      EXPECT_NE(r.output.find(helper_line), std::string::npos) << r.output;
    }
    expect_same_run("one", l.name);
  }
}

TEST_F(ParallelCli, CheckpointOfPp2Ep2ResumesUnderPp4AndOneProcess) {
  Result one = launch(1, train_args("one", 1, kPipe));
  ASSERT_EQ(one.status, 0) << one.output;
  for (const auto& [name, ranks, flags] : std::vector<std::tuple<std::string, int, std::string>>{
           {"to_pp4", 4, "--parallel.pp=4 --parallel.schedule=1f1b"}, {"to_one", 1, ""}}) {
    SCOPED_TRACE(name);
    Result first = launch(4, train_args(name, 2, std::string(kPipe) + " --parallel.pp=2 --parallel.ep=2 "
                                                                      "--training.stop_after_steps=2"));
    ASSERT_EQ(first.status, 0) << first.output;
    Result second = launch(ranks, train_args(name, 1, std::string(kPipe) + " " + flags));
    ASSERT_EQ(second.status, 0) << second.output;
    EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
    expect_same_run("one", name);
  }
}

TEST_F(ParallelCli, TiedEmbeddingsLiveOnRankZeroOfTheV) {
  const std::string tied = std::string(kPipe) + " --model.tie_word_embeddings=true";
  Result one = launch(1, train_args("one", 1, tied));
  ASSERT_EQ(one.status, 0) << one.output;
  Result v = launch(2, train_args("v", 1, tied + " --parallel.pp=2 --parallel.schedule=dualpipev"));
  ASSERT_EQ(v.status, 0) << v.output;
  expect_same_run("one", "v");
  // 1F1B puts the embedding on the first rank and the head on the last: refused, named.
  Result r = launch(2, train_args("bad", 1, tied + " --parallel.pp=2 --parallel.schedule=1f1b"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("tie_word_embeddings needs the embedding and the head on one rank"), std::string::npos)
      << r.output;
}

TEST_F(ParallelCli, TooFewMicroBatchesForDualPipeVIsNamed) {
  Result r = launch(2, train_args("few", 1, "--parallel.pp=2 --parallel.schedule=dualpipev"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("[parallel].schedule = \"dualpipev\" with pp = 2 and [training].grad_accum_steps = 2"),
            std::string::npos)
      << r.output;
}

// On two GPUs (NCCL, one process each): the tiny model in bf16 under dp2 and ep2 (ZeRO-3,
// experts exchanged by all-to-all-v on a communication stream; then by all-gather, also
// with the micro-batches overlapped) and dp2 with ZeRO-2 against
// one GPU with twice the micro-batch. bf16 activations round differently when cuBLASLt
// picks other kernels for other row counts, so the bound is 2e-2 (the CPU layouts above are
// held to 1e-5).
// DeepSeek-V3 (configs/dsv3-tiny.toml: MLA, YaRN, a dense first layer, 16 experts in 4
// groups with a shared expert, aux-loss-free balancing, the sequence-wise balance loss and a
// multi-token prediction module: on the head's stage, its own exchange) under the layouts that split what
// the family adds: experts over 2 and 4 ranks (the routing bias moved from the loads of all
// ranks), ZeRO-3, the paired micro-batches, and the pipeline with and without experts
// split. Each against one process; each run ends with the replicated tensors (attention,
// router, shared experts, norms, routing biases) bitwise equal on every data rank.
TEST_F(ParallelCli, DeepseekV3LayoutsMatchOneProcess) {
  const std::string model = "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-tiny.toml " +
                            "--model.router_bias_update_speed=0.01 --model.num_hidden_layers=4 "
                            "--model.seq_aux_loss_coef=0.01";
  const std::string pipe = "--training.grad_accum_steps=8 --training.sample_tokens=0";
  Result one = launch(1, train_args("one", 1, "", model));
  ASSERT_EQ(one.status, 0) << one.output;
  Result one_pipe = launch(1, train_args("one_pipe", 1, pipe, model));
  ASSERT_EQ(one_pipe.status, 0) << one_pipe.output;
  struct Layout {
    const char* name;
    int ranks, data_ranks;
    const char* flags;
    bool pipeline;
  };
  for (const Layout& l :
       {Layout{"ep2", 2, 2, "--parallel.ep=2", false}, Layout{"ep4", 4, 4, "--parallel.ep=4", false},
        Layout{"dp2_zero3", 2, 2, "--parallel.dp=2 --parallel.shard_weights=true", false},
        Layout{"ep2_gather_overlap", 2, 2,
               "--parallel.ep=2 --parallel.ep_dispatch=all_gather --parallel.ep_overlap=true", false},
        Layout{"pp2_dualpipev", 2, 1, "--parallel.pp=2 --parallel.schedule=dualpipev", true},
        Layout{"pp2_ep2_1f1b", 4, 2, "--parallel.pp=2 --parallel.ep=2 --parallel.schedule=1f1b", true}}) {
    SCOPED_TRACE(l.name);
    Result r = launch(l.ranks, train_args(l.name, l.data_ranks, std::string(l.pipeline ? pipe : "") + " " + l.flags,
                                          model));
    ASSERT_EQ(r.status, 0) << r.output;
    expect_same_run(l.pipeline ? "one_pipe" : "one", l.name);
    if (l.data_ranks > 1) {
      EXPECT_NE(r.output.find("replicated tensors"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find(fmt::format("bitwise equal on the {} data ranks", l.pipeline ? 2 : l.data_ranks)),
                std::string::npos)
          << r.output;
    }
  }
}

// Activation recomputation ([training].recompute = "full" and "selective") changes no bit of a
// run under the layouts whose passes it touches: the expert exchange redone inside the backward while the
// paired micro-batch's exchange is in flight (ep2 with ep_overlap), DualPipeV's overlapped
// forward/backward chunks and deferred weight gradients, ZeRO-3's weights gathered for the
// backward. DeepSeek-V3 (its multi-token prediction layer is never recomputed); every loss,
// gradient norm and final weight equal (a relative bound below any nonzero difference).
TEST_F(ParallelCli, RecomputationLeavesEveryLayoutsRunBitwiseUnchanged) {
  const std::string model = "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-tiny.toml " +
                            "--model.router_bias_update_speed=0.01 --model.num_hidden_layers=4 "
                            "--model.seq_aux_loss_coef=0.01";
  struct Layout {
    const char* name;
    int ranks, data_ranks;
    const char* flags;
  };
  for (const Layout& l :
       {Layout{"ep2_overlap", 2, 2, "--parallel.ep=2 --parallel.ep_overlap=true"},
        Layout{"pp2_dualpipev", 2, 1,
               "--parallel.pp=2 --parallel.schedule=dualpipev --training.grad_accum_steps=8 --training.sample_tokens=0"},
        Layout{"dp2_zero3", 2, 2, "--parallel.dp=2 --parallel.shard_weights=true"}}) {
    SCOPED_TRACE(l.name);
    const std::string keep = std::string(l.name) + "_keep";
    Result a = launch(l.ranks, train_args(keep, l.data_ranks, l.flags, model));
    ASSERT_EQ(a.status, 0) << a.output;
    for (const std::string mode : {"full", "selective"}) {
      const std::string redo = std::string(l.name) + "_" + mode;
      Result b = launch(l.ranks, train_args(redo, l.data_ranks,
                                            std::string(l.flags) + " --training.recompute=" + mode, model));
      ASSERT_EQ(b.status, 0) << b.output;
      EXPECT_NE(b.output.find("recompute: " + mode + ", decoder layers [0, 1, 2, 3]"), std::string::npos) << b.output;
      expect_same_run(keep, redo, /*tol=*/1e-300);
    }
  }
  // Some layers only, named; a layer the model lacks is refused with the range.
  Result some = launch(1, train_args("some", 1, "--training.recompute=full --training.recompute_layers=[1,3]", model));
  ASSERT_EQ(some.status, 0) << some.output;
  EXPECT_NE(some.output.find("recompute: full, decoder layers [1, 3]"), std::string::npos) << some.output;
  Result all = launch(1, train_args("all", 1, "", model));
  ASSERT_EQ(all.status, 0) << all.output;
  expect_same_run("all", "some", 1e-300);
  Result bad = launch(1, train_args("bad", 1, "--training.recompute=full --training.recompute_layers=[4]", model));
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("[training].recompute_layers names layer 4, but the model's decoder layers are 0..3"),
            std::string::npos)
      << bad.output;
}

// Context parallelism on the CPU (Gloo): every sequence cut into 2 cp zigzag chunks, keys and
// values passed round the cp ranks (ring attention, engine/parallel/context_attention.h), the
// loss and the router totals summed over them, gradients reduced over dp x cp (x ep): cp2,
// cp4, cp2 x ep2, cp2 x dp2 (the tiny Qwen3 model), DeepSeek-V3's MLA with its MTP module and
// with the sequence-wise balance loss, against one process with the same rows (packed
// conversations: test_cli_sft.cpp). A seq_len that does not cut into 2 cp chunks is refused.
TEST_F(ParallelCli, ContextParallelLayoutsMatchOneProcess) {
  Result one = launch(1, train_args("one", 1));
  ASSERT_EQ(one.status, 0) << one.output;
  struct Layout {
    const char* name;
    int ranks, row_ranks;
    const char* flags;
  };
  for (const Layout& l : {Layout{"cp2", 2, 1, "--parallel.cp=2"}, Layout{"cp4", 4, 1, "--parallel.cp=4"},
                          Layout{"cp2_ep2", 4, 2, "--parallel.cp=2 --parallel.ep=2"},
                          Layout{"cp2_dp2", 4, 2, "--parallel.cp=2 --parallel.dp=2"}}) {
    SCOPED_TRACE(l.name);
    Result r = launch(l.ranks, train_args(l.name, l.row_ranks, l.flags));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("context parallelism: cp "), std::string::npos) << r.output;
    expect_same_run("one", l.name);
    // The step's tokens count each sequence once (the cp ranks share their rows).
    EXPECT_EQ(metrics(dir_ / l.name).back().value("tokens", int64_t{0}),
              metrics(dir_ / "one").back().value("tokens", int64_t{-1}));
  }
  // DeepSeek-V3 with its multi-token prediction module: a chunk's last positions predict
  // tokens of another rank's chunk (the loader's Batch::ahead_inputs / ahead_targets).
  const std::string dsv3 = "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-tiny.toml " +
                           "--model.router_bias_update_speed=0.01 --model.num_hidden_layers=4 "
                           "--model.num_nextn_predict_layers=1 --model.mtp_loss_weight=0.3";
  Result mla_one = launch(1, train_args("mla_one", 1, "", dsv3));
  ASSERT_EQ(mla_one.status, 0) << mla_one.output;
  Result mla = launch(2, train_args("mla_cp2", 1, "--parallel.cp=2", dsv3));
  ASSERT_EQ(mla.status, 0) << mla.output;
  expect_same_run("mla_one", "mla_cp2");
  EXPECT_GT(metrics(dir_ / "mla_cp2")[0].value("loss_terms", nlohmann::json::object()).value("mtp_loss", 0.0), 0.0)
      << "the module ran";
  Result bad = launch(2, train_args("bad", 1, "--parallel.cp=2 --training.seq_len=30"));
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("[training].seq_len (30) must be a multiple of 2 x [parallel].cp (4)"), std::string::npos)
      << bad.output;
  // The sequence-wise balance loss: each sequence's expert selections summed over the cp ranks.
  const std::string seq_aux = dsv3 + " --model.seq_aux_loss_coef=0.05";
  Result seq_one = launch(1, train_args("seq_one", 1, "", seq_aux));
  ASSERT_EQ(seq_one.status, 0) << seq_one.output;
  Result seq = launch(2, train_args("seq_cp2", 1, "--parallel.cp=2", seq_aux));
  ASSERT_EQ(seq.status, 0) << seq.output;
  expect_same_run("seq_one", "seq_cp2");
  const double seq_loss =
      metrics(dir_ / "seq_cp2")[0].value("loss_terms", nlohmann::json::object()).value("seq_aux_loss", 0.0);
  EXPECT_NEAR(seq_loss,
              metrics(dir_ / "seq_one")[0].value("loss_terms", nlohmann::json::object()).value("seq_aux_loss", -1.0),
              1e-6 * seq_loss);
  EXPECT_GT(seq_loss, 0.0);
}

// `bench` under context parallelism: each cp rank benches its zigzag chunks of the same
// synthetic rows, and the step's tokens are those of one process's step.
TEST_F(ParallelCli, BenchRunsUnderContextParallelism) {
  const std::string args = "bench --config " + std::string(MOETRAIN_SOURCE_DIR) +
                           "/configs/tiny.toml --training.seq_len=32 --training.micro_batch_size=2 "
                           "--training.threads=1 --warmup 1 --steps 1";
  Result one = launch(1, args);
  ASSERT_EQ(one.status, 0) << one.output;
  Result cp = launch(2, args + " --parallel.cp=2");
  ASSERT_EQ(cp.status, 0) << cp.output;
  auto tokens = [](const std::string& out) {
    const size_t at = out.find("tokens/step");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  EXPECT_FALSE(tokens(one.output).empty()) << one.output;
  EXPECT_EQ(tokens(cp.output), tokens(one.output)) << cp.output;
}

// Context parallelism inside pipelines (pp2 x cp2, both schedules): each stage's CP pair
// passes its zigzag chunks' activations to the next stage's pair, and the run matches one
// process.
TEST_F(ParallelCli, ContextParallelPipelinesMatchOneProcess) {
  Result one = launch(1, train_args("one", 1, kPipe));
  ASSERT_EQ(one.status, 0) << one.output;
  for (const char* schedule : {"dualpipev", "1f1b"}) {
    SCOPED_TRACE(schedule);
    const std::string name = std::string("pp2_cp2_") + schedule;
    Result r = launch(4, train_args(name, 1, std::string(kPipe) + " --parallel.pp=2 --parallel.cp=2 " +
                                                 "--parallel.schedule=" + schedule));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("context parallelism: cp 2"), std::string::npos) << r.output;
    expect_same_run("one", name);
  }
}

// Tensor parallelism (issue 33): attention heads, dense MLP columns and the vocabulary split
// over the tp ranks, the tokens between them too (sequence parallelism), the MoE layers'
// experts over tp x ep. Every layout against one process (the vocabulary 258: it must split).
const char* kTpModel = "--model.vocab_size=258";

TEST_F(ParallelCli, TensorParallelLayoutsMatchOneProcess) {
  struct Layout {
    const char* name;
    int ranks, row_ranks;
    const char* flags;
  };
  // Dense layers (every other one) and tied embeddings: their split too.
  const std::string dense = " --model.mlp_only_layers=[0,2] --model.tie_word_embeddings=true";
  Result one = launch(1, train_args("one", 1, kTpModel));
  ASSERT_EQ(one.status, 0) << one.output;
  Result one_dense = launch(1, train_args("one_dense", 1, kTpModel + dense));
  ASSERT_EQ(one_dense.status, 0) << one_dense.output;
  for (const Layout& l : {Layout{"tp2", 2, 1, "--parallel.tp=2"},
                          Layout{"tp2_zero3", 2, 1, "--parallel.tp=2 --parallel.shard_weights=true"},
                          Layout{"tp2_ep2", 4, 2, "--parallel.tp=2 --parallel.ep=2"},
                          Layout{"tp2_dp2", 4, 2, "--parallel.tp=2 --parallel.dp=2 --parallel.shard_weights=true"},
                          Layout{"tp2_gather", 2, 1, "--parallel.tp=2 --parallel.ep_dispatch=all_gather"},
                          Layout{"tp2_hsdp", 4, 2, "--parallel.tp=2 --parallel.dp_replicate=2"},
                          // Not folded: every tp rank holds the ep rank's experts and runs its own
                          // tokens through them (their gradients summed over tp).
                          Layout{"tp2_unfolded", 2, 1, "--parallel.tp=2 --parallel.fold_experts=false"},
                          Layout{"tp2_ep2_unfolded", 4, 2,
                                 "--parallel.tp=2 --parallel.ep=2 --parallel.fold_experts=false"}}) {
    SCOPED_TRACE(l.name);
    Result r = launch(l.ranks, train_args(l.name, l.row_ranks, std::string(kTpModel) + " " + l.flags));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("tensor parallelism: tp 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("info replicas: "), std::string::npos) << r.output;  // the copies were checked
    if (std::string(l.flags).find("fold_experts=false") != std::string::npos) {  // each tp rank's expert copies
      EXPECT_NE(r.output.find("bitwise equal on the 2 tp ranks of each expert-parallel coordinate"), std::string::npos)
          << r.output;
    }
    expect_same_run("one", l.name);
    // The step's tokens count each row once (the tp ranks share their rows).
    EXPECT_EQ(metrics(dir_ / l.name).back().value("tokens", int64_t{0}),
              metrics(dir_ / "one").back().value("tokens", int64_t{-1}));
  }
  Result r = launch(2, train_args("tp2_dense", 1, std::string(kTpModel) + dense + " --parallel.tp=2"));
  ASSERT_EQ(r.status, 0) << r.output;
  expect_same_run("one_dense", "tp2_dense");
  // Four tp ranks: the rings of the overlapped gathers and reduce-scatters take three hops.
  const std::string four = " --model.vocab_size=260 --model.num_key_value_heads=4";
  Result one_four = launch(1, train_args("one_four", 1, four));
  ASSERT_EQ(one_four.status, 0) << one_four.output;
  Result tp4 = launch(4, train_args("tp4", 1, four + " --parallel.tp=4"));
  ASSERT_EQ(tp4.status, 0) << tp4.output;
  expect_same_run("one_four", "tp4");
  // Dense layers over four ranks: the running sums of the fused gather / reduce-scatter ring
  // pass through two ranks before they reach their own.
  Result one_four_dense = launch(1, train_args("one_four_dense", 1, four + dense));
  ASSERT_EQ(one_four_dense.status, 0) << one_four_dense.output;
  Result tp4_dense = launch(4, train_args("tp4_dense", 1, four + dense + " --parallel.tp=4"));
  ASSERT_EQ(tp4_dense.status, 0) << tp4_dense.output;
  expect_same_run("one_four_dense", "tp4_dense");
  // Fewer key/value heads than tp ranks: each is held whole by the ranks that share it (tp4
  // over 2 heads, tp2 and tp2 x ep2 over 1), its gradient summed over them; the run's end
  // finds the copies bitwise equal.
  for (const auto& [name, ranks, row_ranks, model, flags] :
       std::vector<std::tuple<std::string, int, int, std::string, std::string>>{
           {"tp4_kv2", 4, 1, " --model.vocab_size=260 --model.num_key_value_heads=2", " --parallel.tp=4"},
           {"tp2_kv1", 2, 1, std::string(" ") + kTpModel + " --model.num_key_value_heads=1", " --parallel.tp=2"},
           {"tp2_ep2_kv1", 4, 2, std::string(" ") + kTpModel + " --model.num_key_value_heads=1",
            " --parallel.tp=2 --parallel.ep=2"}}) {
    SCOPED_TRACE(name);
    const std::string one_name = name + "_one";
    Result ref = launch(1, train_args(one_name, 1, model));
    ASSERT_EQ(ref.status, 0) << ref.output;
    Result kv = launch(ranks, train_args(name, row_ranks, model + flags));
    ASSERT_EQ(kv.status, 0) << kv.output;
    EXPECT_NE(kv.output.find("info replicas: "), std::string::npos) << kv.output;
    expect_same_run(one_name, name);
  }
}

// Full recomputation under tensor parallelism redoes each layer's forward, its gathers and
// reduce-scatters included, before its backward: the same bits as without. Selective
// recomputation is refused under tp (its dropped norm outputs would need gathering again).
TEST_F(ParallelCli, TensorParallelFullRecomputationIsBitwiseUnchanged) {
  // (Layers 0 and 2 dense: their MLPs' fused gather / reduce-scatter ring made again too.)
  const std::string tp2 = std::string(kTpModel) + " --model.mlp_only_layers=[0,2] --parallel.tp=2";
  Result keep = launch(2, train_args("tp2_keep", 1, tp2));
  ASSERT_EQ(keep.status, 0) << keep.output;
  Result full = launch(2, train_args("tp2_full", 1, tp2 + " --training.recompute=full"));
  ASSERT_EQ(full.status, 0) << full.output;
  expect_same_run("tp2_keep", "tp2_full", /*tol=*/1e-300);
  Result selective = launch(2, train_args("tp2_selective", 1, tp2 + " --training.recompute=selective"));
  EXPECT_NE(selective.status, 0);
  EXPECT_NE(selective.output.find("[training].recompute = \"selective\" is not built yet"), std::string::npos)
      << selective.output;
}

// Pipeline stages of tensor-parallel pairs (pp2 x tp2, both schedules): each stage passes its
// sequence-parallel slices to the next stage's rank of the same tp coordinate.
TEST_F(ParallelCli, TensorParallelPipelinesMatchOneProcess) {
  Result one = launch(1, train_args("one", 1, std::string(kPipe) + " " + kTpModel));
  ASSERT_EQ(one.status, 0) << one.output;
  for (const char* schedule : {"dualpipev", "1f1b"}) {
    SCOPED_TRACE(schedule);
    const std::string name = std::string("pp2_tp2_") + schedule;
    Result r = launch(4, train_args(name, 1, std::string(kPipe) + " " + kTpModel +
                                                 " --parallel.pp=2 --parallel.tp=2 --parallel.schedule=" + schedule));
    ASSERT_EQ(r.status, 0) << r.output;
    expect_same_run("one", name);
  }
}

// A checkpoint written under tp2 x ep2 (heads, vocabulary rows and experts split; what every
// tp rank holds written once) resumes under ep2, under tp2 and under one process.
TEST_F(ParallelCli, CheckpointOfTp2Ep2ResumesUnderOtherLayouts) {
  Result one = launch(1, train_args("one", 1, kTpModel));
  ASSERT_EQ(one.status, 0) << one.output;
  for (const auto& [name, ranks, rows, flags] : std::vector<std::tuple<std::string, int, int, std::string>>{
           {"to_ep2", 2, 2, "--parallel.ep=2"}, {"to_tp2", 2, 1, "--parallel.tp=2"}, {"to_one", 1, 1, ""}}) {
    SCOPED_TRACE(name);
    Result first = launch(4, train_args(name, 2, std::string(kTpModel) +
                                                     " --parallel.tp=2 --parallel.ep=2 --training.stop_after_steps=2"));
    ASSERT_EQ(first.status, 0) << first.output;
    Result second = launch(ranks, train_args(name, rows, std::string(kTpModel) + " " + flags));
    ASSERT_EQ(second.status, 0) << second.output;
    EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
    expect_same_run("one", name);
  }
}

// What every tp rank holds whole (norms, routers, the final norm) stays bitwise equal on every
// rank: each rank's gradient of it is summed over the tp group before one update all apply.
// 50 steps under tp2 x ep2; the run's end checks the copies (and fails, naming the first that
// differs, when they drift: tried with the tp gradient sum taken out).
TEST_F(ParallelCli, TensorParallelCopiesStayBitwiseEqualFor50Steps) {
  Result r = launch(4, train_args("tp50", 2, std::string(kTpModel) +
                                                 " --parallel.tp=2 --parallel.ep=2 --training.steps=50 "
                                                 "--training.eval_every=50"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("info step 50/50"), std::string::npos) << r.output;
  // 4 layers x (two norms, two head norms, the router) + the final norm, and the routing biases.
  EXPECT_NE(r.output.find("replicas: 25 replicated tensors bitwise equal on the 4 data ranks"), std::string::npos)
      << r.output;
  // The split weights' pieces are copies on the ranks of one tp coordinate (ep 2 of them).
  EXPECT_NE(r.output.find("bitwise equal on the 2 ranks of each tensor-parallel piece"), std::string::npos)
      << r.output;
}

TEST_F(ParallelCli, ATensorParallelLayoutThatDoesNotSplitIsNamed) {
  Result vocab = launch(2, train_args("bad_vocab", 1, "--parallel.tp=2"));
  EXPECT_NE(vocab.status, 0);
  EXPECT_NE(vocab.output.find("[model].vocab_size = 257 must be a multiple of tp"), std::string::npos) << vocab.output;
  Result heads = launch(2, train_args("bad_kv", 1, std::string(kTpModel) + " --parallel.tp=2 "
                                                  "--model.num_attention_heads=6 --model.num_key_value_heads=3"));
  EXPECT_NE(heads.status, 0);
  EXPECT_NE(heads.output.find("[model].num_key_value_heads = 3 must be a multiple of tp = 2"), std::string::npos)
      << heads.output;
  Result cp = launch(4, train_args("bad_cp", 1, std::string(kTpModel) + " --parallel.tp=2 --parallel.cp=2"));
  EXPECT_NE(cp.status, 0);
  EXPECT_NE(cp.output.find("tensor and context parallelism together are not built yet"), std::string::npos)
      << cp.output;
  const std::string dsv3 = "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-tiny.toml " + kTpModel;
  Result mtp = launch(2, train_args("bad_mtp", 1, "--parallel.tp=2", dsv3));
  EXPECT_NE(mtp.status, 0);
  EXPECT_NE(mtp.output.find("[model].num_nextn_predict_layers = 1 under tensor parallelism is not built yet"),
            std::string::npos)
      << mtp.output;
}

// DeepSeek-V3 under tensor parallelism: MLA's query and key/value up-projections (q_b_proj or
// q_proj, kv_b_proj) split by heads and o_proj by rows; the latents' down-projections and
// norms (q_a_proj, kv_a_proj_with_mqa with k_pe's rows) held whole and made for every row on
// every tp rank, their gradients (each rank's heads' part) summed over the tp group; the shared
// experts whole on each rank's rows; the dense first layer by columns; routed experts over tp x
// ep. Against one process: tp2 with and without the query latent, and tp2 x ep2.
TEST_F(ParallelCli, DeepseekV3TensorParallelLayoutsMatchOneProcess) {
  const std::string dsv3 = "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-tiny.toml " + kTpModel +
                           " --model.num_nextn_predict_layers=0";
  for (const auto& [name, model] : std::vector<std::pair<std::string, std::string>>{
           {"mla", dsv3}, {"mla_no_q_latent", dsv3 + " --model.q_lora_rank=0"}}) {
    SCOPED_TRACE(name);
    Result one = launch(1, train_args(name + "_one", 1, "", model));
    ASSERT_EQ(one.status, 0) << one.output;
    Result tp2 = launch(2, train_args(name + "_tp2", 1, "--parallel.tp=2", model));
    ASSERT_EQ(tp2.status, 0) << tp2.output;
    EXPECT_NE(tp2.output.find("info replicas: "), std::string::npos) << tp2.output;
    expect_same_run(name + "_one", name + "_tp2");
    if (name != "mla") continue;
    Result folded = launch(4, train_args(name + "_tp2_ep2", 2, "--parallel.tp=2 --parallel.ep=2", model));
    ASSERT_EQ(folded.status, 0) << folded.output;
    expect_same_run(name + "_one", name + "_tp2_ep2");
  }
}

// A DeepSeek-V3 checkpoint written under ep2 (experts split, the routing biases with the
// model) resumes under ep4 and under one process, and the run matches one uninterrupted
// process.
TEST_F(ParallelCli, DeepseekV3CheckpointOfEp2ResumesUnderEp4AndOneProcess) {
  const std::string model = "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-tiny.toml " +
                            "--model.router_bias_update_speed=0.01";
  Result one = launch(1, train_args("one", 1, "", model));
  ASSERT_EQ(one.status, 0) << one.output;
  for (const auto& [name, ranks, flags] :
       std::vector<std::tuple<std::string, int, std::string>>{{"to_ep4", 4, "--parallel.ep=4"}, {"to_one", 1, ""}}) {
    SCOPED_TRACE(name);
    Result first = launch(2, train_args(name, 2, "--parallel.ep=2 --training.stop_after_steps=2", model));
    ASSERT_EQ(first.status, 0) << first.output;
    Result second = launch(ranks, train_args(name, ranks, flags, model));
    ASSERT_EQ(second.status, 0) << second.output;
    EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
    expect_same_run("one", name);
  }
}

TEST_F(ParallelCli, TwoGpusMatchOneGpu) {
  if (!cuda::available() || cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs: " << (cuda::available() ? "this machine has fewer" : cuda::unavailable_reason());
  }
  Result one = launch(1, train_args("gpu1", 1, "--training.device=cuda"));
  ASSERT_EQ(one.status, 0) << one.output;
  for (const auto& [name, flags] : std::vector<std::pair<std::string, std::string>>{
           {"gpu_dp2", "--training.device=cuda --parallel.dp=2 --parallel.shard_weights=true"},
           {"gpu_ep2", "--training.device=cuda --parallel.ep=2 --parallel.shard_weights=true"},
           {"gpu_ep2_gather", "--training.device=cuda --parallel.ep=2 --parallel.ep_dispatch=all_gather"},
           {"gpu_ep2_gather_nccl",
            "--training.device=cuda --parallel.ep=2 --parallel.ep_dispatch=all_gather --parallel.ep_transport=nccl"},
           {"gpu_ep2_gather_overlap",
            "--training.device=cuda --parallel.ep=2 --parallel.ep_dispatch=all_gather --parallel.ep_overlap=true"},
           // ZeRO-2: whole gradients live across the micro-batches, so the experts' weight
           // gradients of both micro-batches come from one grouped pass on each GPU.
           {"gpu_dp2_zero2", "--training.device=cuda --parallel.dp=2 --parallel.shard_weights=false"}}) {
    SCOPED_TRACE(name);
    Result r = launch(2, train_args(name, 2, flags));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("nccl collectives"), std::string::npos) << r.output;
    const bool gather = name.find("gather") != std::string::npos;
    if (gather) {
      const bool copies = name.find("nccl") == std::string::npos;
      EXPECT_NE(r.output.find(copies ? "token rows by copies into the peers' memory" : "token rows by NCCL"),
                std::string::npos)
          << r.output;
    }
    // The all-gather adds bf16 roundings the one GPU does not make (each rank's partial sums
    // of the combine and of dx rounded, then summed over the ranks): the weights, whose first
    // Adam steps move by the sign of each gradient element, land further apart (measured
    // 0.065 against 0.011 for the all-to-all); the losses stay within 2e-2.
    expect_same_run("gpu1", name, 2e-2, gather ? 1e-1 : 2e-2);
    if (name == "gpu_dp2_zero2") {
      EXPECT_NE(r.output.find("optimizer: each layer's update and weight gather under the next forward"),
                std::string::npos)
          << r.output;
    }
  }
  // FSDP's overlap (on by default: gpu_dp2_zero2) against the same steps in line, over NCCL:
  // the same bits.
  Result line = launch(2, train_args("gpu_dp2_zero2_in_line", 2,
                                     "--training.device=cuda --parallel.dp=2 --parallel.shard_weights=false "
                                     "--optimizer.overlap=false"));
  ASSERT_EQ(line.status, 0) << line.output;
  expect_same_run("gpu_dp2_zero2_in_line", "gpu_dp2_zero2", std::numeric_limits<double>::min());
}

// Context parallelism on two GPUs (the whole-sequence form: keys and values all-gathered,
// the flash-attention kernels over the whole sequences, the key/value gradients
// reduce-scattered) against one GPU, Qwen3 and DeepSeek-V3's MLA with its MTP module.
TEST_F(ParallelCli, TwoGpuContextParallelMatchesOneGpu) {
  if (!cuda::available() || cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs: " << (cuda::available() ? "this machine has fewer" : cuda::unavailable_reason());
  }
  // The ring's attention sums each query's keys in two parts (rounded apart, merged in f32),
  // not in one pass as one GPU does: within bf16's error (ContextAttention.
  // TwoGpuRingMatchesTheWholeAttention), which is enough to route a token otherwise in a tiny
  // model. So the routing bias stays still (it moves by +-speed on the sign of each expert's
  // load against the mean: one token flips a step's move, 0.29-0.5 relative after 3 steps,
  // measured on H100, which says nothing of CP; the CPU tests move it under cp2 in f32), and
  // the routed experts' weights, whose few tokens move a long way under Adam's first steps
  // when one is routed otherwise (0.10-0.13 measured), have their own bound. The MLA model's
  // gradient norm at step 2 moved 4.5% (measured, H100; its losses within 2e-2): its metrics
  // take 6e-2. What checks the ring's arithmetic itself on GPUs, within bf16's error, is
  // ContextAttention.TwoGpuRingMatchesTheWholeAttention; this test checks it wired into the
  // models on GPUs. (A wrong part, an earlier rank's later chunk seen, moved the tiny Qwen3's
  // gradient norm by 12% at step 1 on the CPU: tried.)
  // (dsv3-mla-tiny: head dims the CUDA kernels take, 192 / 128; an MTP module.)
  const std::string still = " --model.router_bias_update_speed=0";
  const std::string qwen3 = "--config " + std::string(MOETRAIN_SOURCE_DIR) +
                            "/configs/tiny.toml --model.router_z_loss_coef=0.001" + still;
  const std::string dsv3 = "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-mla-tiny.toml" + still;
  // (mla_seq_aux: DeepSeek's sequence-wise balance loss, its counts all-reduced over the group.)
  for (const auto& [name, model] : std::vector<std::pair<std::string, std::string>>{
           {"qwen3", qwen3}, {"mla", dsv3}, {"mla_seq_aux", dsv3 + " --model.seq_aux_loss_coef=0.05"}}) {
    SCOPED_TRACE(name);
    Result one = launch(1, train_args(name + "_gpu1", 1, "--training.device=cuda", model));
    ASSERT_EQ(one.status, 0) << one.output;
    Result r = launch(2, train_args(name + "_gpu_cp2", 1, "--training.device=cuda --parallel.cp=2", model));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("context parallelism: cp 2"), std::string::npos) << r.output;
    expect_same_run(name + "_gpu1", name + "_gpu_cp2", name == "qwen3" ? 2e-2 : 6e-2, 1e-1, 2.5e-1);
  }
}

// Tensor parallelism on two GPUs (NCCL: the rows gathered and reduce-scattered, the
// vocabulary-parallel head, the experts over the two tp ranks, one-rank DualPipeV by default)
// against one GPU. bf16 partial sums of o_proj and of the head's input gradient are summed
// over the ranks in another order than one GPU's GEMM: the tolerances of the CP test (which
// says why the routing bias is held still and the experts get their own bound).
TEST_F(ParallelCli, TwoGpuTensorParallelMatchesOneGpu) {
  if (!cuda::available() || cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs: " << (cuda::available() ? "this machine has fewer" : cuda::unavailable_reason());
  }
  const std::string model = "--config " + std::string(MOETRAIN_SOURCE_DIR) +
                            "/configs/tiny.toml --model.router_z_loss_coef=0.001 --model.router_bias_update_speed=0 " +
                            kTpModel;
  // (dsv3-mla-tiny: MLA with the head dims the CUDA kernels take, 192 / 128, no MTP module.)
  const std::string mla = "--config " + std::string(MOETRAIN_SOURCE_DIR) +
                          "/configs/dsv3-mla-tiny.toml --model.router_bias_update_speed=0 "
                          "--model.num_nextn_predict_layers=0 " + kTpModel;
  for (const auto& [name, base, flags] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"tp_gpu", model, ""},
           {"tp_gpu_dense", model, "--parallel.ep_overlap=false --model.mlp_only_layers=[1]"},
           {"tp_gpu_mla", mla, ""},
           {"tp_gpu_unfolded", model, "--parallel.fold_experts=false"},
           {"tp_gpu_kv1", model, "--model.num_key_value_heads=1"}}) {  // the one kv head on both ranks
    SCOPED_TRACE(name);
    const std::string extra = flags.empty() ? "" : " " + flags;
    Result one = launch(1, train_args(name + "1", 1, "--training.device=cuda" + extra, base));
    ASSERT_EQ(one.status, 0) << one.output;
    Result r = launch(2, train_args(name + "_tp2", 1, "--training.device=cuda --parallel.tp=2" + extra, base));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("tensor parallelism: tp 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("info replicas: "), std::string::npos) << r.output;
    expect_same_run(name + "1", name + "_tp2", name == "tp_gpu_mla" ? 6e-2 : 2e-2, 1e-1, 2.5e-1);
  }
}

// Pipeline parallelism on two GPUs against one GPU: the messages copied into the peer's
// memory (the default on one host) and over NCCL (MOETRAIN_PIPELINE_TRANSPORT=nccl).
TEST_F(ParallelCli, TwoGpuPipelineMatchesOneGpu) {
  if (!cuda::available() || cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs: " << (cuda::available() ? "this machine has fewer" : cuda::unavailable_reason());
  }
  const std::string gpu = std::string(kPipe) + " --training.device=cuda";
  Result one = launch(1, train_args("gpu_one", 1, gpu));
  ASSERT_EQ(one.status, 0) << one.output;
  for (const auto& [name, flags, nccl] : std::vector<std::tuple<std::string, std::string, bool>>{
           {"gpu_pp2_v", " --parallel.pp=2 --parallel.schedule=dualpipev", false},
           {"gpu_pp2_1f1b", " --parallel.pp=2 --parallel.schedule=1f1b", false},
           {"gpu_pp2_v_nccl", " --parallel.pp=2 --parallel.schedule=dualpipev", true},
           {"gpu_pp2_1f1b_nccl", " --parallel.pp=2 --parallel.schedule=1f1b", true}}) {
    SCOPED_TRACE(name);
    if (nccl) setenv("MOETRAIN_PIPELINE_TRANSPORT", "nccl", 1);
    Result r = launch(2, train_args(name, 1, gpu + flags));
    unsetenv("MOETRAIN_PIPELINE_TRANSPORT");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find(nccl ? "pipeline: messages over NCCL" : "pipeline: messages copied into the peers' memory"),
              std::string::npos) << r.output;
    expect_same_run("gpu_one", name, 2e-2);
  }
}

}  // namespace
}  // namespace moetrain
