// Causal attention over a paged KV cache.
//
// Token t of sequence s = token_seq[t] attends to positions 0..token_pos[t] of s, whose V rows
// live at v_cache[block_tables[s][p / block_size], p % block_size] and whose K values at
// k_cache[block_tables[s][p / block_size], kv_head, feature, p % block_size] (transposed blocks,
// kernels/kv_layout.py). Query head h reads KV head h / (Hq / Hkv) (grouped-query attention).
//
// Partitions: a token's positions are cut at fixed multiples of kPartition. Per partition the
// softmax numerators give a partial (max, sum of exp, exp-weighted value sum), and the partials
// are merged in partition order. The cuts never depend on the batch, so neither does the result;
// they let one long context be shared between threads, each reading its own part of the cache
// once (a single decode token used to split its query heads instead, and every thread read the
// whole cache: at context 3000 a decode token's attention took 1.4x as long).
//
// Work units: a run of up to kRunTokens consecutive batch tokens of one sequence (a decode token,
// a verification chunk, a slice of a prompt) x one KV head x the query heads of its group (or a
// slice of them when there are too few units to share between threads), over all partitions,
// or over one partition when few runs have long contexts (attend_split). A unit computes the
// scores of its queries in register tiles of queries x vectors of 8 (16) positions: a score
// vector is one FMA chain over the features of a transposed K block, q[d] broadcast, no
// horizontal sums; each group of kScoreVectors vectors comes from memory once and is reused from
// L1 by every query of the unit; the V rows of a token are shared by its heads. K blocks and V
// rows are prefetched ahead: the cache is read from DRAM at every step (the weights streamed in
// between evict it), and its block boundaries are jumps hardware prefetchers miss.
//
// Batch invariance: each (token, head) output is computed with one fixed sequence of operations
// (per partition: each score one FMA chain over the features, one max, exp and sum in 8-lane
// chunks, the value sum in position order; then the merge in partition order) that never
// depends on the other queries of its unit, on how the batch was split into units, or on which
// thread ran it.
//
// Kernel paths: on a path with wide attention (kernel_path.h) the scores and the value sums run as
// 512-bit loops (avx512/attention.cpp: 16 positions or 16 features per vector) with the same
// operations per lane, so the outputs are bit-identical to the AVX2 loops here. On an AMX-BF16
// CPU (kernel_path.h, prompt_attention_tiles) the units of prompt positions run their scores,
// softmax and value sums on bf16 tiles with split operands instead (avx512/attention_amx.cpp):
// within fp32 rounding of these loops, not bit-identical, batch-invariant all the same; a run
// never mixes prompt and generated positions, and generated ones always take the loops here.
//
// A bf16 cache is kept in the tiles' own layout (kernels/kv_layout.py) and every query position,
// prompt or generated, runs on AMX-BF16 tiles straight from it (avx512/attention_tiles.cpp): a
// unit's query rows (tokens x heads of one KV head, up to 16 a tile) share each tile product, so
// a verification chunk of a few tokens costs about what one decode token does. On an
// AVX512_BF16 CPU without AMX (AMD Zen 4 and 5) the same cache runs on bf16 dot products
// instead (avx512/attention_bf16dot.cpp): each instruction adds two features to 16 scores or two
// positions to 16 value sums, straight from the same layout.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_wide.h"
#include "kernel_path.h"
#include "ops.h"
#include "pool.h"
#include "scratch.h"
#include "simd.h"

