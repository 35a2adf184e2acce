// Tests of the declarative config (config.h), the run config (run_config.h) and the
// Qwen3-MoE model config (HF config.json loading, validation, is_moe_layer), and the GPU a
// launched rank takes.
#include <gtest/gtest.h>

#include "test_util.h"
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "core/error.h"
#include "engine/config.h"
#include "engine/models/qwen3_moe_config.h"
#include "engine/parallel/parallel_context.h"
#include "engine/run_config.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

// A fresh temporary folder per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            fmt::format("moetrain_cfg_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name, const std::string& text) const {
    std::string p = (path_ / name).string();
    std::ofstream(p) << text;
    return p;
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

using moetrain::testing::error_of;

const char* kRunToml = R"(
[model]
hidden_size = 64
num_experts = 4

[training]
steps = 50
seq_len = 32

[optimizer]
lr = 1e-3
warmup_steps = 5

[data]
paths = ["a.txt", "b"]

[metrics]
dir = "runs/x"
)";

struct Small {
  int64_t n = 3;
  double x = 0.5;
  bool flag = false;
  std::string name = "abc";
  std::vector<int64_t> ids = {1, 2};
  std::vector<std::string> words = {"a"};
  void describe(ConfigFields& f) {
    f.add("n", &n, "an int", positive(&n));
    f.add("x", &x, "a double", in_range(&x, 0, 1));
    f.add("flag", &flag, "a bool");
    f.add("name", &name, "a string", one_of(&name, {"abc", "def"}));
    f.add("ids", &ids, "ints");
    f.add("words", &words, "strings");
  }
};

}  // namespace

TEST(ConfigFields, ClosestMatch) {
  std::vector<std::string> keys = {"steps", "seq_len", "micro_batch_size", "warmup_steps"};
  EXPECT_EQ(closest_match("stesp", keys), "steps");
  EXPECT_EQ(closest_match("micro_batchsize", keys), "micro_batch_size");
  EXPECT_EQ(closest_match("warmup", keys), std::nullopt);
  EXPECT_EQ(closest_match("completely_different", keys), std::nullopt);
}

TEST(ConfigFields, LoadSetPrint) {
  Small s;
  ConfigFields f("small");
  s.describe(f);
  toml::table t = toml::parse("n = 7\nx = 1\nflag = true\nname = \"def\"\nids = [4, 5, 6]\nwords = [\"p\", \"q\"]\n");
  f.load(t, "t.toml");
  EXPECT_EQ(s.n, 7);
  EXPECT_EQ(s.x, 1.0);  // an integer where a double is expected is fine
  EXPECT_TRUE(s.flag);
  EXPECT_EQ(s.name, "def");
  EXPECT_EQ(s.ids, (std::vector<int64_t>{4, 5, 6}));
  EXPECT_EQ(s.words, (std::vector<std::string>{"p", "q"}));
  f.validate("t.toml");

  f.set_from_string("n", "12", "cli");
  f.set_from_string("x", "2.5e-1", "cli");
  f.set_from_string("flag", "false", "cli");
  f.set_from_string("name", "\"abc\"", "cli");
  f.set_from_string("ids", "[1, 2]", "cli");
  EXPECT_EQ(s.ids, (std::vector<int64_t>{1, 2}));
  f.set_from_string("ids", "7,8,9", "cli");
  EXPECT_EQ(s.ids, (std::vector<int64_t>{7, 8, 9}));
  f.set_from_string("ids", "[]", "cli");
  EXPECT_TRUE(s.ids.empty());
  f.set_from_string("words", "x, 'y,z'", "cli");
  EXPECT_EQ(s.words, (std::vector<std::string>{"x", "y,z"}));
  EXPECT_EQ(s.n, 12);
  EXPECT_EQ(s.x, 0.25);
  EXPECT_FALSE(s.flag);
  EXPECT_EQ(s.name, "abc");

  EXPECT_EQ(f.to_toml(),
            "n = 12\nx = 0.25\nflag = false\nname = \"abc\"\nids = []\nwords = [\"x\", \"y,z\"]\n");
  // What to_toml prints loads back to the same values.
  Small s2;
  ConfigFields f2("small");
  s2.describe(f2);
  f2.load(toml::parse(f.to_toml()), "printed");
  EXPECT_EQ(f2.to_toml(), f.to_toml());
}

