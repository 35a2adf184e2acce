#include "engine/data/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "engine/data/json_keys.h"
#include "engine/json_file.h"
#include "engine/data/normalizer.h"
#include "engine/data/regex.h"
#include "engine/data/utf8.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace moetrain {
namespace {

using json_keys::bool_or;
using json_keys::member;
using json_keys::string_at;

// A non-owning reference to a callable: the pre-tokenizer's stages call each other through
// these, a level per Split, without allocating.
template <typename Sig>
class FunctionRef;
template <typename R, typename... A>
class FunctionRef<R(A...)> {
 public:
  template <typename F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef>)
  FunctionRef(F&& f)  // NOLINT: implicit on purpose
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, A... a) -> R { return (*static_cast<std::remove_reference_t<F>*>(o))(a...); }) {}
  R operator()(A... a) const { return call_(obj_, a...); }

 private:
  void* obj_;
  R (*call_)(void*, A...);
};
using PieceFn = FunctionRef<void(std::string_view)>;
using IdFn = FunctionRef<void(int32_t)>;

// GPT-2's byte-to-character table: printable bytes stand for themselves, the other 68
// (controls, space, DEL, NBSP, soft hyphen...) map to U+0100 and up, in byte order.
struct ByteLevelTable {
  std::array<uint32_t, 256> to_char{};
  std::array<int16_t, 512> to_byte{};
  ByteLevelTable() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_char[b] = printable ? static_cast<uint32_t>(b) : next++;
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteLevelTable& byte_level() {
  static const ByteLevelTable table;
  return table;
}

// The text of a byte string in byte-level characters (how the vocabulary spells it).
std::string byte_level_text(std::string_view bytes) {
  std::string s;
  s.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) utf8_append(s, byte_level().to_char[b]);
  return s;
}

// The bytes a vocabulary entry stands for. As the library's ByteLevel decoder does, an
// entry with a character outside the table stands for its own UTF-8 text.
std::string vocab_entry_bytes(const std::string& token) {
  std::string out;
  size_t i = 0;
  while (i < token.size()) {
    const uint32_t cp = utf8_next(token, i);
    if (cp >= 512 || byte_level().to_byte[cp] < 0) return token;
    out += static_cast<char>(byte_level().to_byte[cp]);
  }
  return out;
}

// GPT-2's pre-tokenizer regex, which ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Unicode's White_Space characters: what lstrip/rstrip of an added token take in.
bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// A fast hash for short strings, eight bytes at a time (SplitMix64's multipliers).
uint64_t piece_hash(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

// The merge results of pieces seen before. Encoding is mostly lookups here, so the layout
// is for few cache misses: open addressing over one array of (tag, offset) slots, and each
// entry's key bytes and ids back to back in one arena, two cache lines a lookup where a
// node-based map touches four or five. When full it starts over (cheap, and the common
// pieces come back at once).
class PieceCache {
 public:
  static constexpr size_t kMaxKeyBytes = 64;
  static constexpr size_t kMaxEntries = size_t{1} << 16;

  PieceCache() : slots_(2 * kMaxEntries) {}

  // The ids cached for `piece` (hash h), or nullptr.
  const int32_t* find(std::string_view piece, uint64_t h, size_t& n) const {
    const uint32_t tag = static_cast<uint32_t>(h >> 32) | 1;
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.tag == 0) return nullptr;
      if (s.tag != tag) continue;
      const uint32_t* e = arena_.data() + s.at;
      if ((e[0] & 0xFFFF) == piece.size() && std::memcmp(e + 1, piece.data(), piece.size()) == 0) {
        n = e[0] >> 16;
        return reinterpret_cast<const int32_t*>(e + 1 + (piece.size() + 3) / 4);
      }
    }
  }

  void insert(std::string_view piece, uint64_t h, const std::vector<int32_t>& ids) {
    if (size_ == kMaxEntries) clear();
    const uint32_t tag = static_cast<uint32_t>(h >> 32) | 1;
    size_t i = h & (slots_.size() - 1);
    while (slots_[i].tag != 0) i = (i + 1) & (slots_.size() - 1);
    const size_t at = arena_.size();
    const size_t key_words = (piece.size() + 3) / 4;
    arena_.resize(at + 1 + key_words + ids.size(), 0);
    arena_[at] = static_cast<uint32_t>(piece.size() | ids.size() << 16);
    std::memcpy(arena_.data() + at + 1, piece.data(), piece.size());
    std::memcpy(arena_.data() + at + 1 + key_words, ids.data(), ids.size() * sizeof(int32_t));
    slots_[i] = {tag, static_cast<uint32_t>(at)};
    ++size_;
  }

  void clear() {
    if (size_ == 0) return;
    std::fill(slots_.begin(), slots_.end(), Slot{});
    arena_.clear();
    size_ = 0;
  }

 private:
  struct Slot {
    uint32_t tag = 0;  // high bits of the hash, never 0; 0 marks an empty slot
    uint32_t at = 0;   // entry's offset in arena_: [length | ids << 16] [key bytes] [ids]
  };
  std::vector<Slot> slots_;
  std::vector<uint32_t> arena_;
  size_t size_ = 0;
};

