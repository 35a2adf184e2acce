#include "engine/data/tokenize.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "engine/data/token_shards.h"
#include "engine/data/utf8.h"
#include "engine/telemetry/progress.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace moetrain {
namespace {

bool is_jsonl(const fs::path& p) { return p.extension() == ".jsonl" || p.extension() == ".ndjson"; }

void refuse_compressed(const fs::path& p) {
  static const char* const kRefused[] = {".gz", ".zst", ".zstd", ".xz", ".bz2", ".lz4", ".parquet", ".arrow"};
  const std::string ext = p.extension().string();
  for (const char* r : kRefused) {
    MT_CHECK(ext != r, "{}: compressed or columnar files are not read; decompress it (or export it as JSONL) first",
             p.string());
  }
}

bool same_path(const fs::path& a, const fs::path& b) {
  std::error_code ec1, ec2;
  return fs::weakly_canonical(a, ec1) == fs::weakly_canonical(b, ec2) && !ec1 && !ec2;
}

void collect_folder(const fs::path& dir, const fs::path& skip, std::vector<fs::path>& out) {
  std::error_code ec;
  std::vector<fs::path> found;
  fs::recursive_directory_iterator it(dir, ec), end;
  MT_CHECK(!ec, "{}: cannot list the folder: {}", dir.string(), ec.message());
  for (; it != end; it.increment(ec)) {
    MT_CHECK(!ec, "{}: cannot list the folder: {}", dir.string(), ec.message());
    const fs::path& p = it->path();
    const bool hidden = p.filename().string().starts_with(".");
    if (it->is_directory(ec)) {
      if (hidden || (!skip.empty() && same_path(p, skip))) it.disable_recursion_pending();
      continue;
    }
    if (!hidden && it->is_regular_file(ec)) found.push_back(p);
  }
  std::sort(found.begin(), found.end());
  out.insert(out.end(), found.begin(), found.end());
}

// The JSON library's message without its "[json.exception...] " prefix, and without
// "line 1" (each JSONL line is parsed alone; the caller names the line).
std::string json_error(const std::exception& e) {
  std::string m = e.what();
  if (m.starts_with("[json.exception") && m.find("] ") != std::string::npos) m = m.substr(m.find("] ") + 2);
  if (const size_t at = m.find("at line 1, column"); at != std::string::npos) m.replace(at, 17, "at column");
  return m;
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// A piece of one file for a worker: whole lines (or the whole file, when a file is one
// document), with the number of its first line.
struct Chunk {
  int64_t seq = 0;
  size_t file = 0;
  int64_t first_line = 1;
  std::string text;
  std::exception_ptr error;  // set instead of text when the file could not be read
};

// What a worker makes of a chunk.
struct Tokens {
  std::vector<int32_t> ids;
  int64_t documents = 0, empty = 0, invalid_utf8 = 0, bytes = 0;
  std::exception_ptr error;
};

class Pipeline {
 public:
  Pipeline(const Tokenizer& tok, const TokenizeOptions& opt, const std::vector<std::string>& files, int threads)
      : tok_(tok), opt_(opt), files_(files), max_in_flight_(2 * threads + 2) {}

  // Reader thread: files -> chunks, at most max_in_flight_ ahead of the writer.
  void read_all() {
    for (size_t f = 0; f < files_.size(); ++f) {
      try {
        if (!read_file(f)) return;
      } catch (...) {
        Chunk c;
        c.file = f;
        c.error = std::current_exception();
        push(std::move(c));
        break;
      }
    }
    std::lock_guard lk(m_);
    reading_done_ = true;
    cv_.notify_all();
  }

  // Worker thread: chunks -> tokens.
  void work() {
    while (true) {
      Chunk c;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return abort_ || !queue_.empty() || reading_done_; });
        if (abort_ || queue_.empty()) return;
        c = std::move(queue_.front());
        queue_.pop_front();
      }
      Tokens t = tokenize(c);
      std::lock_guard lk(m_);
      done_.emplace(c.seq, std::move(t));
      cv_.notify_all();
    }
  }

  // Writer (the calling thread): the next chunk's tokens in input order; false when all
  // chunks have been handed out.
  bool next(Tokens& out) {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return done_.count(next_write_) > 0 || (reading_done_ && next_write_ == produced_); });
    auto it = done_.find(next_write_);
    if (it == done_.end()) return false;
    out = std::move(it->second);
    done_.erase(it);
    ++next_write_;
    cv_.notify_all();
    return true;
  }

  void abort() {
    std::lock_guard lk(m_);
    abort_ = true;
    cv_.notify_all();
  }

 private:
  bool push(Chunk c) {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return abort_ || produced_ - next_write_ < max_in_flight_; });
    if (abort_) return false;
    c.seq = produced_++;
    queue_.push_back(std::move(c));
    cv_.notify_all();
    return true;
  }

  bool read_file(size_t f) {
    const std::string& path = files_[f];
    std::ifstream in(path, std::ios::binary);
    MT_CHECK(in.good(), "{}: cannot read", path);
    if (!is_jsonl(path) && !opt_.lines) {  // the file is one document
      std::ostringstream ss;
      ss << in.rdbuf();
      MT_CHECK(!in.bad(), "{}: error while reading", path);
      Chunk c;
      c.file = f;
      c.text = std::move(ss).str();
      return push(std::move(c));
    }
    std::string carry;
    std::vector<char> buf(static_cast<size_t>(opt_.chunk_bytes));
    int64_t line = 1;
    while (true) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      MT_CHECK(!in.bad(), "{}: error while reading", path);
      const auto n = static_cast<size_t>(in.gcount());
      carry.append(buf.data(), n);
      const bool eof = n < buf.size();
      size_t cut = eof ? carry.size() : carry.rfind('\n');
      if (cut == std::string::npos) continue;  // a line longer than a chunk: read on
      if (!eof) ++cut;
      Chunk c;
      c.file = f;
      c.first_line = line;
      c.text = carry.substr(0, cut);
      carry.erase(0, cut);
      line += std::count(c.text.begin(), c.text.end(), '\n');
      if (!c.text.empty() && !push(std::move(c))) return false;
      if (eof) return true;
    }
  }

  Tokens tokenize(Chunk& c) {
    Tokens t;
    t.bytes = static_cast<int64_t>(c.text.size());
    t.error = c.error;
    if (t.error) return t;
    const std::string& path = files_[c.file];
    auto add_document = [&](std::string_view doc, int64_t line) {
      if (doc.empty()) {
        ++t.empty;
        return;
      }
      try {
        std::vector<int32_t> ids = tok_.encode(doc);
        t.ids.insert(t.ids.end(), ids.begin(), ids.end());
      } catch (const Error& e) {
        if (line > 0) MT_THROW("{}:{}: {}", path, line, e.what());
        MT_THROW("{}: {}", path, e.what());
      }
      t.ids.push_back(tok_.eos_id());
      ++t.documents;
    };
    try {
      if (is_jsonl(path)) {
        for_each_line(c, [&](std::string_view l, int64_t line) {
          if (!is_blank(l)) add_document(jsonl_text(l, path, line), line);
        });
      } else {
        t.invalid_utf8 = utf8_replace_invalid(c.text);
        if (opt_.lines) {
          for_each_line(c, [&](std::string_view l, int64_t line) {
            if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
            if (!l.empty()) add_document(l, line);
          });
        } else {
          add_document(c.text, 0);
        }
      }
    } catch (...) {
      t.error = std::current_exception();
    }
    return t;
  }

  template <typename F>
  static void for_each_line(const Chunk& c, F&& f) {
    std::string_view text = c.text;
    int64_t line = c.first_line;
    size_t pos = 0;
    while (pos < text.size()) {
      const size_t nl = text.find('\n', pos);
      const size_t end = nl == std::string_view::npos ? text.size() : nl;
      f(text.substr(pos, end - pos), line++);
      pos = end + 1;
    }
  }

  // The document of one JSONL line.
  std::string_view jsonl_text(std::string_view l, const std::string& path, int64_t line) {
    json j;
    try {
      j = json::parse(l);
    } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
      MT_THROW("{}:{}: malformed JSON line: {}", path, line, json_error(e));
    }
    MT_CHECK(j.is_object(), "{}:{}: expected a JSON object with a \"{}\" string, got {}", path, line,
             opt_.text_field, j.type_name());
    auto it = j.find(opt_.text_field);
    if (it == j.end()) {
      std::vector<std::string> keys;
      for (auto k = j.begin(); k != j.end(); ++k) keys.push_back(k.key());
      MT_THROW("{}:{}: no \"{}\" field (the line has: {}); --text-field names another", path, line, opt_.text_field,
               keys.empty() ? "no fields" : fmt::format("{}", fmt::join(keys, ", ")));
    }
    MT_CHECK(it->is_string(), "{}:{}: \"{}\" is a {}, expected a string", path, line, opt_.text_field,
             it->type_name());
    // The document must outlive `j`: keep it in the worker's scratch string.
    scratch_ = it->get_ref<const std::string&>();
    return scratch_;
  }

  const Tokenizer& tok_;
  const TokenizeOptions& opt_;
  const std::vector<std::string>& files_;
  const int64_t max_in_flight_;

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Chunk> queue_;
  std::map<int64_t, Tokens> done_;
  int64_t produced_ = 0, next_write_ = 0;
  bool reading_done_ = false, abort_ = false;
  static thread_local std::string scratch_;
};

