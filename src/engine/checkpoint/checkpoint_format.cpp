#include "engine/checkpoint/checkpoint_format.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <unistd.h>

#include "engine/json_file.h"

namespace moetrain {
namespace fs = std::filesystem;
namespace {

constexpr int kFormatVersion = 1;



Shape full_start(const Shape& start, size_t ndim) { return start.empty() ? Shape(ndim, 0) : start; }

int64_t volume(const Shape& s) { return shape_numel(s); }

// Whether boxes [a, a+as) and [b, b+bs) share an element.
bool boxes_overlap(const Shape& a, const Shape& as, const Shape& b, const Shape& bs) {
  for (size_t d = 0; d < a.size(); ++d) {
    if (std::max(a[d], b[d]) >= std::min(a[d] + as[d], b[d] + bs[d])) return false;
  }
  return true;
}

// Copies the intersection of a source box (bytes laid out row-major in src, placed at
// s_start with shape s_shape) and a destination box (dst at d_start, d_shape). Returns the
// number of elements copied.
int64_t copy_intersection(const uint8_t* src, const Shape& s_start, const Shape& s_shape, uint8_t* dst,
                          const Shape& d_start, const Shape& d_shape, size_t elem) {
  const size_t nd = s_shape.size();
  if (nd == 0) {
    std::memcpy(dst, src, elem);
    return 1;
  }
  Shape lo(nd), hi(nd);
  for (size_t d = 0; d < nd; ++d) {
    lo[d] = std::max(s_start[d], d_start[d]);
    hi[d] = std::min(s_start[d] + s_shape[d], d_start[d] + d_shape[d]);
    if (lo[d] >= hi[d]) return 0;
  }
  std::vector<int64_t> s_stride(nd, 1), d_stride(nd, 1);
  for (size_t d = nd - 1; d-- > 0;) {
    s_stride[d] = s_stride[d + 1] * s_shape[d + 1];
    d_stride[d] = d_stride[d + 1] * d_shape[d + 1];
  }
  const int64_t run = hi[nd - 1] - lo[nd - 1];
  Shape idx = lo;
  int64_t copied = 0;
  while (true) {
    int64_t so = 0, doff = 0;
    for (size_t d = 0; d < nd; ++d) {
      so += (idx[d] - s_start[d]) * s_stride[d];
      doff += (idx[d] - d_start[d]) * d_stride[d];
    }
    std::memcpy(dst + doff * elem, src + so * elem, static_cast<size_t>(run) * elem);
    copied += run;
    // Advance the outer dims (all but the last) like an odometer.
    size_t d = nd - 1;
    while (d-- > 0) {
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
    }
    if (d == static_cast<size_t>(-1)) break;
  }
  return copied;
}

// An integer of the index. nlohmann's get<> turns a JSON float into an integer by a C++ cast,
// which is undefined beyond the type's range (UBSan, fuzz_checkpoint_index: "bytes": 1.4e86),
// so only JSON integers are taken.
int64_t index_int(const nlohmann::json& v, const std::string& index, const std::string& what) {
  MT_CHECK(v.is_number_integer(), "{}: {} must be an integer, got {}", index, what,
           v.is_primitive() ? v.dump() : std::string(v.type_name()));
  return v.get<int64_t>();
}

Shape index_shape(const nlohmann::json& v, const std::string& index, const std::string& what) {
  MT_CHECK(v.is_array(), "{}: {} must be an array of integers, got {}", index, what, v.type_name());
  Shape out;
  for (const auto& d : v) out.push_back(index_int(d, index, what));
  return out;
}

// A file an index names must be inside the checkpoint's folder: a name, not a path.
void check_plain_file_name(const std::string& index, const std::string& file) {
  MT_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..",
           "{}: file '{}' must be a plain file name inside the checkpoint directory", index, file);
}

// Checks that the slices of tensor `name` tile its global shape.
void check_tiling(const std::string& where, const std::string& name, const CheckpointReader::TensorInfo& t) {
  int64_t covered = 0;
  for (size_t i = 0; i < t.slices.size(); ++i) {
    const auto& s = t.slices[i];
    MT_CHECK(s.start.size() == t.shape.size() && s.shape.size() == t.shape.size(),
             "{}: tensor '{}': slice in {} has rank {} for a tensor of rank {}", where, name, s.file, s.shape.size(),
             t.shape.size());
    for (size_t d = 0; d < t.shape.size(); ++d) {
      MT_CHECK(s.start[d] >= 0 && s.shape[d] >= 0 && s.shape[d] <= t.shape[d] && s.start[d] <= t.shape[d] - s.shape[d],
               "{}: tensor '{}': slice in {} (start {}, shape {}) lies outside the tensor's shape {}", where, name,
               s.file, shape_str(s.start), shape_str(s.shape), shape_str(t.shape));
    }
    covered += volume(s.shape);
  }
  // No two slices overlap. Sorted by their first row, a slice can only meet those that start
  // before its last row ends: with many ranks' flat pieces (a few rows each) that is a few.
  std::vector<size_t> order;
  for (size_t i = 0; i < t.slices.size(); ++i) {
    if (volume(t.slices[i].shape) > 0) order.push_back(i);
  }
  auto row0 = [&](size_t i) { return t.shape.empty() ? int64_t{0} : t.slices[i].start[0]; };
  auto rows = [&](size_t i) { return t.shape.empty() ? int64_t{1} : t.slices[i].shape[0]; };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return row0(a) < row0(b); });
  for (size_t a = 0; a < order.size(); ++a) {
    const auto& s = t.slices[order[a]];
    for (size_t b = a + 1; b < order.size() && row0(order[b]) < row0(order[a]) + rows(order[a]); ++b) {
      const auto& o = t.slices[order[b]];
      MT_CHECK(!boxes_overlap(s.start, s.shape, o.start, o.shape), "{}: tensor '{}': slices in {} and {} overlap",
               where, name, o.file, s.file);
    }
  }
  MT_CHECK(covered == volume(t.shape), "{}: tensor '{}': slices cover {} of its {} elements (a rank's part is missing)",
           where, name, covered, volume(t.shape));
}

}  // namespace

