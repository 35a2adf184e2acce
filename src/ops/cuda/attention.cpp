// attention_forward / attention_backward on CUDA: argument checks, output allocation and
// the launches of the fused kernels in attention.cu (bf16 q/k/v/out and gradients, f32 lse;
// head_dim 32, 64 or 128 with value heads of the same size, or DeepSeek-V3's MLA heads:
// query/key 192, value 128).
#include <climits>
#include <cmath>
#include <cstdint>

#include "ops/arg_checks.h"
#include "ops/cuda/attention_launch.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"

namespace moetrain::ops::cuda {
namespace {

const __nv_bfloat16* bf16_ptr(const Tensor& t) { return static_cast<const __nv_bfloat16*>(t.raw()); }
__nv_bfloat16* bf16_ptr(Tensor& t) { return static_cast<__nv_bfloat16*>(t.raw()); }

void check_aligned(const char* op, const Tensor& t, const char* name) {
  MT_CHECK(reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0,
           "{}: tensor {} ({}) must be 16-byte aligned for the CUDA attention kernels", op, name, t.str());
}

// A CUDA bf16 tensor of exactly `shape` on `device`, named in every error.
void check_bf16(const char* op, const Tensor& t, const Shape& shape, Device device, const char* name) {
  MT_CHECK(t.defined(), "{}: tensor {} is undefined", op, name);
  check_shape(t, shape, name);
  check_dtype(t, DType::BF16, name);
  MT_CHECK(t.device() == device, "{}: tensor {} is on {}, expected {} (where q lives)", op, name, t.device().str(),
           device.str());
  check_aligned(op, t, name);
}

AttentionDims check_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                         const AttentionShape& a) {
  MT_CHECK(a.batch >= 0 && a.seq >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0,
           "{}: bad shape batch={} seq={} q_heads={} kv_heads={} head_dim={}", op, a.batch, a.seq, a.q_heads,
           a.kv_heads, a.head_dim);
  MT_CHECK(a.q_heads % a.kv_heads == 0, "{}: q_heads {} is not a multiple of kv_heads {}", op, a.q_heads,
           a.kv_heads);
  MT_CHECK(a.v_head_dim >= 0, "{}: v_head_dim must be >= 0 (0: head_dim), got {}", op, a.v_head_dim);
  const int64_t dv = a.value_dim();
  const bool equal = dv == a.head_dim && (a.head_dim == 32 || a.head_dim == 64 || a.head_dim == 128);
  const bool mla = a.head_dim == 192 && dv == 128;
  MT_CHECK(equal || mla,
           "{}: head_dim {} with value heads of {} is not supported by the CUDA attention kernels; (head_dim, "
           "v_head_dim) must be (32, 32), (64, 64), (128, 128) or (192, 128) (the CPU reference takes any)",
           op, a.head_dim, dv);
  MT_CHECK(a.scale > 0 && std::isfinite(a.scale), "{}: softmax scale must be positive, got {}", op, a.scale);
  // Grid limits (y = heads, z = batch) and 32-bit positions inside a sequence.
  MT_CHECK(a.batch <= 65535 && a.q_heads <= 65535, "{}: batch {} or q_heads {} over the CUDA grid limit 65535", op,
           a.batch, a.q_heads);
  MT_CHECK(a.seq <= (INT_MAX / 2), "{}: seq {} too long for the CUDA attention kernels", op, a.seq);
  // One-dimensional grids of (row tile of >= 64, head, batch) blocks.
  MT_CHECK((a.seq / 64 + 1) * a.q_heads * a.batch <= INT_MAX,
           "{}: batch {} * q_heads {} * seq {} too large for the CUDA grid", op, a.batch, a.q_heads, a.seq);
  MT_CHECK(q.defined(), "{}: tensor q is undefined", op);
  MT_CHECK(!q.device().is_cpu(), "{}: tensor q is on the CPU, expected CUDA", op);
  const Device dev = q.device();
  const int64_t T = a.batch * a.seq;
  check_bf16(op, q, {T, a.q_heads * a.head_dim}, dev, "q");
  check_bf16(op, k, {T, a.kv_heads * a.head_dim}, dev, "k");
  check_bf16(op, v, {T, a.kv_heads * dv}, dev, "v");
  if (seg.defined()) {
    check_shape(seg, {T}, "segment_ids");
    check_dtype(seg, DType::I32, "segment_ids");
    MT_CHECK(seg.device() == dev, "{}: tensor segment_ids is on {}, expected {} (where q lives)", op,
             seg.device().str(), dev.str());
  }
  AttentionDims d;
  d.batch = static_cast<int>(a.batch);
  d.seq = static_cast<int>(a.seq);
  d.q_heads = static_cast<int>(a.q_heads);
  d.kv_heads = static_cast<int>(a.kv_heads);
  d.head_dim = static_cast<int>(a.head_dim);
  d.v_head_dim = static_cast<int>(dv);
  d.scale = static_cast<float>(a.scale);
  return d;
}

const int32_t* seg_ptr(const Tensor& seg) { return seg.defined() ? seg.data<int32_t>() : nullptr; }

// The backward's dout and out (bf16 [T, Hq*Dv]) and lse (f32 [B, Hq, S]) where q lives.
void check_backward_args(const char* op, const Tensor& dout, const Tensor& out, const Tensor& lse, Device device,
                         const AttentionShape& shape) {
  const Shape out_shape{shape.batch * shape.seq, shape.q_heads * shape.value_dim()};
  check_bf16(op, dout, out_shape, device, "dout");
  check_bf16(op, out, out_shape, device, "out");
  check_shape(lse, {shape.batch, shape.q_heads, shape.seq}, "lse");
  check_dtype(lse, DType::F32, "lse");
  MT_CHECK(lse.device() == device, "{}: tensor lse is on {}, expected {} (where q lives)", op, lse.device().str(),
           device.str());
}

}  // namespace