TEST(ConfigFields, Errors) {
  Small s;
  ConfigFields f("small");
  s.describe(f);
  std::string e = error_of([&] { f.load(toml::parse("n = \"seven\""), "t.toml"); });
  EXPECT_NE(e.find("t.toml:1:"), std::string::npos) << e;
  EXPECT_NE(e.find("[small].n expects an integer, got string"), std::string::npos) << e;

  e = error_of([&] { f.load(toml::parse("n = 1.5"), "t.toml"); });
  EXPECT_NE(e.find("[small].n expects an integer, got float"), std::string::npos) << e;
  e = error_of([&] { f.load(toml::parse("ids = [1, \"2\"]"), "t.toml"); });
  EXPECT_NE(e.find("[small].ids expects a list of integers"), std::string::npos) << e;
  e = error_of([&] { f.load(toml::parse("flg = true"), "t.toml"); });
  EXPECT_NE(e.find("unknown key [small].flg (did you mean 'flag'?)"), std::string::npos) << e;

  e = error_of([&] { f.set_from_string("n", "abc", "command line"); });
  EXPECT_EQ(e, "command line: [small].n expects an integer, got 'abc'");
  e = error_of([&] { f.set_from_string("flag", "yes", "command line"); });
  EXPECT_NE(e.find("expects a boolean"), std::string::npos) << e;
  e = error_of([&] { f.set_from_string("x", "0.5x", "command line"); });
  EXPECT_NE(e.find("expects a number"), std::string::npos) << e;
  e = error_of([&] { f.set_from_string("ids", "1,b", "command line"); });
  EXPECT_NE(e.find("expects a list of integers"), std::string::npos) << e;
  e = error_of([&] { f.set_from_string("nn", "1", "command line"); });
  EXPECT_NE(e.find("unknown key [small].nn (did you mean 'n'?)"), std::string::npos) << e;

  s.n = 0;
  EXPECT_EQ(error_of([&] { f.validate("t.toml"); }), "t.toml: [small].n must be > 0, got 0");
  s.n = 1;
  s.x = 1.5;
  EXPECT_EQ(error_of([&] { f.validate("t.toml"); }), "t.toml: [small].x must be in [0, 1], got 1.5");
  s.x = 0.5;
  s.name = "dfe";
  e = error_of([&] { f.validate("t.toml"); });
  EXPECT_EQ(e, "t.toml: [small].name must be one of abc, def, got 'dfe' (did you mean 'def'?)");
}

TEST(ConfigFields, Checks) {
  double d = -0.001;
  EXPECT_EQ(*positive(&d)(), "must be > 0, got -0.001");
  EXPECT_EQ(*non_negative(&d)(), "must be >= 0, got -0.001");
  d = 0;
  EXPECT_FALSE(non_negative(&d)());
  int64_t i = -1;
  EXPECT_EQ(*non_negative(&i)(), "must be >= 0, got -1");
  i = 5;
  EXPECT_FALSE(positive(&i)());
}

TEST(RunConfig, DefaultsValidate) {
  // The defaults of every section pass validation as they are.
  TempDir dir;
  RunConfig cfg = RunConfig::load(dir.file("empty.toml", ""), {});
  EXPECT_EQ(cfg.training.steps, TrainingConfig{}.steps);
  EXPECT_EQ(cfg.optimizer.schedule, "cosine");
  EXPECT_EQ(cfg.model->model_type, "qwen3_moe");
}

TEST(RunConfig, ShardWeightsTakesAutoOrABooleanOfEitherSpelling) {
  TempDir dir;
  EXPECT_EQ(RunConfig::load(dir.file("a.toml", ""), {}).parallel.shard_weights, "auto");
  EXPECT_EQ(RunConfig::load(dir.file("b.toml", "[parallel]\nshard_weights = false\n"), {}).parallel.shard_weights,
            "false");
  EXPECT_EQ(RunConfig::load(dir.file("c.toml", "[parallel]\nshard_weights = \"true\"\n"), {}).parallel.shard_weights,
            "true");
  EXPECT_EQ(RunConfig::load(dir.file("d.toml", ""), {"parallel.shard_weights=true"}).parallel.shard_weights, "true");
  const std::string e = error_of([&] { RunConfig::load(dir.file("e.toml", "[parallel]\nshard_weights = \"maybe\"\n"), {}); });
  EXPECT_NE(e.find("[parallel].shard_weights"), std::string::npos) << e;
  EXPECT_NE(e.find("maybe"), std::string::npos) << e;
}

