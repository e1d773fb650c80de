// The whole decoder stack of a Llama-family model in one call: the same native kernels the
// model's op-by-op path calls, chained here instead of from Python. The per-call cost of a custom
// operator from Python (~3 us of argument parsing and dispatch, plus the Python around it) times
// nine operators per layer was ~1 ms per decode step; here it is paid once. The weights are
// registered once per model (decoder_stack_register) and named by an id at each call.
//
// Every step is the corresponding operator's own function, in the same order, so the result is
// bit-identical to the op-by-op native path (and batch-invariant for the same reasons).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ops.h"

namespace speculant {
namespace {

// Entries of `weights` per layer, in this order (kernels/decoder.py builds the list).
enum Slot : int64_t {
  kAttnNorm, kQkv, kQkvScales, kQkvMins, kQkvBias, kQNorm, kKNorm,
  kOut, kOutScales, kOutMins, kFfnNorm,
  kGateUp, kGateUpScales, kGateUpMins, kDown, kDownScales, kDownMins,
  kSlotsPerLayer
};
constexpr Slot kLinears[] = {kQkv, kOut, kGateUp, kDown};  // data slots, in qtypes' order

// A model's weights, registered once: converting a list of ~500 tensors from Python costs
// ~100 us, too much to pay at every step.
struct Stack {
  std::vector<std::optional<at::Tensor>> weights;  // [num_layers * kSlotsPerLayer]
  std::vector<std::string_view> qtypes;            // [num_layers * 4]
  std::vector<int64_t> out_features;               // [4]
  int64_t num_layers;

  const at::Tensor& get(int64_t layer, Slot s) const {
    return *weights[layer * kSlotsPerLayer + s];
  }
  const std::optional<at::Tensor>& opt(int64_t layer, Slot s) const {
    return weights[layer * kSlotsPerLayer + s];
  }
  at::Tensor linear(const at::Tensor& x, int64_t layer, int which) const {
    const Slot data = kLinears[which];
    return packed_linear(x, get(layer, data), opt(layer, Slot(data + 1)),
                         opt(layer, Slot(data + 2)), qtypes[layer * 4 + which],
                         out_features[which]);
  }
};

std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<const Stack>> registry;
int64_t next_stack_id = 1;

std::shared_ptr<const Stack> find_stack(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry.find(id);
  TORCH_CHECK(it != registry.end(), "speculant::decoder_stack: no registered stack ", id);
  return it->second;
}

}  // namespace

std::string_view qtype_name(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kNumQTypes, "speculant: bad qtype code ", code);
  return kQTypes[code];
}

int64_t decoder_stack_register(const c10::List<std::optional<at::Tensor>>& weights,
                               at::IntArrayRef qtypes, at::IntArrayRef out_features) {
  const int64_t num_layers = static_cast<int64_t>(qtypes.size()) / 4;
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(qtypes.size()) == num_layers * 4 &&
                  static_cast<int64_t>(weights.size()) == num_layers * kSlotsPerLayer &&
                  out_features.size() == 4,
              "speculant::decoder_stack_register: expected ", kSlotsPerLayer, " weights and 4 "
              "qtypes per layer, and 4 out_features");
  auto stack = std::make_shared<Stack>();
  stack->num_layers = num_layers;
  stack->out_features.assign(out_features.begin(), out_features.end());
  for (int64_t code : qtypes) stack->qtypes.push_back(qtype_name(code));
  for (int64_t i = 0; i < num_layers * kSlotsPerLayer; ++i) {
    stack->weights.push_back(weights.get(i));
  }
  for (int64_t l = 0; l < num_layers; ++l) {
    for (Slot s : {kAttnNorm, kQkv, kOut, kFfnNorm, kGateUp, kDown}) {
      TORCH_CHECK(stack->opt(l, s).has_value(), "speculant::decoder_stack_register: layer ", l,
                  " lacks required weight ", static_cast<int64_t>(s));
    }
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace(next_stack_id, std::move(stack));
  return next_stack_id++;
}

