// Row-wise maths of the small fused operators (RMSNorm, RoPE, SiLU-gated product), on one row
// at a time, so a row's result depends only on that row: batch-invariant by construction.
//
// Each function uses one fixed instruction sequence for a given length, and the compiler does not
// contract the scalar tails into FMAs (-ffp-contract=off), so the 8-wide and scalar parts round
// alike: RoPE and the products below are bit-identical to the PyTorch fallback's elementwise ops.
#pragma once

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace speculant {

// sum(x[i]^2), in four 8-lane accumulators over 32-element steps, then 8-element steps into the
// first, then the scalar tail: always the same order for a given n.
inline float sum_squares(const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
    a2 = _mm256_fmadd_ps(x2, x2, a2);
    a3 = _mm256_fmadd_ps(x3, x3, a3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(xi, xi, a0);
  }
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// 1 / sqrt(mean(x^2) + eps), as HF's LlamaRMSNorm computes it in fp32 (mean = sum / n).
inline float rms_scale(const float* x, int64_t n, float eps) {
  const float variance = sum_squares(x, n) / static_cast<float>(n);
  return 1.0f / std::sqrt(variance + eps);
}

// y = w * (x * r): HF's order (normalize, then scale by the weight). y may alias x.
inline void scale_row(const float* x, const float* w, float r, int64_t n, float* y) {
  const __m256 vr = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xr = _mm256_mul_ps(_mm256_loadu_ps(x + i), vr);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), xr));
  }
  for (; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

inline void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  scale_row(x, w, rms_scale(x, n, eps), n, y);
}

// h += delta (the residual add), then y = rms_norm(h).
inline void add_rms_norm_row(float* h, const float* delta, const float* w, float eps, int64_t n,
                             float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(h + i, _mm256_add_ps(_mm256_loadu_ps(h + i), _mm256_loadu_ps(delta + i)));
  }
  for (; i < n; ++i) h[i] += delta[i];
  rms_norm_row(h, w, eps, n, y);
}

// y[i] = silu(g[i]) * u[i], silu(g) = g * sigmoid(g) with sigmoid from e = exp(-|g|) (never
// overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below. Relative error ~1e-7 (exp8's).
inline void silu_mul_row(const float* g, const float* u, int64_t n, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f), sign_bit = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_or_ps(x, sign_bit));  // exp(-|x|)
    const __m256 num = _mm256_blendv_ps(one, e, x);    // sign bit of x set: e, else 1
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
  }
  if (i < n) {  // the tail goes through the same vector code, via a zero-padded copy
    alignas(32) float gt[8] = {}, ut[8] = {}, yt[8];
    for (int64_t j = i; j < n; ++j) gt[j - i] = g[j], ut[j - i] = u[j];
    silu_mul_row(gt, ut, 8, yt);
    for (int64_t j = i; j < n; ++j) y[j] = yt[j - i];
  }
}

// NeoX / HF rotary embedding of one head in place: with h = n / 2,
//   x[i]     <- x[i] * cos[i] - x[i + h] * sin[i]
//   x[i + h] <- x[i + h] * cos[i + h] + x[i] * sin[i + h]
// which is HF's x * cos + rotate_half(x) * sin, rounding for rounding.
inline void rope_row(float* x, const float* cos, const float* sin, int64_t n) {
  const int64_t h = n / 2;
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + h);
    const __m256 new_lo = _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                        _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i)));
    const __m256 new_hi = _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + i + h)),
                                        _mm256_mul_ps(lo, _mm256_loadu_ps(sin + i + h)));
    _mm256_storeu_ps(x + i, new_lo);
    _mm256_storeu_ps(x + i + h, new_hi);
  }
  for (; i < h; ++i) {
    const float lo = x[i], hi = x[i + h];
    x[i] = lo * cos[i] - hi * sin[i];
    x[i + h] = hi * cos[i + h] + lo * sin[i + h];
  }
}

}  // namespace speculant