TEST(RunConfig, FallbackLayoutsApplyInOrderToTheWorldTheLayoutDoesNotFit) {
  TempDir dir;
  RunConfig cfg = RunConfig::load(dir.file("f.toml", "[parallel]\nep = 4\nfallbacks = [\"ep=2\", \"pp=1 ep=1\"]\n"), {});
  EXPECT_EQ(cfg.parallel.for_world(8).ep, 4) << "the layout itself when it fits (dp 2)";
  EXPECT_EQ(cfg.parallel.for_world(2).ep, 2);
  EXPECT_EQ(cfg.parallel.for_world(1).ep, 1);
  EXPECT_EQ(cfg.parallel.for_world(2).fallbacks, cfg.parallel.fallbacks) << "a fallback keeps the list";
  // Bad entries are named at load.
  std::string e = error_of([&] { RunConfig::load(dir.file("g.toml", "[parallel]\nfallbacks = [\"ep:2\"]\n"), {}); });
  EXPECT_NE(e.find("entry 'ep:2'"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(dir.file("h.toml", "[parallel]\nfallbacks = [\"epp=2\"]\n"), {}); });
  EXPECT_NE(e.find("epp"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(dir.file("i.toml", "[parallel]\nfallbacks = [\"ep=3\"]\n"), {}); });
  EXPECT_NE(e.find("not a multiple of tp x ep = 1 x 3"), std::string::npos) << e;
  // None fits: the error lists what was tried.
  RunConfig odd = RunConfig::load(dir.file("j.toml", "[parallel]\nep = 4\nfallbacks = [\"ep=2\"]\n"), {});
  e = error_of([&] { odd.parallel.for_world(3); });
  EXPECT_NE(e.find("neither the layout nor any of its fallbacks fits 3 ranks"), std::string::npos) << e;
}

TEST(RunConfig, LoadOverridePrintRoundTrip) {
  TempDir dir;
  std::string path = dir.file("run.toml", kRunToml);
  RunConfig cfg = RunConfig::load(path, {"training.steps=100", "--optimizer.lr=2e-3", "data.paths=c.txt,d",
                                         "metrics.progress=false", "model.mlp_only_layers=[0]"});
  EXPECT_EQ(cfg.model.as<Qwen3MoeConfig>().hidden_size, 64);
  EXPECT_EQ(cfg.model.as<Qwen3MoeConfig>().num_experts, 4);
  EXPECT_EQ(cfg.training.steps, 100);
  EXPECT_EQ(cfg.training.seq_len, 32);
  EXPECT_EQ(cfg.optimizer.lr, 2e-3);
  EXPECT_EQ(cfg.optimizer.warmup_steps, 5);
  EXPECT_EQ(cfg.data.paths, (std::vector<std::string>{"c.txt", "d"}));
  EXPECT_FALSE(cfg.metrics.progress);
  EXPECT_EQ(cfg.model.as<Qwen3MoeConfig>().mlp_only_layers, (std::vector<int64_t>{0}));

  std::string printed = cfg.to_toml();
  for (const char* s : {"[model]\n", "[parallel]\n", "[training]\n", "[optimizer]\n", "[data]\n", "[metrics]\n",
                        "steps = 100\n", "lr = 0.002\n", "paths = [\"c.txt\", \"d\"]\n", "rope_theta = 10000.0\n",
                        "dp = -1\n", "progress = false\n", "mlp_only_layers = [0]\n", "eps = 1e-08\n"}) {
    EXPECT_NE(printed.find(s), std::string::npos) << s << " not in:\n" << printed;
  }
  // The printed config loads back to the same config.
  RunConfig again = RunConfig::load(dir.file("printed.toml", printed), {});
  EXPECT_EQ(again.to_toml(), printed);
}

TEST(RunConfig, ShippedConfigsLoad) {
  const fs::path dir = fs::path(MOETRAIN_SOURCE_DIR) / "configs";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "no configs/ folder";
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".toml") continue;
    SCOPED_TRACE(e.path().string());
    RunConfig cfg = RunConfig::load(e.path().string(), {});
    EXPECT_FALSE(cfg.to_toml().empty());
  }
}