void decoder_stack_release(int64_t stack) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(stack);
}

std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_stack(
    const at::Tensor& h, int64_t stack_id, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& token_seq,
    const at::Tensor& token_pos, const at::Tensor& final_norm, at::IntArrayRef hidden_layers,
    int64_t num_heads, double eps, double scale, const std::optional<at::Tensor>& hidden_rows,
    const std::optional<at::Tensor>& prompt_lens) {
  const std::shared_ptr<const Stack> stack = find_stack(stack_id);
  const Stack& w = *stack;
  const int64_t num_layers = w.num_layers;
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers &&
                  static_cast<int64_t>(v_caches.size()) == num_layers,
              "speculant::decoder_stack: expected one K and one V cache per layer (", num_layers,
              ")");
  const int64_t T = h.size(0);
  // The captured layers' rows, one tensor for all of them, copied into as the stack goes (a
  // clone per layer, through the dispatcher and the allocator, cost ~20 us each: 4 layers ~1%
  // of a 3-row verification step)
  const int64_t num_wanted = static_cast<int64_t>(hidden_layers.size());
  const int64_t num_rows = hidden_rows ? hidden_rows->size(0) : T;
  const int64_t width = h.size(1);
  at::Tensor captured = num_wanted ? at::empty({num_wanted, num_rows, width}, h.options())
                                   : at::Tensor();
  const int64_t* rows = hidden_rows ? hidden_rows->data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(!num_wanted || h.scalar_type() == at::kFloat,
              "speculant::decoder_stack: hidden states must be float32");
  for (int64_t r = 0; rows != nullptr && r < num_rows; ++r)
    TORCH_CHECK(rows[r] >= 0 && rows[r] < T, "speculant::decoder_stack: hidden row ", rows[r],
                " out of range for ", T, " tokens");
  at::Tensor x = rms_norm(h, w.get(0, kAttnNorm), eps);
  for (int64_t l = 0; l < num_layers; ++l) {
    // 1) attention: q, k, v rotated; k, v written at their slots first, then attended over
    const at::Tensor qkv = w.linear(x, l, 0);
    const at::Tensor q = rope_write_kv(qkv, w.opt(l, kQkvBias), w.opt(l, kQNorm), w.opt(l, kKNorm),
                                       eps, cos, sin, positions, k_caches[l], v_caches[l],
                                       slot_mapping, num_heads);
    const at::Tensor attn = paged_attention(q, k_caches[l], v_caches[l], block_tables, token_seq,
                                            token_pos, scale, prompt_lens);
    x = add_rms_norm(h, w.linear(attn.view({T, -1}), l, 1), w.get(l, kFfnNorm), eps);
    // 2) MLP, its residual add fused with the next norm (next layer's, or the final one)
    const at::Tensor down = w.linear(silu_mul(w.linear(x, l, 2)), l, 3);
    x = add_rms_norm(h, down, l + 1 < num_layers ? w.get(l + 1, kAttnNorm) : final_norm, eps);
    for (int64_t i = 0; i < num_wanted; ++i) {
      // only the rows a caller reads (a long prompt chunk's newest): a copy of every row at
      // every captured layer cost ~1% of a long-context run
      if (hidden_layers[i] != l) continue;
      const float* src = h.data_ptr<float>();
      float* dst = captured.data_ptr<float>() + i * num_rows * width;
      if (rows == nullptr) {
        std::memcpy(dst, src, sizeof(float) * num_rows * width);
      } else {
        for (int64_t r = 0; r < num_rows; ++r)
          std::memcpy(dst + r * width, src + rows[r] * width, sizeof(float) * width);
      }
    }
  }
  std::vector<at::Tensor> hidden;
  for (int64_t i = 0; i < num_wanted; ++i) hidden.push_back(captured.select(0, i));
  return {x, hidden};
}

}  // namespace speculant
