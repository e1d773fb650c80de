// Rows of a packed weight matrix (layouts in linear.cpp), exactly dequantized: the token
// embedding lookup. Done here rather than with torch indexing ops because those run an OpenMP
// region once a few rows are gathered, which wakes torch's OpenMP worker, which then spins on the
// second core for milliseconds while the kernels' own pool needs it.
//
// Values are bit-identical to gguf-py's dequantization (and ggml_blocks.dequantize): one fp32
// multiply (and, for Q4_1, one add) per element, never contracted into an FMA.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "ops.h"

namespace speculant {
namespace {

constexpr int64_t kBlock = 32;

float half_at(const at::Tensor& t, int64_t i) {
  return static_cast<float>(t.const_data_ptr<at::Half>()[i]);
}

// Row r of group g of a Q4_0 / Q4_1 matrix (chunk v of a block holds bytes 4v..4v+3 of each of
// the 8 rows; byte j's low nibble is element j, its high nibble element j + 16).
void q4_row(const at::Tensor& data, const at::Tensor& scales, const at::Tensor* mins, int64_t g,
            int64_t r, int64_t nb, float* out) {
  const uint8_t* qs = data.const_data_ptr<uint8_t>() + g * nb * 128;
  for (int64_t b = 0; b < nb; ++b, qs += 128, out += kBlock) {
    const int64_t field = (g * nb + b) * 8 + r;
    const float d = half_at(scales, field);
    const float m = mins ? half_at(*mins, field) : 0.0f;
    for (int v = 0; v < 4; ++v) {
      for (int e = 0; e < 4; ++e) {
        const uint8_t byte = qs[32 * v + 4 * r + e];
        const int j = 4 * v + e, lo = byte & 0x0F, hi = byte >> 4;
        if (mins) {
          out[j] = d * static_cast<float>(lo) + m;
          out[j + 16] = d * static_cast<float>(hi) + m;
        } else {
          out[j] = d * static_cast<float>(lo - 8);
          out[j + 16] = d * static_cast<float>(hi - 8);
        }
      }
    }
  }
}

// Row r of group g of a Q8_0 matrix (chunk c of a block holds elements 4c..4c+3 of each row).
void q8_row(const at::Tensor& data, const at::Tensor& scales, int64_t g, int64_t r, int64_t nb,
            float* out) {
  const int8_t* qs = data.const_data_ptr<int8_t>() + g * nb * 256;
  for (int64_t b = 0; b < nb; ++b, qs += 256, out += kBlock) {
    const float d = half_at(scales, (g * nb + b) * 8 + r);
    for (int c = 0; c < 8; ++c) {
      for (int e = 0; e < 4; ++e) out[4 * c + e] = static_cast<float>(qs[32 * c + 4 * r + e]) * d;
    }
  }
}

}  // namespace

at::Tensor packed_embed(const at::Tensor& ids_in, const at::Tensor& data,
                        const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& mins, std::string_view qtype,
                        int64_t out_features) {
  TORCH_CHECK(ids_in.device().is_cpu() && ids_in.dim() == 1 &&
                  (ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt),
              "speculant::packed_embed: ids must be a 1-D int64/int32 CPU tensor");
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.dim() == 3,
              "speculant::packed_embed: weight must be a contiguous 3-D CPU tensor");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), G = data.size(0);
  const bool is_float = qtype == "F32" || qtype == "F16";
  const int64_t K = is_float ? data.size(1) : data.size(1) * kBlock, nb = data.size(1);
  at::Tensor out = at::empty({n, K}, ids.options().dtype(at::kFloat));
  const int64_t* idp = ids.const_data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (const std::optional<at::Tensor>* t : {&scales, &mins}) {
    if (!t->has_value() || is_float) continue;
    const at::Tensor& f = **t;
    TORCH_CHECK(f.device().is_cpu() && f.is_contiguous() && f.scalar_type() == at::kHalf &&
                    f.dim() == 3 && f.size(0) == G && f.size(1) == nb && f.size(2) == 8,
                "speculant::packed_embed: scales / mins must be contiguous fp16 [", G, ", ", nb,
                ", 8]");
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < out_features && idp[i] < G * 8,
                "speculant::packed_embed: id ", idp[i], " out of range [0, ", out_features, ")");
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = idp[i] / 8, r = idp[i] % 8;
    float* row = op + i * K;
    if (qtype == "F32") {
      const float* w = data.const_data_ptr<float>() + g * K * 8;
      for (int64_t k = 0; k < K; ++k) row[k] = w[k * 8 + r];
    } else if (qtype == "F16") {
      const at::Half* w = data.const_data_ptr<at::Half>() + g * K * 8;
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(w[k * 8 + r]);
    } else if (qtype == "Q8_0") {
      TORCH_CHECK(scales.has_value(), "speculant::packed_embed: Q8_0 needs scales");
      q8_row(data, *scales, g, r, nb, row);
    } else if (qtype == "Q4_0" || qtype == "Q4_1") {
      TORCH_CHECK(scales.has_value() && (qtype == "Q4_0" || mins.has_value()),
                  "speculant::packed_embed: ", qtype, " needs scales (and Q4_1 mins)");
      q4_row(data, *scales, qtype == "Q4_1" ? &*mins : nullptr, g, r, nb, row);
    } else {
      TORCH_CHECK(false, "speculant::packed_embed: unknown qtype ", qtype);
    }
  }
  return out;
}

}  // namespace speculant
