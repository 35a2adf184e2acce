#include "core/tensor.h"

#include <fmt/ranges.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/allocator.h"
#include "core/cuda_runtime.h"

namespace moetrain {

uint8_t float_to_fp8_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (std::isnan(f)) return 0x7f;
  const float a = std::fabs(f);
  if (a >= kFp8E4m3Max) return sign | 0x7e;  // saturated (infinities too)
  if (a == 0.0f) return sign;
  int e = 0;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): a's exponent is e - 1
  // The grid of e4m3 values near a: steps of 2^(e - 1 - 3) in the normal range, 2^-9 below
  // 2^-6 (subnormals). Dividing by a power of two is exact; nearbyint rounds to nearest even.
  const int step_exp = std::max(e - 4, -9);
  const float steps = std::nearbyint(std::ldexp(a, -step_exp));  // a in steps (<= 16 for normals)
  const int n = static_cast<int>(steps);
  if (e - 1 < -6) {  // below the smallest normal 2^-6: subnormal (n <= 8; 8 rounds up to 2^-6)
    return static_cast<uint8_t>(sign | (n == 8 ? 0x08 : n));
  }
  // n in [8, 16]: mantissa n - 8 of exponent step_exp + 3; 16 carries into the next exponent.
  int biased = step_exp + 3 + 7, m = n - 8;
  if (n == 16) {
    ++biased;
    m = 0;
  }
  if (biased > 15 || (biased == 15 && m == 7)) return sign | 0x7e;  // rounded past 448
  return static_cast<uint8_t>(sign | (biased << 3) | m);
}

float fp8_e4m3_to_float(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int e = (bits >> 3) & 0xf, m = bits & 0x7;
  if (e == 0xf && m == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m) / 8.0f, -6);  // subnormal
  return sign * std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::I16: return 2;
    case DType::F8E4M3: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::I16: return "i16";
    case DType::F8E4M3: return "f8e4m3";
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* out) {
  struct Entry { std::string_view a, b; DType t; };
  static const Entry kEntries[] = {{"f32", "float32", DType::F32}, {"f64", "float64", DType::F64},
                                   {"bf16", "bfloat16", DType::BF16}, {"i32", "int32", DType::I32},
                                   {"i64", "int64", DType::I64}, {"i16", "int16", DType::I16},
                                   {"f8e4m3", "float8_e4m3fn", DType::F8E4M3}};
  for (const auto& e : kEntries) {
    if (name == e.a || name == e.b) {
      *out = e.t;
      return true;
    }
  }
  return false;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    MT_CHECK(d >= 0, "negative dimension in shape {}", shape_str(s));
    n *= d;
  }
  return n;
}

// Owns one block: host memory, or device memory from the stream-ordered pool (freed on the
// stream that is current when the last reference goes, which orders the free after the
// work already queued there).
class Storage {
 public:
  Storage(size_t bytes, Device device, bool pinned = false) : bytes_(bytes), device_(device), pinned_(pinned) {
    allocate();
  }
  // Memory someone else owns (Tensor::borrowed): never freed here.
  Storage(void* borrowed, size_t bytes, Device device)
      : ptr_(borrowed), bytes_(bytes), device_(device), pinned_(false), owned_(false) {}
  ~Storage() { free(); }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool resident() const { return ptr_ != nullptr || bytes_ == 0; }
  void release() {
    MT_CHECK(!pinned_, "pinned host memory cannot be released while its tensors live");
    MT_CHECK(owned_, "borrowed memory cannot be released by its tensors");
    free();
    ptr_ = nullptr;
  }
  void restore() {
    if (ptr_ == nullptr) allocate();
  }