namespace speculant {
namespace {

// Tokens per unit: bounds a unit's scratch and work. On the wide path a unit's fp32 copy of each
// K chunk serves all its queries: 16 tokens' prefill attention took 8% less time than 8 tokens'
// (Xeon AMX, a 3072-token prompt in 512-token chunks, interleaved; AVX2 unchanged).
constexpr int64_t kRunTokens = 16;
// Runs of prompt tokens on the AMX-BF16 tiles are longer: their K and V are converted to the
// tiles' layout once per run and partition, for all its queries.
#ifndef SPECULANT_TILE_RUN
#define SPECULANT_TILE_RUN 64
#endif
constexpr int64_t kTileRunTokens = SPECULANT_TILE_RUN;
// Positions per partition: the softmax runs over fixed partitions [i * kPartition, ...) of every
// token's positions, merged at the end, so a long context splits between threads without the
// result depending on the split (a multiple of 8).
constexpr int64_t kPartition = 256;
constexpr int kHeadTile = 3;       // query heads sharing each loaded V row
constexpr int64_t kPrefetchAhead = 16;  // positions between a V row's prefetch and its use
// 8-position vectors scored per pass over the unit's queries (64 positions): their K comes from
// memory once (the next pass's is prefetched meanwhile) and serves every query tile from L1.
constexpr int64_t kScorePass = 8;
// Below this many (position, query head) pairs, ~5 us of work, one thread does it all.
constexpr int64_t kMinParallelWork = 512;

// A bf16 element of a cache in the AMX tiles' layout (kernels/kv_layout.py): K blocks [Hkv, D / 2,
// block_size, 2], V blocks [Hkv, block_size / 2, D, 2]; attended on the tiles alone
// (avx512/attention_tiles.cpp), every query position alike.
struct TileKV {
  uint16_t bits;
};

// KV: the cache's element type, float or uint16_t (fp16 bit patterns, converted on load), or
// TileKV.
template <typename KV>
struct Problem {
  const float* q;          // [T, Hq, D]
  const KV* k;             // [num_blocks, Hkv, D, block_size]
  const KV* v;             // [num_blocks, block_size, Hkv, D]
  const int32_t* tables;   // [S, max_blocks]
  const int32_t* seq;      // [T]
  const int32_t* pos;      // [T]
  float* out;              // [T, Hq, D]
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
  bool wide;  // the 512-bit inner loops (attention_wide.h)
  // [S] prompt length of each sequence, or null: a token at a position below it is a prompt
  // position, attended on AMX-BF16 tiles (tiles is set only for fp16 caches where
  // prompt_attention_tiles() holds and head_dim suits them)
  const int32_t* prompt_lens;
  bool tiles;
  // a bf16 cache in the tiles' layout: attended on AMX-BF16 tiles (else on AVX512_BF16 dot
  // products; kernel_path.h, kv_attention_tiles)
  bool kv_amx = false;
  bool prompt_token(int64_t t) const {
    return tiles && pos[t] < prompt_lens[seq[t]];
  }
};

// Tokens [t0, t1) of one sequence, query heads [h0, h1) of KV head kvh's group (0-based in it);
// tiles: they are prompt positions whose scores run on AMX-BF16 tiles.
struct Unit {
  int64_t t0, t1, kvh, h0, h1;
  bool tiles = false;
};

// Per-thread scratch, reused across units and calls.
template <typename KV>
struct Scratch {
  std::vector<float> scores;                 // [queries of the unit, kPartition]
  std::vector<const KV*> v_rows;             // [kPartition] position p's V row
  std::vector<const KV*> k_vecs;             // [kPartition / 8] feature 0 of positions 8i..8i+7
  std::vector<const float*> q_rows;          // [queries of the unit] q row of query j
  std::vector<int64_t> q_last;               // [queries of the unit] its last position
  std::vector<int64_t> base;                 // attend_unit's partials: [tokens of the unit]
  std::vector<float> acc, max, sum;          // [tokens x partitions x Hq (x D)]
  std::vector<const float*> pass_q;          // [queries] those reading a score pass
  std::vector<float*> pass_scores;           // [queries] where their scores of the pass go
  std::vector<const float*> probs;           // wide path: [queries] softmax numerators
  std::vector<int64_t> lengths;              // wide path: [queries] positions read here
  std::vector<float*> value_sums;            // wide path: [queries] where the sums go
  std::vector<float*> maxes, sums;           // tile path: [queries] where max / sum go
};

// V row pointers of positions [p_begin, p_end) for KV head kvh (entry 0 = p_begin), and K
// pointers of each 8-position vector (feature d at + d * block_size). p_begin is a multiple of
// the block size, so no vector crosses a block.
template <typename KV>
void gather_rows(const Problem<KV>& pb, const int32_t* table, int64_t kvh, int64_t p_begin,
                 int64_t p_end, Scratch<KV>& sc) {
  const int64_t BS = pb.block_size, Hkv = pb.num_kv_heads, D = pb.head_dim;
  sc.v_rows.resize(p_end - p_begin);
  sc.k_vecs.resize((p_end - p_begin + 7) / 8);
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int64_t b = table[p / BS], r = p % BS;
    sc.v_rows[p - p_begin] = pb.v + ((b * BS + r) * Hkv + kvh) * D;
    if ((p - p_begin) % 8 == 0) sc.k_vecs[(p - p_begin) / 8] = pb.k + (b * Hkv + kvh) * D * BS + r;
  }
}

// Prefetches n elements from p on, one 64-byte line at a time.
template <typename KV>
inline void prefetch_row(const KV* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(KV)) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
  }
}

// Prefetches a K vector's D rows of 8 lanes (block_size = stride apart): when a line holds
// several rows, every line from its start to the end of its block's head (a vector that
// continues the previous one's block is then already covered).
template <typename KV>
inline void prefetch_k_vector(const KV* k, const KV* previous, int64_t D, int64_t stride) {
  if (stride * static_cast<int64_t>(sizeof(KV)) <= 64) {
    if (k != previous + 8) prefetch_row(k, D * stride);
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    _mm_prefetch(reinterpret_cast<const char*>(k + d * stride), _MM_HINT_T0);
  }
}

// NQ queries x NV 8-position vectors of transposed K blocks (vector i's feature d at
// k[i] + d * stride): dst[j] + 8 i <- scale * (FMA chain over d from 0 of q_j[d] * k_i[d]). A
// score depends only on its query and its position's K, never on its slot in the tile.
template <int NQ, int NV, typename KV>
void scores_tile(const float* const* q, const KV* const* k, int64_t stride, int64_t D,
                 float scale, float* const* dst, int64_t first) {
  __m256 acc[NQ][NV];
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 kd[NV];
    for (int i = 0; i < NV; ++i) kd[i] = load8(k[first + i] + d * stride);
    for (int j = 0; j < NQ; ++j) {
      const __m256 qd = _mm256_set1_ps(q[j][d]);
      for (int i = 0; i < NV; ++i) acc[j][i] = _mm256_fmadd_ps(qd, kd[i], acc[j][i]);
    }
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) {
      _mm256_storeu_ps(dst[j] + 8 * (first + i), _mm256_mul_ps(acc[j][i], vscale));
    }
}

// AVX2: tiles of up to 4 queries x 2 vectors (8 accumulators, 2 K vectors and a broadcast of the
// 16 registers; 8 independent chains cover the FMA latency).
template <int NQ, typename KV>
void scores_queries(const float* const* q, const KV* const* k, int64_t num_vec, int64_t stride,
                    int64_t D, float scale, float* const* dst) {
  int64_t i = 0;
  for (; i + 2 <= num_vec; i += 2) scores_tile<NQ, 2>(q, k, stride, D, scale, dst, i);
  if (i < num_vec) scores_tile<NQ, 1>(q, k, stride, D, scale, dst, i);
}