void write_text_synced(const std::filesystem::path& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  MT_CHECK(f, "{}: cannot create", path.string());
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 &&
                  ::fsync(fileno(f)) == 0;
  std::fclose(f);
  MT_CHECK(ok, "{}: write failed", path.string());
}

void write_text_whole(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::path part = path;
  part += ".part";
  write_text_synced(part, text);
  std::filesystem::rename(part, path);
}

std::string rank_file_name(const char* kind, int rank, const char* ext) {
  return fmt::format("{}-r{:05d}.{}", kind, rank, ext);
}

TensorSlice whole_slice(std::string name, Tensor host_data) {
  TensorSlice s;
  s.name = std::move(name);
  s.global_shape = host_data.shape();
  s.data = std::move(host_data);
  return s;
}

TensorSlice whole_slice(std::string name, DType dtype, Shape shape, const void* bytes) {
  TensorSlice s;
  s.name = std::move(name);
  s.global_shape = shape;
  s.dtype = dtype;
  s.shape = std::move(shape);
  s.bytes = bytes;
  return s;
}

void write_rank_files(const std::string& dir, int rank, const std::vector<TensorSlice>& model,
                      const std::vector<TensorSlice>& optimizer) {
  nlohmann::json manifest = {{"rank", rank}, {"files", nlohmann::json::object()}, {"slices", nlohmann::json::array()}};
  auto write_kind = [&](const char* kind, const std::vector<TensorSlice>& slices) {
    if (slices.empty()) return;
    const std::string file = rank_file_name(kind, rank, "safetensors");
    SafetensorsWriter w;
    for (const TensorSlice& s : slices) {
      MT_CHECK(!s.data.defined() || s.data.device().is_cpu(), "checkpoint: slice of '{}' must be on the host", s.name);
      w.add(s.name, s.slice_dtype(), s.slice_shape(), s.slice_bytes());
      auto record = [&](const Shape& start, const Shape& shape, int64_t offset) {
        nlohmann::json j = {{"name", s.name},
                            {"kind", kind},
                            {"file", file},
                            {"dtype", safetensors_dtype_name(s.slice_dtype())},
                            {"global_shape", s.global_shape},
                            {"start", start},
                            {"shape", shape}};
        if (offset >= 0) j["offset"] = offset;
        manifest["slices"].push_back(j);
      };
      if (s.flat_begin >= 0) {
        const int64_t n = volume(s.slice_shape());
        MT_CHECK(s.slice_shape().size() == 1 && s.flat_begin + n <= volume(s.global_shape),
                 "checkpoint: flat slice of '{}' ({} at element {}) does not fit its global shape {}", s.name,
                 shape_str(s.slice_shape()), s.flat_begin, shape_str(s.global_shape));
        int64_t offset = 0;
        for (const auto& [start, shape] : element_range_boxes(s.global_shape, s.flat_begin, s.flat_begin + n)) {
          record(start, shape, offset);
          offset += volume(shape);
        }
      } else {
        MT_CHECK(s.slice_shape().size() == s.global_shape.size(),
                 "checkpoint: slice of '{}' has shape {} for a global shape {}", s.name, shape_str(s.slice_shape()),
                 shape_str(s.global_shape));
        record(full_start(s.start, s.global_shape.size()), s.slice_shape(), -1);
      }
    }
    w.set_metadata({{"format", "pt"}, {"moetrain_kind", kind}});
    const SafetensorsWriter::Written out = w.write((fs::path(dir) / file).string());
    manifest["files"][file] = {{"bytes", out.bytes}, {"xxh3_64", hex64(out.xxh3)}};
  };
  write_kind("model", model);
  write_kind("optimizer", optimizer);
  write_text_whole(fs::path(dir) / rank_file_name("manifest", rank, "json"), manifest.dump(1));
}