 private:
  void allocate() {
    if (pinned_) {
      ptr_ = cuda::pinned_alloc(std::max<size_t>(bytes_, 1));
    } else if (device_.is_cpu()) {
      ptr_ = host_alloc(bytes_);
    } else {
      MT_CHECK(cuda::available(), "cannot allocate on {}: {}", device_.str(), cuda::unavailable_reason());
      // CUDA allocates on the thread's current device, whatever the tensor says.
      MT_CHECK(cuda::current_device() == device_.index, "cannot allocate on {}: this thread's current CUDA device is "
               "cuda:{} (cuda::set_device first)", device_.str(), cuda::current_device());
      ptr_ = cuda::device_alloc(bytes_, cuda::current_stream());
    }
  }
  void free() {
    if (ptr_ == nullptr || !owned_) return;
    if (pinned_) {
      try {
        cuda::pinned_free(ptr_);
      } catch (...) {
      }
    } else if (device_.is_cpu()) {
      host_free(ptr_, bytes_);
    } else {
      try {
        cuda::device_free(ptr_, bytes_, cuda::current_stream());
      } catch (...) {  // a destructor must not throw; the pool reclaims at exit
      }
    }
  }

  void* ptr_ = nullptr;
  size_t bytes_;
  Device device_;
  bool pinned_;
  bool owned_ = true;
};

Tensor Tensor::borrowed(void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(data, t.nbytes(), device);
  return t;
}

Tensor Tensor::empty_pinned(const Shape& shape, DType dtype) {
  if (!cuda::available()) return empty(shape, dtype);
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), Device::cpu(), /*pinned=*/true);
  return t;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  Tensor t = empty(shape, dtype_of<T>());
  MT_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "from_vector: {} values for shape {}",
           values.size(), shape_str(shape));
  if (t.nbytes() > 0) std::memcpy(t.raw(), values.data(), t.nbytes());  // an empty vector's data() may be null
  return t;
}
template Tensor Tensor::from_vector(const std::vector<float>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<double>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<int32_t>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<int64_t>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<int16_t>&, const Shape&);

int64_t Tensor::size(int d) const {
  int n = ndim();
  if (d < 0) d += n;
  MT_CHECK(d >= 0 && d < n, "dimension {} out of range for tensor {}", d, str());
  return shape_[d];
}

void Tensor::release_memory() const {
  MT_CHECK(defined(), "release of an undefined tensor");
  storage_->release();
}

void Tensor::restore_memory() const {
  MT_CHECK(defined(), "restore of an undefined tensor");
  storage_->restore();
}

bool Tensor::memory_resident() const { return defined() && storage_->resident(); }

bool Tensor::whole_storage() const { return defined() && offset_ == 0 && nbytes() == storage_->bytes(); }

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

std::string Tensor::str() const {
  if (!defined()) return "undefined";
  return fmt::format("{}{} {}", dtype_name(dtype_), shape_str(shape_), device().str());
}

void* Tensor::raw() const {
  MT_CHECK(defined(), "access to an undefined tensor");
  MT_CHECK(storage_->resident(), "access to a tensor whose memory is released ({}: a sharded weight that was not "
           "gathered)", str());
  return static_cast<char*>(storage_->ptr()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  MT_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
           "slice [{}, {}) out of range for tensor {}", begin, end, str());
  Tensor t = *this;
  int64_t row = numel_ / std::max<int64_t>(shape_[0], 1);
  t.shape_[0] = end - begin;
  t.numel_ = row * (end - begin);
  t.offset_ = offset_ + begin * row;
  return t;
}

Tensor Tensor::select(int64_t i) const {
  Tensor t = slice(i, i + 1);
  t.shape_.erase(t.shape_.begin());
  return t;
}

Tensor Tensor::view(const Shape& shape) const {
  MT_CHECK(shape_numel(shape) == numel_, "cannot view tensor {} as shape {}", str(), shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  Tensor t = empty(shape_, dtype, device());
  t.copy_from(*this);
  return t;
}

namespace {
template <typename D, typename S>
void convert(D* dst, const S* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<D, bf16> || std::is_same_v<D, f8e4m3>) {
      dst[i] = D(static_cast<float>(src[i]));
    } else if constexpr (std::is_same_v<S, bf16> || std::is_same_v<S, f8e4m3>) {
      dst[i] = static_cast<D>(static_cast<float>(src[i]));
    } else {
      dst[i] = static_cast<D>(src[i]);
    }
  }
}

