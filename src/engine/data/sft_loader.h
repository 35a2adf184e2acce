// The "sft" data kind: supervised fine-tuning on chat conversations (chat.h), the loss on
// the assistant tokens only.
//
// load_chat_corpus reads the JSONL files of [data].paths (folders: their *.jsonl and *.ndjson
// files, recursively, in sorted order), tokenizes every conversation with the ChatML
// template (in parallel; the result does not depend on the thread count) and holds them in
// memory. A conversation goes to validation when a number drawn from the hash of its line
// is below [data].val_fraction, so the split depends on the text alone.
//
// A conversation of n tokens is an example of n - 1 positions: inputs ids[0..n-2], targets
// ids[1..n-1], a target kept only where its token is trained and -100 elsewhere. One longer
// than seq_len is cut to its first seq_len positions (counted and logged).
//
// SftLoader lays the examples into rows of seq_len positions:
//   packing on   several conversations per row, chosen best-fit (each into the open row
//                with the least room that holds it, else a new row) in the epoch's order;
//                each conversation is its own attention segment (segment_ids) and its
//                positions restart at 0, as Hugging Face packing with position ids does;
//   packing off  one conversation per row.
// The rest of a row is padding: end-of-text inputs, targets -100, a segment of its own.
// Training shuffles the conversations each epoch (seeded by the seed and the epoch);
// validation keeps file order. The position is {"epoch": e, "row": r}, the next row of the
// epoch's plan: the plan is a pure function of (data, seed, epoch), so a resumed run
// continues with the next unseen row. Data-parallel ranks follow the contract of DataLoader
// (loader.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/data/loader.h"
#include "engine/data/tokenizer.h"
#include "engine/run_config.h"

namespace moetrain {

// Tokenized conversations, back to back: conversation i is tokens [offsets[i], offsets[i+1]).
struct ChatDocuments {
  std::vector<int32_t> ids;
  std::vector<uint8_t> trained;
  std::vector<int64_t> offsets{0};
  int64_t size() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t length(int64_t i) const { return offsets[i + 1] - offsets[i]; }
  int64_t trained_tokens() const;
};

struct ChatCorpus {
  ChatDocuments train, val;
  int64_t files = 0, bytes = 0;
};

// Throws naming the file and line of a bad conversation (see parse_chat_line), and when a
// path is missing, a folder has no JSONL file, or either split holds no conversation.
ChatCorpus load_chat_corpus(const DataConfig& config, const Tokenizer& tokenizer, int threads = 0);

class SftLoader final : public DataLoader {
 public:
  // shuffle: a new order each epoch (training); else file order (validation).
  SftLoader(std::shared_ptr<const ChatDocuments> docs, int64_t micro_batch, int64_t seq_len, uint64_t seed,
            bool shuffle, bool packing, int32_t pad_id, int data_rank = 0, int data_world = 1);

  Batch next() override;
  void reset() override { set_epoch_row(0, 0); }
  nlohmann::json position() const override { return {{"epoch", epoch_}, {"row", row_}}; }
  void set_position(const nlohmann::json& position) override;

  // Rows of the current epoch's plan, conversations cut to seq_len, and the share of
  // positions that hold a conversation (not padding) in the current plan.
  int64_t rows_in_epoch() const { return static_cast<int64_t>(rows_.size()); }
  int64_t truncated() const { return truncated_; }
  double fill() const;

 private:
  void set_epoch_row(int64_t epoch, int64_t row);
  void plan_epoch(int64_t epoch);
  void fill_row(int64_t row, int64_t i, Batch& b) const;

  std::shared_ptr<const ChatDocuments> docs_;
  int64_t micro_batch_, seq_len_;
  uint64_t seed_;
  bool shuffle_, packing_;
  int32_t pad_id_;
  int rank_, world_;
  int64_t truncated_ = 0;
  int64_t epoch_ = 0, row_ = 0;
  int64_t planned_epoch_ = -1;
  std::vector<std::vector<int64_t>> rows_;  // the conversations of each row of the epoch
};

}  // namespace moetrain