TEST(RunConfig, MisspeltKey) {
  TempDir dir;
  std::string path = dir.file("run.toml", "[training]\nsteps = 10\nwarmup_step = 5\n");
  std::string e = error_of([&] { RunConfig::load(path, {}); });
  EXPECT_NE(e.find(path + ":3:"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key [training].warmup_step"), std::string::npos) << e;
  std::string path2 = dir.file("run2.toml", "[optimizer]\nwarmup_step = 5\n");
  e = error_of([&] { RunConfig::load(path2, {}); });
  EXPECT_NE(e.find("unknown key [optimizer].warmup_step (did you mean 'warmup_steps'?)"), std::string::npos) << e;
}

TEST(RunConfig, NegativeLearningRate) {
  TempDir dir;
  std::string path = dir.file("run.toml", "[optimizer]\nlr = -0.001\n");
  std::string e = error_of([&] { RunConfig::load(path, {}); });
  EXPECT_EQ(e, path + ":2:6: [optimizer].lr must be > 0, got -0.001");
  // The same value from the command line names the override.
  std::string ok = dir.file("ok.toml", "");
  e = error_of([&] { RunConfig::load(ok, {"optimizer.lr=-1e-3"}); });
  EXPECT_EQ(e, "command line override 'optimizer.lr=-1e-3': [optimizer].lr must be > 0, got -0.001");
}

TEST(RunConfig, WrongType) {
  TempDir dir;
  std::string path = dir.file("run.toml", "[training]\nsteps = \"many\"\n");
  std::string e = error_of([&] { RunConfig::load(path, {}); });
  EXPECT_NE(e.find(path + ":2:"), std::string::npos) << e;
  EXPECT_NE(e.find("[training].steps expects an integer, got string"), std::string::npos) << e;
}

TEST(RunConfig, UnknownSection) {
  TempDir dir;
  std::string e = error_of([&] { RunConfig::load(dir.file("a.toml", "[trainig]\nsteps = 1\n"), {}); });
  EXPECT_NE(e.find("unknown section [trainig] (did you mean 'training'?)"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(dir.file("b.toml", "[metric]\ndir = \"x\"\n"), {}); });
  EXPECT_NE(e.find("unknown section [metric] (did you mean 'metrics'?)"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(dir.file("b2.toml", "[fault_tolerance]\nreplicas = 1\n"), {}); });
  EXPECT_NE(e.find("[fault_tolerance]"), std::string::npos) << e;
  EXPECT_NE(e.find("replicas"), std::string::npos) << e;
  e = error_of([&] {
    RunConfig::load(dir.file("b3.toml", "[fault_tolerance]\nlighthouse = \"h:1\"\nreplica_id = 2\nreplica_groups = 2\n"), {});
  });
  EXPECT_NE(e.find("[fault_tolerance].replica_id (2) must be below [fault_tolerance].replica_groups (2)"),
            std::string::npos) << e;
  e = error_of([&] {
    RunConfig::load(dir.file("b4.toml", "[parallel]\ndp_replicate = 2\n[fault_tolerance]\nlighthouse = \"h:1\"\n"), {});
  });
  EXPECT_NE(e.find("[parallel].dp_replicate = 2 with [fault_tolerance]"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(dir.file("c.toml", "steps = 5\n"), {}); });
  EXPECT_NE(e.find("unknown section [steps]"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(dir.file("d.toml", "training = 5\n"), {}); });
  EXPECT_NE(e.find("[training] must be a section"), std::string::npos) << e;
}

TEST(RunConfig, FileErrors) {
  TempDir dir;
  std::string missing = (dir.path() / "nope.toml").string();
  std::string e = error_of([&] { RunConfig::load(missing, {}); });
  EXPECT_NE(e.find(missing), std::string::npos) << e;
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
  std::string bad = dir.file("bad.toml", "[training]\nsteps = = 3\n");
  e = error_of([&] { RunConfig::load(bad, {}); });
  EXPECT_NE(e.find(bad + ":2:"), std::string::npos) << e;
  EXPECT_NE(e.find("TOML parse error"), std::string::npos) << e;
}

TEST(RunConfig, OverrideErrors) {
  TempDir dir;
  std::string path = dir.file("run.toml", "");
  std::string e = error_of([&] { RunConfig::load(path, {"steps=5"}); });
  EXPECT_NE(e.find("command line"), std::string::npos) << e;
  EXPECT_NE(e.find("'steps=5' is not of the form section.key=value"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(path, {"training.steps"}); });
  EXPECT_NE(e.find("'training.steps' is not of the form"), std::string::npos) << e;
  e = error_of([&] { RunConfig::load(path, {"trainin.steps=5"}); });
  EXPECT_NE(e.find("command line override 'trainin.steps=5': unknown section [trainin] (did you mean 'training'?)"),
            std::string::npos)
      << e;
  e = error_of([&] { RunConfig::load(path, {"training.stesp=5"}); });
  EXPECT_EQ(e, "command line override 'training.stesp=5': unknown key [training].stesp (did you mean 'steps'?)");
  e = error_of([&] { RunConfig::load(path, {"training.steps=ten"}); });
  EXPECT_EQ(e, "command line override 'training.steps=ten': [training].steps expects an integer, got 'ten'");
}

TEST(RunConfig, SectionChecks) {
  TempDir dir;
  std::string path = dir.file("run.toml", "");
  auto err = [&](std::vector<std::string> o) { return error_of([&] { RunConfig::load(path, o); }); };
  EXPECT_NE(err({"parallel.cp=2", "training.seq_len=30"}).find("must be a multiple of 2 x [parallel].cp (4)"),
            std::string::npos);
  EXPECT_EQ(err({"parallel.cp=2", "training.device=cuda", "parallel.pp=2"}), "") << "cp on GPUs and in pipelines";
  const std::string dsv3 = std::string(MOETRAIN_SOURCE_DIR) + "/configs/dsv3-mla-tiny.toml";
  for (const char* device : {"training.device=cpu", "training.device=cuda"}) {
    EXPECT_EQ(error_of([&] { RunConfig::load(dsv3, {"parallel.cp=2", device, "model.seq_aux_loss_coef=0.01"}); }), "")
        << "the sequence-wise balance loss under cp, " << device;
  }
  EXPECT_NE(err({"parallel.cp=0"}).find("[parallel].cp must be"), std::string::npos);
  EXPECT_NE(err({"parallel.dp=0"}).find("[parallel].dp must be -1 (inferred) or >= 1, got 0"), std::string::npos);
  EXPECT_NE(err({"parallel.ep=0"}).find("[parallel].ep must be"), std::string::npos);
  EXPECT_NE(err({"optimizer.beta2=1"}).find("[optimizer].beta2 must be in [0, 1), got 1"), std::string::npos);
  EXPECT_NE(err({"optimizer.min_lr=-1"}).find("[optimizer].min_lr must be >= 0"), std::string::npos);
  EXPECT_NE(err({"optimizer.overlap_sms=4097"}).find("[optimizer].overlap_sms must be in [0, 4096], got 4097"),
            std::string::npos);
  EXPECT_NE(err({"optimizer.schedule=cosin"}).find("did you mean 'cosine'"), std::string::npos);
  EXPECT_NE(err({"training.device=gpu"}).find("[training].device must be one of cpu, cuda"), std::string::npos);
  EXPECT_NE(err({"data.val_fraction=0"}).find("[data].val_fraction must be in (0, 1), got 0"), std::string::npos);
  EXPECT_NE(err({"data.tokenizer="}).find("[data].tokenizer must be \"byte\" or the path of a tokenizer.json"),
            std::string::npos);
  EXPECT_NE(err({"data.kind=shard"}).find("[data].kind must be one of text, shards, sft, got 'shard' (did you mean"),
            std::string::npos);
  EXPECT_NE(err({"data.kind=sft"}).find("[data].kind = \"sft\" needs a tokenizer with the chat template's special "
                                        "tokens"),
            std::string::npos);
  EXPECT_NE(err({"data.chat_template=llama3"}).find("[data].chat_template must be one of chatml"), std::string::npos);
  EXPECT_NE(err({"data.packing=maybe"}).find("[data].packing"), std::string::npos);
  EXPECT_NE(err({"training.steps=0"}).find("[training].steps must be > 0, got 0"), std::string::npos);
  EXPECT_NE(err({"training.steps=10", "optimizer.warmup_steps=20"})
                .find("[optimizer].warmup_steps (20) must be <= [training].steps (10)"),
            std::string::npos);
  EXPECT_NE(err({"model.num_key_value_heads=3"}).find("[model].num_attention_heads (4) must be a multiple"),
            std::string::npos);
  EXPECT_NE(err({"model.num_experts_per_tok=9"}).find("[model].num_experts_per_tok (9) must be <= [model].num_experts"),
            std::string::npos);
  EXPECT_NE(err({"model.mlp_only_layers=[4]"}).find("[model].mlp_only_layers holds layer 4"), std::string::npos);
  EXPECT_NE(err({"model.head_dim=31"}).find("[model].head_dim must be even"), std::string::npos);
  EXPECT_NE(err({"model.model_type=llama"})
                .find("command line override 'model.model_type=llama': [model].model_type \"llama\" is not a family "
                      "moetrain builds (it builds qwen3_moe, deepseek_v3)"),
            std::string::npos);
  EXPECT_NE(err({"model.vocab_size=200"}).find("byte tokenizer"), std::string::npos);
}

// An HF Qwen3-MoE config.json (the shape of Qwen3-30B-A3B's, shrunk).
const char* kHfJson = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 16,
  "hidden_act": "silu",
  "hidden_size": 96,
  "initializer_range": 0.02,
  "intermediate_size": 192,
  "max_position_embeddings": 2048,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 48,
  "norm_topk_prob": true,
  "num_attention_heads": 6,
  "num_experts": 16,
  "num_experts_per_tok": 4,
  "num_hidden_layers": 3,
  "num_key_value_heads": 2,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 512
})";

