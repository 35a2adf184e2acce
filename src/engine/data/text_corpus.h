// Text corpus: plain text files turned into two token streams, train and validation.
//
// Each path is a file or a folder (read recursively in sorted order, skipping links,
// hidden entries, fortune's *.dat index files and its "off" folder of offensive fortunes).
// A file is split into documents at lines that are exactly "%" (the fortune format); a
// file without such lines is one document. Each non-empty document is tokenized and
// followed by EOS. A document is held out for validation when a uniform number drawn from
// the hash of its text is below val_fraction: the split depends on the text alone, not on
// file order, and duplicate documents always land on the same side.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/data/tokenizer.h"
#include "engine/run_config.h"

namespace moetrain {

struct Corpus {
  std::vector<int32_t> train, val;
  int64_t train_documents = 0, val_documents = 0;
  int64_t bytes = 0;  // bytes of text read from the files
};

// Throws naming the path for a missing or unreadable path, and when there are no documents
// or either split holds fewer than `min_split_tokens` tokens (pass training.seq_len + 1, the
// tokens one sequence needs).
Corpus load_text_corpus(const DataConfig& config, const Tokenizer& tokenizer, int64_t min_split_tokens = 2);

}  // namespace moetrain
