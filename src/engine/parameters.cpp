#include "engine/parameters.h"

#include <algorithm>

#include "core/rng.h"
#include "ops/ops.h"

namespace moetrain {

int64_t count_elements(const ParameterList& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.value.numel();
  return n;
}

void zero_grads(ParameterList& params) {
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (auto& p : params) grads.push_back(p.grad);
  ops::zero_all(grads);
}

std::vector<Tensor> flat_views(const std::vector<Tensor>& like, DType dtype) {
  if (like.empty()) return {};
  int64_t total = 0;
  for (const Tensor& t : like) total += t.numel();
  Tensor flat = Tensor::zeros({total}, dtype, like.front().device());
  std::vector<Tensor> views;
  views.reserve(like.size());
  int64_t at = 0;
  for (const Tensor& t : like) {
    views.push_back(flat.slice(at, at + t.numel()).view(t.shape()));
    at += t.numel();
  }
  return views;
}

void BucketBuilder::add(Tensor* value, Tensor* grad, Shape shape) {
  slots_.emplace_back(value, grad);
  shapes_.push_back(std::move(shape));
}

ParamBucket BucketBuilder::build(DType dtype, Device device, int64_t pad) {
  MT_CHECK(pad >= 1, "bucket {}: pad must be >= 1, got {}", name_, pad);
  ParamBucket b;
  b.name = name_;
  b.experts = experts_;
  b.tp_replicated = tp_replicated_;
  // Every weight starts on a 64-element boundary (128 bytes of bf16): GEMM and TMA
  // descriptors want aligned bases, whatever the shapes before it.
  constexpr int64_t kAlign = 64;
  std::vector<int64_t> offsets;
  for (const Shape& s : shapes_) {
    b.used = (b.used + kAlign - 1) / kAlign * kAlign;
    offsets.push_back(b.used);
    b.used += shape_numel(s);
  }
  const int64_t total = std::max<int64_t>((b.used + pad - 1) / pad * pad, pad);
  b.values = Tensor::empty({total}, dtype, device);
  b.grads = Tensor::zeros({total}, grad_dtype_for(dtype), device);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const int64_t at = offsets[i], n = shape_numel(shapes_[i]);
    *slots_[i].first = b.values.slice(at, at + n).view(shapes_[i]);
    *slots_[i].second = b.grads.slice(at, at + n).view(shapes_[i]);
  }
  return b;
}

void index_buckets(std::vector<ParamBucket>& buckets, const ParameterList& params) {
  for (auto& b : buckets) b.members.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto* v = static_cast<const char*>(params[i].value.raw());
    int found = 0;
    for (auto& b : buckets) {
      const auto* base = static_cast<const char*>(b.values.raw());
      const size_t es = dtype_size(b.values.dtype());
      if (v >= base && v < base + b.values.nbytes()) {
        const int64_t offset = static_cast<int64_t>((v - base) / es);
        MT_CHECK(offset + params[i].value.numel() <= b.used, "parameter {} overruns bucket {}", params[i].name,
                 b.name);
        b.members.push_back({i, offset});
        ++found;
      }
    }
    MT_CHECK(found == 1, "parameter {} lies in {} parameter buckets, expected exactly one", params[i].name, found);
  }
  for (auto& b : buckets) {
    std::sort(b.members.begin(), b.members.end(),
              [](const ParamBucket::Member& x, const ParamBucket::Member& y) { return x.offset < y.offset; });
  }
}

DType grad_dtype_for(DType value_dtype) { return value_dtype == DType::BF16 ? DType::F32 : value_dtype; }

void attach_masters(ParameterList& params) {
  std::vector<Parameter*> need;
  std::vector<Tensor> values;
  for (auto& p : params) {
    if (p.value.dtype() == DType::BF16 && !p.has_master()) {
      need.push_back(&p);
      values.push_back(p.value);
    }
  }
  // A bf16 value is exact in f32: the master is the value with a zero low half.
  std::vector<Tensor> lows = flat_views(values, DType::I16);
  for (size_t i = 0; i < need.size(); ++i) need[i]->master_low = lows[i];
}

Tensor master_f32(const Parameter& p) {
  Tensor m = Tensor::empty(p.value.shape(), DType::F32, p.value.device());
  if (p.has_master()) ops::master_join_into(m, p.value, p.master_low);
  else m.copy_from(p.value);
  return m;
}

void set_master(Parameter& p, const Tensor& master) {
  MT_CHECK(master.numel() == p.value.numel(), "set_master: {} elements for '{}' of shape {}", master.numel(), p.name,
           shape_str(p.value.shape()));
  if (!p.has_master()) {
    p.value.copy_from(master);
    return;
  }
  Tensor m;
  if (master.dtype() == DType::F32 && master.device() == p.value.device()) {
    m = master.view(p.value.shape());
  } else {
    m = Tensor::empty(p.value.shape(), DType::F32, p.value.device());
    m.copy_from(master);
  }
  ops::master_split_into(m, p.value, p.master_low);
}

Parameter tp_piece(Parameter p, int dim, int64_t rank, int64_t ranks) {
  if (ranks == 1) return p;
  MT_CHECK(dim >= 0 && dim < p.value.ndim() && rank >= 0 && rank < ranks,
           "tp_piece: '{}' {} has no piece {} of {} along dimension {}", p.name, p.value.str(), rank, ranks, dim);
  p.whole_shape = p.value.shape();
  p.whole_shape[static_cast<size_t>(dim)] *= ranks;
  p.start.assign(p.whole_shape.size(), 0);
  p.start[static_cast<size_t>(dim)] = rank * p.value.size(dim);
  return p;
}

void init_parameters(ParameterList& params, uint64_t seed) {
  for (auto& p : params) {
    // Drawn in f32 where the parameter lives, then split when it has a master.
    Tensor target = p.has_master() ? Tensor::empty(p.value.shape(), DType::F32, p.value.device()) : p.value;
    if (p.init_std == 0) {
      target.fill_(1.0);
    } else if (p.tp_split()) {
      fill_normal_box(target, stream_key(seed, p.name), p.init_std, p.whole_shape, p.start);
    } else {
      fill_normal(target, stream_key(seed, p.name), p.init_std);
    }
    if (p.has_master()) ops::master_split_into(target, p.value, p.master_low);
  }
}

}  // namespace moetrain
