// 512-bit inner loops of paged attention (see attention.cpp for the algorithm), compiled apart
// with the AVX-512 flags and included only through attention_wide.h (see linear_blocks.h why).
//
// Bit-identical to the AVX2 loops, lane for lane:
//   scores: a 512-bit accumulator holds the 8-lane FMA chains of two queries against the same K
//     row ([query a | query b]), so one FMA does the work of two AVX2 ones; the horizontal sums
//     then follow the AVX2 hadd tree (vshufps pairs within 128-bit lanes are vhaddps, and two
//     128-bit lane shuffles stand for the vperm2f128 step), adding the same numbers in the same
//     order.
//   values: each feature's sum is still one FMA chain over the positions in ascending order; a
//     vector just covers 16 features instead of 8.
#include <immintrin.h>

#include <cstdint>

#include "../attention_wide.h"

namespace speculant {
namespace {

// 256-bit halves through their 64-bit-lane forms, which need only AVX-512F (the f32x8 forms are
// AVX-512DQ). Casts are free.
// [8 floats at lo | 8 floats at hi]
inline __m512 load_halves(const float* lo, const float* hi) {
  const __m512d wide = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(lo)));
  return _mm512_castpd_ps(_mm512_insertf64x4(wide, _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
}

// [8 floats at p | the same 8]
inline __m512 broadcast8(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

inline __m256 upper_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// vhaddps on each 256-bit half: [x0+x1, x2+x3, y0+y1, y2+y3] per 128-bit lane.
inline __m512 hadd_halves(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// NP pairs of queries (a, b) x 8 K rows: acc[n][j] = [chain of a | chain of b] for row j, each
// chain summing q[d..d+8) * k_j[d..d+8) over d in steps of 8, as scores8 does.
template <int NP>
void chains(const float* const* qa, const float* const* qb, const float* const* k, int64_t D,
            __m512 (*acc)[8]) {
  for (int n = 0; n < NP; ++n)
    for (int j = 0; j < 8; ++j) acc[n][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 q[NP];
    for (int n = 0; n < NP; ++n) q[n] = load_halves(qa[n] + d, qb[n] + d);
    for (int j = 0; j < 8; ++j) {
      const __m512 kj = broadcast8(k[j] + d);
      for (int n = 0; n < NP; ++n) acc[n][j] = _mm512_fmadd_ps(q[n], kj, acc[n][j]);
    }
  }
}

// The 8 chains of a pair -> [8 scores of a | 8 scores of b], by scores8's reduction tree.
inline __m512 reduce8(const __m512* a) {
  const __m512 h01 = hadd_halves(a[0], a[1]), h23 = hadd_halves(a[2], a[3]);
  const __m512 h45 = hadd_halves(a[4], a[5]), h67 = hadd_halves(a[6], a[7]);
  const __m512 x = hadd_halves(h01, h23), y = hadd_halves(h45, h67);
  // AVX2: [x.lo | y.lo] + [x.hi | y.hi] per query, with 128-bit lanes x = (a.lo, a.hi, b.lo,
  // b.hi); summed as [a: x.lo, b: x.lo, a: y.lo, b: y.lo] + [... hi ...], then lanes reordered
  const __m512 lo = _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 hi = _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1));
  const __m512 sums = _mm512_add_ps(lo, hi);
  return _mm512_shuffle_f32x4(sums, sums, _MM_SHUFFLE(3, 1, 2, 0));
}

// Scores of NP query pairs; a pair may name one query twice (its second copy is not stored).
template <int NP>
void score_pairs(const float* const* qa, const float* const* qb, float* const* da,
                 float* const* db, const float* const* k, int64_t D, float scale) {
  __m512 acc[NP][8];
  chains<NP>(qa, qb, k, D, acc);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int n = 0; n < NP; ++n) {
    const __m512 s = _mm512_mul_ps(reduce8(acc[n]), vscale);
    _mm256_storeu_ps(da[n], _mm512_castps512_ps256(s));
    if (db[n] != da[n]) _mm256_storeu_ps(db[n], upper_half(s));
  }
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Features [d0, d0 + 16 NV) of NQ queries: the value sums, every vector its own FMA chain.
template <int NQ, int NV, typename KV>
void values_tile(const KV* const* v_rows, const float* const* probs, int64_t n, int64_t d0,
                 float* const* outs) {
  __m512 acc[NQ][NV];
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = load16(v_rows[p] + d0 + 16 * i);
    for (int j = 0; j < NQ; ++j) {
      const __m512 w = _mm512_set1_ps(probs[j][p]);
      for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_fmadd_ps(w, v[i], acc[j][i]);
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(outs[j] + d0 + 16 * i, acc[j][i]);
}

// The last 8 features when D is not a multiple of 16.
template <int NQ, typename KV>
void values_tail8(const KV* const* v_rows, const float* const* probs, int64_t n, int64_t d0,
                  float* const* outs) {
  __m256 acc[NQ];
  for (int j = 0; j < NQ; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    const __m256 v = load8(v_rows[p] + d0);
    for (int j = 0; j < NQ; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(probs[j][p]), v, acc[j]);
  }
  for (int j = 0; j < NQ; ++j) _mm256_storeu_ps(outs[j] + d0, acc[j]);
}

// All D features of NQ queries, in slices of up to 4 vectors (64 features): NQ x 4 accumulators
// and the 4 loaded V vectors fit the 32 registers.
template <int NQ, typename KV>
void values(const KV* const* v_rows, const float* const* probs, int64_t n, int64_t D,
            float* const* outs) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) values_tile<NQ, 4>(v_rows, probs, n, d0, outs);
  for (; d0 + 16 <= D; d0 += 16) values_tile<NQ, 1>(v_rows, probs, n, d0, outs);
  if (d0 < D) values_tail8<NQ>(v_rows, probs, n, d0, outs);
}

template <typename KV>
void values_any(const KV* const* v_rows, const float* const* probs, int nq, int64_t n, int64_t D,
                float* const* outs) {
  static_assert(kMaxWideQueries == 3, "one case per query count");
  if (nq == 3) {
    values<3>(v_rows, probs, n, D, outs);
  } else if (nq == 2) {
    values<2>(v_rows, probs, n, D, outs);
  } else {
    values<1>(v_rows, probs, n, D, outs);
  }
}

}  // namespace

