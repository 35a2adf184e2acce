#include "engine/models/mtp.h"

#include <fmt/format.h>

#include "engine/telemetry/stage_timer.h"

namespace moetrain {

namespace {
constexpr int32_t kNoTarget = ops::kIgnoreIndex;  // the loss skips it (Batch::num_targets)
}  // namespace

// Under context parallelism the loader shifted the whole rows before cutting them
// (Batch::ahead_inputs / ahead_targets): this module's depth's.
const Tensor& MtpModule::ahead(const std::vector<Tensor>& shifted) const {
  MT_CHECK(static_cast<int64_t>(shifted.size()) >= depth_,
           "multi-token prediction module {} (depth {}): the batch carries tokens ahead for {} depths only",
           layer_id_, depth_, shifted.size());
  return shifted[static_cast<size_t>(depth_ - 1)];
}

MtpModule::MtpModule(int64_t layer_id, int64_t depth, int64_t vocab_size, int64_t hidden_size, double rms_norm_eps,
                     DType dtype, Device device, int64_t bucket_pad)
    : layer_id_(layer_id), depth_(depth), H_(hidden_size), eps_(rms_norm_eps) {
  const int64_t V = vocab_size, H = hidden_size;
  BucketBuilder b(fmt::format("model.layers.{}.mtp", layer_id), false);
  b.add(&embed_, &g_embed_, {V, H});
  b.add(&enorm_w_, &g_enorm_w_, {H});
  b.add(&hnorm_w_, &g_hnorm_w_, {H});
  b.add(&eh_w_, &g_eh_w_, {H, 2 * H});
  b.add(&head_norm_w_, &g_head_norm_w_, {H});
  b.add(&head_w_, &g_head_w_, {V, H});
  bucket_ = b.build(dtype, device, bucket_pad);
  bucket_.layer = layer_id;
}

void MtpModule::collect_parameters(ParameterList& out, double init_std) {
  const std::string p = fmt::format("model.layers.{}.", layer_id_);
  out.push_back({p + "embed_tokens.weight", embed_, g_embed_, true, init_std});
  out.push_back({p + "enorm.weight", enorm_w_, g_enorm_w_, false, 0.0});
  out.push_back({p + "hnorm.weight", hnorm_w_, g_hnorm_w_, false, 0.0});
  out.push_back({p + "eh_proj.weight", eh_w_, g_eh_w_, true, init_std});
  out.push_back({p + "shared_head.norm.weight", head_norm_w_, g_head_norm_w_, false, 0.0});
  out.push_back({p + "shared_head.head.weight", head_w_, g_head_w_, true, init_std});
}

// u = eh_proj [enorm(Emb(t_{i+k})); hnorm(h_{k-1})]; a position whose token i + k lies past
// its row or document embeds token 0 (it has no target, so nothing reads it: see mtp.h).
Tensor MtpModule::input_forward(const Batch& batch, const Tensor& h_prev, MtpState& s) const {
  {
    StageScope t(Stage::kNorms);
    s.ids = batch.ahead_inputs.empty() ? ops::shift_tokens(batch.inputs, batch.segment_ids, batch.batch, depth_, 0)
                                       : ahead(batch.ahead_inputs);
    s.e = ops::embedding_forward(s.ids, embed_);
    s.h = h_prev;
    s.en = ops::rmsnorm_forward(s.e, enorm_w_, eps_);
    s.hn = ops::rmsnorm_forward(h_prev, hnorm_w_, eps_);
    s.joined = Tensor::empty({h_prev.size(0), 2 * H_}, h_prev.dtype(), h_prev.device());
    s.joined.copy_columns_from(0, s.en.y);
    s.joined.copy_columns_from(H_, s.hn.y);
  }
  StageScope t(Stage::kAttention);
  return ops::linear_forward(s.joined, eh_w_);
}

Tensor MtpModule::loss_forward(const Tensor& h_k, const Batch& batch, bool training, double scale, bool accumulate,
                               MtpState& s) {
  const Tensor targets = batch.ahead_targets.empty()
                             ? ops::shift_tokens(batch.targets, batch.segment_ids, batch.batch, depth_, kNoTarget)
                             : ahead(batch.ahead_targets);
  ops::RmsNormOut norm;
  {
    StageScope t(Stage::kNorms);
    norm = ops::rmsnorm_forward(h_k, head_norm_w_, eps_);
  }
  if (!training) {
    StageScope t(Stage::kLoss);
    return ops::linear_cross_entropy(norm.y, head_w_, targets, 1.0, nullptr, nullptr).loss_sum;
  }
  // Forward and backward in one pass, as the main head (decoder_model.cpp's end_forward).
  Tensor d_norm, loss;
  {
    StageScope t(Stage::kLoss);
    loss = ops::linear_cross_entropy(norm.y, head_w_, targets, scale, &d_norm, &g_head_w_, 0, accumulate).loss_sum;
  }
  StageScope t(Stage::kNorms);
  ops::rmsnorm_backward_weight(d_norm, h_k, norm.rstd, g_head_norm_w_, accumulate);
  s.d_out = ops::rmsnorm_backward_input(d_norm, h_k, head_norm_w_, norm.rstd);
  return loss;
}

Tensor MtpModule::backward_input(const Tensor& d_u, MtpState& s) const {
  Tensor d_joined;
  {
    StageScope t(Stage::kAttention);
    d_joined = ops::linear_backward_input(d_u, eh_w_);
  }
  StageScope t(Stage::kNorms);
  s.d_u = d_u;
  s.d_en = d_joined.columns(0, H_);
  s.d_hn = d_joined.columns(H_, 2 * H_);
  s.d_e = ops::rmsnorm_backward_input(s.d_en, s.e, enorm_w_, s.en.rstd);
  return ops::rmsnorm_backward_input(s.d_hn, s.h, hnorm_w_, s.hn.rstd);
}

void MtpModule::backward_weight(MtpState& s, bool accumulate) {
  {
    StageScope t(Stage::kAttention);
    ops::linear_backward_weight(s.d_u, s.joined, g_eh_w_, accumulate);
  }
  StageScope t(Stage::kNorms);
  ops::rmsnorm_backward_weight(s.d_en, s.e, s.en.rstd, g_enorm_w_, accumulate);
  ops::rmsnorm_backward_weight(s.d_hn, s.h, s.hn.rstd, g_hnorm_w_, accumulate);
  ops::embedding_backward_weight(s.ids, s.d_e, g_embed_, accumulate);
  s = MtpState();
}

}  // namespace moetrain