TEST(Qwen3MoeConfig, LoadHfJson) {
  TempDir dir;
  Qwen3MoeConfig c;
  c.load_hf_json(dir.file("config.json", kHfJson));
  EXPECT_EQ(c.hidden_size, 96);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.num_attention_heads, 6);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  c.validate("config.json");

  // Without head_dim, HF's default hidden_size / num_attention_heads applies.
  std::string j = kHfJson;
  j.erase(j.find("\"head_dim\": 16,"), std::string("\"head_dim\": 16,").size());
  Qwen3MoeConfig d;
  d.load_hf_json(dir.file("nohead.json", j));
  EXPECT_EQ(d.head_dim, 16);
}

// One model in the two spellings transformers has written. Every value differs from
// moetrain's default and from transformers' (booleans: from moetrain's, and the test below
// checks that an omitted one takes transformers'), so a key that is not read shows.
const char* kOldSpelling = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "float32",
  "vocab_size": 1000, "hidden_size": 96, "intermediate_size": 160, "moe_intermediate_size": 40,
  "num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 24,
  "num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": false, "decoder_sparse_step": 2,
  "mlp_only_layers": [3], "rope_theta": 500000.0, "rope_scaling": null, "rms_norm_eps": 1e-05,
  "tie_word_embeddings": true, "initializer_range": 0.013, "max_position_embeddings": 3000,
  "router_aux_loss_coef": 0.004, "hidden_act": "silu", "attention_bias": false, "attention_dropout": 0.0,
  "use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 5, "use_cache": true,
  "output_router_logits": false, "bos_token_id": 151643, "eos_token_id": 151645, "transformers_version": "4.51.0"
})";
// As transformers 5.17's save_pretrained writes it (num_local_experts, rope_parameters, dtype).
const char* kNewSpelling = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "float32",
  "vocab_size": 1000, "hidden_size": 96, "intermediate_size": 160, "moe_intermediate_size": 40,
  "num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 24,
  "num_local_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": false, "decoder_sparse_step": 2,
  "mlp_only_layers": [3], "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
  "rms_norm_eps": 1e-05, "tie_word_embeddings": true, "initializer_range": 0.013,
  "max_position_embeddings": 3000, "router_aux_loss_coef": 0.004, "hidden_act": "silu",
  "attention_bias": false, "attention_dropout": 0.0, "use_sliding_window": false, "sliding_window": null,
  "use_cache": true, "output_router_logits": false, "pad_token_id": null, "bos_token_id": null,
  "eos_token_id": null, "transformers_version": "5.17.0"
})";