// The merges: (left id, right id) -> (rank, merged id), open addressing on the pair.
class MergeTable {
 public:
  struct Merge {
    int32_t rank, id;
  };

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    entries_.assign(cap, Entry{});
  }
  // A pair listed twice keeps its last rank, as the library's map does.
  void set(int32_t a, int32_t b, Merge m) {
    const uint64_t key = pack(a, b);
    size_t i = slot(key);
    while (entries_[i].key != kEmpty && entries_[i].key != key) i = (i + 1) & (entries_.size() - 1);
    size_ += entries_[i].key == kEmpty;
    entries_[i] = {key, m};
  }
  const Merge* find(int32_t a, int32_t b) const {
    const uint64_t key = pack(a, b);
    for (size_t i = slot(key);; i = (i + 1) & (entries_.size() - 1)) {
      if (entries_[i].key == key) return &entries_[i].merge;
      if (entries_[i].key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are below 2^31, so no pair packs to this
  struct Entry {
    uint64_t key = kEmpty;
    Merge merge{};
  };
  static uint64_t pack(int32_t a, int32_t b) {
    return static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32 | static_cast<uint32_t>(b);
  }
  size_t slot(uint64_t key) const { return mix64(key) & (entries_.size() - 1); }
  std::vector<Entry> entries_ = std::vector<Entry>(16);
  size_t size_ = 0;
};

// What each thread keeps for the tokenizer it used last: PCRE2 match data and JIT stack
// (not shareable between threads) and the merge cache.
struct ThreadState {
  uint64_t owner = 0;  // BpeTokenizer instance the cache belongs to
  RegexScratch rx;
  PieceCache cache;
  std::vector<int32_t> symbols;
};

struct AddedToken {
  std::string content;
  // What the matcher looks for: the content, or for a token with normalized = true what
  // the normalizer makes of it (as the library builds its second matcher).
  std::string match;
  int32_t id = 0;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = true;
};

// Finds added tokens in text: leftmost match first, the longest one where several start
// at the same byte (the library's Aho-Corasick LeftmostLongest). Tokens are few and
// nearly always start with '<' or '[', so a first-byte table skips most of the text.
class AddedTokenMatcher {
 public:
  // `t->match` is not empty.
  void add(const AddedToken* t) {
    const auto first = static_cast<unsigned char>(t->match[0]);
    auto& bucket = by_first_[first];
    bucket.push_back(t);
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const AddedToken* a, const AddedToken* b) { return a->match.size() > b->match.size(); });
    if (!is_first_[first]) {
      is_first_[first] = true;
      ++num_first_;
      only_first_ = first;
    }
  }
  bool empty() const { return num_first_ == 0; }

  // The token matching at the smallest position >= from; sets `start`. nullptr: none.
  const AddedToken* find(std::string_view s, size_t from, size_t& start) const {
    for (size_t i = from; i < s.size(); ++i) {
      if (num_first_ == 1) {
        const void* p = std::memchr(s.data() + i, only_first_, s.size() - i);
        if (p == nullptr) return nullptr;
        i = static_cast<size_t>(static_cast<const char*>(p) - s.data());
      } else if (!is_first_[static_cast<unsigned char>(s[i])]) {
        continue;
      }
      for (const AddedToken* t : by_first_[static_cast<unsigned char>(s[i])]) {
        if (s.compare(i, t->match.size(), t->match) == 0) {
          start = i;
          return t;
        }
      }
    }
    return nullptr;
  }

 private:
  std::array<std::vector<const AddedToken*>, 256> by_first_;
  std::array<bool, 256> is_first_{};
  int num_first_ = 0;
  unsigned char only_first_ = 0;
};

uint64_t file_hash(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return hash_string(bytes);
}

}  // namespace

struct BpeTokenizer::Impl {
  std::string path;
  uint64_t hash = 0;
  uint64_t instance = 0;  // keys the per-thread state

  // Model.
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab;  // byte-level text -> id
  using Merge = MergeTable::Merge;
  MergeTable merges;
  std::array<int32_t, 256> byte_ids{};         // -1: no symbol for that byte
  int32_t unk_id = -1;
  bool fuse_unk = false, ignore_merges = false;