template <typename KV>
void scores_avx2(const float* const* q_rows, float* const* dst, int64_t num_queries,
                 const KV* const* k, int64_t num_vec, int64_t stride, int64_t D, float scale) {
  for (int64_t j = 0; j < num_queries; j += 4) {
    const float* const* q = q_rows + j;
    float* const* out = dst + j;
    switch (std::min<int64_t>(4, num_queries - j)) {
      case 4: scores_queries<4>(q, k, num_vec, stride, D, scale, out); break;
      case 3: scores_queries<3>(q, k, num_vec, stride, D, scale, out); break;
      case 2: scores_queries<2>(q, k, num_vec, stride, D, scale, out); break;
      default: scores_queries<1>(q, k, num_vec, stride, D, scale, out); break;
    }
  }
}

// Scores of the 8-position vectors [v0, v0 + nv) of the partition (K pointers sc.k_vecs) for the
// queries of the unit that read the first of them; a query's scores past its last position are
// computed too (from the block's other entries) and never read: the softmax overwrites those up
// to its length rounded to 8 with -inf and reads no further.
template <typename KV>
void pass_scores(const Problem<KV>& pb, int64_t v0, int64_t nv, int64_t stride, float* scores,
                 Scratch<KV>& sc) {
  const int64_t num_queries = static_cast<int64_t>(sc.q_rows.size());
  sc.pass_q.resize(num_queries);
  sc.pass_scores.resize(num_queries);
  int64_t n = 0;
  for (int64_t j = 0; j < num_queries; ++j) {
    if (8 * v0 > sc.q_last[j]) continue;
    sc.pass_q[n] = sc.q_rows[j];
    sc.pass_scores[n++] = scores + j * stride;
  }
  const KV* const* k = sc.k_vecs.data() + v0;
  for (int64_t j = 0; j < n; ++j) sc.pass_scores[j] += 8 * v0;
  if (pb.wide) {
    attention_scores_avx512(sc.pass_q.data(), sc.pass_scores.data(), n, k, nv, pb.block_size,
                            pb.head_dim, pb.scale);
  } else {
    scores_avx2(sc.pass_q.data(), sc.pass_scores.data(), n, k, nv, pb.block_size, pb.head_dim,
                pb.scale);
  }
}

// Scores [L rounded up to 8] -> exp(s - max) in place (positions >= L become exactly 0); returns
// their sum and stores the max in *max_out.
float softmax_numerators(float* s, int64_t L, float* max_out) {
  const int64_t L8 = (L + 7) / 8 * 8;
  std::fill(s + L, s + L8, -std::numeric_limits<float>::infinity());
  __m256 vmax = _mm256_loadu_ps(s);
  for (int64_t p = 8; p < L8; p += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + p));
  *max_out = hmax(vmax);
  vmax = _mm256_set1_ps(*max_out);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t p = 0; p < L8; p += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmax));
    _mm256_storeu_ps(s + p, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return hsum(vsum);
}

