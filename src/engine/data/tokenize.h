// tokenize_corpus: text files, JSONL files or folders of them -> token shards
// (token_shards.h), the work behind `moetrain tokenize`.
//
// Inputs: a file is read as given; a folder is read recursively in sorted path order,
// skipping hidden entries and the output folder. *.jsonl / *.ndjson files hold one JSON
// object per line whose text field (default "text") is a document; any other file is
// plain UTF-8 text, one document per file (or per line with `lines`). Compressed files
// are refused. Each document is followed by the tokenizer's end-of-text id; empty
// documents are skipped.
//
// Files are cut into chunks of whole lines that worker threads tokenize; chunks are written
// in input order, so the shards are the same whatever the number of threads. Invalid UTF-8
// in plain text becomes U+FFFD (counted and reported); in JSONL it is malformed JSON.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/data/tokenizer.h"

namespace moetrain {

struct TokenizeOptions {
  std::vector<std::string> inputs;  // files or folders
  std::string out_dir;
  int64_t shard_tokens = 100'000'000;
  int threads = 0;                  // 0: one per core
  std::string text_field = "text";  // JSONL key of the document text
  bool lines = false;               // plain text: one document per line instead of per file
  bool overwrite = false;           // replace shards already in out_dir
  bool progress = true;             // progress bar (on a terminal)
  int64_t chunk_bytes = 4 << 20;    // work handed to a thread at a time
  std::string tokenizer_name;       // recorded in index.json
};

struct TokenizeSummary {
  int64_t files = 0, input_bytes = 0;
  int64_t documents = 0, empty_documents = 0;
  int64_t tokens = 0;
  int64_t invalid_utf8 = 0;  // ill-formed sequences replaced by U+FFFD
  std::vector<std::string> shards;
  uint32_t token_bytes = 0;
  int threads = 0;
  double seconds = 0;
};

// Throws naming the file (and line, for JSONL) of bad input, and when the inputs hold no
// document at all. Refuses an out_dir that already holds shards unless `overwrite`.
TokenizeSummary tokenize_corpus(const Tokenizer& tokenizer, const TokenizeOptions& options);

// "tokenized 3 files (...) into ... tokens ... : 12.3 MB/s, 3.4 M tokens/s on 2 threads".
std::string format_tokenize_summary(const TokenizeSummary& s);

// The files that `inputs` name, in the order tokenize_corpus reads them.
std::vector<std::string> list_corpus_files(const std::vector<std::string>& inputs, const std::string& skip_dir = {});

// The ids of a whole text file as a JSON array (no end-of-text added), for comparing with
// other tokenizer implementations. Throws naming the file when it is not valid UTF-8.
std::string encode_file_to_json(const Tokenizer& tokenizer, const std::string& path);
// The text of a file holding a JSON array of ids.
std::string decode_json_file(const Tokenizer& tokenizer, const std::string& path);

}  // namespace moetrain
