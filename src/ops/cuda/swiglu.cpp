// Grouped expert SwiGLU on CUDA: host wrapper of the grouped GEMMs in swiglu.cu.
// Activations and weights bf16, weight gradients f32 (accumulated), counts i64 on the
// device and never read by the host: sum(counts) = N is the caller's promise (counts are
// clamped on the device so that bad counts cannot reach memory outside the tensors).
#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/swiglu_launch.h"

namespace moetrain::ops::cuda {
namespace {

struct Dims {
  int64_t N, H, I, E;
};

void check_bf16_matrix(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(t.defined() && t.dtype() == DType::BF16, "{}: {} must be a bf16 tensor, got {}", op, name,
           t.defined() ? t.str() : std::string("undefined"));
}

void check_aligned(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0,
           "{}: {} ({}) must start on a 16-byte boundary for the grouped GEMM", op, name, t.str());
}

// Checks the weights (or their gradients, with prefix "dw") against N x H rows and counts.
Dims check_swiglu(const char* op, int64_t N, int64_t H, const Tensor& counts, const Tensor& w_gate,
                  const Tensor& w_up, const Tensor& w_down, const char* w, DType wdtype) {
  MT_CHECK(w_gate.defined() && w_gate.ndim() == 3, "{}: {}_gate must be [E, I, H = {}], got {}", op, w, H,
           w_gate.str());
  Dims d{N, H, w_gate.size(1), w_gate.size(0)};
  const std::string p = fmt::format("{} {}", op, w);
  check_shape(w_gate, {d.E, d.I, H}, (p + "_gate [E, I, H]").c_str());
  check_shape(w_up, {d.E, d.I, H}, (p + "_up [E, I, H]").c_str());
  check_shape(w_down, {d.E, H, d.I}, (p + "_down [E, H, I]").c_str());
  check_dtype(w_gate, wdtype, (p + "_gate").c_str());
  check_dtype(w_up, wdtype, (p + "_up").c_str());
  check_dtype(w_down, wdtype, (p + "_down").c_str());
  MT_CHECK(counts.defined(), "{}: counts is undefined", op);
  check_shape(counts, {d.E}, fmt::format("{} counts [E]", op).c_str());
  check_dtype(counts, DType::I64, fmt::format("{} counts", op).c_str());
  MT_CHECK(d.E >= 1 && d.E <= kSwigluMaxExperts, "{}: {} experts; the CUDA grouped SwiGLU takes 1 to {}", op, d.E,
           kSwigluMaxExperts);
  MT_CHECK(H > 0 && H % 8 == 0 && d.I > 0 && d.I % 8 == 0,
           "{}: hidden size H = {} and intermediate size I = {} must be positive multiples of 8", op, H, d.I);
  MT_CHECK(H <= INT_MAX / 2 && d.I <= INT_MAX / 2 && N <= INT_MAX, "{}: N = {}, H = {}, I = {} exceed the int range",
           op, N, H, d.I);
  MT_CHECK(swiglu_max_tiles(N, static_cast<int>(d.E)) <= kSwigluMaxGridY,
           "{}: N = {} rows over {} experts need more than {} row tiles of 128", op, N, d.E, kSwigluMaxGridY);
  MT_CHECK(!counts.device().is_cpu(), "{}: counts {} is on the CPU; it must be on the CUDA device (it is never read "
           "by the host)", op, counts.str());
  check_cuda_tensors(op, {&w_gate, &w_up, &w_down});
  check_aligned(w_gate, op, (p + "_gate").c_str());
  check_aligned(w_up, op, (p + "_up").c_str());
  check_aligned(w_down, op, (p + "_down").c_str());
  return d;
}

void check_rows(const Tensor& t, int64_t N, int64_t cols, const char* op, const char* name) {
  check_bf16_matrix(t, op, name);
  check_shape(t, {N, cols}, fmt::format("{} {}", op, name).c_str());
  check_cuda_tensors(op, {&t});
  check_aligned(t, op, name);
}

}  // namespace

