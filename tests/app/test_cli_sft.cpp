// `moetrain train` on real data kinds, end to end: supervised fine-tuning on a generated chat
// set from a converted (Hugging Face) checkpoint, where the assistant-only loss falls; exact
// resume for the "sft" and "shards" kinds (the loader position travels in the checkpoint);
// bad input stops with one line naming file and line or the config key.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "cli_run.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/scratch_dir.h"
#include "engine/tiny_bpe.h"

namespace {

using Result = moetrain::testing::CliResult;
inline Result run(const std::string& args) { return moetrain::testing::run_moetrain(args); }

std::vector<nlohmann::json> metrics(const std::string& dir) { return moetrain::testing::read_metrics(dir); }

// loss and grad_norm by step (the last line of a step wins: a resumed run may repeat steps).
std::map<int64_t, std::pair<double, double>> by_step(const std::vector<nlohmann::json>& m) {
  std::map<int64_t, std::pair<double, double>> out;
  for (const auto& j : m) out[j["step"].get<int64_t>()] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  return out;
}

void expect_one_line_error(const Result& r, const std::string& needle) {
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("moetrain: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
}

// Colours of a few named things: the assistant's answers follow from the question, so a
// model that learns the chats predicts most assistant tokens.
const char* const kThings[] = {"sky", "grass", "snow", "coal", "blood", "sun"};
const char* const kColours[] = {"blue", "green", "white", "black", "red", "yellow"};

class SftCli : public ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    tokenizer_ = tiny_bpe::write(path("tokenizer.json"), tiny_bpe::tokenizer_json());
    std::string chats, text;
    for (int i = 0; i < 240; ++i) {
      const int k = i % 6;
      nlohmann::json messages = nlohmann::json::array();
      if (i % 3 == 0) messages.push_back({{"role", "system"}, {"content", "You answer in one sentence."}});
      messages.push_back(
          {{"role", "user"},
           {"content", std::string("What colour is the ") + kThings[k] + "? (" + std::to_string(i) + ")"}});
      messages.push_back(
          {{"role", "assistant"}, {"content", std::string("The ") + kThings[k] + " is " + kColours[k] + "."}});
      chats += nlohmann::json{{"messages", messages}}.dump() + "\n";
      text += std::string("The ") + kThings[(i * 5) % 6] + " and the thing number " + std::to_string(i) + ".\n%\n";
    }
    chats_ = file("chats/train.jsonl", chats);
    corpus_ = file("corpus.txt", text);
  }

  // The tiny model of configs/tiny.toml with this test's tokenizer, shrunk to seconds.
  std::string common(const std::string& metrics_dir, const std::string& config_file = "tiny.toml") const {
    return "--config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + config_file + " --data.tokenizer=" + tokenizer_ +
           " --model.vocab_size=320 --metrics.progress=false --training.sample_tokens=8 --metrics.dir=" +
           path(metrics_dir) + " ";
  }
  std::string sft(const std::string& metrics_dir, const std::string& extra = "") const {
    return "train " + common(metrics_dir) + "--data.kind=sft --data.paths=" + path("chats") +
           " --data.val_fraction=0.1 --training.seq_len=128 --training.micro_batch_size=2 --training.eval_every=10 "
           "--training.eval_batches=4 --optimizer.warmup_steps=3 " +
           extra;
  }

  void fine_tune_a_converted_model(const std::string& config_file);

  std::string tokenizer_, chats_, corpus_;
};