void expect_spelling_model(const Qwen3MoeConfig& c, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.hidden_size, 96);
  EXPECT_EQ(c.intermediate_size, 160);
  EXPECT_EQ(c.moe_intermediate_size, 40);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_EQ(c.num_attention_heads, 6);
  EXPECT_EQ(c.num_key_value_heads, 3);
  EXPECT_EQ(c.head_dim, 24);
  EXPECT_EQ(c.num_experts, 6);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, 2);
  EXPECT_EQ(c.mlp_only_layers, std::vector<int64_t>{3});
  EXPECT_EQ(c.rope_theta, 5e5);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.initializer_range, 0.013);
  EXPECT_EQ(c.max_position_embeddings, 3000);
  EXPECT_EQ(c.router_aux_loss_coef, 0.004);
  c.validate(what);
}

TEST(Qwen3MoeConfig, BothHfSpellingsGiveOneModel) {
  TempDir dir;
  Qwen3MoeConfig older, newer;
  older.load_hf_json(dir.file("old.json", kOldSpelling));
  newer.load_hf_json(dir.file("new.json", kNewSpelling));
  expect_spelling_model(older, "older spelling (num_experts, rope_theta, torch_dtype)");
  expect_spelling_model(newer, "transformers 5 spelling (num_local_experts, rope_parameters, dtype)");

  // What moetrain writes is the transformers 5 spelling, and reads back as the same model.
  const std::string written = older.to_hf_json();
  const auto j = nlohmann::json::parse(written);
  EXPECT_EQ(j.at("num_local_experts"), 6);
  EXPECT_FALSE(j.contains("num_experts"));
  EXPECT_EQ(j.at("rope_parameters").at("rope_theta"), 5e5);
  EXPECT_EQ(j.at("rope_parameters").at("rope_type"), "default");
  EXPECT_FALSE(j.contains("rope_theta"));
  EXPECT_TRUE(j.contains("dtype"));
  EXPECT_FALSE(j.contains("torch_dtype"));
  Qwen3MoeConfig back;
  back.load_hf_json(dir.file("back.json", written));
  expect_spelling_model(back, "moetrain's own config.json");
  // Qwen3's FP8 releases: quantization_config (quant_method "fp8") tells how the weights are
  // stored, not the model.
  auto fp8 = nlohmann::json::parse(kNewSpelling);
  fp8["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                {"weight_block_size", {128, 128}}, {"modules_to_not_convert", {"lm_head"}}};
  Qwen3MoeConfig quantized;
  quantized.load_hf_json(dir.file("fp8.json", fp8.dump()));
  expect_spelling_model(quantized, "an FP8 folder's config.json");
}

// A key the file omits takes transformers' default, not moetrain's: the two differ in every
// field (moetrain's describe a tiny model), so an omitted key that kept moetrain's shows.
TEST(Qwen3MoeConfig, OmittedHfKeysTakeTransformersDefaults) {
  TempDir dir;
  Qwen3MoeConfig c;  // moetrain's defaults to start with
  c.router_z_loss_coef = 0.25;  // moetrain's own key: not an HF key, kept
  c.load_hf_json(dir.file("config.json", R"({"model_type": "qwen3_moe"})"));
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 64);  // hidden_size / num_attention_heads
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.initializer_range, 0.02);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.router_z_loss_coef, 0.25);
  // null means the default too (head_dim null: hidden / heads; mlp_only_layers null: none).
  Qwen3MoeConfig d;
  d.load_hf_json(dir.file("nulls.json", R"({"model_type": "qwen3_moe", "hidden_size": 96, "num_attention_heads": 4,
                                             "head_dim": null, "mlp_only_layers": null})"));
  EXPECT_EQ(d.head_dim, 24);
  EXPECT_TRUE(d.mlp_only_layers.empty());
}

