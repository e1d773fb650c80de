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
//   softmax: exp16 is simd.h's exp8 instruction for instruction on 16 lanes; the maximum is exact
//     in any order, and the sum still adds 8-lane vectors in position order, then by hsum's tree.
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

// simd.h's hsum: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Positions [p_begin, p_end) of the value sums of NQ queries, features [d0, d0 + 16 NV): every
// vector is its own FMA chain, started at 0 or continued from outs (a chain split at a position
// is the same chain: the stored partial sum is reloaded exactly).
template <int NQ, int NV, typename KV>
void values_tile(const KV* const* v_rows, const float* const* probs, int64_t p_begin,
                 int64_t p_end, int64_t d0, bool resume, float* const* outs) {
  __m512 acc[NQ][NV];
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) {
      acc[j][i] = resume ? _mm512_loadu_ps(outs[j] + d0 + 16 * i) : _mm512_setzero_ps();
    }
  for (int64_t p = p_begin; p < p_end; ++p) {
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
void values_tail8(const KV* const* v_rows, const float* const* probs, int64_t p_begin,
                  int64_t p_end, int64_t d0, bool resume, float* const* outs) {
  __m256 acc[NQ];
  for (int j = 0; j < NQ; ++j) {
    acc[j] = resume ? _mm256_loadu_ps(outs[j] + d0) : _mm256_setzero_ps();
  }
  for (int64_t p = p_begin; p < p_end; ++p) {
    const __m256 v = load8(v_rows[p] + d0);
    for (int j = 0; j < NQ; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(probs[j][p]), v, acc[j]);
  }
  for (int j = 0; j < NQ; ++j) _mm256_storeu_ps(outs[j] + d0, acc[j]);
}

// All D features of NQ queries over positions [p_begin, p_end), in slices of up to 4 vectors
// (64 features): 6 x 4 accumulators and the 4 loaded V vectors fit the 32 registers.
template <int NQ, typename KV>
void values(const KV* const* v_rows, const float* const* probs, int64_t p_begin, int64_t p_end,
            int64_t D, bool resume, float* const* outs) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    values_tile<NQ, 4>(v_rows, probs, p_begin, p_end, d0, resume, outs);
  }
  for (; d0 + 16 <= D; d0 += 16) {
    values_tile<NQ, 1>(v_rows, probs, p_begin, p_end, d0, resume, outs);
  }
  if (d0 < D) values_tail8<NQ>(v_rows, probs, p_begin, p_end, d0, resume, outs);
}

template <typename KV>
void values_n(int nq, const KV* const* v_rows, const float* const* probs, int64_t p_begin,
              int64_t p_end, int64_t D, bool resume, float* const* outs) {
  static_assert(kMaxWideQueries == 6, "one case per query count");
  switch (nq) {
    case 6: values<6>(v_rows, probs, p_begin, p_end, D, resume, outs); break;
    case 5: values<5>(v_rows, probs, p_begin, p_end, D, resume, outs); break;
    case 4: values<4>(v_rows, probs, p_begin, p_end, D, resume, outs); break;
    case 3: values<3>(v_rows, probs, p_begin, p_end, D, resume, outs); break;
    case 2: values<2>(v_rows, probs, p_begin, p_end, D, resume, outs); break;
    default: values<1>(v_rows, probs, p_begin, p_end, D, resume, outs); break;
  }
}

// Queries of different lengths: by increasing length, all of them over the positions the
// shortest reads, then those still reading over the next stretch, and so on.
template <typename KV>
void values_any(const KV* const* v_rows, const float* const* probs, const int64_t* lengths,
                int nq, int64_t D, float* const* outs) {
  int order[kMaxWideQueries];
  for (int j = 0; j < nq; ++j) {
    int i = j;
    for (; i > 0 && lengths[order[i - 1]] > lengths[j]; --i) order[i] = order[i - 1];
    order[i] = j;
  }
  const float* sorted_probs[kMaxWideQueries];
  float* sorted_outs[kMaxWideQueries];
  for (int j = 0; j < nq; ++j) sorted_probs[j] = probs[order[j]], sorted_outs[j] = outs[order[j]];
  int64_t p = 0;
  for (int first = 0; first < nq;) {
    const int64_t end = lengths[order[first]];
    if (end > p) {
      values_n(nq - first, v_rows, sorted_probs + first, p, end, D, p > 0, sorted_outs + first);
      p = end;
    }
    while (first < nq && lengths[order[first]] <= p) ++first;
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

float attention_softmax_avx512(float* s, int64_t L, float* max_out) {
  const int64_t L8 = (L + 7) / 8 * 8;
  const float neg_inf = -__builtin_inff();
  for (int64_t p = L; p < L8; ++p) s[p] = neg_inf;
  // a last chunk of 8 positions, loaded with -inf in the upper lanes (neutral for the maximum,
  // exp gives 0 there)
  const __mmask16 low8 = 0x00FF;
  const __m512 neg_infs = _mm512_set1_ps(neg_inf);
  __m512 vmax = neg_infs;
  int64_t p = 0;
  for (; p + 16 <= L8; p += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + p));
  if (p < L8) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_infs, low8, s + p));
  *max_out = _mm512_reduce_max_ps(vmax);
  const __m512 m = _mm512_set1_ps(*max_out);
  __m256 vsum = _mm256_setzero_ps();
  for (p = 0; p + 16 <= L8; p += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), m));
    _mm512_storeu_ps(s + p, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
    vsum = _mm256_add_ps(vsum, upper_half(e));
  }
  if (p < L8) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(neg_infs, low8, s + p), m));
    _mm512_mask_storeu_ps(s + p, low8, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
  }
  return hsum8(vsum);
}

void attention_values_avx512(const float* const* v_rows, const float* const* probs,
                             const int64_t* lengths, int nq, int64_t D, float* const* outs) {
  values_any(v_rows, probs, lengths, nq, D, outs);
}

void attention_values_avx512(const uint16_t* const* v_rows, const float* const* probs,
                             const int64_t* lengths, int nq, int64_t D, float* const* outs) {
  values_any(v_rows, probs, lengths, nq, D, outs);
}

}  // namespace speculant