// For NQ queries over the same positions 0..n-1 (heads of one token) and features
// [d0, d0 + 8 NV): out_q[d] = sum_p probs_q[p] * v_p[d], positions in ascending order. Every
// 8-feature vector of every query is its own FMA chain, so the result is the same for any NQ, NV
// or slicing; sharing each loaded V row between queries only saves loads.
template <int NQ, int NV, typename KV>
void values_tile(const KV* const* v_rows, const float* const* probs, int64_t n, int64_t d0,
                 float* const* outs) {
  __m256 acc[NQ][NV];
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    const KV* v = v_rows[p] + d0;
    for (int j = 0; j < NQ; ++j) {
      const __m256 w = _mm256_set1_ps(probs[j][p]);
      for (int i = 0; i < NV; ++i) {
        acc[j][i] = _mm256_fmadd_ps(w, load8(v + 8 * i), acc[j][i]);
      }
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(outs[j] + d0 + 8 * i, acc[j][i]);
}

// All D features of NQ queries, in slices whose NQ * NV accumulators, NV loaded V vectors and
// the broadcast probability fit the 16 vector registers (a spilled accumulator would chain every
// FMA through a store and a load), with at least 8 independent FMA chains to hide their latency.
template <int NQ, typename KV>
void values(const KV* const* v_rows, const float* const* probs, int64_t n, int64_t D,
            float* const* outs) {
  constexpr int kWide = NQ == 1 ? 8 : NQ == 2 ? 4 : 3;  // vectors per slice
  int64_t d0 = 0;
  for (; d0 + 8 * kWide <= D; d0 += 8 * kWide) values_tile<NQ, kWide, KV>(v_rows, probs, n, d0, outs);
  for (; d0 + 16 <= D; d0 += 16) values_tile<NQ, 2, KV>(v_rows, probs, n, d0, outs);
  for (; d0 + 8 <= D; d0 += 8) values_tile<NQ, 1, KV>(v_rows, probs, n, d0, outs);
}

// Partials of one (token, query head) over one partition of its positions: the running max of
// its scores, the sum of exp(score - max), and the exp-weighted value sum [D].
struct Partials {
  float* acc;         // [entries, D]
  float* max;         // [entries]
  float* sum;         // [entries]
  const int64_t* base;  // base[t - shift] = first entry row of token t (one row per partition)
  int64_t shift, num_heads, head_dim;
  int64_t entry(int64_t t, int64_t part, int64_t head) const {
    return (base[t - shift] + part) * num_heads + head;
  }
};

// Per token: its heads' softmax numerators and exp-weighted value sums over the partition, heads
// in tiles that share each V row load.
template <typename KV>
void values_by_token(const Problem<KV>& pb, const Unit& u, int64_t part, float* scores,
                     int64_t stride, Scratch<KV>& sc, const Partials& out) {
  const int64_t D = pb.head_dim, group = pb.num_heads / pb.num_kv_heads, heads = u.h1 - u.h0;
  const int64_t p_begin = part * kPartition;
  for (int64_t t = u.t0; t < u.t1; ++t) {
    const int64_t n = std::min<int64_t>(pb.pos[t] + 1, p_begin + kPartition) - p_begin;
    if (n <= 0) continue;
    const int64_t j0 = (t - u.t0) * heads;
    for (int64_t h0 = 0; h0 < heads; h0 += kHeadTile) {
      const int nq = static_cast<int>(std::min<int64_t>(kHeadTile, heads - h0));
      const float* probs[kHeadTile];
      float* accs[kHeadTile];
      for (int i = 0; i < nq; ++i) {
        float* s = scores + (j0 + h0 + i) * stride;
        const int64_t e = out.entry(t, part, u.kvh * group + u.h0 + h0 + i);
        out.sum[e] = softmax_numerators(s, n, &out.max[e]);
        probs[i] = s;
        accs[i] = out.acc + e * D;
      }
      const KV* const* v_rows = sc.v_rows.data();
      if (nq == 3) {
        values<3>(v_rows, probs, n, D, accs);
      } else if (nq == 2) {
        values<2>(v_rows, probs, n, D, accs);
      } else {
        values<1>(v_rows, probs, n, D, accs);
      }
    }
  }
}

// Wide path: the softmax numerators of every query of the unit, then the value sums of
// kMaxWideQueries queries at a time (two tokens' heads of a 3-head group), which share each
// converted V row over the positions they all read (attention_wide.h).
template <typename KV>
void values_wide(const Problem<KV>& pb, const Unit& u, int64_t part, float* scores,
                 int64_t stride, Scratch<KV>& sc, const Partials& out) {
  const int64_t D = pb.head_dim, group = pb.num_heads / pb.num_kv_heads, heads = u.h1 - u.h0;
  const int64_t p_begin = part * kPartition;
  sc.probs.clear();
  sc.lengths.clear();
  sc.value_sums.clear();
  for (int64_t t = u.t0; t < u.t1; ++t) {
    const int64_t n = std::min<int64_t>(pb.pos[t] + 1, p_begin + kPartition) - p_begin;
    if (n <= 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + ((t - u.t0) * heads + h) * stride;
      const int64_t e = out.entry(t, part, u.kvh * group + u.h0 + h);
      out.sum[e] = attention_softmax_avx512(s, n, &out.max[e]);
      sc.probs.push_back(s);
      sc.lengths.push_back(n);
      sc.value_sums.push_back(out.acc + e * D);
    }
  }
  const int64_t num_queries = static_cast<int64_t>(sc.probs.size());
  for (int64_t i = 0; i < num_queries; i += kMaxWideQueries) {
    const int nq = static_cast<int>(std::min<int64_t>(kMaxWideQueries, num_queries - i));
    attention_values_avx512(sc.v_rows.data(), sc.probs.data() + i, sc.lengths.data() + i, nq, D,
                            sc.value_sums.data() + i);
  }
}

// The queries of the unit that read partition `part`, in unit order, as the tile kernels take
// them (attention_wide.h): row(t, h) of each (token t, head h of the unit's slice) into `rows`,
// and its length there and where its partials go into sc.lengths, value_sums, maxes, sums.
template <typename KV, typename Row>
void tile_queries(const Problem<KV>& pb, const Unit& u, int64_t part, const Partials& out,
                  Scratch<KV>& sc, std::vector<const float*>& rows, Row row) {
  const int64_t D = pb.head_dim, group = pb.num_heads / pb.num_kv_heads, heads = u.h1 - u.h0;
  const int64_t p_begin = part * kPartition;
  rows.clear();
  sc.lengths.clear();
  sc.value_sums.clear();
  sc.maxes.clear();
  sc.sums.clear();
  for (int64_t t = u.t0; t < u.t1; ++t) {
    const int64_t n = std::min<int64_t>(pb.pos[t] + 1, p_begin + kPartition) - p_begin;
    if (n <= 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t e = out.entry(t, part, u.kvh * group + u.h0 + h);
      rows.push_back(row(t, h));
      sc.lengths.push_back(n);
      sc.value_sums.push_back(out.acc + e * D);
      sc.maxes.push_back(out.max + e);
      sc.sums.push_back(out.sum + e);
    }
  }
}

// AMX-BF16 path (prompt positions): the softmax numerators and value sums of every query of the
// unit in one call (attention_wide.h), their partials straight into `out`.
template <typename KV>
void values_tiles(const Problem<KV>& pb, const Unit& u, int64_t part, float* scores,
                  int64_t stride, int64_t n_max, Scratch<KV>& sc, const Partials& out) {
  const int64_t D = pb.head_dim, heads = u.h1 - u.h0;
  tile_queries(pb, u, part, out, sc, sc.probs, [&](int64_t t, int64_t h) {
    return scores + ((t - u.t0) * heads + h) * stride;
  });
  if constexpr (std::is_same_v<KV, uint16_t>) {
    attention_softmax_values_amx_bf16(sc.probs.data(), sc.lengths.data(),
                                      static_cast<int64_t>(sc.probs.size()), sc.v_rows.data(),
                                      n_max, D, sc.value_sums.data(), sc.maxes.data(),
                                      sc.sums.data());
  }
}

// A cache in the tiles' layout: every query of the unit over the partition's n_max positions in
// one call (attention_wide.h), its partials straight into `out`.
template <typename KV>
void attend_partition_tiles(const Problem<KV>& pb, const Unit& u, int64_t part, int64_t n_max,
                            Scratch<KV>& sc, const Partials& out) {
  const int64_t D = pb.head_dim, BS = pb.block_size, Hkv = pb.num_kv_heads;
  const int64_t group = pb.num_heads / Hkv;
  const int64_t p_begin = part * kPartition;
  const int32_t* table = pb.tables + pb.seq[u.t0] * pb.max_blocks + p_begin / BS;
  const int64_t num_blocks = (n_max + BS - 1) / BS;
  sc.k_vecs.resize(num_blocks);  // here: each block's K, then V, at KV head kvh
  sc.v_rows.resize(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t at = (static_cast<int64_t>(table[b]) * Hkv + u.kvh) * D * BS;
    sc.k_vecs[b] = pb.k + at;
    sc.v_rows[b] = pb.v + at;
  }
  tile_queries(pb, u, part, out, sc, sc.q_rows, [&](int64_t t, int64_t h) {
    return pb.q + (t * pb.num_heads + u.kvh * group + u.h0 + h) * D;
  });
  const auto partition = pb.kv_amx ? attention_partition_tiles : attention_partition_bf16dot;
  partition(sc.q_rows.data(), sc.lengths.data(), static_cast<int64_t>(sc.q_rows.size()),
            reinterpret_cast<const uint16_t* const*>(sc.k_vecs.data()),
            reinterpret_cast<const uint16_t* const*>(sc.v_rows.data()), n_max, BS, D, pb.scale,
            sc.value_sums.data(), sc.maxes.data(), sc.sums.data());
}

// attend_partition on an fp32 or fp16 cache, over the partition's first n_max positions: the
// scores of every query, chunk by chunk (each chunk's K rows come from memory once and serve
// every query of the unit); then per token its heads' softmax numerators and exp-weighted value
// sums, heads in tiles that share each V row load. The V rows are prefetched along with the K
// rows, so the value sums find them in cache.
template <typename KV>
void attend_partition_loops(const Problem<KV>& pb, const Unit& u, int64_t part, int64_t n_max,
                            Scratch<KV>& sc, const Partials& out) {
  const int64_t D = pb.head_dim, Hq = pb.num_heads;
  const int64_t group = Hq / pb.num_kv_heads, heads = u.h1 - u.h0;
  const int64_t p_begin = part * kPartition, p_end = p_begin + n_max;
  const int64_t num_queries = (u.t1 - u.t0) * heads;
  // one query's scores in the scratch (whole 16-position tiles on the AMX-BF16 path)
  const int64_t stride = u.tiles ? (n_max + 15) / 16 * 16 : (n_max + 7) / 8 * 8;
  gather_rows(pb, pb.tables + pb.seq[u.t0] * pb.max_blocks, u.kvh, p_begin, p_end, sc);
  ensure_size(sc.scores, num_queries * stride);  // a query's scores are written before read
  float* scores = sc.scores.data();
  // query j = (token u.t0 + j / heads, head kvh * group + u.h0 + j % heads): its q row and its
  // last position relative to p_begin (no divisions in the loops below)
  sc.q_rows.resize(num_queries);
  sc.q_last.resize(num_queries);
  for (int64_t t = u.t0, j = 0; t < u.t1; ++t) {
    for (int64_t h = 0; h < heads; ++h, ++j) {
      sc.q_rows[j] = pb.q + (t * Hq + u.kvh * group + u.h0 + h) * D;
      sc.q_last[j] = pb.pos[t] - p_begin;
    }
  }
  const int64_t num_vec = (n_max + 7) / 8, BS = pb.block_size;
  if constexpr (std::is_same_v<KV, uint16_t>) {
    if (u.tiles) {
      attention_scores_amx_bf16(sc.q_rows.data(), scores, stride, num_queries, sc.k_vecs.data(),
                                num_vec, BS, D, pb.scale);
      values_tiles(pb, u, part, scores, stride, n_max, sc, out);
      return;
    }
  }
  auto prefetch_pass = [&](int64_t v0) {
    for (int64_t i = v0; i < std::min(v0 + kScorePass, num_vec); ++i) {
      prefetch_k_vector(sc.k_vecs[i], i > 0 ? sc.k_vecs[i - 1] : nullptr, D, BS);
    }
  };
  prefetch_pass(0);
  for (int64_t p = 0; p < std::min(kPrefetchAhead, n_max); ++p) prefetch_row(sc.v_rows[p], D);
  for (int64_t v0 = 0; v0 < num_vec; v0 += kScorePass) {
    prefetch_pass(v0 + kScorePass);
    const int64_t v_end = std::min(8 * (v0 + kScorePass) + kPrefetchAhead, n_max);
    for (int64_t p = 8 * v0 + kPrefetchAhead; p < v_end; ++p) prefetch_row(sc.v_rows[p], D);
    pass_scores(pb, v0, std::min(kScorePass, num_vec - v0), stride, scores, sc);
  }
  if (pb.wide) {
    values_wide(pb, u, part, scores, stride, sc, out);
  } else {
    values_by_token(pb, u, part, scores, stride, sc, out);
  }
}

// Positions [part * kPartition, ...) of the unit's queries (token t attends to 0..pos[t]), on the
// cache's own path.
template <typename KV>
void attend_partition(const Problem<KV>& pb, const Unit& u, int64_t part, Scratch<KV>& sc,
                      const Partials& out) {
  const int64_t p_begin = part * kPartition;
  int64_t p_end = p_begin;  // one past the last position any query of the unit reads here
  for (int64_t t = u.t0; t < u.t1; ++t) {
    p_end = std::max<int64_t>(p_end, std::min<int64_t>(pb.pos[t] + 1, p_begin + kPartition));
  }
  const int64_t n_max = p_end - p_begin;
  if (n_max <= 0) return;
  if constexpr (std::is_same_v<KV, TileKV>) {
    attend_partition_tiles(pb, u, part, n_max, sc, out);
  } else {
    attend_partition_loops(pb, u, part, n_max, sc, out);
  }
}

// out = sum_i w_i acc_i / sum_i w_i sum_i over the token's partitions i in ascending order, with
// w_i = exp(max_i - max over all); one partition gives acc / sum, the plain softmax (w = 1 there,
// so the shortcut is the same arithmetic).
void merge(const Partials& in, int64_t t, int64_t head, int64_t num_parts, float* dst) {
  const int64_t D = in.head_dim;
  if (num_parts == 1) {
    const int64_t e = in.entry(t, 0, head);
    const __m256 den = _mm256_set1_ps(in.sum[e]);
    for (int64_t d = 0; d < D; d += 8) {
      _mm256_storeu_ps(dst + d, _mm256_div_ps(_mm256_loadu_ps(in.acc + e * D + d), den));
    }
    return;
  }
  thread_local std::vector<float> weights;
  weights.resize(num_parts);
  float m = in.max[in.entry(t, 0, head)];
  for (int64_t i = 1; i < num_parts; ++i) m = std::max(m, in.max[in.entry(t, i, head)]);
  float denom = 0.0f;
  for (int64_t i = 0; i < num_parts; ++i) {
    const int64_t e = in.entry(t, i, head);
    weights[i] = std::exp(in.max[e] - m);
    denom += weights[i] * in.sum[e];
  }
  const __m256 den = _mm256_set1_ps(denom);
  for (int64_t d = 0; d < D; d += 8) {
    __m256 o = _mm256_setzero_ps();
    for (int64_t i = 0; i < num_parts; ++i) {
      const float* acc = in.acc + in.entry(t, i, head) * D;
      o = _mm256_fmadd_ps(_mm256_set1_ps(weights[i]), _mm256_loadu_ps(acc + d), o);
    }
    _mm256_storeu_ps(dst + d, _mm256_div_ps(o, den));
  }
}

template <typename KV>
int64_t num_partitions(const Problem<KV>& pb, int64_t t) {
  return (pb.pos[t] + kPartition) / kPartition;  // partitions covering 0..pos[t]
}

// Partitions covering the longest context among tokens [t0, t1).
template <typename KV>
int64_t max_partitions(const Problem<KV>& pb, int64_t t0, int64_t t1) {
  int64_t parts = 0;
  for (int64_t t = t0; t < t1; ++t) parts = std::max(parts, num_partitions(pb, t));
  return parts;
}

// A whole unit: every partition of its tokens into its own scratch, then the merged outputs.
template <typename KV>
void attend_unit(const Problem<KV>& pb, const Unit& u, Scratch<KV>& sc) {
  const int64_t D = pb.head_dim, Hq = pb.num_heads, group = Hq / pb.num_kv_heads;
  const int64_t parts_max = max_partitions(pb, u.t0, u.t1);
  const int64_t rows = (u.t1 - u.t0) * parts_max;
  sc.base.resize(u.t1 - u.t0);
  for (int64_t t = u.t0; t < u.t1; ++t) sc.base[t - u.t0] = (t - u.t0) * parts_max;
  ensure_size(sc.acc, rows * Hq * D);  // every partial merge reads is written first
  ensure_size(sc.max, rows * Hq);
  ensure_size(sc.sum, rows * Hq);
  const Partials partials{sc.acc.data(), sc.max.data(), sc.sum.data(), sc.base.data(), u.t0, Hq,
                          D};
  for (int64_t part = 0; part < parts_max; ++part) attend_partition(pb, u, part, sc, partials);
  for (int64_t t = u.t0; t < u.t1; ++t) {
    for (int64_t h = u.kvh * group + u.h0; h < u.kvh * group + u.h1; ++h) {
      merge(partials, t, h, num_partitions(pb, t), pb.out + (t * Hq + h) * D);
    }
  }
}

// Runs of up to kRunTokens consecutive batch tokens of one sequence.
template <typename KV>
std::vector<Unit> make_runs(const Problem<KV>& pb, int64_t T) {
  std::vector<Unit> runs;
  for (int64_t t0 = 0; t0 < T;) {
    const bool tiles = pb.prompt_token(t0);
    int64_t t1 = t0 + 1;
    const int64_t longest = tiles || std::is_same_v<KV, TileKV> ? kTileRunTokens : kRunTokens;
    while (t1 < T && t1 - t0 < longest && pb.seq[t1] == pb.seq[t0] &&
           pb.prompt_token(t1) == tiles) {
      ++t1;
    }
    runs.push_back({t0, t1, 0, 0, 0, tiles});
    t0 = t1;
  }
  return runs;
}

// Units = run x KV head x a slice of its group's query heads, latest tokens (longest contexts)
// first so that dynamic claiming balances the threads. Heads are sliced only when there are too
// few units for the threads (a decode token at a short context).
template <typename KV>
std::vector<Unit> make_units(const Problem<KV>& pb, const std::vector<Unit>& runs,
                             int64_t wanted) {
  const int64_t group = pb.num_heads / pb.num_kv_heads;
  const int64_t per_kv = static_cast<int64_t>(runs.size()) * pb.num_kv_heads;
  const int64_t slices = std::min(group, std::max<int64_t>(1, (wanted + per_kv - 1) / per_kv));
  const int64_t slice = (group + slices - 1) / slices;
  std::vector<Unit> units;
  for (auto r = runs.rbegin(); r != runs.rend(); ++r) {
    for (int64_t kvh = 0; kvh < pb.num_kv_heads; ++kvh) {
      for (int64_t h0 = 0; h0 < group; h0 += slice) {
        units.push_back({r->t0, r->t1, kvh, h0, std::min(group, h0 + slice), r->tiles});
      }
    }
  }
  return units;
}

// Few runs (one sequence decoding or verifying): the partitions of each (run, KV head) go to
// different threads, their partials to a shared buffer, merged in a second pass. Same partials,
// same merge: the outputs are bit-identical to attend_unit's.
template <typename KV>
void attend_split(const Problem<KV>& pb, const std::vector<Unit>& runs, int64_t T) {
  const int64_t D = pb.head_dim, Hq = pb.num_heads;
  std::vector<int64_t> base(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) base[t + 1] = base[t] + num_partitions(pb, t);
  thread_local std::vector<float> acc, mx, sm;  // every partial merge reads is written first
  ensure_size(acc, base[T] * Hq * D);
  ensure_size(mx, base[T] * Hq);
  ensure_size(sm, base[T] * Hq);
  const Partials partials{acc.data(), mx.data(), sm.data(), base.data(), 0, Hq, D};
  struct Work {
    Unit unit;
    int64_t part;
  };
  std::vector<Work> work;
  for (auto r = runs.rbegin(); r != runs.rend(); ++r) {
    for (int64_t part = max_partitions(pb, r->t0, r->t1) - 1; part >= 0; --part) {
      for (int64_t kvh = 0; kvh < pb.num_kv_heads; ++kvh) {
        work.push_back({{r->t0, r->t1, kvh, 0, Hq / pb.num_kv_heads, r->tiles}, part});
      }
    }
  }
  parallel_for(static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch<KV> scratch;
    for (int64_t i = begin; i < end; ++i) {
      attend_partition(pb, work[i].unit, work[i].part, scratch, partials);
    }
  });
  parallel_for(T * Hq, balanced_chunk(T * Hq, 8), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / Hq, h = i % Hq;
      merge(partials, t, h, num_partitions(pb, t), pb.out + (t * Hq + h) * D);
    }
  });
}