TEST(Qwen3MoeConfig, UnknownOrUnsupportedHfKeysAreErrors) {
  TempDir dir;
  auto error_with = [&](const std::string& from, const std::string& to) {
    std::string j = kNewSpelling;
    const size_t at = j.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    j.replace(at, from.size(), to);
    const std::string p = dir.file("config.json", j);
    Qwen3MoeConfig c;
    const std::string e = error_of([&] { c.load_hf_json(p); });
    EXPECT_NE(e.find(p), std::string::npos) << e;
    return e;
  };
  // A key nobody told moetrain about: named with its value, not skipped.
  std::string e = error_with("\"use_cache\": true", "\"use_cache\": true, \"moe_layer_freq\": 2");
  EXPECT_NE(e.find("unknown key \"moe_layer_freq\" = 2"), std::string::npos) << e;
  // A quantization other than DeepSeek's FP8 (whose weights `moetrain convert` dequantizes).
  e = error_with("\"use_cache\": true", "\"use_cache\": true, \"quantization_config\": {\"quant_method\": \"gptq\"}");
  EXPECT_NE(e.find("\"quantization_config\" = {\"quant_method\":\"gptq\"}"), std::string::npos) << e;
  // Two spellings that disagree.
  e = error_with("\"num_local_experts\": 6", "\"num_local_experts\": 6, \"num_experts\": 8");
  EXPECT_NE(e.find("keys \"num_experts\" = 8 and \"num_local_experts\" = 6 are two spellings"), std::string::npos) << e;
  e = error_with("\"hidden_act\"", "\"rope_theta\": 10000, \"hidden_act\"");
  EXPECT_NE(e.find("disagree"), std::string::npos) << e;
  // RoPE variants moetrain does not implement, in either spelling.
  e = error_with("\"rope_type\": \"default\"", "\"rope_type\": \"yarn\", \"factor\": 4.0");
  EXPECT_NE(e.find("unsupported architecture key \"rope_parameters\""), std::string::npos) << e;
  e = error_with("\"rope_type\": \"default\"", "\"rope_type\": \"default\", \"partial_rotary_factor\": 0.5");
  EXPECT_NE(e.find("\"partial_rotary_factor\""), std::string::npos) << e;
  e = error_with("\"hidden_act\"", "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}, \"hidden_act\"");
  EXPECT_NE(e.find("unsupported architecture key \"rope_scaling\""), std::string::npos) << e;
  e = error_with("\"attention_dropout\": 0.0", "\"attention_dropout\": 0.1");
  EXPECT_NE(e.find("unsupported architecture key \"attention_dropout\" = 0.1"), std::string::npos) << e;
  e = error_with("\"use_cache\": true", "\"use_cache\": true, \"layer_types\": [\"full_attention\", "
                 "\"sliding_attention\"]");
  EXPECT_NE(e.find("\"layer_types\""), std::string::npos) << e;
  e = error_with("\"model_type\": \"qwen3_moe\", ", "");
  EXPECT_NE(e.find("no \"model_type\" key"), std::string::npos) << e;
  e = error_with("\"model_type\": \"qwen3_moe\"", "\"model_type\": \"qwen2_moe\"");
  EXPECT_NE(e.find("\"model_type\" = \"qwen2_moe\""), std::string::npos) << e;
  e = error_with("\"dtype\": \"float32\"", "\"dtype\": \"float32\", \"torch_dtype\": \"bfloat16\"");
  EXPECT_NE(e.find("disagree"), std::string::npos) << e;
  // The harmless ones load: generation defaults, auto_map, token ids, an all-full layer_types.
  std::string j = kNewSpelling;
  j.replace(j.find("\"use_cache\": true"), 17,
            "\"use_cache\": true, \"temperature\": 0.7, \"auto_map\": {}, \"sep_token_id\": 3, "
            "\"layer_types\": [\"full_attention\", \"full_attention\"], \"is_encoder_decoder\": false, "
            "\"pruned_heads\": {}, \"max_window_layers\": 28");
  Qwen3MoeConfig ok;
  ok.load_hf_json(dir.file("ok.json", j));
  expect_spelling_model(ok, "with harmless keys");
}