  // Pre-tokenizer: Split stages in order (Isolated, or Removed when drop_matches), then
  // ByteLevel with its optional prefix space and GPT-2 regex.
  struct SplitStage {
    std::unique_ptr<Regex> regex;
    bool drop_matches = false;
  };
  std::vector<SplitStage> splits;
  bool prefix_space = false;
  std::unique_ptr<Regex> byte_level_regex;

  // Normalizer; null when the file has none or one that changes nothing.
  std::unique_ptr<Normalizer> normalizer;

  // Added tokens; raw: matched on the text as given; normalized: on what the normalizer
  // makes of it.
  std::vector<AddedToken> added;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  std::unique_ptr<Regex> word_char;  // for single_word tokens
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added_ids;
  std::unordered_map<int32_t, const AddedToken*> added_by_id;

  // Decoding: the bytes of every id; has_id marks ids that exist.
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> has_id;
  int64_t size = 0;

  int32_t eos = -1;
  std::string eos_text;

  void load(const json& j);
  void load_model(const json& model);
  void load_normalizer(const json& j);
  void load_pre_tokenizer(const json& j);
  void load_decoder(const json& j, const std::string& where);
  void add_pre_tokenizer_stage(const json& stage, const std::string& where, bool& saw_byte_level);
  void load_added_tokens(const json& j);
  void resolve_eos(const std::string& requested);

  ThreadState& state() const {
    thread_local ThreadState st;
    if (st.owner != instance) {
      st.cache.clear();
      st.owner = instance;
    }
    return st;
  }

  std::optional<int32_t> lookup(std::string_view token) const {
    if (auto it = added_ids.find(token); it != added_ids.end()) return it->second;
    if (auto it = vocab.find(token); it != vocab.end()) return it->second;
    return std::nullopt;
  }

  void walk(std::string_view text, ThreadState& st, PieceFn on_piece, IdFn on_added) const;
  void split_added(std::string_view s, const AddedTokenMatcher& m, PieceFn on_text, IdFn on_added) const;
  bool single_word_ok(std::string_view s, size_t start, size_t stop, ThreadState& st) const;
  void pre_tokenize(std::string_view s, size_t stage, ThreadState& st, PieceFn on_piece) const;
  void regex_split(const Regex& re, bool drop_matches, std::string_view s, ThreadState& st, PieceFn on_piece) const;
  void encode_piece(std::string_view piece, ThreadState& st, std::vector<int32_t>& out) const;
  void initial_symbols(std::string_view piece, std::vector<int32_t>& sym) const;
  void merge(std::vector<int32_t>& sym) const;
  void merge_long(std::vector<int32_t>& sym) const;
  const Merge* find_merge(int32_t a, int32_t b) const { return merges.find(a, b); }
};

// ---- loading ----------------------------------------------------------------------------

void BpeTokenizer::Impl::load(const json& j) {
  MT_CHECK(j.is_object(), "{}: a tokenizer.json is a JSON object, this file holds {}", path, j.type_name());
  load_model(member(j, "model", path, "the file"));
  load_normalizer(j.contains("normalizer") ? j["normalizer"] : json());
  load_pre_tokenizer(member(j, "pre_tokenizer", path, "the file"));
  if (j.contains("decoder") && !j["decoder"].is_null()) load_decoder(j["decoder"], "decoder");
  load_added_tokens(j.contains("added_tokens") ? j["added_tokens"] : json::array());

  // Ids for decoding.
  int64_t max_id = -1;
  for (const auto& [text, id] : vocab) max_id = std::max<int64_t>(max_id, id);
  for (const AddedToken& t : added) max_id = std::max<int64_t>(max_id, t.id);
  size = max_id + 1;
  id_bytes.assign(static_cast<size_t>(size), {});
  has_id.assign(static_cast<size_t>(size), 0);
  for (const auto& [text, id] : vocab) {
    id_bytes[id] = vocab_entry_bytes(text);
    has_id[id] = 1;
  }
  // An added token decodes as in the library: the text it keeps for the token (for one
  // with normalized = true, what the normalizer made of it) goes through the byte-level
  // decoder like a vocabulary entry; "<|im_end|>" is itself either way.
  for (const AddedToken& t : added) {
    id_bytes[t.id] = vocab_entry_bytes(t.match);
    has_id[t.id] = 1;
  }
}

