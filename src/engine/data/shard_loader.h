// The "shards" data kind: pretraining on token shards written by `moetrain tokenize`,
// streamed from disk instead of loaded into memory.
//
// ShardStream opens the shard folders named in [data].paths (each folder one stream, the
// folders one after another) and checks every header against the configured tokenizer
// (fingerprint, vocabulary size, end-of-text id), so a corpus tokenized with another
// vocabulary is refused before it can train nonsense. Reads are positional, any range,
// across shard boundaries.
//
// ShardLoader walks a range [begin, end) of the stream in order: sequence i of an epoch is
// the window starting at begin + i * seq_len, inputs tokens [s, s + seq_len) and targets
// [s + 1, s + seq_len + 1), so each token is a target exactly once per epoch and documents
// are packed back to back across shard boundaries (plain causal attention, positions 0..S-1:
// the usual pretraining packing). When the next window would run past `end`, the epoch
// ends and the walk starts again at `begin`. The position is {"epoch": e, "token": t}, t
// the offset of the next window in the range: resuming continues with the next unseen
// token. Data-parallel ranks follow the contract of DataLoader (loader.h); each reads only
// its own windows.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/data/loader.h"
#include "engine/data/token_shards.h"
#include "engine/data/tokenizer.h"

namespace moetrain {

class ShardStream {
 public:
  // Throws naming the folder or shard: no shards, no index.json (an unfinished
  // tokenization), a shard written with another tokenizer, a gap in the stream, no tokens.
  ShardStream(const std::vector<std::string>& dirs, const Tokenizer& tokenizer);

  int64_t num_tokens() const { return total_; }
  int64_t num_documents() const { return documents_; }
  int64_t num_shards() const { return static_cast<int64_t>(shards_.size()); }
  // Tokens [offset, offset + out.size()) of the stream. Throws naming the shard file and
  // position of a token outside the vocabulary (a corrupt file) or a failed read.
  void read(int64_t offset, std::span<int32_t> out) const;

 private:
  std::vector<std::unique_ptr<TokenShardReader>> shards_;
  std::vector<int64_t> starts_;  // stream offset of each shard's first token, plus the end
  int64_t total_ = 0, documents_ = 0;
};

class ShardLoader final : public DataLoader {
 public:
  // Throws when the range holds fewer than seq_len + 1 tokens.
  ShardLoader(std::shared_ptr<const ShardStream> stream, int64_t begin, int64_t end, int64_t micro_batch,
              int64_t seq_len, int data_rank = 0, int data_world = 1);

  Batch next() override;
  void reset() override { epoch_ = 0, token_ = 0; }
  nlohmann::json position() const override { return {{"epoch", epoch_}, {"token", token_}}; }
  void set_position(const nlohmann::json& position) override;

  int64_t num_tokens() const { return end_ - begin_; }

 private:
  std::shared_ptr<const ShardStream> stream_;
  int64_t begin_, end_, micro_batch_, seq_len_;
  int rank_, world_;
  int64_t epoch_ = 0, token_ = 0;
};

}  // namespace moetrain
