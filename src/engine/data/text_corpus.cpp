#include "engine/data/text_corpus.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"

namespace fs = std::filesystem;

namespace moetrain {
namespace {

// The files under `dir`, in sorted order, depth first.
void collect_folder(const fs::path& dir, std::vector<fs::path>& files) {
  std::vector<fs::directory_entry> entries;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
  MT_CHECK(!ec, "[data].paths: cannot list folder '{}': {}", dir.string(), ec.message());
  std::sort(entries.begin(), entries.end(),
            [](const fs::directory_entry& a, const fs::directory_entry& b) { return a.path() < b.path(); });
  for (const auto& e : entries) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    if (e.is_symlink(ec)) continue;  // fortune's *.u8 links duplicate their targets
    if (e.is_directory(ec)) {
      if (name != "off") collect_folder(e.path(), files);  // "off": fortune's offensive set
    } else if (e.is_regular_file(ec)) {
      if (e.path().extension() != ".dat") files.push_back(e.path());  // strfile's binary index
    }
  }
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "[data].paths: cannot read '{}'", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  MT_CHECK(!in.bad(), "[data].paths: error while reading '{}'", path.string());
  return std::move(ss).str();
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); });
}

// Calls `emit` for each document of `text`: the lines between "%" lines, without the
// newlines that end it.
template <typename Emit>
void split_documents(std::string_view text, Emit&& emit) {
  size_t doc_begin = 0, pos = 0;
  auto finish = [&](size_t doc_end) {
    std::string_view doc = text.substr(doc_begin, doc_end - doc_begin);
    while (!doc.empty() && (doc.back() == '\n' || doc.back() == '\r')) doc.remove_suffix(1);
    if (!is_blank(doc)) emit(doc);
  };
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(pos, line_end - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    size_t next = nl == std::string_view::npos ? text.size() : nl + 1;
    if (line == "%") {
      finish(pos);
      doc_begin = next;
    }
    pos = next;
  }
  finish(text.size());
}

}  // namespace

Corpus load_text_corpus(const DataConfig& config, const Tokenizer& tokenizer, int64_t min_split_tokens) {
  MT_CHECK(!config.paths.empty(), "data.paths is empty: name at least one file or folder of text");
  std::vector<fs::path> files;
  for (const auto& p : config.paths) {
    std::error_code ec;
    fs::file_status st = fs::status(p, ec);  // follows a link named explicitly
    MT_CHECK(fs::exists(st), "[data].paths: '{}' does not exist", p);
    if (fs::is_directory(st)) {
      const size_t before = files.size();
      collect_folder(p, files);
      MT_CHECK(files.size() > before, "[data].paths: folder '{}' holds no text files", p);
    } else {
      files.emplace_back(p);
    }
  }

  Corpus c;
  for (const auto& file : files) {
    const std::string text = read_file(file);
    c.bytes += static_cast<int64_t>(text.size());
    split_documents(text, [&](std::string_view doc) {
      const bool val = uniform_at(hash_string(doc), 0) < config.val_fraction;
      std::vector<int32_t>& out = val ? c.val : c.train;
      std::vector<int32_t> ids = tokenizer.encode(doc);
      out.insert(out.end(), ids.begin(), ids.end());
      out.push_back(tokenizer.eos_id());
      ++(val ? c.val_documents : c.train_documents);
    });
  }

  const int64_t docs = c.train_documents + c.val_documents;
  MT_CHECK(docs > 0, "data.paths ({}) hold no documents ({} files, {} bytes, all empty)",
           fmt::join(config.paths, ", "), files.size(), c.bytes);
  auto check_split = [&](const char* name, const std::vector<int32_t>& tokens, int64_t n_docs) {
    MT_CHECK(static_cast<int64_t>(tokens.size()) >= min_split_tokens,
             "data: the {} split has {} tokens ({} of {} documents, data.val_fraction = {}), fewer than the {} one "
             "sequence needs (training.seq_len + 1); add text, change data.val_fraction or shorten training.seq_len",
             name, tokens.size(), n_docs, docs, config.val_fraction, min_split_tokens);
  };
  check_split("training", c.train, c.train_documents);
  check_split("validation", c.val, c.val_documents);
  return c;
}

}  // namespace moetrain
