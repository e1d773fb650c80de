// An EAGLE-3 head's decoder layer, and optionally its LM head over some rows, in one call.
//
// Drafting runs this layer for one or a few rows per sequence, one forward per drafted
// position. Chained from Python (models/eagle3_layer.py) its eleven kernel calls, the final norm
// and the LM head cost ~0.2 ms per forward in argument parsing, dispatch and the Python between
// them, about as much as the kernels themselves at one row (measured: 0.33 ms per layer call and
// 0.34 ms per norm + LM head call inside the engine's drafting, against ~0.15 ms of kernels).
// Every step is the corresponding operator's own function, in the order the Python path calls
// them, so the results are bit-identical to it.
//
// The call can also take the round's other small steps, each ~10-45 us of Python and dispatch
// inside the engine's drafting against a few us of work (measured on an AMX Xeon, mt_bench at
// c=1: fc 45 us, the embedding 10 us, the greedy pick 28 us; a drafting round runs ~2 calls):
// token ids in place of embeddings (the target's packed token table rows, exactly dequantized),
// the captured target features in place of the fused hidden (`fc` first), and each logits row's
// argmax with its softmax probability (`pick`). Each is the operator the Python path calls.
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
  kEmbed, kEmbedScales, kEmbedMins,  // the target's packed token table (absent: embeddings given)
  kFc, kFcScales, kFcMins,  // fc: captured features -> fused hidden (absent: hidden given)
  kNumSlots
};
constexpr Slot kLinears[] = {kQkv, kOut, kGateUp, kDown, kLmHead, kEmbed, kFc};  // qtypes' order
constexpr int kEmbedIndex = 5, kFcIndex = 6;
constexpr int64_t kNumLinears = sizeof(kLinears) / sizeof(kLinears[0]);

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
  bool has(int which) const { return list.get(kLinears[which]).has_value(); }
  // a packed matrix's input width (linear.cpp's layouts: blocks of 32 with scales, else
  // [G, in_features, 8])
  int64_t in_features(int which) const {
    const Slot data = kLinears[which];
    const std::optional<at::Tensor> scales = list.get(data + 1);
    return scales.has_value() ? scales->size(1) * 32 : get(data).size(1);
  }
  at::Tensor linear(const at::Tensor& x, int which) const {
    const Slot data = kLinears[which];
    return packed_linear(x, get(data), list.get(data + 1), list.get(data + 2),
                         qtype_name(qtypes[which]), out_features[which]);
  }
  // rows `ids` of the token table, as PackedLinear.embed computes them
  at::Tensor embed(const at::Tensor& ids) const {
    return packed_embed(ids, get(kEmbed), list.get(kEmbedScales), list.get(kEmbedMins),
                        qtype_name(qtypes[kEmbedIndex]), out_features[kEmbedIndex]);
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> eagle3_layer(
    const at::Tensor& inputs, const at::Tensor& hidden,
    const c10::List<std::optional<at::Tensor>>& weights, at::IntArrayRef qtypes,
    at::IntArrayRef out_features, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& token_seq,
    const at::Tensor& token_pos, const std::optional<at::Tensor>& logits_rows, int64_t num_heads,
    double eps, double scale, bool pick) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kNumSlots &&
                  static_cast<int64_t>(qtypes.size()) == kNumLinears &&
                  static_cast<int64_t>(out_features.size()) == kNumLinears,
              "speculant::eagle3_layer: expected ", static_cast<int64_t>(kNumSlots), " weights, ",
              kNumLinears, " qtypes and ", kNumLinears, " out_features");
  const HeadWeights w{weights, qtypes, out_features};
  const int64_t d = w.get(kInputNorm).size(0);
  // token ids [T] (embedded here) or their embeddings [T, d]
  const bool ids = inputs.dim() == 1;
  TORCH_CHECK(!ids || (inputs.scalar_type() == at::kLong && w.has(kEmbedIndex)),
              "speculant::eagle3_layer: token ids must be int64 and need the token table");
  const at::Tensor embeds = ids ? w.embed(inputs) : inputs.to(at::kFloat).contiguous();
  TORCH_CHECK(embeds.dim() == 2 && embeds.size(1) == d,
              "speculant::eagle3_layer: embeddings must be [T, ", d, "]");
  const int64_t T = embeds.size(0);
  // captured features [T, n_feat * d] (fused by fc here) or the fused hidden [T, d]
  const int64_t fc_in = w.has(kFcIndex) ? w.in_features(kFcIndex) : d;
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == T &&
                  (hidden.size(1) == d || hidden.size(1) == fc_in),
              "speculant::eagle3_layer: hidden must be [T, ", d, "] (fused) or [T, ", fc_in,
              "] (the features fc reads), got ", hidden.sizes());
  // the residual carries the fused feature (or the previous output), not the embedding
  at::Tensor h = hidden.size(1) == d ? hidden.to(at::kFloat).contiguous().clone()
                                     : w.linear(hidden.to(at::kFloat).contiguous(), kFcIndex);
  TORCH_CHECK(h.size(1) == d, "speculant::eagle3_layer: fc must yield [T, ", d, "]");
  const at::Tensor x_in = at::cat({rms_norm(embeds, w.get(kInputNorm), eps),
                                   rms_norm(h, w.get(kHiddenNorm), eps)},
                                  -1);  // [T, 2 hidden]
  const at::Tensor q = rope_write_kv(w.linear(x_in, 0), std::nullopt, std::nullopt, std::nullopt,
                                     eps, cos, sin, positions, k_cache, v_cache, slot_mapping,
                                     num_heads);
  const at::Tensor attn =
      paged_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale);
  const at::Tensor x = add_rms_norm(h, w.linear(attn.reshape({T, -1}), 1), w.get(kPostNorm), eps);
  h.add_(w.linear(silu_mul(w.linear(x, 2)), 3));
  const at::Tensor none = h.new_empty({0}, h.options().dtype(at::kLong));
  if (!logits_rows.has_value()) {
    return {h, h.new_empty({0, out_features[4]}), none, h.new_empty({0})};
  }
  const at::Tensor rows = h.index_select(0, *logits_rows).contiguous();
  const at::Tensor logits = w.linear(rms_norm(rows, w.get(kFinalNorm), eps), 4);
  if (!pick) return {h, logits, none, h.new_empty({0})};
  auto [cols, probs] = row_argmax(logits, /*with_prob=*/true);
  return {h, logits, cols, probs};
}

}  // namespace speculant
