// 512-bit inner loops of paged attention (see attention.cpp for the algorithm), compiled apart
// with the AVX-512 flags and included only through attention_wide.h (see linear_blocks.h why).
//
// Bit-identical to the AVX2 loops, lane for lane:
//   scores: a lane is a position of a transposed K block (kernels/kv_layout.py), its score one
//     FMA chain over the features from 0, then times the scale; a vector covers 16 positions
//     instead of 8.
//   values: each feature's sum is still one FMA chain over the positions in ascending order; a
//     vector just covers 16 features instead of 8.
//   softmax: exp16 is simd.h's exp8 instruction for instruction on 16 lanes; the maximum is exact
//     in any order, and the sum still adds 8-lane vectors in position order, then by hsum's tree.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../attention_wide.h"
#include "exp16.h"

namespace speculant {
namespace {

inline __m256 upper_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// NQ queries x NV 16-position vectors of a transposed K block (vector i's feature d at
// k[i] + d * stride): dst[j] + 16 i <- scale * (FMA chain over d from 0 of q_j[d] * k_i[d]), the
// AVX2 loop's per-lane arithmetic. 6 x 4 accumulators, 4 K vectors and a broadcast q fit the 32
// registers, and 24 independent chains hide the FMA latency.
template <int NQ, int NV, typename KV>
void scores_tile16(const float* const* q, const KV* const* k, int64_t stride, int64_t D,
                   float scale, float* const* dst) {
  __m512 acc[NQ][NV];
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kd[NV];
    for (int i = 0; i < NV; ++i) kd[i] = load16(k[i] + d * stride);
    for (int j = 0; j < NQ; ++j) {
      const __m512 qd = _mm512_set1_ps(q[j][d]);
      for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_fmadd_ps(qd, kd[i], acc[j][i]);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(dst[j] + 16 * i, _mm512_mul_ps(acc[j][i], vscale));
}

// The same for one 8-position vector (a block of 8 positions, or the last 8 of a partition).
template <int NQ, typename KV>
void scores_tile8(const float* const* q, const KV* k, int64_t stride, int64_t D, float scale,
                  float* const* dst) {
  __m256 acc[NQ];
  for (int j = 0; j < NQ; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 kd = load8(k + d * stride);
    for (int j = 0; j < NQ; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d]), kd, acc[j]);
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int j = 0; j < NQ; ++j) _mm256_storeu_ps(dst[j], _mm256_mul_ps(acc[j], vscale));
}

template <int NQ, typename KV>
void scores_tile16_n(int nv, const float* const* q, const KV* const* k, int64_t stride, int64_t D,
                     float scale, float* const* dst) {
  switch (nv) {
    case 4: scores_tile16<NQ, 4>(q, k, stride, D, scale, dst); break;
    case 3: scores_tile16<NQ, 3>(q, k, stride, D, scale, dst); break;
    case 2: scores_tile16<NQ, 2>(q, k, stride, D, scale, dst); break;
    default: scores_tile16<NQ, 1>(q, k, stride, D, scale, dst); break;
  }
}

constexpr int kScoreQueries = 6;  // queries per register tile
constexpr int kScoreVectors = 4;  // 16-position vectors per register tile

// A query tile (nq <= kScoreQueries) over all the vectors: pairs of adjacent 8-position vectors
// of one block run as 16-lane vectors, up to kScoreVectors at a time; a lone one as 8 lanes.
template <int NQ, typename KV>
void scores_queries(const float* const* q, const KV* const* k8, int64_t num_vec8, int64_t stride,
                    int64_t D, float scale, float* const* dst) {
  const KV* k16[kScoreVectors];
  float* out[NQ];
  int64_t first = 0;  // 8-position vector where the pending 16-lane vectors start
  int nv = 0;
  auto flush = [&] {
    if (nv == 0) return;
    for (int j = 0; j < NQ; ++j) out[j] = dst[j] + 8 * first;
    scores_tile16_n<NQ>(nv, q, k16, stride, D, scale, out);
    first += 2 * nv;
    nv = 0;
  };
  for (int64_t i = 0; i < num_vec8;) {
    if (i + 1 < num_vec8 && k8[i + 1] == k8[i] + 8) {
      k16[nv++] = k8[i];
      i += 2;
      if (nv == kScoreVectors) flush();
    } else {
      flush();
      for (int j = 0; j < NQ; ++j) out[j] = dst[j] + 8 * i;
      scores_tile8<NQ>(q, k8[i], stride, D, scale, out);
      i += 1;
      first = i;
    }
  }
  flush();
}

template <typename KV>
void scores_any(const float* const* q_rows, float* const* dst, int64_t num_queries,
                const KV* const* k8, int64_t num_vec8, int64_t stride, int64_t D, float scale) {
  static_assert(kScoreQueries == 6, "one case per query count");
  for (int64_t j = 0; j < num_queries; j += kScoreQueries) {
    const float* const* q = q_rows + j;
    float* const* out = dst + j;
    switch (std::min<int64_t>(kScoreQueries, num_queries - j)) {
      case 6: scores_queries<6>(q, k8, num_vec8, stride, D, scale, out); break;
      case 5: scores_queries<5>(q, k8, num_vec8, stride, D, scale, out); break;
      case 4: scores_queries<4>(q, k8, num_vec8, stride, D, scale, out); break;
      case 3: scores_queries<3>(q, k8, num_vec8, stride, D, scale, out); break;
      case 2: scores_queries<2>(q, k8, num_vec8, stride, D, scale, out); break;
      default: scores_queries<1>(q, k8, num_vec8, stride, D, scale, out); break;
    }
  }
}

// simd.h's hsum: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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

void attention_scores_avx512(const float* const* q_rows, float* const* dst, int64_t num_queries,
                             const float* const* k8, int64_t num_vec8, int64_t stride, int64_t D,
                             float scale) {
  scores_any(q_rows, dst, num_queries, k8, num_vec8, stride, D, scale);
}

void attention_scores_avx512(const float* const* q_rows, float* const* dst, int64_t num_queries,
                             const uint16_t* const* k8, int64_t num_vec8, int64_t stride,
                             int64_t D, float scale) {
  scores_any(q_rows, dst, num_queries, k8, num_vec8, stride, D, scale);
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
    const __m512 e = avx512::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), m));
    _mm512_storeu_ps(s + p, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
    vsum = _mm256_add_ps(vsum, upper_half(e));
  }
  if (p < L8) {
    const __m512 e = avx512::exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(neg_infs, low8, s + p), m));
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