template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::BF16: f(bf16{}); break;
    case DType::I32: f(int32_t{}); break;
    case DType::I64: f(int64_t{}); break;
    case DType::I16: f(int16_t{}); break;
    case DType::F8E4M3: f(f8e4m3{}); break;
  }
}
}  // namespace

void Tensor::copy_from(const Tensor& src) {
  MT_CHECK(src.numel() == numel_, "copy_from: source {} does not match destination {}", src.str(), str());
  const bool here = device().is_cpu(), there = src.device().is_cpu();
  if (!here || !there) {
    if (src.dtype() != dtype_) {  // convert on the host
      Tensor h = Tensor::empty(shape_, dtype_);
      h.copy_from(there ? src : src.to(Device::cpu()));
      copy_from(h);
      return;
    }
    if (here) cuda::copy_device_to_host(raw(), src.raw(), nbytes());
    else if (there) cuda::copy_host_to_device(raw(), src.raw(), nbytes());
    else cuda::copy_device_to_device(raw(), src.raw(), nbytes());
    return;
  }
  if (src.dtype() == dtype_) {
    std::memmove(raw(), src.raw(), nbytes());
    return;
  }
  dispatch_dtype(dtype_, [&](auto d) {
    using D = decltype(d);
    dispatch_dtype(src.dtype(), [&](auto s) {
      using S = decltype(s);
      convert(static_cast<D*>(raw()), static_cast<const S*>(src.raw()), numel_);
    });
  });
}

namespace {
// The strided copy under copy_columns_from / columns: `rows` rows of `cols` elements.
void copy_column_block(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t rows,
                       int64_t cols) {
  const size_t e = dtype_size(dst.dtype());
  const size_t dp = static_cast<size_t>(dst.size(1)) * e, sp = static_cast<size_t>(src.size(1)) * e;
  char* d = static_cast<char*>(dst.raw()) + static_cast<size_t>(dst_col) * e;
  const char* s = static_cast<const char*>(src.raw()) + static_cast<size_t>(src_col) * e;
  const size_t width = static_cast<size_t>(cols) * e;
  if (rows == 0 || cols == 0) return;
  if (dst.device().is_cpu()) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * dp, s + r * sp, width);
  } else {
    cuda::copy_device_to_device_2d(d, dp, s, sp, width, static_cast<size_t>(rows));
  }
}

void check_column_operands(const Tensor& a, const Tensor& b, const char* op) {
  MT_CHECK(a.ndim() == 2 && b.ndim() == 2, "{}: needs 2-D tensors, got {} and {}", op, a.str(), b.str());
  MT_CHECK(a.dtype() == b.dtype() && a.device() == b.device(), "{}: {} and {} differ in dtype or device", op,
           a.str(), b.str());
  MT_CHECK(a.size(0) == b.size(0), "{}: {} and {} have different row counts", op, a.str(), b.str());
}
}  // namespace

void Tensor::copy_columns_from(int64_t col, const Tensor& src) {
  check_column_operands(*this, src, "copy_columns_from");
  MT_CHECK(col >= 0 && col + src.size(1) <= size(1), "copy_columns_from: columns [{}, {}) of {}", col,
           col + src.size(1), str());
  copy_column_block(*this, col, src, 0, size(0), src.size(1));
}

Tensor Tensor::columns(int64_t begin, int64_t end) const {
  MT_CHECK(ndim() == 2 && begin >= 0 && begin <= end && end <= size(1), "columns [{}, {}) of {}", begin, end, str());
  Tensor out = empty({size(0), end - begin}, dtype_, device());
  copy_column_block(out, 0, *this, begin, size(0), end - begin);
  return out;
}

void Tensor::zero_() {
  if (device().is_cpu()) std::memset(raw(), 0, nbytes());
  else cuda::memset_device(raw(), 0, nbytes());
}

