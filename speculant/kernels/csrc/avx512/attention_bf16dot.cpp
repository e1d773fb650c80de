// Attention over a bf16 KV cache in the AMX tiles' layout (kernels/kv_layout.py) on AVX512_BF16
// dot products, for CPUs that have them without AMX (AMD Zen 4 and 5, Intel Cooper Lake), or
// with AMX forced off (SPECULANT_KV_ATTENTION=avx512_bf16). Same contract as
// attention_tiles.cpp's attention_partition_tiles (attention_wide.h); compiled apart with the
// AVX-512 flags and included only through attention_wide.h (linear_blocks.h says why).
//
// Why it fits the layout: `vdpbf16ps` adds to each of 16 fp32 lanes the products of one pair of
// bf16 elements, the operand pairs (2i, 2i + 1). A K block [D / 2, block_size, 2] holds, for a
// feature pair r, the pairs (k[p][2r], k[p][2r + 1]) of consecutive positions p: one 64-byte
// load is 16 positions' pair r, and with the query's pair r broadcast, one instruction adds two
// features to 16 scores, no horizontal sums. A V block [block_size / 2, D, 2] holds, for a
// position pair, (v[2i][f], v[2i + 1][f]) of consecutive features f: one load is 16 features of
// two positions, and with the two softmax numerators broadcast, one instruction adds two
// positions to 16 value sums. Half the instructions of the fp32 FMA loops over an fp16 cache
// (two multiply-adds per lane each), and no fp16 conversions.
//
// Precision: as on the tiles, bf16 operands with fp32 sums: the scaled query and the softmax
// numerators are rounded to bf16; a score adds its feature pairs in ascending order, a value sum
// its position pairs in ascending order (each instruction adds the odd element's product, then
// the even one's, rounding after each, as Intel's definition of `vdpbf16ps` says). The softmax's
// max, exponentials and their sum stay fp32, computed as attention_tiles.cpp computes them
// (exp16.h's softmax_bf16_row). Not bit-identical to the tiles: the tile unit's order of adding
// products is its own.
//
// Batch invariance: every lane of every accumulator belongs to one query, and the queries a call
// groups together share only the loads, so a query's scores, softmax and value sums never depend
// on the other queries, on how many there are, or on the partition's extent past the query's own
// length (its numerators there are exact zeros, which add nothing).
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../attention_wide.h"
#include "aligned_scratch.h"
#include "exp16.h"

namespace speculant {
namespace {

constexpr int kChunk = 32;     // positions per score step (two 16-lane vectors) and per P chunk
constexpr int kMaxGroup = 4;   // queries sharing each K and V load
constexpr int kMaxFeatureVecs = 8;  // 16-feature vectors of a query (head_dim <= 128)

thread_local avx512::AlignedScratch tls_scratch;  // grown as needed

inline __m512bh broadcast_pair(const uint16_t* pair) {
  uint32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(bits)));
}

inline __m512bh load_bh(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// scale * q rounded to bf16 (nearest even, as the tiles' queries), D values into dst.
void round_query(const float* q, int64_t D, float scale, uint16_t* dst) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < D; d += 16) {
    const __m256bh x = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q + d), vscale));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i>(x));
  }
}

// Scores of G queries (bf16 rows qb[g], D features) over the positions [0, 32 * num_chunks),
// into scores[g * stride + p]: per 32 positions, the feature pairs in ascending order.
template <int G>
void scores_group(const uint16_t* const* qb, const uint16_t* const* k_blocks, int64_t block_size,
                  int64_t D, int64_t num_chunks, float* scores, int64_t stride) {
  const int64_t pair_stride = 2 * block_size;  // bf16 elements between a K block's pair rows
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t p = c * kChunk;
    const uint16_t* kb = k_blocks[p / block_size] + p % block_size * 2;
    if (c + 1 < num_chunks) {  // the next chunk's rows (blocks are scattered in the cache)
      const int64_t pn = p + kChunk;
      const char* kn = reinterpret_cast<const char*>(k_blocks[pn / block_size] +
                                                     pn % block_size * 2);
      for (int64_t r = 0; r < D / 2; ++r) {
        _mm_prefetch(kn + r * pair_stride * 2, _MM_HINT_T0);
        _mm_prefetch(kn + r * pair_stride * 2 + 64, _MM_HINT_T0);
      }
    }
    __m512 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t r = 0; r < D / 2; ++r) {
      const __m512bh k0 = load_bh(kb + r * pair_stride);
      const __m512bh k1 = load_bh(kb + r * pair_stride + 32);
      for (int g = 0; g < G; ++g) {
        const __m512bh q = broadcast_pair(qb[g] + 2 * r);
        acc[g][0] = _mm512_dpbf16_ps(acc[g][0], k0, q);
        acc[g][1] = _mm512_dpbf16_ps(acc[g][1], k1, q);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(scores + g * stride + p, acc[g][0]);
      _mm512_storeu_ps(scores + g * stride + p + 16, acc[g][1]);
    }
  }
}

