// The operators registered as torch.ops.speculant.* (schemas in ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

namespace speculant {

// x [M, in] f32 times a packed weight (layouts in linear.cpp) -> [M, out_features] f32.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, std::string_view qtype,
                         int64_t out_features);

// Causal attention of each query token over its own sequence's paged K/V (see attention.cpp).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& token_seq, const at::Tensor& token_pos,
                           double scale);

}  // namespace speculant