void check(bool ok, const char* what) {
  TORCH_CHECK(ok, "speculant::paged_attention: ", what);
}

// Validates the indices against the cache, then attends (see the top of the file).
template <typename KV>
void attend(const Problem<KV>& pb, int64_t T, int64_t S, int64_t num_blocks) {
  int64_t num_positions = 0;  // summed over tokens: the work, in units of one K and one V row
  for (int64_t t = 0; t < T; ++t) {
    check(pb.seq[t] >= 0 && pb.seq[t] < S, "token_seq entry out of range");
    check(pb.pos[t] >= 0 && pb.pos[t] < pb.max_blocks * pb.block_size,
          "token_pos beyond the block table");
    const int32_t* table = pb.tables + pb.seq[t] * pb.max_blocks;
    for (int64_t b = 0; b <= pb.pos[t] / pb.block_size; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "speculant::paged_attention: block id ",
                  table[b], " out of range [0, ", num_blocks, ")");
    }
    num_positions += pb.pos[t] + 1;
  }
  const bool parallel = num_positions * pb.num_heads >= kMinParallelWork;
  const int64_t wanted = parallel ? 2 * pool_threads() : 1;
  const std::vector<Unit> runs = make_runs(pb, T);
  const bool long_context = num_positions > static_cast<int64_t>(runs.size()) * kPartition;
  if (parallel && long_context &&
      static_cast<int64_t>(runs.size()) * pb.num_kv_heads < wanted * 2) {
    attend_split(pb, runs, T);
    return;
  }
  const std::vector<Unit> units = make_units(pb, runs, wanted);
  const int64_t num_units = static_cast<int64_t>(units.size());
  parallel_for(num_units, parallel ? 1 : num_units, [&](int64_t begin, int64_t end) {
    thread_local Scratch<KV> scratch;
    for (int64_t i = begin; i < end; ++i) attend_unit(pb, units[i], scratch);
  });
}

