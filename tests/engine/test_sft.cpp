// Tests of supervised fine-tuning data: ChatML rendering and its exact token layout, the
// assistant-only mask (-100 elsewhere), packing with segment ids and positions restarting
// per conversation, the loader contract (ranks, determinism, resume), bad input named by
// file and line, and document-confined attention through the model: a packed row gives
// the same loss and gradients as its conversations run one by one.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "engine/data/chat.h"
#include "engine/data/data_context.h"
#include "engine/data/sft_loader.h"
#include "engine/data/tokenizer_factory.h"
#include "engine/models/qwen3_moe.h"
#include "model_batches.h"
#include "engine/scratch_dir.h"
#include "engine/tiny_bpe.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace moetrain;
using Ids = std::vector<int32_t>;

namespace {

constexpr int32_t kIgnore = ops::kIgnoreIndex;

class SftTest : public ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    // Qwen's layout: no "<|im_start|>assistant" token of its own (the tiny tokenizer has one
    // to test longest-match; the test of that case writes the full file).
    nlohmann::json j = tiny_bpe::tokenizer_json();
    auto& added = j["added_tokens"];
    added.erase(std::remove_if(added.begin(), added.end(),
                               [](const nlohmann::json& t) { return t["id"] == tiny_bpe::kImStartAssistant; }),
                added.end());
    tokenizer_path_ = tiny_bpe::write(path("tokenizer.json"), j);
    tok_ = make_tokenizer(tokenizer_path_);
  }

  static std::string chat_line(const std::vector<std::pair<std::string, std::string>>& messages) {
    nlohmann::json m = nlohmann::json::array();
    for (const auto& [role, content] : messages) m.push_back({{"role", role}, {"content", content}});
    return nlohmann::json{{"messages", m}}.dump();
  }

  // n conversations "user: question i / assistant: answer i", of varied lengths.
  std::string write_chats(const std::string& name, int n) {
    std::string text;
    for (int i = 0; i < n; ++i) {
      text += chat_line({{"user", "the thing " + std::to_string(i) + std::string(i % 7, '!')},
                         {"assistant", "her caf\xC3\xA9 " + std::to_string(i * 7)}}) +
              "\n";
    }
    return file(name, text);
  }

  RunConfig sft_config(const std::vector<std::string>& paths) {
    RunConfig cfg;
    cfg.model.as<Qwen3MoeConfig>().vocab_size = 320;
    cfg.data.kind = "sft";
    cfg.data.tokenizer = tokenizer_path_;
    cfg.data.paths = paths;
    cfg.data.val_fraction = 0.2;
    cfg.training.seq_len = 48;
    cfg.training.micro_batch_size = 2;
    return cfg;
  }

  std::string tokenizer_path_;
  std::unique_ptr<Tokenizer> tok_;
};

// The example a conversation makes: inputs ids[0..n-2], targets ids[1..n-1] where trained.
void example(const ChatTokens& c, Ids& in, Ids& tg) {
  for (size_t j = 0; j + 1 < c.ids.size(); ++j) {
    in.push_back(c.ids[j]);
    tg.push_back(c.trained[j + 1] ? c.ids[j + 1] : kIgnore);
  }
}

}  // namespace

