// exp on 16 float lanes and the softmax passes built on it, shared by the AVX-512 attention files (and included only by files in
// this folder, compiled with the AVX-512 flags: see linear_blocks.h why).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace speculant {
namespace avx512 {

// simd.h's exp8 (Cephes' polynomial) on 16 lanes, same constants, same operations per lane.
inline __m512 exp16(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.0f);
  const __mmask16 in_range = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lowest);
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
  return _mm512_maskz_mov_ps(in_range, y);
}

// The max of s [0, n) (n >= 1), 16 lanes at a time: the softmax's first pass.
inline float max_of(const float* s, int64_t n) {
  const __m512 neg_infs = _mm512_set1_ps(-__builtin_inff());
  __m512 vmax = neg_infs;
  for (int64_t q = 0; q < n; q += 16) {
    const __mmask16 mask = n - q >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - q)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_infs, mask, s + q));
  }
  return _mm512_reduce_max_ps(vmax);
}

// exp(s[q + i] - max) for the 16 lanes i of positions q.. (max broadcast in vm), exactly 0 for
// positions at or past n (exp(-inf - max)): a softmax numerator vector.
inline __m512 numerators16(const float* s, int64_t q, int64_t n, __m512 vm) {
  const int64_t valid = n - q < 0 ? 0 : n - q > 16 ? 16 : n - q;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), mask, s + q);
  return exp16(_mm512_sub_ps(v, vm));
}

// One query's softmax numerators over its scores s [0, n): exp(s - max), rounded to bf16 (nearest
// even) in chunks of 32 positions, chunk c at p + c * chunk_stride, exact zeros from n on.
// Returns the sum of the fp32 numerators (16 lanes in position order, then reduced); stores the
// max in *max_out. The tiles (attention_tiles.cpp) and the bf16 dot products
// (attention_bf16dot.cpp) share it, so a query's softmax is the same on both.
inline float softmax_bf16_row(const float* s, int64_t n, int64_t num_chunks, uint16_t* p,
                              int64_t chunk_stride, float* max_out) {
  const float m = max_of(s, n);
  *max_out = m;
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t c = 0; c < num_chunks; ++c) {
    uint16_t* row = p + c * chunk_stride;
    for (int64_t h = 0; h < 2; ++h) {
      const __m512 e = numerators16(s, 32 * c + 16 * h, n, vm);
      vsum = _mm512_add_ps(vsum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * h),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
  }
  return _mm512_reduce_add_ps(vsum);
}

}  // namespace avx512
}  // namespace speculant