AttentionOut attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids,
                               const AttentionShape& shape) {
  const char* op = "attention_forward";
  const AttentionDims d = check_args(op, q, k, v, segment_ids, shape);
  // out is [T, Hq*Dv]: q's shape only when Dv == D.
  AttentionOut o{Tensor::empty({shape.batch * shape.seq, shape.q_heads * shape.value_dim()}, DType::BF16,
                               q.device()),
                 Tensor::empty({shape.batch, shape.q_heads, shape.seq}, DType::F32, q.device())};
  if (q.numel() == 0) return o;
  launch_attention_forward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), seg_ptr(segment_ids), bf16_ptr(o.out),
                           o.lse.data<float>(), d, stream());
  check_launch("attention_fwd_kernel");
  return o;
}

AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& segment_ids, const Tensor& out, const Tensor& lse,
                                  const AttentionShape& shape) {
  const char* op = "attention_backward";
  const AttentionDims d = check_args(op, q, k, v, segment_ids, shape);
  check_backward_args(op, dout, out, lse, q.device(), shape);
  AttentionGrads g{Tensor::empty(q.shape(), DType::BF16, q.device()), Tensor::empty(k.shape(), DType::BF16, q.device()),
                   Tensor::empty(v.shape(), DType::BF16, q.device())};
  if (q.numel() == 0) return g;
  // Workspaces, freed on return (stream-ordered, so they stay valid for the kernels queued
  // here): delta = rowsum(dout * out) and lse * log2(e), f32, each laid out like lse; and,
  // when the dK/dV pass splits each kv group's query heads over several blocks, their f32
  // partial sums (splits x dK, then splits x dV).
  Tensor delta = Tensor::empty({2, shape.batch, shape.q_heads, shape.seq}, DType::F32, q.device());
  int num_sms = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.device().index));
  const int splits = attention_dkdv_splits(d, num_sms);
  Tensor partial;
  if (splits > 1) partial = Tensor::empty({splits * (k.numel() + v.numel())}, DType::F32, q.device());
  // Not deterministic: the one-pass Hopper backward adds dQ into this f32 buffer.
  Tensor dq_acc;
  if (!ops::deterministic() && attention_hopper_applies(d, seg_ptr(segment_ids))) {
    dq_acc = Tensor::empty(q.shape(), DType::F32, q.device());
  }
  const bool dq_in_acc = launch_attention_backward(
      bf16_ptr(dout), bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), seg_ptr(segment_ids), bf16_ptr(out), lse.data<float>(),
      delta.data<float>(), splits > 1 ? partial.data<float>() : nullptr, splits,
      dq_acc.defined() ? dq_acc.data<float>() : nullptr, bf16_ptr(g.dq), bf16_ptr(g.dk), bf16_ptr(g.dv), d, stream());
  check_launch("attention_bwd kernels (delta, dkdv, dkdv_reduce, dq)");
  if (dq_in_acc) g.dq = dq_acc;  // the one-pass kernel's f32 sums (see ops.h)
  return g;
}

namespace {

// The launchers' dims for a part (ops.h's attention_part_*), checked. An empty part leaves
// `empty` set (the lengths 0 would mean the whole sequence to the launchers).
AttentionDims part_dims(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& p,
                        const AttentionShape& a, bool* empty) {
  AttentionDims d = check_args(op, q, k, v, p.q_segments, a);
  check_attention_part(op, p, a);
  if (p.k_segments.defined()) {
    MT_CHECK(p.k_segments.device() == q.device(), "{}: tensor k_segments is on {}, expected {} (where q lives)", op,
             p.k_segments.device().str(), q.device().str());
  }
  *empty = p.q_end == p.q_begin || p.k_end == p.k_begin;
  d.q_begin = static_cast<int>(p.q_begin);
  d.q_len = static_cast<int>(p.q_end - p.q_begin);
  d.k_begin = static_cast<int>(p.k_begin);
  d.k_len = static_cast<int>(p.k_end - p.k_begin);
  d.causal = p.causal;
  const int32_t* kseg = seg_ptr(p.k_segments);
  d.k_seg = kseg == seg_ptr(p.q_segments) ? nullptr : kseg;
  return d;
}

}  // namespace