void Tensor::fill_(double value) {
  if (!device().is_cpu()) {  // rare (initialisation): fill on the host, copy over
    Tensor h = Tensor::empty(shape_, dtype_);
    h.fill_(value);
    copy_from(h);
    return;
  }
  dispatch_dtype(dtype_, [&](auto d) {
    using D = decltype(d);
    D v;
    if constexpr (std::is_same_v<D, bf16>) v = bf16(static_cast<float>(value));
    else v = static_cast<D>(value);
    D* p = static_cast<D*>(raw());
    for (int64_t i = 0; i < numel_; ++i) p[i] = v;
  });
}

double Tensor::item(int64_t i) const {
  MT_CHECK(i >= 0 && i < numel_, "item {} out of range for tensor {}", i, str());
  if (!device().is_cpu()) return view({numel_}).slice(i, i + 1).to(Device::cpu()).item(0);
  double out = 0;
  dispatch_dtype(dtype_, [&](auto d) {
    using D = decltype(d);
    const D* p = static_cast<const D*>(raw());
    if constexpr (std::is_same_v<D, bf16> || std::is_same_v<D, f8e4m3>) out = static_cast<float>(p[i]);
    else out = static_cast<double>(p[i]);
  });
  return out;
}

std::vector<double> Tensor::to_double_vector() const {
  if (!device().is_cpu()) return to(Device::cpu()).to_double_vector();
  std::vector<double> v(numel_);
  Tensor t = Tensor::empty(shape_, DType::F64);
  t.copy_from(*this);
  if (t.nbytes() > 0) std::memcpy(v.data(), t.raw(), t.nbytes());
  return v;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  if (!device().is_cpu()) return to(Device::cpu()).to_vector<T>();
  const T* p = data<T>();
  return std::vector<T>(p, p + numel_);
}
template std::vector<float> Tensor::to_vector() const;
template std::vector<double> Tensor::to_vector() const;
template std::vector<int32_t> Tensor::to_vector() const;
template std::vector<int64_t> Tensor::to_vector() const;

std::vector<Tensor> to_host(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> out = tensors;
  // Packed back to back, and only those bytes come back: padding that nothing wrote would be
  // copied uninitialized (compute-sanitizer's initcheck reports it).
  std::vector<size_t> at(tensors.size(), 0);  // byte offset of each device tensor in the buffer
  size_t bytes = 0;
  Device device = Device::cpu();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined() || t.device().is_cpu()) continue;
    MT_CHECK(device.is_cpu() || t.device() == device, "to_host: tensors on {} and {}", device.str(), t.device().str());
    device = t.device();
    at[i] = bytes;
    bytes += t.nbytes();
  }
  if (bytes == 0) return out;
  Tensor gathered = Tensor::empty({static_cast<int64_t>((bytes + 7) / 8)}, DType::I64, device);
  auto* base = static_cast<char*>(gathered.raw());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (t.defined() && !t.device().is_cpu()) cuda::copy_device_to_device(base + at[i], t.raw(), t.nbytes());
  }
  std::vector<char> host(bytes);
  cuda::copy_device_to_host(host.data(), base, bytes);  // the one wait
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined() || t.device().is_cpu()) continue;
    out[i] = Tensor::empty(t.shape(), t.dtype());
    if (t.nbytes() > 0) std::memcpy(out[i].raw(), host.data() + at[i], t.nbytes());
  }
  return out;
}

void check_shape(const Tensor& t, const Shape& shape, const char* name) {
  MT_CHECK(t.defined(), "tensor {} is undefined, expected shape {}", name, shape_str(shape));
  MT_CHECK(t.shape() == shape, "tensor {} has shape {}, expected {}", name, shape_str(t.shape()),
           shape_str(shape));
}

void check_dtype(const Tensor& t, DType dtype, const char* name) {
  MT_CHECK(t.dtype() == dtype, "tensor {} has dtype {}, expected {}", name, dtype_name(t.dtype()),
           dtype_name(dtype));
}

}  // namespace moetrain