SwigluOut grouped_swiglu_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate, const Tensor& w_up,
                                 const Tensor& w_down) {
  const char* op = "grouped_swiglu_forward";
  MT_CHECK(x.defined() && x.ndim() == 2, "{}: x must be [N, H], got {}", op, x.str());
  const Dims d = check_swiglu(op, x.size(0), x.size(1), counts, w_gate, w_up, w_down, "w", DType::BF16);
  check_rows(x, d.N, d.H, op, "x");
  const Device dev = x.device();
  SwigluOut out;
  out.y = Tensor::empty({d.N, d.H}, DType::BF16, dev);
  out.gate = Tensor::empty({d.N, d.I}, DType::BF16, dev);
  out.up = Tensor::empty({d.N, d.I}, DType::BF16, dev);
  out.act = Tensor::empty({d.N, d.I}, DType::BF16, dev);
  Tensor ws = Tensor::empty({swiglu_workspace_words(d.N, static_cast<int>(d.E))}, DType::I32, dev);
  launch_swiglu_forward(x.raw(), counts.data<int64_t>(), w_gate.raw(), w_up.raw(), w_down.raw(), d.N,
                        static_cast<int>(d.H), static_cast<int>(d.I), static_cast<int>(d.E), out.gate.raw(),
                        out.up.raw(), out.act.raw(), out.y.raw(), ws.data<int32_t>(), stream());
  check_launch("grouped_swiglu_forward kernels");
  return out;  // ws is freed in stream order, after the kernels
}

namespace {
// The FP8 launches' limits: experts, the int range of the kernels' sizes, the row tiles.
void check_fp8_sizes(const char* op, int64_t N, int64_t H, int64_t I, int64_t experts) {
  MT_CHECK(experts <= kSwigluMaxExperts, "{}: {} experts; the CUDA grouped SwiGLU takes 1 to {}", op, experts,
           kSwigluMaxExperts);
  MT_CHECK(H <= INT_MAX / 2 && I <= INT_MAX / 2 && N <= INT_MAX, "{}: N = {}, H = {}, I = {} exceed the int range", op,
           N, H, I);
  MT_CHECK(swiglu_max_tiles(N, static_cast<int>(experts)) <= kSwigluMaxGridY,
           "{}: N = {} rows over {} experts need more than {} row tiles of 128", op, N, experts, kSwigluMaxGridY);
}
}  // namespace

SwigluOut grouped_swiglu_forward_fp8(const Fp8Tensor& x, const Tensor& counts, const Fp8Tensor& w_gate,
                                     const Fp8Tensor& w_up, const Fp8Tensor& w_down, int64_t experts) {
  const char* op = "grouped_swiglu_forward_fp8";
  const int64_t N = x.q.size(0), H = x.q.size(1), I = w_gate.q.size(0) / experts;
  check_cuda_tensors(op, {&x.q, &x.scale, &counts, &w_gate.q, &w_gate.scale, &w_up.q, &w_up.scale, &w_down.q,
                          &w_down.scale});
  check_fp8_sizes(op, N, H, I, experts);
  for (const Tensor* t : {&x.q, &w_gate.q, &w_up.q, &w_down.q}) check_aligned(*t, op, "an operand's codes");
  const Device dev = x.q.device();
  SwigluOut out;
  out.y = Tensor::empty({N, H}, DType::BF16, dev);
  out.gate = Tensor::empty({N, I}, DType::BF16, dev);
  out.up = Tensor::empty({N, I}, DType::BF16, dev);
  out.act = Tensor::empty({N, I}, DType::BF16, dev);
  out.act_q.q = Tensor::empty({N, I}, DType::F8E4M3, dev);
  out.act_q.scale = Tensor::empty({I / 128, N}, DType::F32, dev);
  Tensor ws = Tensor::empty({swiglu_workspace_words(N, static_cast<int>(experts))}, DType::I32, dev);
  auto codes = [](const Tensor& t) { return static_cast<const uint8_t*>(t.raw()); };
  const bool launched = launch_swiglu_forward_fp8(
      codes(x.q), x.scale.data<float>(), counts.data<int64_t>(), codes(w_gate.q), w_gate.scale.data<float>(),
      codes(w_up.q), w_up.scale.data<float>(), codes(w_down.q), w_down.scale.data<float>(), N, static_cast<int>(H),
      static_cast<int>(I), static_cast<int>(experts), out.gate.raw(), out.up.raw(), out.act.raw(),
      static_cast<uint8_t*>(out.act_q.q.raw()), out.act_q.scale.data<float>(), out.y.raw(), ws.data<int32_t>(), stream());
  MT_CHECK(launched, "{}: the FP8 grouped GEMMs need a Hopper GPU (sm_90) whose driver encodes TMA maps of these "
           "tensors (N = {}, H = {}, I = {}); this GPU or driver does not", op, N, H, I);
  check_launch("grouped_swiglu_forward_fp8 kernels");
  return out;  // scratch freed in stream order
}