TEST_F(SftTest, ChatMlLayoutAndAssistantMask) {
  ChatMlTemplate chatml(*tok_);
  const std::vector<ChatMessage> conv = {{"user", "the thing"}, {"assistant", "her caf\xC3\xA9"}};
  std::vector<std::pair<size_t, size_t>> spans;
  EXPECT_EQ(chatml.render(conv, &spans),
            "<|im_start|>user\nthe thing<|im_end|>\n<|im_start|>assistant\nher caf\xC3\xA9<|im_end|>\n");
  ChatTokens t = chatml.tokenize(conv, "x:1");
  // <|im_start|> "u" "s" "er" "\n" "t" "he" " t" "h" "ing" <|im_end|> "\n"
  // <|im_start|> "assistant" (no merges) "\n" | "he" "r" " " "café" <|im_end|> | "\n"
  const Ids expected = {301, 'u', 's', 261, '\n', 't', 257, 256,  'h', 260, 302, '\n', 301, 'a', 's',
                        's', 'i', 's', 't', 'a',  'n', 't', '\n', 257, 'r', ' ', 271,  302, '\n'};
  EXPECT_EQ(t.ids, expected);
  std::vector<uint8_t> trained(expected.size(), 0);
  for (size_t i = 23; i <= 27; ++i) trained[i] = 1;  // "her café<|im_end|>"
  EXPECT_EQ(t.trained, trained);
  // Decoding gives the rendered text back.
  EXPECT_EQ(tok_->decode(t.ids), chatml.render(conv, nullptr));

  // A system message and two assistant turns: each assistant reply and its <|im_end|> trained.
  ChatTokens u = chatml.tokenize(
      {{"system", "in"}, {"user", "12"}, {"assistant", "on"}, {"user", "er"}, {"assistant", "he"}}, "x:2");
  std::string trained_text;
  for (size_t i = 0; i < u.ids.size(); ++i) {
    if (u.trained[i]) trained_text += tok_->decode(std::span<const int32_t>(&u.ids[i], 1)) + "|";
  }
  EXPECT_EQ(trained_text, "on|<|im_end|>|he|<|im_end|>|");
}

TEST_F(SftTest, LongestAddedTokenStaysUntrained) {
  // With a "<|im_start|>assistant" token (longest match wins, as in the library) the header
  // is one id, still not trained.
  auto tok = make_tokenizer(tiny_bpe::write(path("full.json"), tiny_bpe::tokenizer_json()));
  ChatTokens t = ChatMlTemplate(*tok).tokenize({{"user", "in"}, {"assistant", "on"}}, "x:1");
  const Ids expected = {301, 'u', 's', 261, '\n', 259, 302, '\n', 303, '\n', 267, 302, '\n'};
  EXPECT_EQ(t.ids, expected);
  EXPECT_EQ(t.trained, (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0}));
}