std::vector<std::pair<Shape, Shape>> element_range_boxes(const Shape& shape, int64_t begin, int64_t end) {
  std::vector<std::pair<Shape, Shape>> out;
  const int nd = static_cast<int>(shape.size());
  MT_CHECK(begin >= 0 && begin <= end && end <= volume(shape), "element range [{}, {}) outside a tensor of shape {}",
           begin, end, shape_str(shape));
  if (nd == 0) {
    if (end > begin) out.push_back({Shape{}, Shape{}});
    return out;
  }
  // stride[d]: elements in one step of dim d.
  std::vector<int64_t> stride(nd, 1);
  for (int d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];
  int64_t at = begin;
  while (at < end) {
    // The largest block starting at `at`: along the innermost dim d where `at` is not
    // aligned, or the outermost dim whose whole sub-blocks fit.
    int d = nd - 1;
    while (d > 0 && at % stride[d - 1] == 0 && at + stride[d - 1] <= end) --d;
    // Dims inside d are whole; dim d runs from at's index to as far as fits (and the row's end).
    const int64_t idx = (at / stride[d]) % shape[d];
    const int64_t count = std::min((end - at) / stride[d], shape[d] - idx);
    Shape start(nd), box(nd);
    int64_t rem = at;
    for (int k = 0; k < nd; ++k) {
      start[k] = rem / stride[k];
      rem %= stride[k];
      box[k] = k < d ? 1 : (k == d ? count : shape[k]);
    }
    out.push_back({start, box});
    at += count * stride[d];
  }
  return out;
}

