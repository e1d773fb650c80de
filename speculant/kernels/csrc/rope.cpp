// The attention block's glue between the QKV projection and attention, fused into one pass per
// token: split the fused projection into q / k / v heads, add the QKV bias (Qwen2), RMS-normalize
// each q and k head (Qwen3), rotate q and k (NeoX / HF RoPE), return q and write k and v straight
// into the paged cache at the token's slot (V as a row of its block, K as a column of its
// transposed block; a bf16 cache in the AMX tiles' layout takes both as element pairs:
// kernels/kv_layout.py).
//
// The order of operations is the PyTorch reference's (bias, norm, rotate), each step rounding the
// same way, so the result is bit-identical to it except for the norms' sum of squares (rows.h).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "rows.h"

namespace speculant {
namespace {

// Entry i of an int32 or int64 index tensor.
struct Indices {
  const int32_t* i32 = nullptr;
  const int64_t* i64 = nullptr;
  int64_t operator[](int64_t i) const { return i32 ? i32[i] : i64[i]; }
};

Indices indices(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.numel() == n && t.is_contiguous() &&
                  (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
              "speculant::rope_write_kv: ", name, " must be a contiguous int32/int64 CPU "
              "tensor of ", n, " entries");
  Indices idx;
  if (t.scalar_type() == at::kInt) {
    idx.i32 = t.const_data_ptr<int32_t>();
  } else {
    idx.i64 = t.const_data_ptr<int64_t>();
  }
  return idx;
}

const float* optional_vector(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 1 &&
                  t->numel() == n && t->is_contiguous(),
              "speculant::rope_write_kv: ", name, " must be a contiguous float32 CPU tensor of ",
              n, " elements");
  return t->const_data_ptr<float>();
}

// dst = src (+ bias), then the optional per-head norm and rotation, all in place in dst.
void head(const float* src, const float* bias, const float* norm, float eps, const float* cos,
          const float* sin, int64_t D, float* dst) {
  if (bias) {
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(src + i), _mm256_loadu_ps(bias + i)));
    }
    for (; i < D; ++i) dst[i] = src[i] + bias[i];
  } else {
    std::memcpy(dst, src, D * sizeof(float));
  }
  if (norm) rms_norm_row(dst, norm, eps, D, dst);
  if (cos) rope_row(dst, cos, sin, D);
}

// head() straight into a float32 cache row.
void store_row(const float* src, const float* bias, const float* norm, float eps, const float* cos,
               const float* sin, int64_t D, float* /*scratch*/, float* dst) {
  head(src, bias, norm, eps, cos, sin, D, dst);
}

// head() into scratch, then rounded to the nearest fp16 (ties to even, as torch's .half()).
void store_row(const float* src, const float* bias, const float* norm, float eps, const float* cos,
               const float* sin, int64_t D, float* scratch, uint16_t* dst) {
  head(src, bias, norm, eps, cos, sin, D, scratch);
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(scratch + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < D; ++i) dst[i] = _cvtss_sh(scratch[i], _MM_FROUND_TO_NEAREST_INT);
}

// head() into the column of a transposed K block: feature d at dst[d * stride], rounded like
// store_row for an fp16 cache.
template <typename KV>
void store_column(const float* src, const float* bias, const float* norm, float eps,
                  const float* cos, const float* sin, int64_t D, float* scratch, KV* dst,
                  int64_t stride) {
  thread_local std::vector<KV> row;
  row.resize(D);
  store_row(src, bias, norm, eps, cos, sin, D, scratch, row.data());
  for (int64_t d = 0; d < D; ++d) dst[d * stride] = row[d];
}

// x rounded to the nearest bf16 (ties to even; a NaN stays a quiet NaN), as torch's
// .to(torch.bfloat16).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Where a cache in the AMX tiles' layout (kernels/kv_layout.py) keeps a token's K and V: K
// blocks [Hkv, D / 2, block_size, 2], V blocks [Hkv, block_size / 2, D, 2], bf16.
struct TileSlots {
  int64_t Hkv, D, block_size;
  // element of feature d of KV head h at row r of block b
  int64_t k(int64_t b, int64_t h, int64_t r, int64_t d) const {
    return ((b * Hkv + h) * (D / 2) + d / 2) * block_size * 2 + r * 2 + d % 2;
  }
  int64_t v(int64_t b, int64_t h, int64_t r, int64_t d) const {
    return ((b * Hkv + h) * (block_size / 2) + r / 2) * D * 2 + d * 2 + r % 2;
  }
};

}  // namespace

