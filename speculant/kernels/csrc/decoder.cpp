// The whole decoder stack of a Llama-family model in one call: the same native kernels the
// model's op-by-op path calls, chained here instead of from Python. The per-call cost of a custom
// operator from Python (~3 us of argument parsing and dispatch, plus the Python around it) times
// nine operators per layer was ~1 ms per decode step; here it is paid once.
//
// Every step is the corresponding operator's own function, in the same order, so the result is
// bit-identical to the op-by-op native path (and batch-invariant for the same reasons).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <string_view>

#include "ops.h"

namespace speculant {
namespace {

// qtype codes of decoder_stack's `qtypes`, in the order of packed_linear.QTYPES.
constexpr std::string_view kQTypes[] = {"Q4_0", "Q4_1", "Q8_0", "F16", "F32"};
constexpr int64_t kNumQTypes = sizeof(kQTypes) / sizeof(kQTypes[0]);

// Entries of `weights` per layer, in this order (see model.py, which builds the list).
enum Slot : int64_t {
  kAttnNorm, kQkv, kQkvScales, kQkvMins, kQkvBias, kQNorm, kKNorm,
  kOut, kOutScales, kOutMins, kFfnNorm,
  kGateUp, kGateUpScales, kGateUpMins, kDown, kDownScales, kDownMins,
  kSlotsPerLayer
};

struct Weights {
  const c10::List<std::optional<at::Tensor>>& list;
  int64_t layer;

  std::optional<at::Tensor> opt(Slot s) const { return list.get(layer * kSlotsPerLayer + s); }
  at::Tensor get(Slot s) const {
    std::optional<at::Tensor> t = opt(s);
    TORCH_CHECK(t.has_value(), "speculant::decoder_stack: layer ", layer, " is missing weight ",
                static_cast<int64_t>(s));
    return *t;
  }
};

at::Tensor linear(const at::Tensor& x, const Weights& w, Slot data, at::IntArrayRef qtypes,
                  int64_t which, int64_t out_features) {
  const int64_t code = qtypes[w.layer * 4 + which];
  TORCH_CHECK(code >= 0 && code < kNumQTypes, "speculant::decoder_stack: bad qtype code ", code);
  return packed_linear(x, w.get(data), w.opt(Slot(data + 1)), w.opt(Slot(data + 2)),
                       kQTypes[code], out_features);
}

}  // namespace

std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_stack(
    const at::Tensor& h, const c10::List<std::optional<at::Tensor>>& weights,
    at::IntArrayRef qtypes, at::IntArrayRef out_features, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& token_seq, const at::Tensor& token_pos, const at::Tensor& final_norm,
    at::IntArrayRef hidden_layers, int64_t num_heads, double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kSlotsPerLayer &&
                  static_cast<int64_t>(v_caches.size()) == num_layers &&
                  static_cast<int64_t>(qtypes.size()) == num_layers * 4 &&
                  out_features.size() == 4,
              "speculant::decoder_stack: expected ", kSlotsPerLayer, " weights and 4 qtypes per "
              "layer, one K and one V cache per layer, and 4 out_features");
  const int64_t T = h.size(0);
  std::vector<at::Tensor> hidden;
  at::Tensor x = rms_norm(h, Weights{weights, 0}.get(kAttnNorm), eps);
  for (int64_t l = 0; l < num_layers; ++l) {
    const Weights w{weights, l};
    // 1) attention: q, k, v rotated; k, v written at their slots first, then attended over
    const at::Tensor qkv = linear(x, w, kQkv, qtypes, 0, out_features[0]);
    const at::Tensor q = rope_write_kv(qkv, w.opt(kQkvBias), w.opt(kQNorm), w.opt(kKNorm), eps,
                                       cos, sin, positions, k_caches[l], v_caches[l],
                                       slot_mapping, num_heads);
    const at::Tensor attn = paged_attention(q, k_caches[l], v_caches[l], block_tables, token_seq,
                                            token_pos, scale);
    const at::Tensor o = linear(attn.view({T, -1}), w, kOut, qtypes, 1, out_features[1]);
    x = add_rms_norm(h, o, w.get(kFfnNorm), eps);
    // 2) MLP, its residual add fused with the next norm (next layer's, or the final one)
    const at::Tensor gate_up = linear(x, w, kGateUp, qtypes, 2, out_features[2]);
    const at::Tensor down = linear(silu_mul(gate_up), w, kDown, qtypes, 3, out_features[3]);
    const at::Tensor next_norm =
        l + 1 < num_layers ? Weights{weights, l + 1}.get(kAttnNorm) : final_norm;
    x = add_rms_norm(h, down, next_norm, eps);
    for (int64_t wanted : hidden_layers) {
      if (wanted == l) hidden.push_back(h.clone());
    }
  }
  return {x, hidden};
}

}  // namespace speculant
