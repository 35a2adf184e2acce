// Multi-token prediction (DeepSeek-V3 report, section 2.2): D modules after the main model,
// module k (depth 1..D) predicting the token k + 1 places ahead of each position. At
// position i it joins h_{k-1}(i), the main model's last hidden state (the final norm's input)
// for k = 1 and module k-1's output after, with the embedding of token i + k:
//
//   u   = eh_proj [enorm(Emb(t_{i+k})); hnorm(h_{k-1}(i))]          eh_proj: [H, 2H]
//   h_k = decoder layer L + k - 1 of the family (u)                  (its own attention and experts)
//   loss_k = cross-entropy of shared_head.head(shared_head.norm(h_k)) against t_{i+k+1}
//
// and the model's loss adds mtp_loss_weight / D times the sum of the modules' token
// cross-entropies, divided as the main one (by the step's target count). Positions whose
// token i + k or i + k + 1 lies past their row or document have no target.
//
// This class is the module's own part around its decoder layer (which the skeleton runs as
// any other layer, exchanges and all): the weights under Hugging Face's names
// model.layers.<L+k-1>.{embed_tokens, enorm, hnorm, eh_proj, shared_head.norm,
// shared_head.head} in one bucket of that layer, and the math before and after the layer.
// DeepSeek shares the embedding and the output head with the main model; its checkpoints
// store copies under these names, and moetrain keeps them as the module's own weights, so
// that the whole module lives on the pipeline's head stage (docs/deepseek-v3.md).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/data/loader.h"
#include "engine/parameters.h"
#include "ops/ops.h"

namespace moetrain {

// What one micro-batch's pass through a module keeps for its backward.
struct MtpState {
  Tensor ids;                // token i + k of every position (i32 [T])
  Tensor e, h;               // the embedding rows and h_{k-1}: the two norms' inputs
  ops::RmsNormOut en, hn;    // enorm(e), hnorm(h)
  Tensor joined;             // [en.y, hn.y] [T, 2H]: eh_proj's input
  Tensor d_out;              // the gradient of the module's loss at h_k (made with the loss)
  Tensor d_u, d_en, d_hn, d_e;  // backward_input's results kept for backward_weight
};

class MtpModule {
 public:
  // Module `depth` (1-based) around decoder layer `layer_id`, weights uninitialised.
  MtpModule(int64_t layer_id, int64_t depth, int64_t vocab_size, int64_t hidden_size, double rms_norm_eps,
            DType dtype, Device device, int64_t bucket_pad);

  int64_t layer_id() const { return layer_id_; }
  int64_t depth() const { return depth_; }
  ParamBucket& bucket() { return bucket_; }
  void collect_parameters(ParameterList& out, double init_std);

  // u, the decoder layer's input, from h_{k-1} and the batch's tokens.
  Tensor input_forward(const Batch& batch, const Tensor& h_prev, MtpState& s) const;
  // The module's loss at the layer output h_k: returns its token cross-entropy sum ([1], f32
  // on the GPU). When training also its gradient: s.d_out (d loss / d h_k, the sum scaled by
  // `scale`) and the head's and its norm's weight gradients (written, or added per `accumulate`).
  Tensor loss_forward(const Tensor& h_k, const Batch& batch, bool training, double scale, bool accumulate,
                      MtpState& s);
  // d u -> d h_{k-1}; keeps what backward_weight needs.
  Tensor backward_input(const Tensor& d_u, MtpState& s) const;
  // eh_proj's, the two norms' and the embedding's weight gradients (written or added).
  void backward_weight(MtpState& s, bool accumulate);

 private:
  const Tensor& ahead(const std::vector<Tensor>& shifted) const;
  int64_t layer_id_, depth_, H_;
  double eps_;
  ParamBucket bucket_;
  Tensor embed_, enorm_w_, hnorm_w_, eh_w_, head_norm_w_, head_w_;
  Tensor g_embed_, g_enorm_w_, g_hnorm_w_, g_eh_w_, g_head_norm_w_, g_head_w_;
};

}  // namespace moetrain
