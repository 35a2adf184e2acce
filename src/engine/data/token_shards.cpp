#include "engine/data/token_shards.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace fs = std::filesystem;

namespace moetrain {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian; add byte swaps here");

namespace {

constexpr const char* kShardPrefix = "shard-";
constexpr const char* kShardSuffix = ".bin";

template <typename T>
void put(unsigned char* buf, size_t offset, T v) {
  std::memcpy(buf + offset, &v, sizeof(T));
}
template <typename T>
T get(const unsigned char* buf, size_t offset) {
  T v;
  std::memcpy(&v, buf + offset, sizeof(T));
  return v;
}

void encode_header(const TokenShardHeader& h, unsigned char* buf) {
  std::memset(buf, 0, kTokenShardHeaderBytes);
  std::memcpy(buf, kTokenShardMagic, 8);
  put<uint32_t>(buf, 8, h.version);
  put<uint32_t>(buf, 12, static_cast<uint32_t>(kTokenShardHeaderBytes));
  put<uint32_t>(buf, 16, h.token_bytes);
  put<int32_t>(buf, 20, h.eos_id);
  put<int64_t>(buf, 24, h.vocab_size);
  put<int64_t>(buf, 32, h.num_tokens);
  put<int64_t>(buf, 40, h.num_documents);
  put<int64_t>(buf, 48, h.first_token);
  put<uint64_t>(buf, 56, h.tokenizer_fingerprint);
}

// Reads exactly n bytes at `offset`; false at end of file.
bool pread_all(int fd, void* dst, size_t n, int64_t offset) {
  auto* p = static_cast<unsigned char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
  return true;
}

}  // namespace

uint32_t token_bytes_for_vocab(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

std::string token_shard_path(const std::string& dir, int64_t index) {
  return (fs::path(dir) / fmt::format("{}{:05}{}", kShardPrefix, index, kShardSuffix)).string();
}

std::vector<std::string> list_token_shards(const std::string& dir) {
  std::error_code ec;
  MT_CHECK(fs::is_directory(dir, ec), "{}: not a folder of token shards", dir);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(kShardPrefix) && name.ends_with(kShardSuffix)) names.push_back(name);
  }
  MT_CHECK(!ec, "{}: cannot list the folder: {}", dir, ec.message());
  MT_CHECK(!names.empty(), "{}: no token shards (shard-00000.bin ...) in this folder", dir);
  std::sort(names.begin(), names.end());
  std::vector<std::string> paths;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string expected = token_shard_path(dir, static_cast<int64_t>(i));
    MT_CHECK((fs::path(dir) / names[i]).string() == expected, "{}: the shards are not numbered 0..{} without a gap: "
             "found {} where {} was expected", dir, names.size() - 1, names[i], fs::path(expected).filename().string());
    paths.push_back(expected);
  }
  return paths;
}

// ---- writer -----------------------------------------------------------------------------

TokenShardWriter::TokenShardWriter(Options options) : opt_(std::move(options)) {
  MT_CHECK(opt_.shard_tokens > 0, "token shards: shard_tokens must be > 0, got {}", opt_.shard_tokens);
  MT_CHECK(opt_.vocab_size > 0 && opt_.vocab_size <= (int64_t{1} << 31), "token shards: vocab_size {} is out of range",
           opt_.vocab_size);
  MT_CHECK(opt_.eos_id >= 0 && opt_.eos_id < opt_.vocab_size, "token shards: eos_id {} is outside [0, {})",
           opt_.eos_id, opt_.vocab_size);
  width_ = token_bytes_for_vocab(opt_.vocab_size);
  std::error_code ec;
  fs::create_directories(opt_.dir, ec);
  MT_CHECK(!ec, "{}: cannot create the folder: {}", opt_.dir, ec.message());
}

TokenShardWriter::~TokenShardWriter() {
  if (finished_) return;
  if (file_ != nullptr) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
  for (const Shard& s : shards_) std::remove(s.path.c_str());
}