SwigluInputGrads grouped_swiglu_backward_input_fp8(const Fp8Tensor& dy, const Tensor& counts, const Tensor& gate,
                                                   const Tensor& up, const Fp8Tensor& w_gate_t,
                                                   const Fp8Tensor& w_up_t, const Fp8Tensor& w_down_t,
                                                   int64_t experts) {
  const char* op = "grouped_swiglu_backward_input_fp8";
  const int64_t N = dy.q.size(0), H = dy.q.size(1), I = w_down_t.q.size(0) / experts;
  check_cuda_tensors(op, {&dy.q, &dy.scale, &counts, &gate, &up, &w_gate_t.q, &w_gate_t.scale, &w_up_t.q,
                          &w_up_t.scale, &w_down_t.q, &w_down_t.scale});
  MT_CHECK(gate.dtype() == DType::BF16, "{}: gate and up must be bf16 on CUDA, got {}", op, gate.str());
  check_fp8_sizes(op, N, H, I, experts);
  for (const Tensor* t : {&dy.q, &w_gate_t.q, &w_up_t.q, &w_down_t.q, &gate, &up}) {
    check_aligned(*t, op, "an operand");
  }
  const Device dev = dy.q.device();
  SwigluInputGrads g;
  g.dx = Tensor::empty({N, H}, DType::BF16, dev);
  g.dgate = Tensor::empty({N, I}, DType::BF16, dev);
  g.dup = Tensor::empty({N, I}, DType::BF16, dev);
  Tensor dgate_q = Tensor::empty({N, I}, DType::F8E4M3, dev), dup_q = Tensor::empty({N, I}, DType::F8E4M3, dev);
  Tensor dgate_s = Tensor::empty({I / 128, N}, DType::F32, dev), dup_s = Tensor::empty({I / 128, N}, DType::F32, dev);
  Tensor ws = Tensor::empty({swiglu_workspace_words(N, static_cast<int>(experts))}, DType::I32, dev);
  auto codes = [](const Tensor& t) { return static_cast<const uint8_t*>(t.raw()); };
  auto out_codes = [](Tensor& t) { return static_cast<uint8_t*>(t.raw()); };
  const bool launched = launch_swiglu_backward_input_fp8(
      codes(dy.q), dy.scale.data<float>(), counts.data<int64_t>(), gate.raw(), up.raw(), codes(w_gate_t.q),
      w_gate_t.scale.data<float>(), codes(w_up_t.q), w_up_t.scale.data<float>(), codes(w_down_t.q),
      w_down_t.scale.data<float>(), N, static_cast<int>(H), static_cast<int>(I), static_cast<int>(experts),
      g.dgate.raw(), g.dup.raw(), out_codes(dgate_q), dgate_s.data<float>(), out_codes(dup_q), dup_s.data<float>(),
      g.dx.raw(), ws.data<int32_t>(), stream());
  MT_CHECK(launched, "{}: the FP8 grouped GEMMs need a Hopper GPU (sm_90) whose driver encodes TMA maps of these "
           "tensors (N = {}, H = {}, I = {}); this GPU or driver does not", op, N, H, I);
  check_launch("grouped_swiglu_backward_input_fp8 kernels");
  return g;  // scratch freed in stream order
}