void BpeTokenizer::Impl::load_model(const json& model) {
  MT_CHECK(model.is_object(), "{}: model must be a JSON object", path);
  if (model.contains("type")) {
    const std::string type = string_at(model, "type", path, "model");
    MT_CHECK(type == "BPE", "{}: model.type is \"{}\"; moetrain reads byte-level BPE tokenizers only", path, type);
  }
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    MT_CHECK(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0,
             "{}: model.dropout is {}; BPE dropout makes encoding random (a training-time regulariser): set it to "
             "null",
             path, model["dropout"].dump());
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null()) {
      MT_CHECK(model[key].is_string() && model[key].get<std::string>().empty(),
               "{}: model.{} is {}; byte-level BPE has none (this looks like a WordPiece-style BPE)", path, key,
               model[key].dump());
    }
  }
  fuse_unk = bool_or(model, "fuse_unk", false, path, "model");
  ignore_merges = bool_or(model, "ignore_merges", false, path, "model");

  const json& v = member(model, "vocab", path, "model");
  MT_CHECK(v.is_object(), "{}: model.vocab must be an object of token -> id, not {}", path, v.type_name());
  vocab.reserve(v.size());
  for (auto it = v.begin(); it != v.end(); ++it) {
    MT_CHECK(it.value().is_number_integer() && it.value().get<int64_t>() >= 0 &&
                 it.value().get<int64_t>() < INT32_MAX,
             "{}: model.vocab[\"{}\"] must be a non-negative integer id, not {}", path, it.key(), it.value().dump());
    vocab[it.key()] = it.value().get<int32_t>();
  }

  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    const std::string unk = string_at(model, "unk_token", path, "model");
    auto it = vocab.find(unk);
    MT_CHECK(it != vocab.end(), "{}: model.unk_token \"{}\" is not in model.vocab", path, unk);
    unk_id = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(byte_level_text(std::string(1, static_cast<char>(b))));
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
  }
  // byte_fallback spells a byte with no symbol as a <0xNN> token; with all 256 byte-level
  // symbols in the vocabulary (as byte-level BPEs have) it never applies.
  if (bool_or(model, "byte_fallback", false, path, "model")) {
    const auto missing = std::find(byte_ids.begin(), byte_ids.end(), -1);
    MT_CHECK(missing == byte_ids.end(),
             "{}: model.byte_fallback is true and the vocabulary has no symbol for byte 0x{:02X}: byte fallback "
             "(<0xNN> tokens) is not implemented",
             path, static_cast<int>(missing - byte_ids.begin()));
  }

  const json& m = member(model, "merges", path, "model");
  MT_CHECK(m.is_array(), "{}: model.merges must be an array, not {}", path, m.type_name());
  merges.reserve(m.size());
  for (size_t r = 0; r < m.size(); ++r) {
    const json& e = m[r];
    std::string a, b;
    if (e.is_string()) {
      // "left right": the format before tokens with spaces needed pairs.
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      MT_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
               "{}: model.merges[{}] is \"{}\"; expected two tokens separated by one space", path, r, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      MT_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(),
               "{}: model.merges[{}] is {}; expected \"left right\" or [\"left\", \"right\"]", path, r, e.dump());
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    MT_CHECK(ia != vocab.end() && ib != vocab.end(), "{}: model.merges[{}] (\"{}\" + \"{}\") names a token not in "
             "model.vocab", path, r, a, b);
    MT_CHECK(iab != vocab.end(), "{}: model.merges[{}] makes \"{}\", which is not in model.vocab", path, r, a + b);
    merges.set(ia->second, ib->second, Merge{static_cast<int32_t>(r), iab->second});
  }
}

void BpeTokenizer::Impl::load_normalizer(const json& n) {
  auto norm = std::make_unique<Normalizer>(n, path);
  if (!norm->empty()) normalizer = std::move(norm);
}

void BpeTokenizer::Impl::load_decoder(const json& d, const std::string& where) {
  // ByteLevel decoding maps the byte-level characters back to bytes; the library's
  // ByteLevel decoder ignores its add_prefix_space, trim_offsets and use_regex options.
  const std::string type = string_at(d, "type", path, where);
  if (type == "Sequence") {
    const json& list = member(d, "decoders", path, where);
    MT_CHECK(list.is_array(), "{}: {}.decoders must be an array, not {}", path, where, list.type_name());
    for (size_t i = 0; i < list.size(); ++i) load_decoder(list[i], fmt::format("{}.decoders[{}]", where, i));
    return;
  }
  MT_CHECK(type == "ByteLevel",
           "{}: {}.type is \"{}\"; moetrain implements the ByteLevel decoder (and Sequence of it) that byte-level "
           "BPE tokenizers use",
           path, where, type);
}

void BpeTokenizer::Impl::load_pre_tokenizer(const json& p) {
  MT_CHECK(!p.is_null(), "{}: pre_tokenizer is null; a byte-level BPE needs a ByteLevel pre-tokenizer", path);
  bool saw_byte_level = false;
  add_pre_tokenizer_stage(p, "pre_tokenizer", saw_byte_level);
  MT_CHECK(saw_byte_level, "{}: pre_tokenizer has no ByteLevel step; moetrain reads byte-level BPE tokenizers only",
           path);
}