// A base model of `config` (configs/<config>) pretrained for a few steps, exported to Hugging
// Face and fine-tuned from that folder on the chats: the assistant-only loss must halve.
void SftCli::fine_tune_a_converted_model(const std::string& config_file) {
  // A base model pretrained for a few steps on plain text with the same tokenizer, saved,
  // and exported as a Hugging Face folder.
  Result r = run("train " + common("base", config_file) + "--data.paths=" + corpus_ +
                 " --training.steps=4 --training.seq_len=64 --training.micro_batch_size=4 "
                 "--optimizer.warmup_steps=1 --checkpoint.save_final=true");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("convert " + path("base/checkpoints") + " " + path("hf"));
  ASSERT_EQ(r.status, 0) << r.output;

  // Fine-tuning from it with a config of its own: no [model] section, the shape comes from
  // the folder's config.json.
  const std::string config =
      file("sft.toml",
           "[training]\nsteps = 40\nseq_len = 128\nmicro_batch_size = 2\n"
           "eval_every = 10\neval_batches = 4\nsample_tokens = 8\n\n"
           "[optimizer]\nlr = 3e-3\nwarmup_steps = 3\n\n"
           "[data]\nkind = \"sft\"\ntokenizer = \"" +
               tokenizer_ + "\"\npaths = [\"" + path("chats") +
               "\"]\nval_fraction = 0.1\nchat_template = \"chatml\"\n"
               "packing = true\n\n[checkpoint]\ninit_from = \"" +
               path("hf") + "\"\nsave_final = false\n\n[metrics]\ndir = \"" + path("sft") + "\"\nprogress = false\n");
  r = run("train --config " + config);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("weights from " + path("hf") + " (Hugging Face folder)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("240 conversations in 1 files"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("were cut"), std::string::npos) << r.output;
  const auto m = metrics(path("sft"));
  ASSERT_EQ(m.size(), 40u);
  auto mean_loss = [&](size_t from, size_t to) {
    double s = 0;
    for (size_t i = from; i < to; ++i) s += m[i]["loss"].get<double>();
    return s / static_cast<double>(to - from);
  };
  const double first = m[0]["loss"].get<double>(), last = mean_loss(35, 40);
  double first_val = 0;
  {
    // The step-0 validation loss is logged; the last one is on the final metrics line.
    const auto at = r.output.find("step 0 | val loss ");
    ASSERT_NE(at, std::string::npos) << r.output;
    first_val = std::stod(r.output.substr(at + 18));
  }
  const double last_val = m.back()["val_loss"].get<double>();
  std::printf("SFT assistant-only loss: train step 1 %.3f -> steps 36-40 mean %.3f; validation %.3f -> %.3f\n", first,
              last, first_val, last_val);
  EXPECT_LT(last, 0.5 * first);
  EXPECT_LT(last_val, 0.5 * first_val);
}

TEST_F(SftCli, FineTuningAConvertedModelLowersTheAssistantLoss) { fine_tune_a_converted_model("tiny.toml"); }

TEST_F(SftCli, FineTuningAConvertedDeepseekV3LowersTheAssistantLoss) {
  fine_tune_a_converted_model("dsv3-tiny.toml");
}

TEST_F(SftCli, SftResumesExactlyWhereItStopped) {
  const std::string ck = "--training.steps=6 --checkpoint.every=2 --checkpoint.save_final=true --checkpoint.keep=0";
  ASSERT_EQ(run(sft("straight", ck)).status, 0);
  Result first = run(sft("split", ck + " --training.stop_after_steps=3"));
  ASSERT_EQ(first.status, 0) << first.output;
  Result second = run(sft("split", ck));
  ASSERT_EQ(second.status, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  const auto a = by_step(metrics(path("straight"))), b = by_step(metrics(path("split")));
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a, b);
  const nlohmann::json st = moetrain::CheckpointReader(path("split/checkpoints/step-00000006")).trainer_state();
  EXPECT_TRUE(st["data"]["train_position"].contains("row")) << st["data"].dump();
  EXPECT_EQ(st["data"], moetrain::CheckpointReader(path("straight/checkpoints/step-00000006")).trainer_state()["data"]);
}

// Context and tensor parallelism over packed conversations (CP: segments cut with the tokens,
// each chunk's documents masked by place; TP: every rank attends over every row for its heads
// and counts the loss of its slice of the rows, most of whose targets are masked):
// `moetrain launch -n 2 -- train --parallel.cp=2` (and tp=2) on the chats against one process,
// every step's loss and gradient norm within 1e-5 relative.
TEST_F(SftCli, ContextAndTensorParallelPackedConversationsMatchOneProcess) {
  const std::string steps = "--training.steps=4 --training.sample_tokens=0 --optimizer.eps=1e-6 --training.threads=1";
  Result one = run(sft("cp_one", steps));
  ASSERT_EQ(one.status, 0) << one.output;
  const auto a = by_step(metrics(path("cp_one")));
  ASSERT_EQ(a.size(), 4u);
  for (const auto& [name, flag, says] : {std::tuple{"cp_two", "--parallel.cp=2", "context parallelism: cp 2"},
                                         std::tuple{"tp_two", "--parallel.tp=2", "tensor parallelism: tp 2"}}) {
    SCOPED_TRACE(name);
    Result two = run("launch -n 2 -- " + sft(name, steps + " " + flag));
    ASSERT_EQ(two.status, 0) << two.output;
    EXPECT_NE(two.output.find(says), std::string::npos) << two.output;
    const auto b = by_step(metrics(path(name)));
    ASSERT_EQ(b.size(), 4u);
    for (const auto& [step, la] : a) {
      const auto& lb = b.at(step);
      EXPECT_NEAR(lb.first, la.first, 1e-5 * la.first) << "loss, step " << step;
      EXPECT_NEAR(lb.second, la.second, 1e-5 * la.second) << "grad norm, step " << step;
    }
  }
}

TEST_F(SftCli, ShardsTrainAndResumeExactly) {
  std::string jsonl;
  for (int i = 0; i < 300; ++i)
    jsonl += nlohmann::json{{"text", "the thing " + std::to_string(i) + " is her caf\xC3\xA9"}}.dump() + "\n";
  Result r = run("tokenize --tokenizer " + tokenizer_ + " --out " + path("shards") +
                 " --shard-tokens 1000 --no-progress " + file("docs.jsonl", jsonl));
  ASSERT_EQ(r.status, 0) << r.output;
  auto shards = [&](const std::string& dir, const std::string& extra) {
    return "train " + common(dir) + "--data.kind=shards --data.paths=" + path("shards") +
           " --model.vocab_size=320 --training.seq_len=32 --training.micro_batch_size=2 --training.eval_every=3 "
           "--training.eval_batches=2 --optimizer.warmup_steps=1 --training.steps=6 --checkpoint.every=2 "
           "--checkpoint.keep=0 " +
           extra;
  };
  Result straight = run(shards("straight", ""));
  ASSERT_EQ(straight.status, 0) << straight.output;
  EXPECT_NE(straight.output.find("token shards"), std::string::npos) << straight.output;
  ASSERT_EQ(run(shards("split", "--training.stop_after_steps=4")).status, 0);
  Result second = run(shards("split", ""));
  ASSERT_EQ(second.status, 0) << second.output;
  EXPECT_EQ(by_step(metrics(path("straight"))), by_step(metrics(path("split"))));
  const nlohmann::json st = moetrain::CheckpointReader(path("split/checkpoints/step-00000006")).trainer_state();
  // 6 steps of 2 sequences of 32 tokens: the next window starts at token 384.
  EXPECT_EQ(st["data"]["train_position"], (nlohmann::json{{"epoch", 0}, {"token", 384}}));

  // Shards of another tokenizer are refused, naming the shard.
  r = run("train " + common("byte") + "--data.tokenizer=byte --data.kind=shards --data.paths=" + path("shards"));
  expect_one_line_error(r, "shard-00000.bin: written with another tokenizer");
}

TEST_F(SftCli, BadInputIsNamed) {
  file("bad/chats.jsonl",
       "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
       "\"content\": \"hello\"}]}\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, \n");
  Result r = run("train " + common("bad") + "--data.kind=sft --data.paths=" + path("bad"));
  expect_one_line_error(r, path("bad/chats.jsonl") + ":2: malformed JSON line");
  file("roles/chats.jsonl", "{\"messages\": [{\"role\": \"human\", \"content\": \"hi\"}]}\n");
  r = run("train " + common("roles") + "--data.kind=sft --data.paths=" + path("roles"));
  expect_one_line_error(r, path("roles/chats.jsonl") + ":1: message 1 has unknown role \"human\"");
  r = run("train " + common("byte") + "--data.tokenizer=byte --data.kind=sft --data.paths=" + chats_);
  expect_one_line_error(r, "[data].kind = \"sft\" needs a tokenizer");
  r = run("train " + common("kind") + "--data.kind=sfx");
  expect_one_line_error(r, "[data].kind must be one of text, shards, sft, got 'sfx' (did you mean 'sft'?)");
  r = run("train " + common("empty") + "--data.kind=sft --data.paths=" + file("empty.jsonl", "\n"));
  expect_one_line_error(r, "the corpus is empty");
  // A tokenizer larger than the model's vocabulary: its ids would fall outside the embedding.
  r = run("train " + common("vocab") + "--data.paths=" + corpus_ + " --model.vocab_size=257");
  expect_one_line_error(r, "[model].vocab_size = 257 is smaller than the vocabulary of [data].tokenizer");
}

}  // namespace