SwigluInputGrads grouped_swiglu_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate,
                                               const Tensor& up, const Tensor& w_gate, const Tensor& w_up,
                                               const Tensor& w_down) {
  const char* op = "grouped_swiglu_backward_input";
  MT_CHECK(dy.defined() && dy.ndim() == 2, "{}: dy must be [N, H], got {}", op, dy.str());
  const Dims d = check_swiglu(op, dy.size(0), dy.size(1), counts, w_gate, w_up, w_down, "w", DType::BF16);
  check_rows(dy, d.N, d.H, op, "dy");
  check_rows(gate, d.N, d.I, op, "gate");
  check_rows(up, d.N, d.I, op, "up");
  const Device dev = dy.device();
  SwigluInputGrads g;
  g.dx = Tensor::empty({d.N, d.H}, DType::BF16, dev);
  g.dgate = Tensor::empty({d.N, d.I}, DType::BF16, dev);
  g.dup = Tensor::empty({d.N, d.I}, DType::BF16, dev);
  Tensor ws = Tensor::empty({swiglu_workspace_words(d.N, static_cast<int>(d.E))}, DType::I32, dev);
  launch_swiglu_backward_input(dy.raw(), counts.data<int64_t>(), gate.raw(), up.raw(), w_gate.raw(), w_up.raw(),
                               w_down.raw(), d.N, static_cast<int>(d.H), static_cast<int>(d.I),
                               static_cast<int>(d.E), g.dgate.raw(), g.dup.raw(), g.dx.raw(), ws.data<int32_t>(),
                               stream());
  check_launch("grouped_swiglu_backward_input kernels");
  return g;
}

void grouped_swiglu_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& counts, const Tensor& gate,
                                    const Tensor& up, const Tensor& dgate, const Tensor& dup, Tensor& dw_gate,
                                    Tensor& dw_up, Tensor& dw_down, bool accumulate, SumSquaresInto squares,
                                    const Tensor& act_in) {
  const char* op = "grouped_swiglu_backward_weight";
  MT_CHECK(x.defined() && x.ndim() == 2, "{}: x must be [N, H], got {}", op, x.str());
  const Dims d = check_swiglu(op, x.size(0), x.size(1), counts, dw_gate, dw_up, dw_down, "dw", DType::F32);
  check_rows(x, d.N, d.H, op, "x");
  check_rows(dy, d.N, d.H, op, "dy");
  if (!act_in.defined()) {  // gate and up only make act
    check_rows(gate, d.N, d.I, op, "gate");
    check_rows(up, d.N, d.I, op, "up");
  }
  check_rows(dgate, d.N, d.I, op, "dgate");
  check_rows(dup, d.N, d.I, op, "dup");
  if (act_in.defined()) check_rows(act_in, d.N, d.I, op, "act");
  const Device dev = x.device();
  // The forward's act, or scratch the launcher fills with silu(gate) * up.
  Tensor act = act_in.defined() ? act_in : Tensor::empty({d.N, d.I}, DType::BF16, dev);
  Tensor ws = Tensor::empty({swiglu_workspace_words(d.N, static_cast<int>(d.E))}, DType::I32, dev);
  Tensor sq_scratch;
  double* sq_result = nullptr;
  if (squares.out) {
    sq_scratch = Tensor::empty(
        {swiglu_squares_scratch_doubles(static_cast<int>(d.H), static_cast<int>(d.I), static_cast<int>(d.E))},
        DType::F64, dev);
    sq_result = squares.out->data<double>() + squares.index;
  }
  launch_swiglu_backward_weight(dy.raw(), x.raw(), counts.data<int64_t>(), gate.defined() ? gate.raw() : nullptr,
                                up.defined() ? up.raw() : nullptr, dgate.raw(),
                                dup.raw(), d.N, static_cast<int>(d.H), static_cast<int>(d.I), static_cast<int>(d.E),
                                act.raw(), act_in.defined(), dw_gate.data<float>(), dw_up.data<float>(),
                                dw_down.data<float>(), accumulate, ws.data<int32_t>(),
                                sq_scratch.defined() ? sq_scratch.data<double>() : nullptr, sq_result, stream());
  check_launch("grouped_swiglu_backward_weight kernels");
}

