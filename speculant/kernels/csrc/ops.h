// The operators registered as torch.ops.speculant.* (schemas in ops.cpp).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

namespace speculant {

// qtype codes of the operators that take weights in lists (decoder_stack_register,
// eagle3_layer), in the order of packed_linear.QTYPES.
inline constexpr std::string_view kQTypes[] = {"Q4_0", "Q4_1", "Q8_0", "F16", "F32"};
inline constexpr int64_t kNumQTypes = sizeof(kQTypes) / sizeof(kQTypes[0]);
std::string_view qtype_name(int64_t code);  // checks the code (decoder.cpp)

// Whether K [num_blocks, num_kv_heads, head_dim, block_size] and V [num_blocks, block_size,
// num_kv_heads, head_dim] describe one paged cache (kernels/kv_layout.py): the writer
// (rope_write_kv) and the reader (paged_attention) check the same shapes.
inline bool paged_kv_shapes_match(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == v_cache.size(0) &&
         k_cache.size(1) == v_cache.size(2) && k_cache.size(2) == v_cache.size(3) &&
         k_cache.size(3) == v_cache.size(1);
}

// Whether K [num_blocks, num_kv_heads, head_dim / 2, block_size, 2] and V [num_blocks,
// num_kv_heads, block_size / 2, head_dim, 2] describe one bf16 cache in the AMX tiles' layout
// (kernels/kv_layout.py), checked by its writer and its reader alike.
inline bool tile_kv_shapes_match(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.size(0) == v_cache.size(0) &&
         k_cache.size(1) == v_cache.size(1) && k_cache.size(4) == 2 && v_cache.size(4) == 2 &&
         k_cache.size(2) * 2 == v_cache.size(3) && k_cache.size(3) == v_cache.size(2) * 2;
}

// x [M, in] f32 times a packed weight (layouts in linear.cpp) -> [M, out_features] f32.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, std::string_view qtype,
                         int64_t out_features);

// packed_linear, and each output row's argmax [M] int64 (torch.argmax's answer) found as the row
// is written: the LM head's logits and greedy picks in one call.
std::tuple<at::Tensor, at::Tensor> packed_linear_argmax(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
    const std::optional<at::Tensor>& mins, std::string_view qtype, int64_t out_features);

// Each row's argmax (torch.argmax's: first maximum, first NaN) as int64 [R], and with
// `with_prob` the softmax probability of that entry [R] (else an empty tensor) (argmax.cpp).
std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& logits, bool with_prob);

// One token per row of logits [R, V] with the filters of engine/sampler.py, from one float64
// uniform per row: int64 [R], and with `with_prob` its probability under the filtered
// distribution [R] (else an empty tensor) (sample.cpp).
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits,
                                               const at::Tensor& uniforms, double temperature,
                                               int64_t top_k, double top_p, double min_p,
                                               bool with_prob);

// Rows `ids` of a packed weight, exactly dequantized: [n, in_features] f32 (embed.cpp).
at::Tensor packed_embed(const at::Tensor& ids, const at::Tensor& weight,
                        const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& mins, std::string_view qtype,
                        int64_t out_features);

// Causal attention of each query token over its own sequence's paged K/V (see attention.cpp).
// prompt_lens [S] int32 (optional): a token at a position below its sequence's entry is a
// prompt position, which may run on AMX-BF16 tiles (kernel_path.h, prompt_attention_tiles).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& token_seq, const at::Tensor& token_pos,
                           double scale, const std::optional<at::Tensor>& prompt_lens = {});

// x [T, D] -> weight * x / sqrt(mean(x^2) + eps), row by row (rowwise.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// h += delta in place, then returns rms_norm(h) (rowwise.cpp).
at::Tensor add_rms_norm(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight,
                        double eps);

// gate_up [T, 2F] = gate | up -> silu(gate) * up [T, F] (rowwise.cpp).
at::Tensor silu_mul(const at::Tensor& gate_up);

// Fused QKV output [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]; rotated k and v written into the
// caches at slot_mapping (rope.cpp).
at::Tensor rope_write_kv(const at::Tensor& qkv, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& positions,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, int64_t num_heads);

// Registers a model's layer weights for decoder_stack (decoder.cpp): 17 per layer (see Slot),
// 4 qtype codes per layer, the 4 linear layers' out_features. Returns the stack's id.
int64_t decoder_stack_register(const c10::List<std::optional<at::Tensor>>& weights,
                               at::IntArrayRef qtypes, at::IntArrayRef out_features);
void decoder_stack_release(int64_t stack);

// The decoder stack, every layer chained through the operators above: h [T, hidden] (the
// embeddings) becomes the last layer's output in place; returns the final-normed hidden states
// and a copy of h after each layer listed in hidden_layers (only its rows hidden_rows, when
// given: int64 row indices).
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_stack(
    const at::Tensor& h, int64_t stack, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& token_seq,
    const at::Tensor& token_pos, const at::Tensor& final_norm, at::IntArrayRef hidden_layers,
    int64_t num_heads, double eps, double scale,
    const std::optional<at::Tensor>& hidden_rows = std::nullopt,
    const std::optional<at::Tensor>& prompt_lens = std::nullopt);

// An EAGLE-3 head's decoder layer on the operators above (head_layer.cpp): inputs (token ids
// [T] int64, embedded with the token table of `weights`, or their embeddings [T, hidden]) and
// hidden ([T, hidden], or the captured features [T, n * hidden] that fc fuses first) -> the
// layer's output [T, hidden] (K/V written at slot_mapping), the LM head's logits [R,
// draft_vocab] of its rows logits_rows after the final norm ([0, draft_vocab] without them),
// and with `pick` each logits row's argmax [R] int64 and its softmax probability [R] (else
// empty). weights: 25 entries (see head_layer.cpp's Slot; the token table's and fc's may be
// absent), qtypes and out_features: of the qkv, output, gate/up, down, LM head, token table and
// fc matrices (an absent one's entries are not read).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> eagle3_layer(
    const at::Tensor& inputs, const at::Tensor& hidden,
    const c10::List<std::optional<at::Tensor>>& weights, at::IntArrayRef qtypes,
    at::IntArrayRef out_features, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& token_seq,
    const at::Tensor& token_pos, const std::optional<at::Tensor>& logits_rows, int64_t num_heads,
    double eps, double scale, bool pick);

}  // namespace speculant
