#include "engine/data/shard_loader.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"

namespace fs = std::filesystem;

namespace moetrain {

ShardStream::ShardStream(const std::vector<std::string>& dirs, const Tokenizer& tok) {
  MT_CHECK(!dirs.empty(), "[data].paths is empty: name the folder(s) of token shards that `moetrain tokenize` wrote");
  for (const std::string& dir : dirs) {
    std::error_code ec;
    MT_CHECK(fs::exists(dir, ec), "[data].paths: '{}' does not exist", dir);
    MT_CHECK(fs::is_directory(dir, ec),
             "[data].paths: '{}' is not a folder; [data].kind = \"shards\" reads folders written by `moetrain "
             "tokenize --out`",
             dir);
    const std::vector<std::string> files = list_token_shards(dir);
    MT_CHECK(fs::exists(fs::path(dir) / "index.json", ec),
             "{}: no index.json beside the shards: the tokenization did not finish (run `moetrain tokenize` again)",
             dir);
    int64_t in_folder = 0;
    for (const std::string& f : files) {
      auto r = std::make_unique<TokenShardReader>(f);
      const TokenShardHeader& h = r->header();
      MT_CHECK(
          h.tokenizer_fingerprint == tok.fingerprint(),
          "{}: written with another tokenizer (fingerprint {:016x}, vocabulary {}) than [data].tokenizer, {} "
          "(fingerprint {:016x}); tokenize the corpus again with it, or configure the tokenizer it was written with",
          f, h.tokenizer_fingerprint, h.vocab_size, tok.describe(), tok.fingerprint());
      MT_CHECK(h.vocab_size == tok.vocab_size() && h.eos_id == tok.eos_id(),
               "{}: vocabulary size {} and end-of-text id {}, but [data].tokenizer has {} and {}", f, h.vocab_size,
               h.eos_id, tok.vocab_size(), tok.eos_id());
      MT_CHECK(h.first_token == in_folder,
               "{}: starts at token {} of its stream, but the shards before it hold {} tokens (a shard is missing or "
               "from another run)",
               f, h.first_token, in_folder);
      in_folder += h.num_tokens;
      starts_.push_back(total_);
      total_ += h.num_tokens;
      documents_ += h.num_documents;
      shards_.push_back(std::move(r));
    }
  }
  starts_.push_back(total_);
  MT_CHECK(total_ > 0, "[data].paths ({}): the shards hold no tokens", fmt::join(dirs, ", "));
}

void ShardStream::read(int64_t offset, std::span<int32_t> out) const {
  const auto n = static_cast<int64_t>(out.size());
  MT_CHECK(offset >= 0 && offset + n <= total_, "token stream: tokens [{}, {}) are outside its {} tokens", offset,
           offset + n, total_);
  // The shard holding `offset`: the last start <= offset (empty shards are skipped over).
  size_t k = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin()) - 1;
  int64_t done = 0;
  while (done < n) {
    const int64_t in_shard = offset + done - starts_[k];
    const int64_t take = std::min(n - done, shards_[k]->num_tokens() - in_shard);
    if (take > 0) shards_[k]->read(in_shard, out.subspan(static_cast<size_t>(done), static_cast<size_t>(take)));
    done += std::max<int64_t>(take, 0);
    ++k;
  }
}

ShardLoader::ShardLoader(std::shared_ptr<const ShardStream> stream, int64_t begin, int64_t end, int64_t micro_batch,
                         int64_t seq_len, int data_rank, int data_world)
    : stream_(std::move(stream)),
      begin_(begin),
      end_(end),
      micro_batch_(micro_batch),
      seq_len_(seq_len),
      rank_(data_rank),
      world_(data_world) {
  check_data_rank("ShardLoader", micro_batch, data_rank, data_world);
  MT_CHECK(seq_len > 0, "ShardLoader: seq_len must be > 0, got {}", seq_len);
  MT_CHECK(0 <= begin && begin <= end && end <= stream_->num_tokens(),
           "ShardLoader: range [{}, {}) of a {}-token stream", begin, end, stream_->num_tokens());
  MT_CHECK(end - begin >= seq_len + 1, "ShardLoader: the range holds {} tokens, fewer than seq_len + 1 = {}",
           end - begin, seq_len + 1);
}

Batch ShardLoader::next() {
  const int64_t B = micro_batch_, S = seq_len_;
  Batch b = Batch::allocate(B, S, false);
  b.num_targets = B * S;
  std::vector<int32_t> window(static_cast<size_t>(S + 1));
  const int64_t first = static_cast<int64_t>(rank_) * B;
  for (int64_t g = 0; g < B * world_; ++g) {
    if (token_ + S + 1 > end_ - begin_) {  // the next window does not fit: a new epoch
      ++epoch_;
      token_ = 0;
    }
    const int64_t start = begin_ + token_;
    token_ += S;
    if (g < first || g >= first + B) continue;  // another rank's row: not read
    stream_->read(start, window);
    b.fill_row(g - first, window.data());
  }
  return b;
}

void ShardLoader::set_position(const nlohmann::json& p) {
  const auto [e, t] = epoch_position(p, "token", "shard loader");
  MT_CHECK(t <= end_ - begin_,
           "data position {}: token {} is beyond the {} training tokens of [data].paths (did the corpus change since "
           "the checkpoint?)",
           p.dump(), t, end_ - begin_);
  epoch_ = e;
  token_ = t;
}

}  // namespace moetrain
