// AVX2/FMA/F16C helpers shared by the kernels. Every reduction here has one fixed order, so a
// result depends only on its inputs, never on how the caller batched or tiled the work.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace speculant {

// Sum of the 8 lanes, always as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 consecutive floats, from fp32 or (bit patterns of) fp16 storage.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 4 bytes at p + 4 * chunk, repeated in all eight 32-bit lanes.
inline __m256i broadcast4(const int8_t* p, int chunk) {
  int32_t v;
  std::memcpy(&v, p + 4 * chunk, 4);
  return _mm256_set1_epi32(v);
}

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes' polynomial as in avx_mathfun:
// relative error ~1e-7. Inputs below -87 (results under 1.7e-38, or -inf padding) give exactly 0.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 in_range = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  // x - fx * ln2, with ln2 split in two so the subtraction stays exact
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  // 2^fx built in the exponent field (fx >= -126 after the clamp, so it stays a normal float)
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
  return _mm256_and_ps(y, in_range);
}

}  // namespace speculant
