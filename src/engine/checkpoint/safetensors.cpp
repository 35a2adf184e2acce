#include "engine/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

namespace moetrain {
namespace {

// A header larger than this is not a weight file (the reference reader's limit is 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

void write_all(int fd, const void* data, size_t bytes, XXH3_state_t* hash, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  XXH3_64bits_update(hash, p, bytes);
  while (bytes > 0) {
    // Bounded chunks: Linux writes at most ~2 GiB per call anyway.
    const ssize_t n = ::write(fd, p, std::min<size_t>(bytes, 1u << 30));
    if (n < 0 && errno == EINTR) continue;
    MT_CHECK(n > 0, "{}: write failed: {}", path, std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace

std::string safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::I16: return "I16";
    case DType::F8E4M3: return "F8_E4M3";
  }
  MT_THROW("unknown dtype {}", static_cast<int>(t));
}

bool parse_safetensors_dtype(const std::string& s, DType* out) {
  if (s == "F32") *out = DType::F32;
  else if (s == "F64") *out = DType::F64;
  else if (s == "BF16") *out = DType::BF16;
  else if (s == "I32") *out = DType::I32;
  else if (s == "I64") *out = DType::I64;
  else if (s == "I16") *out = DType::I16;
  else return false;
  return true;
}


uint64_t xxh3_bytes(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

// ---- writer ----

void SafetensorsWriter::add(const std::string& name, DType dtype, const Shape& shape, const void* data) {
  MT_CHECK(!name.empty() && name != "__metadata__", "safetensors: bad tensor name '{}'", name);
  for (const Item& it : items_) MT_CHECK(it.name != name, "safetensors: tensor '{}' added twice", name);
  items_.push_back({name, dtype, shape, data});
}

void SafetensorsWriter::add(const std::string& name, const Tensor& t) {
  MT_CHECK(t.device().is_cpu(), "safetensors: tensor '{}' must be on the host to be written, is {}", name, t.str());
  add(name, t.dtype(), t.shape(), t.raw());
}

SafetensorsWriter::Written SafetensorsWriter::write(const std::string& path, bool sync) const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const Item& it : items_) {
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(it.shape)) * dtype_size(it.dtype);
    header[it.name] = {{"dtype", safetensors_dtype_name(it.dtype)},
                       {"shape", it.shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  // Spaces pad the header so the data starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  uint8_t size_le[8];
  for (int i = 0; i < 8; ++i) size_le[i] = static_cast<uint8_t>(n >> (8 * i));

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MT_CHECK(fd >= 0, "{}: cannot create: {}", path, std::strerror(errno));
  XXH3_state_t* hash = XXH3_createState();
  XXH3_64bits_reset(hash);
  try {
    write_all(fd, size_le, 8, hash, path);
    write_all(fd, text.data(), text.size(), hash, path);
    for (const Item& it : items_) {
      write_all(fd, it.data, static_cast<size_t>(shape_numel(it.shape)) * dtype_size(it.dtype), hash, path);
    }
    if (sync) MT_CHECK(::fsync(fd) == 0, "{}: fsync failed: {}", path, std::strerror(errno));
  } catch (...) {
    XXH3_freeState(hash);
    ::close(fd);
    throw;
  }
  Written w{8 + n + offset, XXH3_64bits_digest(hash)};
  XXH3_freeState(hash);
  MT_CHECK(::close(fd) == 0, "{}: close failed: {}", path, std::strerror(errno));
  return w;
}

// ---- reader ----

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd_ >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    MT_THROW("{}: cannot stat: {}", path, std::strerror(errno));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  try {
    MT_CHECK(size_ >= 8, "{}: not a safetensors file: {} bytes, shorter than the 8-byte header size", path, size_);
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    MT_CHECK(m != MAP_FAILED, "{}: mmap failed: {}", path, std::strerror(errno));
    map_ = static_cast<const uint8_t*>(m);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(map_[i]) << (8 * i);
    MT_CHECK(n <= kMaxHeaderBytes && n <= size_ - 8,
             "{}: header size {} is impossible (file is {} bytes; at most 100 MB of header is accepted): "
             "truncated or not a safetensors file",
             path, n, size_);
    data_start_ = 8 + n;
    const uint64_t data_size = size_ - data_start_;
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(map_ + 8, map_ + 8 + n);
    } catch (const nlohmann::json::exception& e) {
      MT_THROW("{}: header is not valid JSON: {}", path, e.what());
    }
    MT_CHECK(header.is_object(), "{}: header must be a JSON object", path);
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& key = it.key();
      const nlohmann::json& v = it.value();
      if (key == "__metadata__") {
        MT_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings", path);
        for (auto m = v.begin(); m != v.end(); ++m) {
          MT_CHECK(m.value().is_string(), "{}: __metadata__.{} must be a string", path, m.key());
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      MT_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
               "{}: tensor '{}' needs dtype, shape and data_offsets", path, key);
      SafetensorsEntry e;
      e.name = key;
      e.f8_e4m3 = v["dtype"].is_string() && v["dtype"].get<std::string>() == "F8_E4M3";
      MT_CHECK(e.f8_e4m3 || (v["dtype"].is_string() && parse_safetensors_dtype(v["dtype"].get<std::string>(), &e.dtype)),
               "{}: tensor '{}' has dtype {}, expected one of F32, F64, BF16, I32, I64 (or F8_E4M3 with a "
               "weight_scale_inv)",
               path, key, v["dtype"].dump());
      MT_CHECK(v["shape"].is_array(), "{}: tensor '{}': shape must be an array", path, key);
      uint64_t numel = 1;
      for (const auto& d : v["shape"]) {
        MT_CHECK(d.is_number_unsigned() && d.get<uint64_t>() < (1ull << 40),
                 "{}: tensor '{}': shape {} must hold non-negative integers", path, key, v["shape"].dump());
        e.shape.push_back(d.get<int64_t>());
        numel *= d.get<uint64_t>();
        MT_CHECK(numel < (1ull << 48), "{}: tensor '{}': shape {} is too large", path, key, v["shape"].dump());
      }
      const auto& off = v["data_offsets"];
      MT_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
               "{}: tensor '{}': data_offsets must be [begin, end]", path, key);
      e.begin = off[0].get<uint64_t>();
      e.end = off[1].get<uint64_t>();
      MT_CHECK(e.begin <= e.end && e.end <= data_size,
               "{}: tensor '{}': data_offsets [{}, {}] fall outside the {} data bytes (truncated file?)", path, key,
               e.begin, e.end, data_size);
      const uint64_t element = e.f8_e4m3 ? 1 : dtype_size(e.dtype);
      MT_CHECK(e.end - e.begin == numel * element, "{}: tensor '{}': {} bytes for shape {} of {}, expected {}", path,
               key, e.end - e.begin, shape_str(e.shape), v["dtype"].get<std::string>(), numel * element);
      by_name_[key] = entries_.size();
      entries_.push_back(std::move(e));
    }
    // The offsets must tile [0, data_size) exactly.
    std::vector<const SafetensorsEntry*> sorted;
    for (const auto& e : entries_) sorted.push_back(&e);
    std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->begin < b->begin || (a->begin == b->begin && a->end < b->end); });
    uint64_t at = 0;
    for (const auto* e : sorted) {
      MT_CHECK(e->begin == at, "{}: tensor '{}' starts at byte {} of the data, expected {} (overlap or gap)", path,
               e->name, e->begin, at);
      at = e->end;
    }
    MT_CHECK(at == data_size, "{}: tensors cover {} of the {} data bytes (trailing bytes: corrupt file)", path, at,
             data_size);
  } catch (...) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
    ::close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

const void* SafetensorsFile::data(const SafetensorsEntry& e) const { return map_ + data_start_ + e.begin; }

Tensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  MT_CHECK(e, "{}: no tensor '{}'", path_, name);
  MT_CHECK(!e->f8_e4m3, "{}: tensor '{}' is F8_E4M3: `moetrain convert` the folder first (it dequantizes it with its "
           "weight_scale_inv)", path_, name);
  Tensor t = Tensor::empty(e->shape, e->dtype);
  if (t.nbytes() > 0) std::memcpy(t.raw(), data(*e), t.nbytes());
  return t;
}

uint64_t SafetensorsFile::checksum() const { return xxh3_bytes(map_, size_); }

}  // namespace moetrain