void TokenShardWriter::open_shard() {
  const std::string path = token_shard_path(opt_.dir, static_cast<int64_t>(shards_.size()));
  tmp_path_ = path + ".tmp";
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  MT_CHECK(file_ != nullptr, "{}: cannot create: {}", tmp_path_, std::strerror(errno));
  header_ = TokenShardHeader{};
  header_.token_bytes = width_;
  header_.eos_id = opt_.eos_id;
  header_.vocab_size = opt_.vocab_size;
  header_.first_token = total_;
  header_.tokenizer_fingerprint = opt_.tokenizer_fingerprint;
  // A placeholder header; the real one goes in when the counts are known.
  unsigned char head[kTokenShardHeaderBytes] = {};
  MT_CHECK(std::fwrite(head, 1, sizeof(head), file_) == sizeof(head), "{}: write failed: {}", tmp_path_,
           std::strerror(errno));
  shards_.push_back({path, 0, 0});
}

void TokenShardWriter::flush_buffer() {
  if (buffer_.empty()) return;
  MT_CHECK(std::fwrite(buffer_.data(), 1, buffer_.size(), file_) == buffer_.size(), "{}: write failed: {}", tmp_path_,
           std::strerror(errno));
  buffer_.clear();
}

void TokenShardWriter::close_shard() {
  flush_buffer();
  Shard& s = shards_.back();
  header_.num_tokens = s.num_tokens;
  header_.num_documents = s.num_documents;
  unsigned char head[kTokenShardHeaderBytes];
  encode_header(header_, head);
  const bool ok = std::fseek(file_, 0, SEEK_SET) == 0 && std::fwrite(head, 1, sizeof(head), file_) == sizeof(head) &&
                  std::fflush(file_) == 0;
  const int err = errno;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  MT_CHECK(ok && closed, "{}: write failed: {}", tmp_path_, std::strerror(err));
  MT_CHECK(std::rename(tmp_path_.c_str(), s.path.c_str()) == 0, "{}: cannot rename to {}: {}", tmp_path_, s.path,
           std::strerror(errno));
}

void TokenShardWriter::append(std::span<const int32_t> tokens) {
  MT_CHECK(!finished_, "{}: TokenShardWriter::append after finish()", opt_.dir);
  size_t i = 0;
  while (i < tokens.size()) {
    if (file_ == nullptr) open_shard();
    Shard& s = shards_.back();
    const size_t take = std::min<size_t>(tokens.size() - i, static_cast<size_t>(opt_.shard_tokens - s.num_tokens));
    const size_t at = buffer_.size();
    buffer_.resize(at + take * width_);
    unsigned char* dst = buffer_.data() + at;
    for (size_t k = 0; k < take; ++k) {
      const int32_t id = tokens[i + k];
      MT_CHECK(id >= 0 && id < opt_.vocab_size, "{}: token {} at stream position {} is outside the vocabulary [0, {})",
               s.path, id, total_ + static_cast<int64_t>(k), opt_.vocab_size);
      if (width_ == 2) {
        put<uint16_t>(dst, k * 2, static_cast<uint16_t>(id));
      } else {
        put<uint32_t>(dst, k * 4, static_cast<uint32_t>(id));
      }
      s.num_documents += id == opt_.eos_id;
    }
    s.num_tokens += static_cast<int64_t>(take);
    total_ += static_cast<int64_t>(take);
    i += take;
    if (buffer_.size() >= (size_t{1} << 22)) flush_buffer();
    if (s.num_tokens == opt_.shard_tokens) close_shard();
  }
}

const std::vector<TokenShardWriter::Shard>& TokenShardWriter::finish() {
  if (!finished_) {
    if (file_ != nullptr) close_shard();
    finished_ = true;
  }
  return shards_;
}

// ---- reader -----------------------------------------------------------------------------