void BpeTokenizer::Impl::add_pre_tokenizer_stage(const json& s, const std::string& where, bool& saw_byte_level) {
  const std::string type = string_at(s, "type", path, where);
  MT_CHECK(!saw_byte_level, "{}: {} ({}) comes after ByteLevel; moetrain needs ByteLevel to be the last step", path,
           where, type);
  if (type == "Sequence") {
    const json& list = member(s, "pretokenizers", path, where);
    MT_CHECK(list.is_array(), "{}: {}.pretokenizers must be an array", path, where);
    for (size_t i = 0; i < list.size(); ++i) {
      add_pre_tokenizer_stage(list[i], fmt::format("{}.pretokenizers[{}]", where, i), saw_byte_level);
    }
  } else if (type == "Split") {
    const json& pat = member(s, "pattern", path, where);
    const bool literal = pat.is_object() && pat.contains("String");
    MT_CHECK(pat.is_object() && (literal || pat.contains("Regex")),
             "{}: {}.pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}, not {}", path, where, pat.dump());
    const std::string text = string_at(pat, literal ? "String" : "Regex", path, where + ".pattern");
    const std::string behavior = string_at(s, "behavior", path, where);
    MT_CHECK(behavior == "Isolated" || behavior == "Removed",
             "{}: {}.behavior is \"{}\"; moetrain supports Isolated and Removed", path, where, behavior);
    // With Isolated, matches and the text between them are pieces either way, so
    // "invert" changes nothing; with Removed it would keep the matches instead.
    const bool invert = bool_or(s, "invert", false, path, where);
    MT_CHECK(!(invert && behavior == "Removed"), "{}: {}: invert with behavior Removed is not supported", path, where);
    splits.push_back({std::make_unique<Regex>(text, literal, fmt::format("{}: {}.pattern", path, where)),
                      behavior == "Removed"});
  } else if (type == "Digits") {
    // The library's Digits splits off digits (Unicode numeric characters), one by one or
    // in runs: the same as an Isolated split on \p{N} or \p{N}+.
    const bool individual = bool_or(s, "individual_digits", false, path, where);
    splits.push_back({std::make_unique<Regex>(individual ? "\\p{N}" : "\\p{N}+", false, path), false});
  } else if (type == "ByteLevel") {
    saw_byte_level = true;
    prefix_space = bool_or(s, "add_prefix_space", true, path, where);
    if (bool_or(s, "use_regex", true, path, where)) {
      byte_level_regex = std::make_unique<Regex>(kGpt2Pattern, false, path);
    }
  } else {
    MT_THROW("{}: {}.type is \"{}\"; moetrain supports Sequence, Split, Digits and ByteLevel pre-tokenizers "
             "(byte-level BPE)",
             path, where, type);
  }
}

void BpeTokenizer::Impl::load_added_tokens(const json& list) {
  MT_CHECK(list.is_array(), "{}: added_tokens must be an array, not {}", path, list.type_name());
  std::unordered_map<std::string, size_t> index;  // content -> position in `added`
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = fmt::format("added_tokens[{}]", i);
    const json& e = list[i];
    AddedToken t;
    t.content = string_at(e, "content", path, where);
    const json& id = member(e, "id", path, where);
    MT_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < INT32_MAX,
             "{}: {}.id must be a non-negative integer, not {}", path, where, id.dump());
    t.id = id.get<int32_t>();
    t.special = bool_or(e, "special", false, path, where);
    t.lstrip = bool_or(e, "lstrip", false, path, where);
    t.rstrip = bool_or(e, "rstrip", false, path, where);
    t.single_word = bool_or(e, "single_word", false, path, where);
    t.normalized = bool_or(e, "normalized", !t.special, path, where);
    if (t.content.empty()) continue;  // the library ignores these too
    MT_CHECK(utf8_valid_prefix(t.content) == t.content.size(), "{}: {}.content is not valid UTF-8", path, where);
    if (auto it = index.find(t.content); it != index.end()) {
      added[it->second] = t;  // the later entry wins, as in the library's map
    } else {
      index[t.content] = added.size();
      added.push_back(t);
    }
  }
  for (AddedToken& t : added) {
    added_ids[t.content] = t.id;
    added_by_id[t.id] = &t;
    t.match = t.content;
    if (t.normalized && normalizer) normalizer->apply(t.content, t.match);
    // A token that normalizes to nothing (" " under Strip) matches nowhere.
    if (!t.match.empty()) (t.normalized ? normalized_matcher : raw_matcher).add(&t);
    if (t.single_word && !word_char) {
      // The library's \w (Rust regex, Unicode): alphabetic, marks, decimal digits,
      // connector punctuation, joiners.
      word_char = std::make_unique<Regex>(R"(^[\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", false, path);
    }
  }
}