void write_index(const std::string& dir, int world, const nlohmann::json& trainer_state) {
  nlohmann::ordered_json index;
  nlohmann::json files = nlohmann::json::object();
  std::map<std::string, CheckpointReader::TensorInfo> tensors;
  std::map<std::string, std::string> kinds;
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    const fs::path mpath = fs::path(dir) / rank_file_name("manifest", r, "json");
    MT_CHECK(fs::exists(mpath), "checkpoint {}: rank {} wrote no manifest ({})", dir, r, mpath.string());
    const nlohmann::json m = read_json_file(mpath);
    for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
      // The rank wrote (and fsynced) its files before its manifest: they must be all there.
      const fs::path fpath = fs::path(dir) / it.key();
      const uint64_t bytes = it.value()["bytes"].get<uint64_t>();
      MT_CHECK(fs::exists(fpath), "checkpoint {}: rank {}'s manifest lists {}, which does not exist", dir, r, it.key());
      MT_CHECK(fs::file_size(fpath) == bytes, "checkpoint {}: rank {}'s file {} has {} bytes, its manifest says {}",
               dir, r, it.key(), fs::file_size(fpath), bytes);
      files[it.key()] = it.value();
      total += bytes;
    }
    for (const auto& s : m["slices"]) {
      const std::string name = s["name"];
      auto& t = tensors[name];
      DType dt;
      MT_CHECK(parse_safetensors_dtype(s["dtype"], &dt), "{}: bad dtype for '{}'", mpath.string(), name);
      const Shape gshape = s["global_shape"].get<Shape>();
      if (t.slices.empty()) {
        t.dtype = dt;
        t.shape = gshape;
        kinds[name] = s["kind"];
      } else {
        MT_CHECK(t.dtype == dt && t.shape == gshape,
                 "checkpoint {}: ranks disagree on tensor '{}': {} {} vs {} {}", dir, name, dtype_name(t.dtype),
                 shape_str(t.shape), dtype_name(dt), shape_str(gshape));
      }
      t.slices.push_back({s["file"], s["start"].get<Shape>(), s["shape"].get<Shape>(), s.value("offset", int64_t{0})});
    }
  }
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  nlohmann::ordered_json tj = nlohmann::ordered_json::object();
  for (auto& [name, t] : tensors) {
    check_tiling("checkpoint " + dir, name, t);
    nlohmann::json slices = nlohmann::json::array();
    std::vector<std::string> where;
    for (const auto& s : t.slices) {
      nlohmann::json j = {{"file", s.file}, {"start", s.start}, {"shape", s.shape}};
      if (s.offset > 0) j["offset"] = s.offset;
      slices.push_back(j);
      if (std::find(where.begin(), where.end(), s.file) == where.end()) where.push_back(s.file);
    }
    if (kinds[name] == "model") {
      if (where.size() == 1) weight_map[name] = where[0];
      else weight_map[name] = where;
    }
    tj[name] = {{"kind", kinds[name]}, {"dtype", safetensors_dtype_name(t.dtype)}, {"shape", t.shape}, {"slices", slices}};
  }
  index["metadata"] = {{"format", "moetrain-checkpoint"},
                       {"format_version", kFormatVersion},
                       {"moetrain_version", MOETRAIN_VERSION},
                       {"world_size", world},
                       {"total_size", total}};
  index["weight_map"] = weight_map;
  index["tensors"] = tj;
  index["files"] = files;
  write_text_synced(fs::path(dir) / "trainer_state.json", trainer_state.dump(1));
  // The model's HF config.json beside the weights: `--init-from` and `convert` read it.
  if (trainer_state.contains("hf_config")) {
    write_text_synced(fs::path(dir) / "config.json", trainer_state["hf_config"].dump(2) + "\n");
  }
  write_text_synced(fs::path(dir) / "index.json", index.dump(1));
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "{}: cannot open directory to sync: {}", dir, std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  MT_CHECK(rc == 0, "{}: fsync failed: {}", dir, std::strerror(errno));
}

// ---- reading ----

bool is_checkpoint_dir(const std::string& dir) { return fs::exists(fs::path(dir) / "index.json"); }

