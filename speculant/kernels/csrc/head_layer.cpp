// An EAGLE-3 head's decoder layer, and optionally its LM head over some rows, in one call.
//
// Drafting runs this layer for one or a few rows per sequence, one forward per drafted
// position. Chained from Python (models/eagle3_layer.py) its eleven kernel calls, the final norm
// and the LM head cost ~0.2 ms per forward in argument parsing, dispatch and the Python between
// them, about as much as the kernels themselves at one row (measured: 0.33 ms per layer call and
// 0.34 ms per norm + LM head call inside the engine's drafting, against ~0.15 ms of kernels).
// Every step is the corresponding operator's own function, in the order the Python path calls
// them, so the results are bit-identical to it.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "ops.h"

namespace speculant {
namespace {

// Entries of `weights`, in this order (models/eagle3_layer.py builds the list); a packed linear
// is (data, scales, mins), scales and mins absent for float weights.
enum Slot : int64_t {
  kInputNorm, kHiddenNorm,
  kQkv, kQkvScales, kQkvMins,
  kOut, kOutScales, kOutMins,
  kPostNorm,
  kGateUp, kGateUpScales, kGateUpMins,
  kDown, kDownScales, kDownMins,
  kFinalNorm,
  kLmHead, kLmHeadScales, kLmHeadMins,
  kNumSlots
};
constexpr Slot kLinears[] = {kQkv, kOut, kGateUp, kDown, kLmHead};  // qtypes' order

struct HeadWeights {
  const c10::List<std::optional<at::Tensor>>& list;
  at::IntArrayRef qtypes;  // codes (qtype_name)
  at::IntArrayRef out_features;

  at::Tensor get(Slot s) const {
    const std::optional<at::Tensor> t = list.get(s);
    TORCH_CHECK(t.has_value(), "speculant::eagle3_layer: weight slot ", static_cast<int64_t>(s),
                " is missing");
    return *t;
  }
  at::Tensor linear(const at::Tensor& x, int which) const {
    const Slot data = kLinears[which];
    return packed_linear(x, get(data), list.get(data + 1), list.get(data + 2),
                         qtype_name(qtypes[which]), out_features[which]);
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> eagle3_layer(
    const at::Tensor& embeds, const at::Tensor& hidden,
    const c10::List<std::optional<at::Tensor>>& weights, at::IntArrayRef qtypes,
    at::IntArrayRef out_features, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& token_seq,
    const at::Tensor& token_pos, const std::optional<at::Tensor>& logits_rows, int64_t num_heads,
    double eps, double scale) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kNumSlots && qtypes.size() == 5 &&
                  out_features.size() == 5,
              "speculant::eagle3_layer: expected ", static_cast<int64_t>(kNumSlots),
              " weights, 5 qtypes and 5 out_features");
  TORCH_CHECK(embeds.dim() == 2 && hidden.sizes() == embeds.sizes(),
              "speculant::eagle3_layer: embeds and hidden must both be [T, hidden]");
  const HeadWeights w{weights, qtypes, out_features};
  const int64_t T = embeds.size(0);
  // the residual carries the fused feature (or the previous output), not the embedding
  at::Tensor h = hidden.to(at::kFloat).contiguous().clone();
  const at::Tensor x_in = at::cat({rms_norm(embeds.to(at::kFloat).contiguous(),
                                            w.get(kInputNorm), eps),
                                   rms_norm(h, w.get(kHiddenNorm), eps)},
                                  -1);  // [T, 2 hidden]
  const at::Tensor q = rope_write_kv(w.linear(x_in, 0), std::nullopt, std::nullopt, std::nullopt,
                                     eps, cos, sin, positions, k_cache, v_cache, slot_mapping,
                                     num_heads);
  const at::Tensor attn =
      paged_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale);
  const at::Tensor x = add_rms_norm(h, w.linear(attn.reshape({T, -1}), 1), w.get(kPostNorm), eps);
  h.add_(w.linear(silu_mul(w.linear(x, 2)), 3));
  if (!logits_rows.has_value()) return {h, h.new_empty({0, out_features[4]})};
  const at::Tensor rows = h.index_select(0, *logits_rows).contiguous();
  return {h, w.linear(rms_norm(rows, w.get(kFinalNorm), eps), 4)};
}

}  // namespace speculant