at::Tensor rope_write_kv(const at::Tensor& qkv, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm, double eps,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         int64_t num_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 &&
                  qkv.is_contiguous(),
              "speculant::rope_write_kv: qkv must be a contiguous 2-D float32 CPU tensor");
  const bool half = k_cache.scalar_type() == at::kHalf;
  const bool tiles = k_cache.scalar_type() == at::kBFloat16;
  const bool layout_ok = tiles ? tile_kv_shapes_match(k_cache, v_cache)
                               : paged_kv_shapes_match(k_cache, v_cache);
  TORCH_CHECK(layout_ok && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (half || tiles || k_cache.scalar_type() == at::kFloat) &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "speculant::rope_write_kv: caches must be contiguous CPU tensors, float32 or "
              "float16 with K [num_blocks, num_kv_heads, head_dim, block_size] and V [num_blocks, "
              "block_size, num_kv_heads, head_dim], or bfloat16 in the tiles' layout, K "
              "[num_blocks, num_kv_heads, head_dim / 2, block_size, 2] and V [num_blocks, "
              "num_kv_heads, block_size / 2, head_dim, 2]");
  const int64_t T = qkv.size(0), Hq = num_heads;
  const int64_t Hkv = tiles ? k_cache.size(1) : v_cache.size(2);
  const int64_t D = v_cache.size(3);
  const int64_t block_size = tiles ? k_cache.size(3) : v_cache.size(1);
  const int64_t width = (Hq + 2 * Hkv) * D, num_slots = v_cache.size(0) * block_size;
  TORCH_CHECK(qkv.size(1) == width, "speculant::rope_write_kv: qkv has ", qkv.size(1),
              " columns, expected (", Hq, " + 2 * ", Hkv, ") * ", D);
  TORCH_CHECK(D % 2 == 0, "speculant::rope_write_kv: head_dim must be even");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.device().is_cpu() && sin.device().is_cpu(),
              "speculant::rope_write_kv: cos and sin must be contiguous float32 CPU tables "
              "[max_positions, head_dim]");
  const Indices pos = indices(positions, T, "positions");
  const Indices slots = indices(slot_mapping, T, "slot_mapping");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "speculant::rope_write_kv: position ",
                pos[t], " outside the rotary tables (", cos.size(0), " positions)");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "speculant::rope_write_kv: slot ",
                slots[t], " outside the cache (", num_slots, " slots)");
  }
  const float* b = optional_vector(bias, width, "bias");
  const float* qn = optional_vector(q_norm, D, "q_norm");
  const float* kn = optional_vector(k_norm, D, "k_norm");
  at::Tensor q = at::empty({T, Hq, D}, qkv.options());
  const float* src = qkv.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // Each token's q heads rotated into q, then store_kv(t, h, row, cos, sin, scratch [2 D]) for
  // each of its KV heads.
  auto for_each_token = [&](auto&& store_kv) {
    parallel_for(T, balanced_chunk(T, 16), [&](int64_t t0, int64_t t1) {
      std::vector<float> scratch(2 * D);
      for (int64_t t = t0; t < t1; ++t) {
        const float* row = src + t * width;
        const float* c = cp + pos[t] * D;
        const float* s = sp + pos[t] * D;
        for (int64_t h = 0; h < Hq; ++h) {
          head(row + h * D, b ? b + h * D : nullptr, qn, e, c, s, D, qp + (t * Hq + h) * D);
        }
        for (int64_t h = 0; h < Hkv; ++h) store_kv(t, h, row, c, s, scratch.data());
      }
    });
  };
  // k and v rows in float32 (the cache's own rows, or a scratch row rounded into an fp16 cache)
  auto write = [&](auto* kc, auto* vc) {
    for_each_token([&](int64_t t, int64_t h, const float* row, const float* c, const float* s,
                       float* scratch) {
      const int64_t k_col = (Hq + h) * D, v_col = (Hq + Hkv + h) * D;
      const int64_t block = slots[t] / block_size, r = slots[t] % block_size;
      store_column(row + k_col, b ? b + k_col : nullptr, kn, e, c, s, D, scratch,
                   kc + (block * Hkv + h) * D * block_size + r, block_size);
      store_row(row + v_col, b ? b + v_col : nullptr, nullptr, e, nullptr, nullptr, D, scratch,
                vc + (slots[t] * Hkv + h) * D);
    });
  };
  if (tiles) {
    uint16_t* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    uint16_t* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    const TileSlots at{Hkv, D, block_size};
    for_each_token([&](int64_t t, int64_t h, const float* row, const float* c, const float* s,
                       float* scratch) {
      const int64_t k_col = (Hq + h) * D, v_col = (Hq + Hkv + h) * D;
      const int64_t block = slots[t] / block_size, r = slots[t] % block_size;
      float* k_row = scratch;
      float* v_row = scratch + D;
      head(row + k_col, b ? b + k_col : nullptr, kn, e, c, s, D, k_row);
      head(row + v_col, b ? b + v_col : nullptr, nullptr, e, nullptr, nullptr, D, v_row);
      for (int64_t d = 0; d < D; ++d) {
        kc[at.k(block, h, r, d)] = bf16_bits(k_row[d]);
        vc[at.v(block, h, r, d)] = bf16_bits(v_row[d]);
      }
    });
  } else if (half) {
    write(reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::Half>()),
          reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::Half>()));
  } else {
    write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return q;
}

}  // namespace speculant