void BpeTokenizer::Impl::resolve_eos(const std::string& requested) {
  std::string name = requested;
  const fs::path config = fs::path(path).parent_path() / "tokenizer_config.json";
  if (name.empty() && lookup("<|endoftext|>")) name = "<|endoftext|>";
  if (name.empty() && fs::exists(config)) {
    const json c = read_json_file(config.string());
    if (c.is_object() && c.contains("eos_token")) {
      const json& e = c["eos_token"];
      if (e.is_string()) name = e.get<std::string>();
      if (e.is_object() && e.contains("content") && e["content"].is_string()) name = e["content"].get<std::string>();
    }
  }
  std::vector<std::string> specials;
  for (const AddedToken& t : added) {
    if (t.special) specials.push_back(t.content);
  }
  MT_CHECK(!name.empty(),
           "{}: no end-of-text token: the vocabulary has no <|endoftext|> and there is no tokenizer_config.json with "
           "an eos_token beside it; name one (moetrain tokenize --eos TOKEN). Special tokens: {}",
           path, specials.empty() ? "none" : fmt::format("{}", fmt::join(specials, " ")));
  std::optional<int32_t> id = lookup(name);
  MT_CHECK(id.has_value(), "{}: the end-of-text token \"{}\" is not in the vocabulary. Special tokens: {}", path, name,
           specials.empty() ? "none" : fmt::format("{}", fmt::join(specials, " ")));
  eos = *id;
  eos_text = name;
}

// ---- encoding ---------------------------------------------------------------------------

void BpeTokenizer::Impl::walk(std::string_view text, ThreadState& st, PieceFn on_piece, IdFn on_added) const {
  // As the library: tokens with normalized = false are cut out of the raw text first;
  // each non-empty span between them is normalized on its own (so Prepend prefixes each
  // span, Strip strips each), then tokens with normalized = true are cut out of what the
  // normalizer made, then the rest is pre-tokenized.
  auto pre = [&](std::string_view span) { pre_tokenize(span, 0, st, on_piece); };
  auto second = [&](std::string_view span) {
    std::string normalized;  // written only when the normalizer changes the span
    if (normalizer && normalizer->apply(span, normalized)) span = normalized;
    split_added(span, normalized_matcher, pre, on_added);
  };
  split_added(text, raw_matcher, second, on_added);
}

void BpeTokenizer::Impl::split_added(std::string_view s, const AddedTokenMatcher& m, PieceFn on_text,
                                     IdFn on_added) const {
  if (m.empty()) {
    if (!s.empty()) on_text(s);
    return;
  }
  ThreadState* st = nullptr;
  size_t from = 0, done = 0;  // search from `from`; text before `done` is handed out
  size_t start = 0;
  while (const AddedToken* t = m.find(s, from, start)) {
    size_t stop = start + t->match.size();
    from = stop;
    if (t->single_word) {
      if (st == nullptr) st = &state();
      if (!single_word_ok(s, start, stop, *st)) continue;
    }
    if (t->lstrip) {
      while (start > done) {
        const size_t c = utf8_char_start_before(s, start);
        size_t k = c;
        if (!is_white_space(utf8_next(s, k))) break;
        start = c;
      }
    }
    if (t->rstrip) {
      while (stop < s.size()) {
        size_t k = stop;
        if (!is_white_space(utf8_next(s, k))) break;
        stop = k;
      }
    }
    if (start > done) on_text(s.substr(done, start - done));
    on_added(t->id);
    done = stop;
    from = std::max(from, stop);
  }
  if (done < s.size()) on_text(s.substr(done));
}

bool BpeTokenizer::Impl::single_word_ok(std::string_view s, size_t start, size_t stop, ThreadState& st) const {
  auto is_word = [&](size_t at) {
    size_t end = at;
    utf8_next(s, end);
    const int rc = pcre2_match(word_char->code(), reinterpret_cast<PCRE2_SPTR>(s.data() + at), end - at, 0,
                               PCRE2_NO_UTF_CHECK, st.rx.match, st.rx.context);
    return rc >= 0;
  };
  if (start > 0 && is_word(utf8_char_start_before(s, start))) return false;
  if (stop < s.size() && is_word(stop)) return false;
  return true;
}