TokenShardReader::TokenShardReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd_ >= 0, "{}: cannot open token shard: {}", path, std::strerror(errno));
  struct stat st {};
  MT_CHECK(::fstat(fd_, &st) == 0, "{}: cannot stat: {}", path, std::strerror(errno));
  const int64_t size = st.st_size;
  unsigned char head[kTokenShardHeaderBytes];
  const bool whole_header = size >= kTokenShardHeaderBytes && pread_all(fd_, head, sizeof(head), 0);
  // Errors are thrown from here on; the destructor does not run for a throwing
  // constructor, so close first.
  auto fail = [&](const std::string& why) {
    ::close(fd_);
    fd_ = -1;
    MT_THROW("{}: not a valid token shard: {}", path, why);
  };
  if (!whole_header) fail(fmt::format("{} bytes, shorter than the {}-byte header", size, kTokenShardHeaderBytes));
  if (std::memcmp(head, kTokenShardMagic, 8) != 0) fail("bad magic (expected \"MTTOKENS\")");
  header_.version = get<uint32_t>(head, 8);
  if (header_.version != kTokenShardVersion) {
    fail(fmt::format("format version {}, this build reads version {}", header_.version, kTokenShardVersion));
  }
  const uint32_t header_bytes = get<uint32_t>(head, 12);
  if (header_bytes != kTokenShardHeaderBytes) {
    fail(fmt::format("header size {}, expected {}", header_bytes, kTokenShardHeaderBytes));
  }
  header_.token_bytes = get<uint32_t>(head, 16);
  header_.eos_id = get<int32_t>(head, 20);
  header_.vocab_size = get<int64_t>(head, 24);
  header_.num_tokens = get<int64_t>(head, 32);
  header_.num_documents = get<int64_t>(head, 40);
  header_.first_token = get<int64_t>(head, 48);
  header_.tokenizer_fingerprint = get<uint64_t>(head, 56);
  if (header_.token_bytes != 2 && header_.token_bytes != 4) {
    fail(fmt::format("token width {} bytes, expected 2 or 4", header_.token_bytes));
  }
  if (header_.vocab_size <= 0 || header_.vocab_size > (int64_t{1} << 31) ||
      (header_.token_bytes == 2 && header_.vocab_size > 65536)) {
    fail(fmt::format("vocabulary size {} does not fit {}-byte tokens", header_.vocab_size, header_.token_bytes));
  }
  if (header_.eos_id < 0 || header_.eos_id >= header_.vocab_size) {
    fail(fmt::format("end-of-text id {} is outside the vocabulary [0, {})", header_.eos_id, header_.vocab_size));
  }
  if (header_.num_tokens < 0 || header_.num_documents < 0 || header_.num_documents > header_.num_tokens ||
      header_.first_token < 0) {
    fail(fmt::format("impossible counts (tokens {}, documents {}, first token {})", header_.num_tokens,
                     header_.num_documents, header_.first_token));
  }
  const int64_t expected = kTokenShardHeaderBytes + header_.num_tokens * header_.token_bytes;
  if (size != expected) {
    fail(fmt::format("{} bytes, but the header's {} tokens of {} bytes make {} (truncated or overwritten?)", size,
                     header_.num_tokens, header_.token_bytes, expected));
  }
}

TokenShardReader::~TokenShardReader() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenShardReader::read(int64_t offset, std::span<int32_t> out) const {
  const auto n = static_cast<int64_t>(out.size());
  MT_CHECK(offset >= 0 && offset + n <= header_.num_tokens, "{}: tokens [{}, {}) are outside the shard's {} tokens",
           path_, offset, offset + n, header_.num_tokens);
  if (n == 0) return;
  const int64_t at = kTokenShardHeaderBytes + offset * header_.token_bytes;
  bool ok;
  if (header_.token_bytes == 4) {
    ok = pread_all(fd_, out.data(), static_cast<size_t>(n) * 4, at);
  } else {
    std::vector<uint16_t> narrow(static_cast<size_t>(n));
    ok = pread_all(fd_, narrow.data(), narrow.size() * 2, at);
    for (int64_t i = 0; ok && i < n; ++i) out[i] = narrow[i];
  }
  MT_CHECK(ok, "{}: read of tokens [{}, {}) failed: {}", path_, offset, offset + n,
           errno != 0 ? std::strerror(errno) : "end of file");
  for (int64_t i = 0; i < n; ++i) {
    MT_CHECK(out[i] >= 0 && out[i] < header_.vocab_size, "{}: token {} at position {} is outside the vocabulary "
             "[0, {}): the file is corrupt", path_, static_cast<uint32_t>(out[i]), offset + i, header_.vocab_size);
  }
}

std::vector<int32_t> TokenShardReader::read_all() const {
  std::vector<int32_t> out(static_cast<size_t>(header_.num_tokens));
  read(0, out);
  return out;
}

}  // namespace moetrain