template <typename KV>
const KV* cache_data(const at::Tensor& t) {
  if constexpr (std::is_same_v<KV, float>) {
    return t.const_data_ptr<float>();
  } else if constexpr (std::is_same_v<KV, TileKV>) {
    return reinterpret_cast<const TileKV*>(t.const_data_ptr<at::BFloat16>());
  } else {
    return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::Half>());
  }
}

void check_indices(const at::Tensor& block_tables, const at::Tensor& token_seq,
                   const at::Tensor& token_pos, int64_t T) {
  check(block_tables.scalar_type() == at::kInt && token_seq.scalar_type() == at::kInt &&
            token_pos.scalar_type() == at::kInt,
        "block_tables, token_seq, token_pos must be int32");
  check(block_tables.dim() == 2, "block_tables must be [S, max_blocks]");
  check(token_seq.numel() == T && token_pos.numel() == T,
        "token_seq, token_pos must have T entries");
}

// A bf16 cache in the tiles' layout (kernels/kv_layout.py): every query on AMX-BF16 tiles, or
// on AVX512_BF16 dot products where the CPU has no AMX (or SPECULANT_KV_ATTENTION says so).
at::Tensor attend_tile_cache(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& token_seq, const at::Tensor& token_pos,
                             double scale) {
  check(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
        "a bfloat16 cache needs K and V both bfloat16");
  check(tile_kv_shapes_match(k_cache, v_cache),
        "expected a bfloat16 cache in the tiles' layout: K [blocks, Hkv, D / 2, block_size, 2], "
        "V [blocks, Hkv, block_size / 2, D, 2]");
  check(tile_kv_cache(), "a bfloat16 KV cache is attended on AMX-BF16 tiles or AVX512_BF16 dot "
        "products, which this CPU lacks (needs avx512_bf16 and avx512_vnni)");
  check(q.dim() == 3, "expected q [T, Hq, D]");
  check_indices(block_tables, token_seq, token_pos, q.size(0));
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t block_size = k_cache.size(3);
  check(v_cache.size(3) == D && D % 32 == 0 && D <= 128,
        "a bfloat16 cache needs head_dim a multiple of 32 up to 128, matching q");
  check(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  check(block_size % 32 == 0 && kPartition % block_size == 0,
        "a bfloat16 cache needs block_size a multiple of 32 that divides 256");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const Problem<TileKV> pb{q.const_data_ptr<float>(), cache_data<TileKV>(k_cache),
                           cache_data<TileKV>(v_cache), block_tables.const_data_ptr<int32_t>(),
                           token_seq.const_data_ptr<int32_t>(),
                           token_pos.const_data_ptr<int32_t>(), out.data_ptr<float>(), Hq, Hkv,
                           D, block_size, block_tables.size(1), static_cast<float>(scale), true,
                           nullptr, false, kv_attention_tiles()};
  attend(pb, T, block_tables.size(0), num_blocks);
  return out;
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const at::Tensor& tables_in, const at::Tensor& seq_in,
                           const at::Tensor& pos_in, double scale,
                           const std::optional<at::Tensor>& prompt_lens_in) {
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &tables_in, &seq_in, &pos_in}) {
    check(t->device().is_cpu(), "all tensors must be on the CPU");
  }
  // no-ops for the usual contiguous inputs
  const at::Tensor q = q_in.contiguous(), k_cache = k_in.contiguous(), v_cache = v_in.contiguous();
  const at::Tensor block_tables = tables_in.contiguous(), token_seq = seq_in.contiguous();
  const at::Tensor token_pos = pos_in.contiguous();
  check(q.scalar_type() == at::kFloat, "q must be float32");
  if (k_cache.scalar_type() == at::kBFloat16 || v_cache.scalar_type() == at::kBFloat16) {
    return attend_tile_cache(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale);
  }
  const bool half = k_cache.scalar_type() == at::kHalf;
  check(k_cache.scalar_type() == v_cache.scalar_type() && (half || k_cache.scalar_type() == at::kFloat),
        "the caches must be both float32 or both float16");
  check(q.dim() == 3 && paged_kv_shapes_match(k_cache, v_cache),
        "expected q [T, Hq, D], K cache [blocks, Hkv, D, block_size], V cache [blocks, "
        "block_size, Hkv, D]");
  check_indices(block_tables, token_seq, token_pos, q.size(0));
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = v_cache.size(2), num_blocks = v_cache.size(0);
  check(v_cache.size(3) == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  check(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  const int64_t S = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t block_size = v_cache.size(1);
  check(block_size % 8 == 0 && kPartition % block_size == 0,
        "block_size must be a multiple of 8 that divides 256");

  at::Tensor prompt_lens;
  if (prompt_lens_in) {
    prompt_lens = prompt_lens_in->contiguous();
    check(prompt_lens.device().is_cpu() && prompt_lens.scalar_type() == at::kInt &&
              prompt_lens.dim() == 1 && prompt_lens.numel() == S,
          "prompt_lens must be int32 [S], one entry per row of block_tables");
  }
  const bool wide = wide_attention(active_kernel_path());
  const bool tiles = prompt_lens.defined() && half && D % 32 == 0 && D <= 128 && wide &&
                     prompt_attention_tiles();
  at::Tensor out = at::empty(q.sizes(), q.options());
  auto run = [&](auto kv_type) {
    using KV = decltype(kv_type);
    const Problem<KV> pb{q.const_data_ptr<float>(), cache_data<KV>(k_cache),
                         cache_data<KV>(v_cache), block_tables.const_data_ptr<int32_t>(),
                         token_seq.const_data_ptr<int32_t>(), token_pos.const_data_ptr<int32_t>(),
                         out.data_ptr<float>(), Hq, Hkv, D, block_size, max_blocks,
                         static_cast<float>(scale), wide,
                         tiles ? prompt_lens.const_data_ptr<int32_t>() : nullptr, tiles};
    attend(pb, T, S, num_blocks);
  };
  if (half) {
    run(uint16_t{});
  } else {
    run(float{});
  }
  return out;
}

}  // namespace speculant