bool is_hf_model_dir(const std::string& dir) {
  return fs::exists(fs::path(dir) / "model.safetensors") || fs::exists(fs::path(dir) / "model.safetensors.index.json");
}

bool hf_folder_has_tensor(const std::string& dir, const std::string& name) {
  const fs::path hf_index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(hf_index)) {
    const nlohmann::json index = read_json_file(hf_index);
    return index.contains("weight_map") && index["weight_map"].is_object() && index["weight_map"].contains(name);
  }
  return SafetensorsFile((fs::path(dir) / "model.safetensors").string()).find(name) != nullptr;
}

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(dir) {
  MT_CHECK(fs::is_directory(dir), "checkpoint '{}' does not exist or is not a directory", dir);
  trainer_state_ = nlohmann::json::object();
  const fs::path idx = fs::path(dir) / "index.json";
  if (fs::exists(idx)) {
    read_index(idx.string());
    const fs::path ts = fs::path(dir) / "trainer_state.json";
    if (fs::exists(ts)) trainer_state_ = read_json_file(ts);
  } else {
    hf_ = true;
    std::vector<std::string> files;
    const fs::path hf_index = fs::path(dir) / "model.safetensors.index.json";
    if (fs::exists(hf_index)) {
      const nlohmann::json index = read_json_file(hf_index);
      MT_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), "{}: no weight_map object",
               hf_index.string());
      for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
        MT_CHECK(it.value().is_string(), "{}: weight_map[{}] must be a file name", hf_index.string(), it.key());
        const std::string f = it.value();
        check_plain_file_name(hf_index.string(), f);
        if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
      }
    } else {
      MT_CHECK(fs::exists(fs::path(dir) / "model.safetensors"),
               "'{}' is neither a moetrain checkpoint (index.json) nor a Hugging Face model folder "
               "(model.safetensors or model.safetensors.index.json)",
               dir);
      files.push_back("model.safetensors");
    }
    // HF folders carry no checksums: the headers are parsed and validated as each file opens.
    for (const std::string& f : files) {
      const SafetensorsFile& sf = open_file(f);
      for (const auto& e : sf.entries()) {
        MT_CHECK(!tensors_.count(e.name), "{}: tensor '{}' appears in two files", dir, e.name);
        MT_CHECK(!e.f8_e4m3,
                 "{}: tensor '{}' is F8_E4M3 (an FP8 checkpoint): `moetrain convert {} <new folder>` dequantizes it "
                 "(with its weight_scale_inv) into a checkpoint to load",
                 dir, e.name, dir);
        TensorInfo t;
        t.dtype = e.dtype;
        t.shape = e.shape;
        t.slices.push_back({f, Shape(e.shape.size(), 0), e.shape});
        tensors_[e.name] = std::move(t);
      }
    }
  }
  for (const auto& [f, bytes] : file_bytes_) {
    const fs::path p = fs::path(dir) / f;
    MT_CHECK(fs::exists(p), "checkpoint {}: file {} is missing", dir, f);
    const uint64_t actual = fs::file_size(p);
    MT_CHECK(actual == bytes, "checkpoint {}: file {} has {} bytes, the index says {} (truncated or replaced)", dir, f,
             actual, bytes);
  }
}

CheckpointReader::~CheckpointReader() = default;