TEST_F(SftTest, PackedRowsSegmentsPositionsAndTargets) {
  ChatMlTemplate chatml(*tok_);
  std::vector<ChatTokens> convs = {chatml.tokenize({{"user", "in"}, {"assistant", "on"}}, "a"),
                                   chatml.tokenize({{"user", "the thing"}, {"assistant", "he"}}, "b"),
                                   chatml.tokenize({{"user", "er"}, {"assistant", "12 12"}}, "c")};
  auto docs = std::make_shared<ChatDocuments>();
  for (const auto& c : convs) {
    docs->ids.insert(docs->ids.end(), c.ids.begin(), c.ids.end());
    docs->trained.insert(docs->trained.end(), c.trained.begin(), c.trained.end());
    docs->offsets.push_back(static_cast<int64_t>(docs->ids.size()));
  }
  const int64_t lens[3] = {docs->length(0) - 1, docs->length(1) - 1, docs->length(2) - 1};
  const int64_t S = lens[0] + lens[1] + 4;  // room for conversations 0 and 1, not 2
  ASSERT_LT(lens[2], S);
  ASSERT_GT(lens[0] + lens[1] + lens[2], S);
  SftLoader loader(docs, 2, S, 0, /*shuffle=*/false, /*packing=*/true, tok_->eos_id());
  EXPECT_EQ(loader.rows_in_epoch(), 2);
  Batch b = loader.next();
  ASSERT_TRUE(b.segment_ids.defined());
  const Ids in = b.inputs.to_vector<int32_t>(), tg = b.targets.to_vector<int32_t>(),
            pos = b.positions.to_vector<int32_t>(), seg = b.segment_ids.to_vector<int32_t>();
  // Row 0: conversation 0 then 1, then padding; row 1: conversation 2, then padding.
  Ids want_in, want_tg, want_pos, want_seg;
  auto put = [&](int c, int32_t segment) {
    example(convs[c], want_in, want_tg);
    for (int64_t j = 0; j < lens[c]; ++j) {
      want_pos.push_back(static_cast<int32_t>(j));
      want_seg.push_back(segment);
    }
  };
  auto pad = [&](int64_t n, int32_t segment) {
    for (int64_t j = 0; j < n; ++j) {
      want_in.push_back(tok_->eos_id());
      want_tg.push_back(kIgnore);
      want_pos.push_back(static_cast<int32_t>(j));
      want_seg.push_back(segment);
    }
  };
  put(0, 0);
  put(1, 1);
  pad(S - lens[0] - lens[1], 2);
  put(2, 0);
  pad(S - lens[2], 1);
  EXPECT_EQ(in, want_in);
  EXPECT_EQ(tg, want_tg);
  EXPECT_EQ(pos, want_pos);
  EXPECT_EQ(seg, want_seg);
  // num_targets counts the trained targets only: "on" "he" and "1" "2" " " "1" "2", each
  // reply with its <|im_end|>.
  EXPECT_EQ(b.num_targets,
            static_cast<int64_t>(std::count_if(tg.begin(), tg.end(), [](int32_t t) { return t != kIgnore; })));
  EXPECT_EQ(b.num_targets, 2 + 2 + 6);

  // Without packing: one conversation per row, no segment ids.
  SftLoader single(docs, 3, S, 0, false, false, tok_->eos_id());
  Batch s = single.next();
  EXPECT_FALSE(s.segment_ids.defined());
  EXPECT_EQ(s.num_targets, b.num_targets);
  EXPECT_EQ(s.inputs.to_vector<int32_t>()[S], convs[1].ids[0]);

  // A conversation longer than a row is cut to its first S positions.
  SftLoader tiny(docs, 1, 10, 0, false, true, tok_->eos_id());
  EXPECT_EQ(tiny.truncated(), 3);
  EXPECT_EQ(tiny.next().inputs.to_vector<int32_t>(), Ids(convs[0].ids.begin(), convs[0].ids.begin() + 10));
}

TEST_F(SftTest, LoaderKeepsTheContractAndShufflesEachEpoch) {
  RunConfig cfg = sft_config({write_chats("chats.jsonl", 40)});
  ChatCorpus corpus = load_chat_corpus(cfg.data, *tok_, 2);
  auto docs = std::make_shared<const ChatDocuments>(std::move(corpus.train));
  const int32_t pad = tok_->eos_id();
  const int64_t S = cfg.training.seq_len;
  auto make = [&](int64_t mbs, int rank, int world) {
    return std::make_unique<SftLoader>(docs, mbs, S, 99, true, true, pad, rank, world);
  };
  // Rows of 1 process of 4 == ranks' rows interleaved; resume continues exactly; the epoch
  // plans hold every conversation once.
  const int batches = 12;  // past the end of the first epoch
  auto one = make(4, 0, 1);
  ASSERT_LT(one->rows_in_epoch(), 4 * batches);
  std::vector<Ids> single;
  for (int i = 0; i < batches; ++i) single.push_back(one->next().inputs.to_vector<int32_t>());
  EXPECT_GE(one->position()["epoch"].get<int64_t>(), 1);
  for (const int world : {2, 4}) {
    std::vector<std::unique_ptr<SftLoader>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(make(4 / world, r, world));
    for (int i = 0; i < batches; ++i) {
      Ids joined;
      for (int r = 0; r < world; ++r) {
        Ids part = ranks[r]->next().inputs.to_vector<int32_t>();
        joined.insert(joined.end(), part.begin(), part.end());
      }
      EXPECT_EQ(joined, single[i]) << "world " << world << " batch " << i;
    }
    for (int r = 1; r < world; ++r) EXPECT_EQ(ranks[r]->position(), ranks[0]->position());
  }
  for (const int cut : {1, 5, 10}) {
    auto a = make(4, 0, 1);
    for (int i = 0; i < cut; ++i) a->next();
    auto resumed = make(4, 0, 1);
    resumed->set_position(a->position());
    for (int i = cut; i < batches; ++i) EXPECT_EQ(resumed->next().inputs.to_vector<int32_t>(), single[i]) << cut;
  }
  // Epoch 0 and epoch 1 hold the same conversations in another order.
  auto rows_of_epoch = [&](int64_t epoch) {
    auto l = make(1, 0, 1);
    l->set_position({{"epoch", epoch}, {"row", 0}});
    std::vector<Ids> rows;
    for (int64_t r = 0; r < l->rows_in_epoch(); ++r) rows.push_back(l->next().inputs.to_vector<int32_t>());
    return rows;
  };
  const auto e0 = rows_of_epoch(0), e1 = rows_of_epoch(1);
  EXPECT_NE(e0, e1);
  auto bos_count = [&](const std::vector<Ids>& rows) {
    int64_t n = 0;
    for (const auto& r : rows) n += std::count(r.begin(), r.end(), tiny_bpe::kImStart);
    return n;
  };
  EXPECT_EQ(bos_count(e0), bos_count(e1));
  EXPECT_EQ(bos_count(e0), 2 * docs->size());  // two messages each, every conversation once

  std::string e = error_of([&] { make(1, 0, 1)->set_position({{"epoch", 0}, {"row", 10000}}); });
  EXPECT_NE(e.find("beyond the"), std::string::npos) << e;
  e = error_of([&] { make(1, 0, 1)->set_position(5); });
  EXPECT_NE(e.find("not a position of the SFT loader"), std::string::npos) << e;
}

