#include "engine/data/sft_loader.h"

#include <omp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "engine/data/chat.h"
#include "ops/ops.h"

namespace fs = std::filesystem;

namespace moetrain {
namespace {

bool is_jsonl(const fs::path& p) { return p.extension() == ".jsonl" || p.extension() == ".ndjson"; }

// The JSONL files of `paths`: files as named, folders' *.jsonl / *.ndjson recursively in
// sorted order, hidden entries skipped.
std::vector<fs::path> chat_files(const std::vector<std::string>& paths) {
  MT_CHECK(!paths.empty(), "[data].paths is empty: name the JSONL files of conversations, or folders of them");
  std::vector<fs::path> out;
  for (const std::string& p : paths) {
    std::error_code ec;
    const fs::file_status st = fs::status(p, ec);
    MT_CHECK(fs::exists(st), "[data].paths: '{}' does not exist", p);
    if (!fs::is_directory(st)) {
      out.emplace_back(p);
      continue;
    }
    std::vector<fs::path> found;
    fs::recursive_directory_iterator it(p, ec), end;
    MT_CHECK(!ec, "[data].paths: cannot list folder '{}': {}", p, ec.message());
    for (; it != end; it.increment(ec)) {
      MT_CHECK(!ec, "[data].paths: cannot list folder '{}': {}", p, ec.message());
      const bool hidden = it->path().filename().string().starts_with(".");
      if (it->is_directory(ec)) {
        if (hidden) it.disable_recursion_pending();
      } else if (!hidden && is_jsonl(it->path()) && it->is_regular_file(ec)) {
        found.push_back(it->path());
      }
    }
    MT_CHECK(!found.empty(), "[data].paths: folder '{}' holds no *.jsonl files", p);
    std::sort(found.begin(), found.end());
    out.insert(out.end(), found.begin(), found.end());
  }
  return out;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "{}: cannot read", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  MT_CHECK(!in.bad(), "{}: error while reading", path.string());
  return std::move(ss).str();
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

void append(ChatDocuments& d, const ChatTokens& t) {
  d.ids.insert(d.ids.end(), t.ids.begin(), t.ids.end());
  d.trained.insert(d.trained.end(), t.trained.begin(), t.trained.end());
  d.offsets.push_back(static_cast<int64_t>(d.ids.size()));
}

}  // namespace

int64_t ChatDocuments::trained_tokens() const { return std::accumulate(trained.begin(), trained.end(), int64_t{0}); }

ChatCorpus load_chat_corpus(const DataConfig& config, const Tokenizer& tok, int threads) {
  MT_CHECK(config.chat_template == "chatml", "[data].chat_template = \"{}\": only \"chatml\" is supported",
           config.chat_template);
  const ChatMlTemplate chatml(tok);
  ChatCorpus c;
  for (const fs::path& file : chat_files(config.paths)) {
    const std::string text = read_file(file);
    ++c.files;
    c.bytes += static_cast<int64_t>(text.size());
    struct Line {
      std::string_view text;
      int64_t number;
    };
    std::vector<Line> lines;
    for (size_t pos = 0, number = 1; pos < text.size(); ++number) {
      const size_t nl = std::min(text.find('\n', pos), text.size());
      std::string_view l(text.data() + pos, nl - pos);
      if (l.ends_with('\r')) l.remove_suffix(1);  // the split hashes the line: CRLF and LF files alike
      if (!is_blank(l)) lines.push_back({l, static_cast<int64_t>(number)});
      pos = nl + 1;
    }
    // Tokenize in parallel; the first error in line order is the one reported.
    const auto n = static_cast<int64_t>(lines.size());
    std::vector<ChatTokens> tokens(static_cast<size_t>(n));
    std::vector<std::string> errors(static_cast<size_t>(n));
    const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 16) num_threads(nt)
    for (int64_t i = 0; i < n; ++i) {
      const std::string where = fmt::format("{}:{}", file.string(), lines[i].number);
      try {
        tokens[i] = chatml.tokenize(parse_chat_line(lines[i].text, where), where);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!errors[i].empty()) MT_THROW("{}", errors[i]);
      const bool val = uniform_at(hash_string(lines[i].text), 0) < config.val_fraction;
      append(val ? c.val : c.train, tokens[i]);
    }
  }
  const int64_t docs = c.train.size() + c.val.size();
  MT_CHECK(docs > 0, "[data].paths ({}): {} files, {} bytes, and no conversation: the corpus is empty",
           fmt::join(config.paths, ", "), c.files, c.bytes);
  MT_CHECK(c.train.size() > 0 && c.val.size() > 0,
           "[data].paths: of {} conversations, {} went to training and {} to validation ([data].val_fraction = {}); "
           "both need at least one: add conversations or change val_fraction",
           docs, c.train.size(), c.val.size(), config.val_fraction);
  return c;
}

SftLoader::SftLoader(std::shared_ptr<const ChatDocuments> docs, int64_t micro_batch, int64_t seq_len, uint64_t seed,
                     bool shuffle, bool packing, int32_t pad_id, int data_rank, int data_world)
    : docs_(std::move(docs)),
      micro_batch_(micro_batch),
      seq_len_(seq_len),
      seed_(seed),
      shuffle_(shuffle),
      packing_(packing),
      pad_id_(pad_id),
      rank_(data_rank),
      world_(data_world) {
  check_data_rank("SftLoader", micro_batch, data_rank, data_world);
  MT_CHECK(seq_len > 0, "SftLoader: seq_len must be > 0, got {}", seq_len);
  MT_CHECK(docs_->size() > 0, "SftLoader: no conversations");
  for (int64_t i = 0; i < docs_->size(); ++i) truncated_ += docs_->length(i) - 1 > seq_len;
  plan_epoch(0);
}

void SftLoader::plan_epoch(int64_t epoch) {
  if (planned_epoch_ == epoch) return;
  const int64_t n = docs_->size(), S = seq_len_;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  if (shuffle_) {  // Fisher-Yates from a stream keyed by (seed, epoch)
    Rng rng(mix64(seed_ ^ mix64(static_cast<uint64_t>(epoch) + 1)));
    for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.below(static_cast<uint64_t>(i + 1))]);
  }
  rows_.clear();
  if (!packing_) {
    for (int64_t d : order) rows_.push_back({d});
  } else {
    // Best fit: the open row with the least room that still holds the conversation; ties to
    // the row opened first (multimap keeps insertion order among equal keys).
    std::multimap<int64_t, int64_t> room;  // free positions -> row
    for (int64_t d : order) {
      const int64_t len = std::min(docs_->length(d) - 1, S);
      auto it = room.lower_bound(len);
      int64_t row, left;
      if (it == room.end()) {
        row = static_cast<int64_t>(rows_.size());
        rows_.emplace_back();
        left = S - len;
      } else {
        row = it->second;
        left = it->first - len;
        room.erase(it);
      }
      rows_[row].push_back(d);
      if (left > 0) room.emplace(left, row);
    }
  }
  planned_epoch_ = epoch;
}

