#include "engine/data/data_context.h"

#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "engine/data/sft_loader.h"
#include "engine/data/shard_loader.h"
#include "engine/data/text_corpus.h"
#include "engine/data/tokenizer_factory.h"

namespace moetrain {
namespace {

void make_text(DataContext& d, const RunConfig& cfg, int rank, int world) {
  const TrainingConfig& tc = cfg.training;
  const uint64_t seed = static_cast<uint64_t>(tc.seed);
  Corpus corpus = load_text_corpus(cfg.data, *d.tokenizer, tc.seq_len + 1);
  d.train_documents = corpus.train_documents;
  d.val_documents = corpus.val_documents;
  d.train_tokens = static_cast<int64_t>(corpus.train.size());
  d.val_tokens = static_cast<int64_t>(corpus.val.size());
  d.train = std::make_unique<BatchLoader>(std::move(corpus.train), tc.micro_batch_size, tc.seq_len,
                                          stream_key(seed, "data.train"), BatchLoader::Mode::Random, rank, world);
  d.val = std::make_unique<BatchLoader>(std::move(corpus.val), tc.micro_batch_size, tc.seq_len,
                                        stream_key(seed, "data.val"), BatchLoader::Mode::Sequential, rank, world);
  d.summary = fmt::format("{} train documents ({} tokens), {} validation documents ({} tokens)", d.train_documents,
                          d.train_tokens, d.val_documents, d.val_tokens);
}

void make_shards(DataContext& d, const RunConfig& cfg, int rank, int world) {
  const TrainingConfig& tc = cfg.training;
  auto stream = std::make_shared<const ShardStream>(cfg.data.paths, *d.tokenizer);
  // Validation: the stream's last val_fraction of tokens (at least one sequence's worth).
  const int64_t n = stream->num_tokens(), need = tc.seq_len + 1;
  const int64_t val =
      std::max(need, static_cast<int64_t>(std::llround(static_cast<double>(n) * cfg.data.val_fraction)));
  MT_CHECK(n - val >= need,
           "[data].paths: the shards hold {} tokens; validation takes {} ([data].val_fraction = {}, at least "
           "[training].seq_len + 1 = {}), leaving {} for training, fewer than one sequence needs",
           n, val, cfg.data.val_fraction, need, n - val);
  d.train = std::make_unique<ShardLoader>(stream, 0, n - val, tc.micro_batch_size, tc.seq_len, rank, world);
  d.val = std::make_unique<ShardLoader>(stream, n - val, n, tc.micro_batch_size, tc.seq_len, rank, world);
  d.train_tokens = n - val;
  d.val_tokens = val;
  d.train_documents = stream->num_documents();
  d.summary = fmt::format("{} token shards, {} documents, {} tokens: {} for training, the last {} for validation",
                          stream->num_shards(), stream->num_documents(), n, d.train_tokens, d.val_tokens);
}

void make_sft(DataContext& d, const RunConfig& cfg, int rank, int world) {
  const TrainingConfig& tc = cfg.training;
  ChatCorpus c = load_chat_corpus(cfg.data, *d.tokenizer, static_cast<int>(tc.threads));
  d.train_documents = c.train.size();
  d.val_documents = c.val.size();
  d.train_tokens = c.train.trained_tokens();
  d.val_tokens = c.val.trained_tokens();
  const int64_t all_tokens = static_cast<int64_t>(c.train.ids.size() + c.val.ids.size());
  auto train_docs = std::make_shared<const ChatDocuments>(std::move(c.train));
  auto val_docs = std::make_shared<const ChatDocuments>(std::move(c.val));
  const int32_t pad = d.tokenizer->eos_id();
  const uint64_t seed = stream_key(static_cast<uint64_t>(tc.seed), "data.sft");
  auto train = std::make_unique<SftLoader>(train_docs, tc.micro_batch_size, tc.seq_len, seed, /*shuffle=*/true,
                                           cfg.data.packing, pad, rank, world);
  auto val = std::make_unique<SftLoader>(val_docs, tc.micro_batch_size, tc.seq_len, seed, /*shuffle=*/false,
                                         cfg.data.packing, pad, rank, world);
  d.summary = fmt::format(
      "{} conversations in {} files ({} tokens, {} of them assistant tokens trained), ChatML; {} for training, {} "
      "for validation; {} rows of {} per epoch{}",
      d.train_documents + d.val_documents, c.files, all_tokens, d.train_tokens + d.val_tokens, d.train_documents,
      d.val_documents, train->rows_in_epoch(), tc.seq_len,
      cfg.data.packing ? fmt::format(" ({:.0f}% filled by packing)", 100 * train->fill())
                       : std::string(" (no packing)"));
  const int64_t cut = train->truncated() + val->truncated();
  if (cut > 0) {
    spdlog::warn("data: {} conversations are longer than [training].seq_len = {} and were cut to their first {} tokens",
                 cut, tc.seq_len, tc.seq_len);
  }
  d.train = std::move(train);
  d.val = std::move(val);
}

}  // namespace

DataContext make_data_context(const RunConfig& cfg, int data_rank, int data_world) {
  DataContext d;
  d.tokenizer = make_tokenizer(cfg.data.tokenizer);
  MT_CHECK(cfg.model->shape().vocab_size >= d.tokenizer->vocab_size(),
           "[model].vocab_size = {} is smaller than the vocabulary of [data].tokenizer ({}): token ids would fall "
           "outside the embedding",
           cfg.model->shape().vocab_size, d.tokenizer->describe());
  if (cfg.data.kind == "text") {
    make_text(d, cfg, data_rank, data_world);
  } else if (cfg.data.kind == "shards") {
    make_shards(d, cfg, data_rank, data_world);
  } else if (cfg.data.kind == "sft") {
    make_sft(d, cfg, data_rank, data_world);
  } else {
    MT_THROW("[data].kind = \"{}\": expected text, shards or sft", cfg.data.kind);
  }
  d.summary += fmt::format("; tokenizer: {}", d.tokenizer->describe());
  return d;
}

}  // namespace moetrain