bool grouped_swiglu_backward_weight_group(const std::vector<SwigluWgradRows>& rows, Tensor& dw_gate, Tensor& dw_up,
                                          Tensor& dw_down, bool accumulate, SumSquaresInto squares) {
  const char* op = "grouped_swiglu_backward_weight_group";
  // The one-pass kernel takes the micro-batches that have rows, with their forward's act.
  // All are checked before any pass runs, so a bad one leaves dW as it was.
  std::vector<const SwigluWgradRows*> with_rows;
  int64_t E = 0, H = 0, I = 0;
  for (const SwigluWgradRows& r : rows) {
    if (!r.act.defined()) return false;
    MT_CHECK(r.x.defined() && r.x.ndim() == 2, "{}: x must be [N, H], got {}", op, r.x.str());
    const Dims d = check_swiglu(op, r.x.size(0), r.x.size(1), r.counts, dw_gate, dw_up, dw_down, "dw", DType::F32);
    check_rows(r.x, d.N, d.H, op, "x");
    check_rows(r.dy, d.N, d.H, op, "dy");
    check_rows(r.dgate, d.N, d.I, op, "dgate");
    check_rows(r.dup, d.N, d.I, op, "dup");
    check_rows(r.act, d.N, d.I, op, "act");
    E = d.E;
    H = d.H;
    I = d.I;
    if (d.N > 0) with_rows.push_back(&r);
  }
  if (with_rows.size() < 2) return false;
  const size_t max = static_cast<size_t>(swiglu_wgrad_group_max());
  // The sum of squares comes from the pass's epilogue when one overwriting pass makes them
  // all; otherwise from a pass over the gradients at the end.
  const bool squares_in_pass = squares.out != nullptr && with_rows.size() <= max;
  bool acc = accumulate;
  for (size_t k0 = 0; k0 < with_rows.size(); k0 += max, acc = true) {
    const size_t n = std::min(with_rows.size() - k0, max);
    if (n == 1) {  // the last of a long list: the one-micro-batch op
      const SwigluWgradRows& r = *with_rows[k0];
      grouped_swiglu_backward_weight(r.dy, r.x, r.counts, r.gate, r.up, r.dgate, r.dup, dw_gate, dw_up, dw_down, acc,
                                     {}, r.act);
      continue;
    }
    std::vector<SwigluWgradSource> src(n);
    std::vector<Tensor> ws(n);
    for (size_t k = 0; k < n; ++k) {
      const SwigluWgradRows& r = *with_rows[k0 + k];
      const int64_t N = r.x.size(0);
      ws[k] = Tensor::empty({swiglu_workspace_words(N, static_cast<int>(E))}, DType::I32, r.x.device());
      src[k] = {r.dy.raw(), r.x.raw(), r.dgate.raw(), r.dup.raw(), r.act.raw(), r.counts.data<int64_t>(), N,
                ws[k].data<int32_t>()};
    }
    Tensor sq_scratch;
    double* sq_result = nullptr;
    if (squares_in_pass) {
      sq_scratch = Tensor::empty(
          {swiglu_squares_scratch_doubles(static_cast<int>(H), static_cast<int>(I), static_cast<int>(E))}, DType::F64,
          dw_gate.device());
      sq_result = squares.out->data<double>() + squares.index;
    }
    const bool ok = launch_swiglu_backward_weight_group(
        src.data(), static_cast<int>(n), static_cast<int>(H), static_cast<int>(I), static_cast<int>(E),
        dw_gate.data<float>(), dw_up.data<float>(), dw_down.data<float>(), acc,
        sq_scratch.defined() ? sq_scratch.data<double>() : nullptr, sq_result, stream());
    if (!ok) {
      // The first pass decides whether the kernel applies (the GPU, the tensor maps); a later
      // pass has the same device, weights and row layout.
      MT_CHECK(k0 == 0, "{}: the one-pass kernel refused a later group of micro-batches", op);
      return false;
    }
    check_launch("grouped_swiglu_backward_weight_group kernels");
  }
  // In overwrite mode, micro-batches without rows add nothing; the experts none of them
  // reached were written as zeros by the first pass.
  if (squares.out && !squares_in_pass) sum_squares_all_into({dw_gate, dw_up, dw_down}, *squares.out, squares.index);
  return true;
}

}  // namespace moetrain::ops::cuda