void BpeTokenizer::Impl::pre_tokenize(std::string_view s, size_t stage, ThreadState& st, PieceFn on_piece) const {
  if (s.empty()) return;
  if (stage < splits.size()) {
    auto next = [&](std::string_view piece) { pre_tokenize(piece, stage + 1, st, on_piece); };
    regex_split(*splits[stage].regex, splits[stage].drop_matches, s, st, next);
    return;
  }
  // ByteLevel: the optional leading space, then GPT-2's split.
  std::string spaced;
  if (prefix_space && s[0] != ' ') {
    spaced.reserve(s.size() + 1);
    spaced += ' ';
    spaced += s;
    s = spaced;
  }
  if (byte_level_regex) {
    regex_split(*byte_level_regex, false, s, st, on_piece);
  } else {
    on_piece(s);
  }
}

void BpeTokenizer::Impl::regex_split(const Regex& re, bool drop_matches, std::string_view s, ThreadState& st,
                                     PieceFn on_piece) const {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t pos = 0, done = 0;
  while (pos < s.size()) {
    const int rc = pcre2_match(re.code(), subject, s.size(), pos, PCRE2_NO_UTF_CHECK, st.rx.match, st.rx.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    MT_CHECK(rc >= 0, "{}: the pre-tokenizer regex /{}/ failed on a text of {} bytes: {}", path, re.pattern(),
             s.size(), pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.rx.match);
    const size_t a = ov[0], b = ov[1];
    if (b == a) {  // an empty match splits nothing: look again one character on
      if (a >= s.size()) break;
      pos = a + utf8_char_length(static_cast<unsigned char>(s[a]));
      continue;
    }
    if (a > done) on_piece(s.substr(done, a - done));
    if (!drop_matches) on_piece(s.substr(a, b - a));
    done = pos = b;
  }
  if (done < s.size()) on_piece(s.substr(done));
}

void BpeTokenizer::Impl::initial_symbols(std::string_view piece, std::vector<int32_t>& sym) const {
  sym.clear();
  bool last_unk = false;
  for (unsigned char b : piece) {
    int32_t id = byte_ids[b];
    if (id < 0) {
      MT_CHECK(unk_id >= 0,
               "{}: the vocabulary has no token for byte 0x{:02X} (byte-level character U+{:04X}) and no unk_token",
               path, b, byte_level().to_char[b]);
      if (fuse_unk && last_unk) continue;
      id = unk_id;
      last_unk = true;
    } else {
      last_unk = false;
    }
    sym.push_back(id);
  }
}

void BpeTokenizer::Impl::merge(std::vector<int32_t>& sym) const {
  // Short pieces (nearly all): scan for the lowest-ranked pair each round. Equal ranks
  // can only be the same pair, and the leftmost goes first, as in the library.
  if (sym.size() > 48) {
    merge_long(sym);
    return;
  }
  while (sym.size() >= 2) {
    int32_t best_rank = INT32_MAX, best_id = -1;
    size_t best = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      const Merge* m = find_merge(sym[i], sym[i + 1]);
      if (m != nullptr && m->rank < best_rank) {
        best_rank = m->rank;
        best_id = m->id;
        best = i;
      }
    }
    if (best_id < 0) break;
    sym[best] = best_id;
    sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
}

void BpeTokenizer::Impl::merge_long(std::vector<int32_t>& sym) const {
  // Long pieces (runs of spaces or symbols): a heap of candidate pairs keyed by (rank,
  // position) over a linked list of symbols, O(n log n). A candidate whose pair has
  // changed since it was pushed makes a different token and is skipped.
  struct Node {
    int32_t id, prev, next;
  };
  struct Cand {
    int32_t rank, pos, id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const int32_t n = static_cast<int32_t>(sym.size());
  std::vector<Node> nodes(static_cast<size_t>(n));
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  for (int32_t i = 0; i < n; ++i) {
    nodes[i] = {sym[i], i - 1, i + 1 < n ? i + 1 : -1};
    if (i + 1 < n) {
      if (const Merge* m = find_merge(sym[i], sym[i + 1])) heap.push({m->rank, i, m->id});
    }
  }
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Node& a = nodes[c.pos];
    if (a.id < 0 || a.next < 0) continue;
    Node& b = nodes[a.next];
    const Merge* m = find_merge(a.id, b.id);
    if (m == nullptr || m->id != c.id) continue;
    a.id = c.id;
    b.id = -1;
    a.next = b.next;
    if (a.next >= 0) nodes[a.next].prev = c.pos;
    if (a.prev >= 0) {
      if (const Merge* l = find_merge(nodes[a.prev].id, a.id)) heap.push({l->rank, a.prev, l->id});
    }
    if (a.next >= 0) {
      if (const Merge* r = find_merge(a.id, nodes[a.next].id)) heap.push({r->rank, c.pos, r->id});
    }
  }
  sym.clear();
  for (int32_t i = 0; i >= 0; i = nodes[i].next) sym.push_back(nodes[i].id);
}

void BpeTokenizer::Impl::encode_piece(std::string_view piece, ThreadState& st, std::vector<int32_t>& out) const {
  if (piece.size() == 1 && !ignore_merges && byte_ids[static_cast<unsigned char>(piece[0])] >= 0) {
    out.push_back(byte_ids[static_cast<unsigned char>(piece[0])]);
    return;
  }
  const bool cacheable = piece.size() <= PieceCache::kMaxKeyBytes;
  const uint64_t h = cacheable ? piece_hash(piece) : 0;
  if (cacheable) {
    size_t n = 0;
    if (const int32_t* ids = st.cache.find(piece, h, n)) {
      out.insert(out.end(), ids, ids + n);
      return;
    }
  }
  std::vector<int32_t>& sym = st.symbols;
  std::optional<int32_t> whole;
  if (ignore_merges) {
    // Llama 3 style: a piece that is a vocabulary entry is that entry, merges or not.
    if (auto it = vocab.find(byte_level_text(piece)); it != vocab.end()) whole = it->second;
  }
  if (whole) {
    sym.assign(1, *whole);
  } else {
    initial_symbols(piece, sym);
    merge(sym);
  }
  out.insert(out.end(), sym.begin(), sym.end());
  if (cacheable) st.cache.insert(piece, h, sym);
}

// ---- public -----------------------------------------------------------------------------

BpeTokenizer::BpeTokenizer(const std::string& path, const std::string& eos_token) : impl_(std::make_unique<Impl>()) {
  static std::atomic<uint64_t> next_instance{1};
  impl_->instance = next_instance.fetch_add(1);
  impl_->path = path;
  MT_CHECK(fs::is_regular_file(path), "{}: no such tokenizer file", path);
  impl_->load(read_json_file(path));
  impl_->resolve_eos(eos_token);
  impl_->hash = file_hash(path);
  const bool jit = impl_->splits.empty() ? (impl_->byte_level_regex && impl_->byte_level_regex->jit())
                                         : impl_->splits[0].regex->jit();
  spdlog::debug("{}: {} ids, {} merges, {} added tokens, normalizer {}, {} split regexes (PCRE2 JIT {})", path,
                impl_->size, impl_->merges.size(), impl_->added.size(),
                impl_->normalizer ? impl_->normalizer->describe() : "none", impl_->splits.size(), jit ? "on" : "off");
}

BpeTokenizer::~BpeTokenizer() = default;

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  const size_t valid = utf8_valid_prefix(text);
  MT_CHECK(valid == text.size(), "{}: cannot encode text that is not valid UTF-8 (bad byte 0x{:02X} at offset {})",
           impl_->path, static_cast<unsigned char>(text[valid]), valid);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  ThreadState& st = impl_->state();
  impl_->walk(
      text, st, [&](std::string_view piece) { impl_->encode_piece(piece, st, out); },
      [&](int32_t id) { out.push_back(id); });
  return out;
}

