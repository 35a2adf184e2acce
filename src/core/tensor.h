// Tensor: a contiguous, typed, shaped view into reference-counted storage.
//
// Views share storage and only ever cut along dim 0 (slice/select) or reshape (view), so
// every tensor stays contiguous and raw pointers can go straight to BLAS or a kernel.
// Copies are explicit (clone, copy_from, to).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace moetrain {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Storage;

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  // A host tensor in page-locked memory when a GPU is usable (fast, asynchronous copies
  // from the device), else an ordinary host tensor.
  static Tensor empty_pinned(const Shape& shape, DType dtype);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // A tensor over memory it does not own (a peer GPU's buffer mapped here, say): the owner
  // keeps it alive past every use; restore/release do not apply.
  static Tensor borrowed(void* data, const Shape& shape, DType dtype, Device device);
  static Tensor full(const Shape& shape, double value, DType dtype, Device device = Device::cpu());
  // A CPU tensor holding a copy of `values`.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  // Whether another tensor (a view, or another handle of this one) holds this storage too:
  // a cache holding a tensor can tell that nobody else will ask for it.
  bool storage_shared() const { return storage_ != nullptr && storage_.use_count() > 1; }
  // Whether this tensor is all of its storage (not a view of part of a larger buffer).
  bool whole_storage() const;
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const;  // negative d counts from the end
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  Device device() const;
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  std::string str() const;  // "f32[4, 8] cpu"

  void* raw() const;
  // Where this view starts in its storage, in elements: a stable identity for an element of
  // a flat buffer whatever views it is reached through (stochastic rounding keys on it).
  int64_t storage_offset() const { return offset_; }
  // Typed pointer; throws when T does not match dtype().
  template <typename T>
  T* data() const {
    MT_CHECK(dtype_ == dtype_of<T>(), "tensor of dtype {} read as {}", dtype_name(dtype_),
             dtype_name(dtype_of<T>()));
    return static_cast<T*>(raw());
  }

  // Views sharing storage.
  Tensor slice(int64_t begin, int64_t end) const;  // rows [begin, end) of dim 0
  Tensor select(int64_t i) const;                  // row i of dim 0, one dim fewer
  Tensor view(const Shape& shape) const;           // same elements, new shape

  // Element-wise copies and fills.
  Tensor clone() const;
  Tensor to(DType dtype) const;       // converted copy (a plain copy when equal)
  Tensor to(Device device) const;     // copy on another device (same dtype)
  // Same element count; converts dtype; copies across devices (a dtype conversion with a
  // device on either side goes through the host).
  void copy_from(const Tensor& src);
  // Column blocks of 2-D tensors (same dtype and device): writes src [R, w] into this
  // tensor's columns [col, col + w) (this [R, C]), and returns a contiguous copy of columns
  // [begin, end). One strided copy each, on the current stream on the GPU: how a
  // concatenation along the feature dimension (and its gradient's split) is made.
  void copy_columns_from(int64_t col, const Tensor& src);
  Tensor columns(int64_t begin, int64_t end) const;
  void zero_();
  void fill_(double value);

  // Frees the memory of this tensor's storage (every view of it) while keeping the tensors,
  // and allocates it again (contents undefined): how sharded data parallelism drops whole
  // weights between uses. Touching the data of a released tensor is an Error.
  void release_memory() const;
  void restore_memory() const;
  bool memory_resident() const;

  // Element i as double, for tests and small host-side reads (a device tensor is copied
  // to the host first).
  double item(int64_t i = 0) const;
  std::vector<double> to_double_vector() const;
  template <typename T>
  std::vector<T> to_vector() const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
};

// Host copies of `tensors` (any dtypes; host ones are returned as they are) with one wait for
// the device: the device ones are gathered into one buffer on the current stream and copied
// over together. For reading a step's small results (losses, counts) without a host wait each.
std::vector<Tensor> to_host(const std::vector<Tensor>& tensors);

// Checks that `t` has exactly this shape, naming it in the error.
void check_shape(const Tensor& t, const Shape& shape, const char* name);
void check_dtype(const Tensor& t, DType dtype, const char* name);

}  // namespace moetrain