// The index is a file anyone may hand us (a downloaded checkpoint): every value is checked
// for its type and range, every file it names must be a plain name inside the directory, and
// every slice must fit in the bytes its file has (and a tensor's slices together too), so that
// reading a tensor never allocates more than the checkpoint's files hold.
void CheckpointReader::read_index(const std::string& idx) {
  const nlohmann::json index = read_json_file(idx);
  try {
    MT_CHECK(index.is_object() && index.contains("metadata") && index["metadata"].is_object() &&
                 index["metadata"].value("format", "") == "moetrain-checkpoint",
             "{}: not a moetrain checkpoint index (metadata.format must be \"moetrain-checkpoint\")", idx);
    const auto& meta = index["metadata"];
    const int64_t version = meta.contains("format_version") ? index_int(meta["format_version"], idx, "format_version") : 0;
    MT_CHECK(version == kFormatVersion, "{}: format_version {} is not one this moetrain reads ({})", idx, version,
             kFormatVersion);
    MT_CHECK(index.contains("files") && index["files"].is_object() && index.contains("tensors") &&
                 index["tensors"].is_object(),
             "{}: 'files' and 'tensors' must be JSON objects", idx);
    for (auto it = index["files"].begin(); it != index["files"].end(); ++it) {
      const std::string& file = it.key();
      check_plain_file_name(idx, file);
      const int64_t bytes = index_int(it.value().at("bytes"), idx, "files." + file + ".bytes");
      MT_CHECK(bytes >= 0, "{}: files.{}.bytes is negative ({})", idx, file, bytes);
      file_bytes_[file] = static_cast<uint64_t>(bytes);
      file_xxh3_[file] = it.value().at("xxh3_64").get<std::string>();
    }
    for (auto it = index["tensors"].begin(); it != index["tensors"].end(); ++it) {
      TensorInfo t;
      t.kind = it.value().value("kind", "model");
      const std::string dts = it.value().at("dtype");
      MT_CHECK(parse_safetensors_dtype(dts, &t.dtype), "{}: tensor '{}' has unknown dtype {}", idx, it.key(), dts);
      const uint64_t elem = dtype_size(t.dtype);
      const std::string where = "tensors." + it.key();
      t.shape = index_shape(it.value().at("shape"), idx, where + ".shape");
      std::map<std::string, uint64_t> bytes_in;  // this tensor's bytes in each file
      for (const auto& s : it.value().at("slices")) {
        TensorInfo::Slice slice{s.at("file"), index_shape(s.at("start"), idx, where + ".slices[].start"),
                                index_shape(s.at("shape"), idx, where + ".slices[].shape"),
                                s.contains("offset") ? index_int(s["offset"], idx, where + ".slices[].offset") : 0};
        auto bytes = file_bytes_.find(slice.file);
        MT_CHECK(bytes != file_bytes_.end(), "{}: tensor '{}' lives in {}, which the index does not list", idx,
                 it.key(), slice.file);
        // Every product checked for overflow: the slice's elements, its bytes, and the byte
        // where it ends in the file's entry (offset elements in), then this tensor's bytes
        // in the file so far.
        uint64_t elems = 1, slice_bytes = 0, end_bytes = 0;
        bool ok = slice.offset >= 0;
        for (int64_t d : slice.shape) ok = ok && d >= 0 && !__builtin_mul_overflow(elems, uint64_t(d), &elems);
        uint64_t& in_file = bytes_in[slice.file];
        ok = ok && !__builtin_mul_overflow(elems, elem, &slice_bytes) &&
             !__builtin_add_overflow(elems, uint64_t(slice.offset), &end_bytes) &&
             !__builtin_mul_overflow(end_bytes, elem, &end_bytes) && end_bytes <= bytes->second &&
             (in_file += slice_bytes) <= bytes->second;
        MT_CHECK(ok, "{}: tensor '{}': a slice of shape {} at element {} does not fit in {} ({} bytes)", idx, it.key(),
                 shape_str(slice.shape), slice.offset, slice.file, bytes->second);
        t.slices.push_back(std::move(slice));
      }
      int64_t numel = 1;
      for (int64_t d : t.shape) {
        MT_CHECK(d >= 0 && !__builtin_mul_overflow(numel, d, &numel), "{}: tensor '{}' has an impossible shape {}",
                 idx, it.key(), shape_str(t.shape));
      }
      check_tiling(idx, it.key(), t);
      tensors_[it.key()] = std::move(t);
    }
  } catch (const nlohmann::json::exception& e) {  // a key missing or of the wrong type
    MT_THROW("{}: malformed checkpoint index: {}", idx, e.what());
  }
}