AttentionOut attention_part_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& part,
                                    const AttentionShape& shape) {
  const char* op = "attention_part_forward";
  bool empty = false;
  const AttentionDims d = part_dims(op, q, k, v, part, shape, &empty);
  if (d.whole()) return cuda::attention_forward(q, k, v, part.q_segments, shape);
  AttentionOut o{Tensor::zeros({shape.batch * shape.seq, shape.q_heads * shape.value_dim()}, DType::BF16, q.device()),
                 Tensor::empty({shape.batch, shape.q_heads, shape.seq}, DType::F32, q.device())};
  launch_fill(o.lse.data<float>(), o.lse.numel(), -INFINITY, stream());
  if (!empty) {
    launch_attention_forward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), seg_ptr(part.q_segments), bf16_ptr(o.out),
                             o.lse.data<float>(), d, stream());
  }
  check_launch("attention_fwd_kernel (a part)");
  return o;
}

AttentionGrads attention_part_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const AttentionPart& part, const Tensor& out, const Tensor& lse,
                                       const AttentionShape& shape) {
  const char* op = "attention_part_backward";
  bool empty = false;
  const AttentionDims d = part_dims(op, q, k, v, part, shape, &empty);
  if (d.whole()) return cuda::attention_backward(dout, q, k, v, part.q_segments, out, lse, shape);
  check_backward_args(op, dout, out, lse, q.device(), shape);
  AttentionGrads g{Tensor::zeros(q.shape(), DType::BF16, q.device()), Tensor::zeros(k.shape(), DType::BF16, q.device()),
                   Tensor::zeros(v.shape(), DType::BF16, q.device())};
  if (empty) return g;
  Tensor delta = Tensor::empty({2, shape.batch, shape.q_heads, shape.seq}, DType::F32, q.device());
  launch_attention_backward(bf16_ptr(dout), bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), seg_ptr(part.q_segments),
                            bf16_ptr(out), lse.data<float>(), delta.data<float>(), nullptr, 1, nullptr,
                            bf16_ptr(g.dq), bf16_ptr(g.dk), bf16_ptr(g.dv), d, stream());
  check_launch("attention_bwd kernels (a part: delta, dkdv, dq)");
  return g;
}

void attention_merge(AttentionOut& acc, const AttentionOut& part) {
  const char* op = "attention_merge";
  MT_CHECK(acc.out.defined() && acc.lse.defined() && part.out.defined() && part.lse.defined(),
           "{}: every tensor must be defined", op);
  check_dtype(acc.out, DType::F32, "acc.out (the running sum is kept in f32 on the GPU)");
  check_dtype(acc.lse, DType::F32, "acc.lse");
  check_dtype(part.lse, DType::F32, "part.lse");
  MT_CHECK(part.out.dtype() == DType::BF16 || part.out.dtype() == DType::F32, "{}: part.out {} must be bf16 or f32",
           op, part.out.str());
  MT_CHECK(acc.lse.ndim() == 3, "{}: acc.lse {} must be [B, Hq, S]", op, acc.lse.str());
  check_shape(part.lse, acc.lse.shape(), "part.lse");
  check_shape(part.out, acc.out.shape(), "part.out");
  const int64_t B = acc.lse.size(0), Hq = acc.lse.size(1), S = acc.lse.size(2);
  MT_CHECK(acc.out.ndim() == 2 && acc.out.size(0) == B * S && acc.out.size(1) % Hq == 0,
           "{}: acc.out {} must be [B*S, Hq*Dv] for lse {}", op, acc.out.str(), acc.lse.str());
  const int dv = static_cast<int>(acc.out.size(1) / Hq);
  if (part.out.dtype() == DType::BF16) {
    launch_attention_merge(acc.out.data<float>(), acc.lse.data<float>(), bf16_ptr(part.out), part.lse.data<float>(),
                           static_cast<int>(B), static_cast<int>(Hq), static_cast<int>(S), dv, stream());
  } else {
    launch_attention_merge(acc.out.data<float>(), acc.lse.data<float>(), part.out.data<float>(),
                           part.lse.data<float>(), static_cast<int>(B), static_cast<int>(Hq), static_cast<int>(S), dv,
                           stream());
  }
  check_launch("attention_merge_kernel");
}

}  // namespace moetrain::ops::cuda
