// DataContext: everything a training run reads its tokens through, built from [data] and
// [training] in one call: the tokenizer, the training and validation loaders, and counts for
// the log. The kinds of [data].kind:
//   text    plain text files tokenized at start (text_corpus.h), random windows for
//           training, sequential windows for validation (BatchLoader);
//   shards  token shards of `moetrain tokenize`, streamed in order (shard_loader.h); the
//           last val_fraction of the stream is validation;
//   sft     chat JSONL rendered with ChatML, loss on the assistant tokens, conversations
//           packed with attention kept within each (sft_loader.h).
// Loaders follow the data-parallel contract of DataLoader (loader.h): every rank builds the
// context with its (data_rank, data_world) and gets its own rows of the same global batches.
#pragma once

#include <memory>
#include <string>

#include "engine/data/loader.h"
#include "engine/data/tokenizer.h"
#include "engine/run_config.h"

namespace moetrain {

struct DataContext {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<DataLoader> train, val;
  int64_t train_documents = 0, train_tokens = 0;  // tokens: trained targets for sft
  int64_t val_documents = 0, val_tokens = 0;
  std::string summary;  // one line for the log: what was read, the splits, the tokenizer
};

// Throws naming the file, line or key of bad input (see each kind), when the tokenizer's
// vocabulary does not fit [model].vocab_size, and when a split is too short for one sequence.
DataContext make_data_context(const RunConfig& cfg, int data_rank, int data_world);

}  // namespace moetrain