TEST(Qwen3MoeConfig, HfJsonErrors) {
  TempDir dir;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string j = kHfJson;
    j.replace(j.find(from), from.size(), to);
    return dir.file("config.json", j);
  };
  Qwen3MoeConfig c;
  std::string p = with("\"rope_scaling\": null", R"("rope_scaling": {"type": "yarn", "factor": 4.0})");
  std::string e = error_of([&] { c.load_hf_json(p); });
  EXPECT_NE(e.find(p), std::string::npos) << e;
  EXPECT_NE(e.find("unsupported architecture key \"rope_scaling\""), std::string::npos) << e;

  p = with("\"attention_bias\": false", "\"attention_bias\": true");
  EXPECT_NE(error_of([&] { c.load_hf_json(p); }).find("\"attention_bias\""), std::string::npos);
  p = with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"");
  EXPECT_NE(error_of([&] { c.load_hf_json(p); }).find("\"hidden_act\""), std::string::npos);
  p = with("\"use_sliding_window\": false", "\"use_sliding_window\": true");
  EXPECT_NE(error_of([&] { c.load_hf_json(p); }).find("\"use_sliding_window\""), std::string::npos);
  p = with("\"hidden_size\": 96", "\"hidden_size\": \"96\"");
  e = error_of([&] { c.load_hf_json(p); });
  EXPECT_NE(e.find("key \"hidden_size\" expects an integer, got string"), std::string::npos) << e;
  p = dir.file("broken.json", "{\"hidden_size\": 96,");
  e = error_of([&] { c.load_hf_json(p); });
  EXPECT_NE(e.find(p + ": not valid JSON"), std::string::npos) << e;
  // Found by fuzz/fuzz_hf_config: a number too large for a double is nlohmann's
  // out_of_range, not its parse_error; it escaped as an uncaught exception.
  p = dir.file("huge.json", "{\"hidden_size\": 8E888888888888888888}");
  e = error_of([&] { c.load_hf_json(p); });
  EXPECT_NE(e.find(p + ": not valid JSON"), std::string::npos) << e;
  std::string missing = (dir.path() / "none.json").string();
  EXPECT_NE(error_of([&] { c.load_hf_json(missing); }).find(missing), std::string::npos);
}

TEST(Qwen3MoeConfig, ConfigJsonInToml) {
  TempDir dir;
  dir.file("config.json", kHfJson);
  // Relative to the TOML file's folder; the TOML's own [model] keys win over the JSON.
  std::string path = dir.file("run.toml", "[model]\nconfig_json = \"config.json\"\nnum_experts_per_tok = 2\n");
  RunConfig cfg = RunConfig::load(path, {"model.num_hidden_layers=2"});
  EXPECT_EQ(cfg.model.as<Qwen3MoeConfig>().hidden_size, 96);
  EXPECT_EQ(cfg.model.as<Qwen3MoeConfig>().num_experts, 16);
  EXPECT_EQ(cfg.model.as<Qwen3MoeConfig>().num_experts_per_tok, 2);
  EXPECT_EQ(cfg.model.as<Qwen3MoeConfig>().num_hidden_layers, 2);
  EXPECT_EQ(fs::path(cfg.model->config_json), fs::absolute(dir.path() / "config.json"));
}

TEST(Qwen3MoeConfig, IsMoeLayer) {
  Qwen3MoeConfig c;
  c.num_hidden_layers = 6;
  EXPECT_TRUE(c.is_moe_layer(0));
  c.decoder_sparse_step = 2;
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  c.mlp_only_layers = {3};
  EXPECT_FALSE(c.is_moe_layer(3));
  EXPECT_TRUE(c.is_moe_layer(5));
  c.num_experts = 0;
  EXPECT_FALSE(c.is_moe_layer(5));
}

// torchrun and `moetrain launch` show every rank all the GPUs (rank k takes GPU k); srun
// --gpus-per-task shows each rank only its own (GPU 0 in the process).
TEST(ParallelContext, EachLocalRankFindsItsGpu) {
  EXPECT_EQ(gpu_for_local_rank(0, 1), 0);
  EXPECT_EQ(gpu_for_local_rank(5, 8), 5);
  EXPECT_EQ(gpu_for_local_rank(7, 8), 7);
  EXPECT_EQ(gpu_for_local_rank(3, 1), 0);
  const std::string e = moetrain::testing::error_of([] { gpu_for_local_rank(2, 2); });
  EXPECT_NE(e.find("LOCAL_RANK 2 but this process sees 2 GPUs"), std::string::npos) << e;
  EXPECT_NE(moetrain::testing::error_of([] { gpu_for_local_rank(0, 0); }), "");
}