thread_local std::string Pipeline::scratch_;

// Removes the shards and index of an earlier run when asked to, refuses otherwise.
void prepare_out_dir(const std::string& dir, bool overwrite) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return;
  MT_CHECK(fs::is_directory(dir, ec), "--out {}: exists and is not a folder", dir);
  std::vector<fs::path> old;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if ((name.starts_with("shard-") && (name.ends_with(".bin") || name.ends_with(".bin.tmp"))) ||
        name == "index.json") {
      old.push_back(e.path());
    }
  }
  if (old.empty()) return;
  std::sort(old.begin(), old.end());
  MT_CHECK(overwrite, "--out {}: already holds token shards ({} and {} more files); pass --overwrite to replace "
           "them or choose another folder", dir, old.front().filename().string(), old.size() - 1);
  for (const auto& p : old) fs::remove(p, ec);
}

void write_index(const std::string& dir, const Tokenizer& tok, const TokenizeOptions& opt, const TokenizeSummary& s,
                 const std::vector<TokenShardWriter::Shard>& shards) {
  json list = json::array();
  for (const auto& sh : shards) {
    list.push_back({{"file", fs::path(sh.path).filename().string()},
                    {"num_tokens", sh.num_tokens},
                    {"num_documents", sh.num_documents}});
  }
  json index = {{"format", "moetrain token shards"},
                {"version", kTokenShardVersion},
                {"tokenizer", opt.tokenizer_name},
                {"tokenizer_fingerprint", fmt::format("{:016x}", tok.fingerprint())},
                {"vocab_size", tok.vocab_size()},
                {"eos_id", tok.eos_id()},
                {"token_bytes", s.token_bytes},
                {"shard_tokens", opt.shard_tokens},
                {"num_tokens", s.tokens},
                {"num_documents", s.documents},
                {"input_files", s.files},
                {"input_bytes", s.input_bytes},
                {"shards", list}};
  const fs::path path = fs::path(dir) / "index.json";
  const fs::path tmp = fs::path(dir) / "index.json.tmp";
  {
    std::ofstream out(tmp);
    out << index.dump(2) << "\n";
    MT_CHECK(out.good(), "{}: write failed", tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  MT_CHECK(!ec, "{}: cannot rename to {}: {}", tmp.string(), path.string(), ec.message());
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "{}: cannot read", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  MT_CHECK(!in.bad(), "{}: error while reading", path);
  return std::move(ss).str();
}

}  // namespace

std::vector<std::string> list_corpus_files(const std::vector<std::string>& inputs, const std::string& skip_dir) {
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(in, ec);
    MT_CHECK(fs::exists(st), "{}: no such file or folder", in);
    if (fs::is_directory(st)) {
      const size_t before = files.size();
      collect_folder(in, skip_dir, files);
      MT_CHECK(files.size() > before, "{}: the folder holds no files", in);
    } else {
      files.emplace_back(in);
    }
  }
  std::vector<std::string> out;
  for (const auto& f : files) {
    refuse_compressed(f);
    out.push_back(f.string());
  }
  return out;
}