double SftLoader::fill() const {
  int64_t used = 0;
  for (const auto& row : rows_) {
    for (int64_t d : row) used += std::min(docs_->length(d) - 1, seq_len_);
  }
  return static_cast<double>(used) / static_cast<double>(rows_.size() * seq_len_);
}

void SftLoader::fill_row(int64_t row, int64_t i, Batch& b) const {
  const int64_t S = seq_len_;
  int32_t* in = b.inputs.data<int32_t>() + i * S;
  int32_t* tg = b.targets.data<int32_t>() + i * S;
  int32_t* pos = b.positions.data<int32_t>() + i * S;
  int32_t* seg = b.segment_ids.defined() ? b.segment_ids.data<int32_t>() + i * S : nullptr;
  int64_t t = 0;
  int32_t segment = 0;
  for (int64_t d : rows_[row]) {
    const int64_t first = docs_->offsets[d];
    const int64_t len = std::min(docs_->length(d) - 1, S - t);
    for (int64_t j = 0; j < len; ++j, ++t) {
      in[t] = docs_->ids[first + j];
      tg[t] = docs_->trained[first + j + 1] ? docs_->ids[first + j + 1] : ops::kIgnoreIndex;
      pos[t] = static_cast<int32_t>(j);
      if (seg) seg[t] = segment;
    }
    ++segment;
  }
  for (int64_t j = 0; t < S; ++j, ++t) {  // padding: a segment of its own, nothing to learn
    in[t] = pad_id_;
    tg[t] = ops::kIgnoreIndex;
    pos[t] = static_cast<int32_t>(j);
    if (seg) seg[t] = segment;
  }
}

Batch SftLoader::next() {
  const int64_t B = micro_batch_;
  Batch b = Batch::allocate(B, seq_len_, packing_);
  const int64_t first = static_cast<int64_t>(rank_) * B;
  for (int64_t g = 0; g < B * world_; ++g) {
    if (row_ >= rows_in_epoch()) set_epoch_row(epoch_ + 1, 0);
    const int64_t row = row_++;
    if (g >= first && g < first + B) fill_row(row, g - first, b);
  }
  b.count_targets();
  return b;
}

void SftLoader::set_epoch_row(int64_t epoch, int64_t row) {
  plan_epoch(epoch);
  epoch_ = epoch;
  row_ = row;
}

void SftLoader::set_position(const nlohmann::json& p) {
  const auto [e, r] = epoch_position(p, "row", "SFT loader");
  plan_epoch(e);
  MT_CHECK(r <= rows_in_epoch(),
           "data position {}: row {} is beyond the {} rows of epoch {} (did the conversations, seq_len or packing "
           "change since the checkpoint?)",
           p.dump(), r, rows_in_epoch(), e);
  epoch_ = e;
  row_ = r;
}

}  // namespace moetrain