void attention_scores8_avx512(const float* const* q_rows, float* const* dst, int64_t num_queries,
                              const float* const* k_rows, int64_t D, float scale) {
  // up to kMaxPairs pairs share each K load (their 8 NP accumulators, NP q vectors and the K
  // vector fit the 32 registers); an odd last query is paired with itself
  constexpr int kMaxPairs = 3;
  int64_t i = 0;
  while (i < num_queries) {
    const float* qa[kMaxPairs];
    const float* qb[kMaxPairs];
    float* da[kMaxPairs];
    float* db[kMaxPairs];
    int np = 0;
    for (; np < kMaxPairs && i < num_queries; ++np, i += 2) {
      const int64_t b = i + 1 < num_queries ? i + 1 : i;
      qa[np] = q_rows[i], qb[np] = q_rows[b], da[np] = dst[i], db[np] = dst[b];
    }
    if (np == 3) {
      score_pairs<3>(qa, qb, da, db, k_rows, D, scale);
    } else if (np == 2) {
      score_pairs<2>(qa, qb, da, db, k_rows, D, scale);
    } else {
      score_pairs<1>(qa, qb, da, db, k_rows, D, scale);
    }
  }
}

void attention_values_avx512(const float* const* v_rows, const float* const* probs, int nq,
                             int64_t n, int64_t D, float* const* outs) {
  values_any(v_rows, probs, nq, n, D, outs);
}

void attention_values_avx512(const uint16_t* const* v_rows, const float* const* probs, int nq,
                             int64_t n, int64_t D, float* const* outs) {
  values_any(v_rows, probs, nq, n, D, outs);
}

}  // namespace speculant