TokenizeSummary tokenize_corpus(const Tokenizer& tok, const TokenizeOptions& opt) {
  MT_CHECK(!opt.inputs.empty(), "tokenize: no inputs: name text or JSONL files, or folders of them");
  MT_CHECK(!opt.out_dir.empty(), "tokenize: no output folder (--out)");
  MT_CHECK(opt.shard_tokens > 0, "tokenize: --shard-tokens must be > 0, got {}", opt.shard_tokens);
  MT_CHECK(opt.chunk_bytes > 0, "tokenize: chunk_bytes must be > 0");
  const auto start = std::chrono::steady_clock::now();

  TokenizeSummary s;
  const std::vector<std::string> files = list_corpus_files(opt.inputs, opt.out_dir);
  s.files = static_cast<int64_t>(files.size());
  int64_t total_bytes = 0;
  for (const auto& f : files) {
    std::error_code ec;
    total_bytes += static_cast<int64_t>(fs::file_size(f, ec));
  }
  prepare_out_dir(opt.out_dir, opt.overwrite);
  s.threads = opt.threads > 0 ? opt.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  spdlog::info("tokenize: {} files ({:.1f} MB) with {} on {} threads -> {}", files.size(), total_bytes / 1e6,
               tok.describe(), s.threads, opt.out_dir);

  TokenShardWriter writer({opt.out_dir, opt.shard_tokens, tok.vocab_size(), tok.eos_id(), tok.fingerprint()});
  s.token_bytes = writer.token_bytes();
  Pipeline pipeline(tok, opt, files, s.threads);
  std::vector<std::thread> threads;
  // Stops and joins the threads however this function ends.
  struct Joiner {
    Pipeline& p;
    std::vector<std::thread>& ts;
    ~Joiner() {
      p.abort();
      for (auto& t : ts) t.join();
    }
  } joiner{pipeline, threads};
  threads.emplace_back([&] { pipeline.read_all(); });
  for (int i = 0; i < s.threads; ++i) threads.emplace_back([&] { pipeline.work(); });

  ProgressBar bar((total_bytes + 999'999) / 1'000'000, opt.progress);
  Tokens t;
  while (pipeline.next(t)) {
    if (t.error) std::rethrow_exception(t.error);
    writer.append(t.ids);
    s.documents += t.documents;
    s.empty_documents += t.empty;
    s.invalid_utf8 += t.invalid_utf8;
    s.input_bytes += t.bytes;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    bar.update(s.input_bytes / 1'000'000, fmt::format("MB  {:.1f} MB/s  {:.2f} M tokens/s", s.input_bytes / 1e6 / secs,
                                                      writer.num_tokens() / 1e6 / secs));
  }
  bar.finish();
  MT_CHECK(s.documents > 0, "tokenize: the inputs ({}) hold no documents ({} files, {} bytes{})",
           fmt::join(opt.inputs, ", "), files.size(), total_bytes,
           s.empty_documents > 0 ? fmt::format(", {} empty documents", s.empty_documents) : "");
  for (const auto& sh : writer.finish()) s.shards.push_back(sh.path);
  s.tokens = writer.num_tokens();
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  write_index(opt.out_dir, tok, opt, s, writer.finish());
  if (s.invalid_utf8 > 0) {
    spdlog::warn("tokenize: {} ill-formed UTF-8 sequences in plain-text files were replaced by U+FFFD",
                 s.invalid_utf8);
  }
  return s;
}

std::string format_tokenize_summary(const TokenizeSummary& s) {
  const double secs = std::max(s.seconds, 1e-9);
  return fmt::format(
      "tokenized {} files ({:.1f} MB, {} documents{}) into {} tokens in {} shard{} of uint{} in {:.2f} s: {:.2f} MB/s, "
      "{:.2f} M tokens/s on {} threads",
      s.files, s.input_bytes / 1e6, s.documents,
      s.empty_documents > 0 ? fmt::format(", {} empty skipped", s.empty_documents) : "", s.tokens, s.shards.size(),
      s.shards.size() == 1 ? "" : "s", s.token_bytes * 8, s.seconds, s.input_bytes / 1e6 / secs,
      s.tokens / 1e6 / secs, s.threads);
}

std::string encode_file_to_json(const Tokenizer& tok, const std::string& path) {
  const std::string text = read_whole_file(path);
  const size_t valid = utf8_valid_prefix(text);
  MT_CHECK(valid == text.size(), "{}: not valid UTF-8 (byte offset {})", path, valid);
  return json(tok.encode(text)).dump() + "\n";
}

std::string decode_json_file(const Tokenizer& tok, const std::string& path) {
  const std::string text = read_whole_file(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    MT_THROW("{}: malformed JSON: {}", path, json_error(e));
  }
  MT_CHECK(j.is_array(), "{}: expected a JSON array of token ids, got {}", path, j.type_name());
  std::vector<int32_t> ids;
  ids.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    MT_CHECK(j[i].is_number_integer() && j[i].get<int64_t>() >= INT32_MIN && j[i].get<int64_t>() <= INT32_MAX,
             "{}: element {} is {}, expected an integer token id", path, i, j[i].dump());
    ids.push_back(j[i].get<int32_t>());
  }
  return tok.decode(ids);
}

}  // namespace moetrain