TEST_F(SftTest, DataContextSplitsAndCounts) {
  RunConfig cfg = sft_config({write_chats("a/one.jsonl", 30), write_chats("b.jsonl", 20)});
  // The folder form reads *.jsonl recursively, skipping other files.
  file("a/notes.txt", "not a conversation");
  cfg.data.paths = {path("a"), path("b.jsonl")};
  DataContext d = make_data_context(cfg, 0, 1);
  EXPECT_EQ(d.train_documents + d.val_documents, 50);
  EXPECT_GT(d.val_documents, 2);
  EXPECT_GT(d.train_tokens, 0);
  EXPECT_NE(d.summary.find("50 conversations in 2 files"), std::string::npos) << d.summary;
  Batch b = d.train->next();
  EXPECT_TRUE(b.segment_ids.defined());
  EXPECT_GT(b.num_targets, 0);
  // Threads do not change the result.
  ChatCorpus one = load_chat_corpus(cfg.data, *tok_, 1), two = load_chat_corpus(cfg.data, *tok_, 2);
  EXPECT_EQ(one.train.ids, two.train.ids);
  EXPECT_EQ(one.train.trained, two.train.trained);
  EXPECT_EQ(one.val.offsets, two.val.offsets);
}

TEST_F(SftTest, BadInputNamesFileAndLine) {
  RunConfig cfg = sft_config({});
  auto error_for = [&](const std::string& jsonl) {
    cfg.data.paths = {file("bad.jsonl", jsonl)};
    return error_of([&] { load_chat_corpus(cfg.data, *tok_, 2); });
  };
  const std::string good = chat_line({{"user", "in"}, {"assistant", "on"}}) + "\n";
  const std::string where = path("bad.jsonl") + ":3: ";
  std::string e = error_for(good + "\n" + "{\"messages\": [oops]}\n" + good);
  EXPECT_EQ(e.rfind(where + "malformed JSON line", 0), 0u) << e;
  e = error_for(good + good + chat_line({{"user", "in"}, {"bot", "on"}}) + "\n");
  EXPECT_EQ(e, where + "message 2 has unknown role \"bot\" (expected system, user or assistant)");
  e = error_for(good + good + "{\"text\": \"plain\"}\n");
  EXPECT_EQ(e.rfind(where + "expected a JSON object with a \"messages\" list", 0), 0u) << e;
  e = error_for(good + good + "{\"messages\": [{\"role\": \"user\", \"content\": 3}]}\n");
  EXPECT_EQ(e, where + "message 1: \"content\" is a number, expected a string");
  e = error_for(good + good + chat_line({{"user", "in"}, {"system", "on"}}) + "\n");
  EXPECT_EQ(e, where + "no assistant message: nothing to train on");
  // An empty corpus (blank lines only), a missing file, a folder without JSONL.
  e = error_for("\n  \n");
  EXPECT_NE(e.find("no conversation: the corpus is empty"), std::string::npos) << e;
  cfg.data.paths = {path("missing.jsonl")};
  e = error_of([&] { load_chat_corpus(cfg.data, *tok_); });
  EXPECT_EQ(e, "[data].paths: '" + path("missing.jsonl") + "' does not exist");
  fs::create_directories(path("nothing"));
  cfg.data.paths = {path("nothing")};
  e = error_of([&] { load_chat_corpus(cfg.data, *tok_); });
  EXPECT_NE(e.find("holds no *.jsonl files"), std::string::npos) << e;
  // Everything in one split.
  cfg.data.paths = {file("one.jsonl", good)};
  e = error_of([&] { load_chat_corpus(cfg.data, *tok_); });
  EXPECT_NE(e.find("both need at least one"), std::string::npos) << e;
  // A tokenizer without ChatML's tokens.
  auto byte = make_tokenizer("byte");
  e = error_of([&] { ChatMlTemplate{*byte}; });
  EXPECT_NE(e.find("needs the special token <|im_start|>"), std::string::npos) << e;
}