// Value sums of G queries (bf16 numerators pb[g], exact zeros past each query's length) over
// the position pairs [0, num_pairs), NF 16-feature vectors starting at feature 16 * f0, into
// outs[g]: the pairs in ascending order.
template <int G, int NF>
void values_group(const uint16_t* const* pb, const uint16_t* const* v_blocks, int64_t block_size,
                  int64_t D, int64_t num_pairs, int64_t f0, float* const* outs) {
  __m512 acc[G][NF];
  for (int g = 0; g < G; ++g) {
    for (int f = 0; f < NF; ++f) acc[g][f] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t p = 2 * i;
    const uint16_t* vb = v_blocks[p / block_size] + (p % block_size / 2) * 2 * D + 32 * f0;
    __m512bh w[G];
    for (int g = 0; g < G; ++g) w[g] = broadcast_pair(pb[g] + p);
    for (int f = 0; f < NF; ++f) {
      const __m512bh v = load_bh(vb + 32 * f);
      for (int g = 0; g < G; ++g) acc[g][f] = _mm512_dpbf16_ps(acc[g][f], v, w[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int f = 0; f < NF; ++f) _mm512_storeu_ps(outs[g] + 16 * (f0 + f), acc[g][f]);
  }
}

template <int G>
void values_dispatch(const uint16_t* const* pb, const uint16_t* const* v_blocks,
                     int64_t block_size, int64_t D, int64_t num_pairs, float* const* outs) {
  // four feature vectors a pass keep G x 4 <= 16 accumulators in registers; D % 32 == 0 leaves
  // a tail of two at most
  const int64_t num_vecs = D / 16;
  int64_t f0 = 0;
  for (; f0 + 4 <= num_vecs; f0 += 4) {
    values_group<G, 4>(pb, v_blocks, block_size, D, num_pairs, f0, outs);
  }
  if (f0 < num_vecs) values_group<G, 2>(pb, v_blocks, block_size, D, num_pairs, f0, outs);
}

template <int G>
void attend_group(const uint16_t* const* qb, const int64_t* lengths,
                  const uint16_t* const* k_blocks, const uint16_t* const* v_blocks,
                  int64_t block_size, int64_t D, float* scores, uint16_t* pbuf, int64_t stride,
                  float* const* outs, float* const* maxes, float* const* sums) {
  int64_t n = 0;  // the group's extent: its longest query
  for (int g = 0; g < G; ++g) n = lengths[g] > n ? lengths[g] : n;
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  scores_group<G>(qb, k_blocks, block_size, D, num_chunks, scores, stride);
  const uint16_t* pb[G];
  for (int g = 0; g < G; ++g) {
    *sums[g] = avx512::softmax_bf16_row(scores + g * stride, lengths[g], num_chunks,
                                        pbuf + g * stride, kChunk, maxes[g]);
    pb[g] = pbuf + g * stride;
  }
  values_dispatch<G>(pb, v_blocks, block_size, D, (n + 1) / 2, outs);
}

}  // namespace

bool attention_partition_bf16dot(const float* const* q_rows, const int64_t* lengths,
                                 int64_t num_queries, const uint16_t* const* k_blocks,
                                 const uint16_t* const* v_blocks, int64_t n_max,
                                 int64_t block_size, int64_t D, float scale, float* const* outs,
                                 float* const* maxes, float* const* sums) {
  if (D % 32 != 0 || D > 16 * kMaxFeatureVecs || block_size % kChunk != 0 || num_queries <= 0 ||
      n_max <= 0) {
    return false;
  }
  const int64_t stride = (n_max + kChunk - 1) / kChunk * kChunk;  // a query's scores and P row
  // scratch: the rounded queries | kMaxGroup queries' scores | their bf16 numerators
  char* base = static_cast<char*>(tls_scratch.get(
      num_queries * D * 2 + kMaxGroup * stride * (sizeof(float) + 2) + 64));
  uint16_t* qbuf = reinterpret_cast<uint16_t*>(base);
  float* scores = reinterpret_cast<float*>(base + (num_queries * D * 2 + 63) / 64 * 64);
  uint16_t* pbuf = reinterpret_cast<uint16_t*>(scores + kMaxGroup * stride);
  for (int64_t j = 0; j < num_queries; ++j) round_query(q_rows[j], D, scale, qbuf + j * D);
  for (int64_t j0 = 0; j0 < num_queries; j0 += kMaxGroup) {
    const int64_t g = num_queries - j0 < kMaxGroup ? num_queries - j0 : kMaxGroup;
    const uint16_t* qb[kMaxGroup];
    for (int64_t i = 0; i < g; ++i) qb[i] = qbuf + (j0 + i) * D;
    const int64_t* len = lengths + j0;
    float* const* o = outs + j0;
    float* const* mx = maxes + j0;
    float* const* sm = sums + j0;
    switch (g) {
      case 1: attend_group<1>(qb, len, k_blocks, v_blocks, block_size, D, scores, pbuf, stride,
                              o, mx, sm); break;
      case 2: attend_group<2>(qb, len, k_blocks, v_blocks, block_size, D, scores, pbuf, stride,
                              o, mx, sm); break;
      case 3: attend_group<3>(qb, len, k_blocks, v_blocks, block_size, D, scores, pbuf, stride,
                              o, mx, sm); break;
      default: attend_group<4>(qb, len, k_blocks, v_blocks, block_size, D, scores, pbuf, stride,
                               o, mx, sm); break;
    }
  }
  return true;
}

}  // namespace speculant