const CheckpointReader::TensorInfo& CheckpointReader::info(const std::string& name) const {
  auto it = tensors_.find(name);
  MT_CHECK(it != tensors_.end(), "checkpoint {}: no tensor '{}'", dir_, name);
  return it->second;
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  for (const auto& [n, t] : tensors_) out.push_back(n);
  return out;
}

uint64_t CheckpointReader::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [f, b] : file_bytes_) n += b;
  for (const auto& [f, sf] : open_) n += file_bytes_.count(f) ? 0 : sf->file_size();
  return n;
}

const SafetensorsFile& CheckpointReader::open_file(const std::string& file) {
  auto it = open_.find(file);
  if (it != open_.end()) return *it->second;
  auto sf = std::make_unique<SafetensorsFile>((fs::path(dir_) / file).string());
  auto sum = file_xxh3_.find(file);
  if (sum != file_xxh3_.end()) {
    const std::string actual = hex64(sf->checksum());
    MT_CHECK(actual == sum->second, "checkpoint {}: file {} is corrupt: XXH3 {} but the index recorded {}", dir_, file,
             actual, sum->second);
  }
  return *(open_[file] = std::move(sf));
}

void CheckpointReader::read(const std::string& name, Tensor& dst, const Shape& start_in) {
  const TensorInfo& t = info(name);
  const Shape start = full_start(start_in, t.shape.size());
  MT_CHECK(dst.ndim() == static_cast<int>(t.shape.size()) && start.size() == t.shape.size(),
           "checkpoint {}: tensor '{}' has shape {}, expected one of rank {} (shape {})", dir_, name,
           shape_str(t.shape), dst.ndim(), shape_str(dst.shape()));
  for (size_t d = 0; d < t.shape.size(); ++d) {
    MT_CHECK(start[d] >= 0 && start[d] + dst.shape()[d] <= t.shape[d],
             "checkpoint {}: tensor '{}' has shape {}, expected {}{}", dir_, name, shape_str(t.shape),
             shape_str(dst.shape()), start_in.empty() ? "" : fmt::format(" at offset {}", shape_str(start)));
  }
  if (start_in.empty() || std::all_of(start.begin(), start.end(), [](int64_t v) { return v == 0; })) {
    MT_CHECK(dst.shape() == t.shape || !start_in.empty(), "checkpoint {}: tensor '{}' has shape {}, expected {}", dir_,
             name, shape_str(t.shape), shape_str(dst.shape()));
  }
  Tensor host = Tensor::empty(dst.shape(), t.dtype);
  const size_t elem = dtype_size(t.dtype);
  int64_t copied = 0;
  for (const auto& s : t.slices) {
    const SafetensorsFile& f = open_file(s.file);
    const SafetensorsEntry* e = f.find(name);
    // A box is the whole entry, or (a flat piece) `offset` elements into a 1-D entry.
    const bool fits = e && e->dtype == t.dtype &&
                      ((e->shape == s.shape && s.offset == 0) ||
                       (e->shape.size() == 1 && s.offset >= 0 && s.offset + volume(s.shape) <= e->shape[0]));
    MT_CHECK(fits, "checkpoint {}: file {} lacks tensor '{}' as the index describes it ({} {} at element {})", dir_,
             s.file, name, dtype_name(t.dtype), shape_str(s.shape), s.offset);
    copied += copy_intersection(static_cast<const uint8_t*>(f.data(*e)) + s.offset * elem, s.start, s.shape,
                                static_cast<uint8_t*>(host.raw()), start, dst.shape(), elem);
  }
  MT_CHECK(copied == dst.numel(), "checkpoint {}: tensor '{}': only {} of {} requested elements found", dir_, name,
           copied, dst.numel());
  dst.copy_from(host);
}

Tensor CheckpointReader::read_whole(const std::string& name) {
  const TensorInfo& t = info(name);
  Tensor out = Tensor::empty(t.shape, t.dtype);
  read(name, out);
  return out;
}

}  // namespace moetrain