// Document-confined attention through the whole model: a row packing two conversations
// (plus padding) gives the loss and gradients of the two run alone, so nothing leaks
// between packed documents, forward or backward.
TEST_F(SftTest, PackedRowEqualsConversationsAloneInTheModel) {
  Qwen3MoeConfig c = moetrain::testing::tiny_moe_config(320);
  c.router_aux_loss_coef = 0;  // batch statistics would see the other documents and the padding
  c.router_z_loss_coef = 0;
  ChatMlTemplate chatml(*tok_);
  auto docs = std::make_shared<ChatDocuments>();
  for (const auto& conv : {chatml.tokenize({{"user", "in"}, {"assistant", "on he"}}, "a"),
                           chatml.tokenize({{"user", "the thing"}, {"assistant", "her"}}, "b")}) {
    docs->ids.insert(docs->ids.end(), conv.ids.begin(), conv.ids.end());
    docs->trained.insert(docs->trained.end(), conv.trained.begin(), conv.trained.end());
    docs->offsets.push_back(static_cast<int64_t>(docs->ids.size()));
  }
  const int64_t S = docs->length(0) + docs->length(1) + 1;
  Batch packed = SftLoader(docs, 1, S, 0, false, true, tok_->eos_id()).next();
  Batch alone = SftLoader(docs, 2, S, 0, false, false, tok_->eos_id()).next();
  ASSERT_EQ(packed.num_targets, alone.num_targets);

  Qwen3MoeModel model(c, DType::F64);
  model.init_weights(5);
  LocalDispatcher d;
  auto grads = [&](const Batch& b) {
    model.forward_backward(b, d, 1.0, 1.0, /*accumulate_grads=*/false);
    std::vector<Tensor> g;
    for (Parameter& p : model.parameters()) g.push_back(p.grad.clone());
    return g;
  };
  const double packed_ce = model.forward_loss(packed, d).ce_sum;
  const double alone_ce = model.forward_loss(alone, d).ce_sum;
  EXPECT_NEAR(packed_ce, alone_ce, 1e-10 * std::abs(alone_ce));
  const auto gp = grads(packed), ga = grads(alone);
  for (size_t i = 0; i < gp.size(); ++i) {
    EXPECT_LT(moetrain::testing::rel_error(gp[i], ga[i]), 1e-10) << model.parameters()[i].name;
  }
  // And without segment ids the packed row does see across documents: the loss differs.
  packed.segment_ids = Tensor();
  EXPECT_GT(std::abs(model.forward_loss(packed, d).ce_sum - alone_ce), 1e-6);
}