std::vector<std::string> BpeTokenizer::pre_tokenize(std::string_view text) const {
  const size_t valid = utf8_valid_prefix(text);
  MT_CHECK(valid == text.size(), "{}: text is not valid UTF-8 at offset {}", impl_->path, valid);
  std::vector<std::string> pieces;
  impl_->walk(
      text, impl_->state(), [&](std::string_view piece) { pieces.emplace_back(piece); },
      [&](int32_t id) { pieces.push_back(impl_->added_by_id.at(id)->match); });
  return pieces;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size() * 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    MT_CHECK(id >= 0 && id < impl_->size && impl_->has_id[id],
             "{}: cannot decode token {} (at position {}): not in the vocabulary (ids 0..{})", impl_->path, id, i,
             impl_->size - 1);
    out += impl_->id_bytes[id];
  }
  return out;
}

int64_t BpeTokenizer::vocab_size() const { return impl_->size; }
int32_t BpeTokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> BpeTokenizer::token_to_id(std::string_view token) const { return impl_->lookup(token); }
uint64_t BpeTokenizer::fingerprint() const { return impl_->hash; }
const std::string& BpeTokenizer::path() const { return impl_->path; }
const std::string& BpeTokenizer::eos_token() const { return impl_->eos_text; }

std::string BpeTokenizer::describe() const {
  return fmt::format("BPE {} ({} ids, {} merges, {} added tokens, eos {} = {})", impl_->path, impl_->size,
                     impl_->merges.size(), impl_->added.size(), impl_->eos_text, impl_->eos);
}

}  // namespace moetrain
