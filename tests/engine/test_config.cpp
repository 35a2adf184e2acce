// Tests of the declarative config (config.h), the run config (run_config.h) and the
// Qwen3-MoE model config (HF config.json loading, validation, is_moe_layer), and the GPU a
// launched rank takes.
#include <gtest/gtest.h>

#include "test_util.h"
#include <unistd.h>

#include <filesystem>
#include <fstream>
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
  EXPECT_EQ(cfg.model.model_type, "qwen3_moe");
}

TEST(RunConfig, LoadOverridePrintRoundTrip) {
  TempDir dir;
  std::string path = dir.file("run.toml", kRunToml);
  RunConfig cfg = RunConfig::load(path, {"training.steps=100", "--optimizer.lr=2e-3", "data.paths=c.txt,d",
                                         "metrics.progress=false", "model.mlp_only_layers=[0]"});
  EXPECT_EQ(cfg.model.hidden_size, 64);
  EXPECT_EQ(cfg.model.num_experts, 4);
  EXPECT_EQ(cfg.training.steps, 100);
  EXPECT_EQ(cfg.training.seq_len, 32);
  EXPECT_EQ(cfg.optimizer.lr, 2e-3);
  EXPECT_EQ(cfg.optimizer.warmup_steps, 5);
  EXPECT_EQ(cfg.data.paths, (std::vector<std::string>{"c.txt", "d"}));
  EXPECT_FALSE(cfg.metrics.progress);
  EXPECT_EQ(cfg.model.mlp_only_layers, (std::vector<int64_t>{0}));

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
  e = error_of([&] { RunConfig::load(dir.file("b.toml", "[fault_tolerance]\nreplicas = 1\n"), {}); });
  EXPECT_NE(e.find("unknown section [fault_tolerance] (known sections: model, parallel"), std::string::npos) << e;
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
  EXPECT_NE(err({"parallel.cp=2"}).find("[parallel].cp must be 1, got 2: context parallelism is not in this build yet"),
            std::string::npos);
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
  EXPECT_NE(err({"model.model_type=llama"}).find("[model].model_type must be one of qwen3_moe"), std::string::npos);
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
  EXPECT_NE(e.find(p + ": invalid JSON"), std::string::npos) << e;
  std::string missing = (dir.path() / "none.json").string();
  EXPECT_NE(error_of([&] { c.load_hf_json(missing); }).find(missing), std::string::npos);
}

TEST(Qwen3MoeConfig, ConfigJsonInToml) {
  TempDir dir;
  dir.file("config.json", kHfJson);
  // Relative to the TOML file's folder; the TOML's own [model] keys win over the JSON.
  std::string path = dir.file("run.toml", "[model]\nconfig_json = \"config.json\"\nnum_experts_per_tok = 2\n");
  RunConfig cfg = RunConfig::load(path, {"model.num_hidden_layers=2"});
  EXPECT_EQ(cfg.model.hidden_size, 96);
  EXPECT_EQ(cfg.model.num_experts, 16);
  EXPECT_EQ(cfg.model.num_experts_per_tok, 2);
  EXPECT_EQ(cfg.model.num_hidden_layers, 2);
  EXPECT_EQ(fs::path(cfg.model.config_json), fs::absolute(dir.path() / "config.json"));
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
