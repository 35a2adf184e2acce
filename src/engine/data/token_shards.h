// Token shards: a tokenized corpus on disk, as written by `moetrain tokenize` and read by
// the data loader. A corpus is a folder of shard-00000.bin, shard-00001.bin, ... whose
// tokens, concatenated in order, are one stream: documents one after another, each followed
// by the end-of-text id. Every shard but the last holds exactly shard_tokens tokens, so a
// document may continue in the next shard, and token i of the stream is in shard
// i / shard_tokens. index.json beside the shards sums them up (written last: a folder
// without one is unfinished).
//
// A shard is a 64-byte header, then the tokens as little-endian uint16 (vocabularies up to
// 65,536 ids) or uint32:
//
//   offset  size  field
//        0     8  magic "MTTOKENS"
//        8     4  u32 version (1)
//       12     4  u32 header bytes (64)
//       16     4  u32 token bytes (2 or 4)
//       20     4  i32 end-of-text id
//       24     8  i64 vocabulary size (every id is below it)
//       32     8  i64 tokens in this shard
//       40     8  i64 documents that end in this shard (its end-of-text ids)
//       48     8  i64 position of the shard's first token in the stream
//       56     8  u64 tokenizer fingerprint (Tokenizer::fingerprint())
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace moetrain {

inline constexpr char kTokenShardMagic[8] = {'M', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr uint32_t kTokenShardVersion = 1;
inline constexpr int64_t kTokenShardHeaderBytes = 64;

struct TokenShardHeader {
  uint32_t version = kTokenShardVersion;
  uint32_t token_bytes = 2;
  int32_t eos_id = -1;
  int64_t vocab_size = 0;
  int64_t num_tokens = 0;
  int64_t num_documents = 0;
  int64_t first_token = 0;
  uint64_t tokenizer_fingerprint = 0;
};

// 2 when every id fits in uint16, else 4.
uint32_t token_bytes_for_vocab(int64_t vocab_size);

// "<dir>/shard-00042.bin".
std::string token_shard_path(const std::string& dir, int64_t index);
// The shard files of `dir`, in order. Throws naming the folder when it has none or when
// their numbers have a gap.
std::vector<std::string> list_token_shards(const std::string& dir);

// Writes the stream into shards of `shard_tokens` tokens. Each shard is written as
// "<name>.tmp" and renamed when complete, so a shard file that exists is whole.
class TokenShardWriter {
 public:
  struct Options {
    std::string dir;
    int64_t shard_tokens = 100'000'000;
    int64_t vocab_size = 0;
    int32_t eos_id = -1;
    uint64_t tokenizer_fingerprint = 0;
  };
  struct Shard {
    std::string path;
    int64_t num_tokens = 0, num_documents = 0;
  };

  // Creates `dir` if needed.
  explicit TokenShardWriter(Options options);
  // Without finish(): removes the shard being written and the ones already renamed, so an
  // interrupted run leaves no partial corpus behind.
  ~TokenShardWriter();
  TokenShardWriter(const TokenShardWriter&) = delete;
  TokenShardWriter& operator=(const TokenShardWriter&) = delete;

  // Throws naming the position of an id outside [0, vocab_size).
  void append(std::span<const int32_t> tokens);
  // Completes the last shard and returns all of them.
  const std::vector<Shard>& finish();

  int64_t num_tokens() const { return total_; }
  uint32_t token_bytes() const { return width_; }

 private:
  void open_shard();
  void close_shard();
  void flush_buffer();

  Options opt_;
  uint32_t width_;
  std::vector<Shard> shards_;
  std::FILE* file_ = nullptr;
  std::string tmp_path_;
  TokenShardHeader header_;
  std::vector<unsigned char> buffer_;
  int64_t total_ = 0;
  bool finished_ = false;
};

// Reads one shard; the header is checked against the file when it is opened. Reads are
// positional (pread), so one reader may serve several threads.
class TokenShardReader {
 public:
  // Throws naming the file: missing, too short, bad magic, other version, impossible
  // fields, or a size that disagrees with the header.
  explicit TokenShardReader(const std::string& path);
  ~TokenShardReader();
  TokenShardReader(const TokenShardReader&) = delete;
  TokenShardReader& operator=(const TokenShardReader&) = delete;

  const TokenShardHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return header_.num_tokens; }

  // Tokens [offset, offset + out.size()) of this shard. Throws when the range is outside
  // the shard or a token read is not below the vocabulary size (a corrupt file).
  void read(int64_t offset, std::span<int32_t> out) const;
  std::vector<int32_t> read_all() const;

 private:
  std::string path_;
  int fd_ = -1;
  TokenShardHeader header_;
};

}  // namespace moetrain
