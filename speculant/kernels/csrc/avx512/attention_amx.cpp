// Prompt attention on AMX-BF16 tiles: the scores, then the softmax and the value sums of a unit's
// queries over one partition (see attention_wide.h), compiled apart with the AVX-512 and AMX
// flags and included only through that header (linear_blocks.h says why).
//
// Precision. Each operand is split into two bf16 numbers, x = hi + lo (hi = x rounded to bf16,
// lo = the rest rounded to bf16), and a score is the fp32 sum of hi*hi' + hi*lo' + lo*hi' over
// the features: a K value from the fp16 cache splits exactly (11 significant bits fit in two
// bf16 of 8), a scaled query (and a softmax numerator) to ~16 bits, so a score (a value sum) is
// within a few fp32 roundings of the fp32 path's, not bit-identical to it. Every bf16 product
// is exact in fp32 and the tile unit adds them in a fixed order per output element (features,
// or positions, ascending), so an output depends only on its query and its sequence's K / V:
// rows of a tile, and the other queries in it, never change it (batch-invariant).
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

#include "../attention_wide.h"
#include "exp16.h"
#include "tile_config.h"

namespace speculant {
namespace {

constexpr int kTile = 16;  // query rows of an A tile, positions of a B / C tile

using avx512::TileConfig;

// tmm0-3: the query tile's hi/lo halves (features [0, 32), [32, 64)); tmm4-5: K hi/lo of a
// 16-position tile; tmm6: its 16 x 16 fp32 scores. Every tile is 16 rows of 64 bytes.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  _tile_loadconfig(&cfg);
}

// 16 fp32 -> hi, lo bf16 with hi + lo ~= x (exactly when x has <= 16 significant bits).
inline void split16(__m512 x, __m256i* hi, __m256i* lo) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  *hi = h;
  *lo = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(x, back)));
}

// a row of a B operand from two 16-lane vectors, a (element 2r of each of 16 columns) and b
// (element 2r + 1): the pairs (a_i, b_i) in column order, split, as 32 hi and 32 lo bf16.
inline void store_pair_row(__m512 a, __m512 b, uint16_t* hi, uint16_t* lo) {
  const __m512i first8 = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i last8 = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  __m256i h0, l0, h1, l1;
  split16(_mm512_permutex2var_ps(a, first8, b), &h0, &l0);
  split16(_mm512_permutex2var_ps(a, last8, b), &h1, &l1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(hi), h0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(hi + 16), h1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lo), l0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lo + 16), l1);
}

inline __m512 load_k16(const uint16_t* lo8, const uint16_t* hi8) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo8));
  const __m128i b = hi8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi8))
                        : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

// Per-thread buffers, grown as needed (plain malloc: no STL in this file).
struct Buffers {
  uint16_t* data = nullptr;
  int64_t capacity = 0;  // uint16_t elements
  ~Buffers() { free(data); }
  uint16_t* get(int64_t n) {
    if (n > capacity) {
      free(data);
      data = static_cast<uint16_t*>(aligned_alloc(64, ((n * 2 + 63) / 64) * 64));
      capacity = n;
    }
    return data;
  }
};
thread_local Buffers tls_buffers;

}  // namespace

bool attention_scores_amx_bf16(const float* const* q_rows, float* scores, int64_t row_stride,
                               int64_t num_queries, const uint16_t* const* k8, int64_t num_vec8,
                               int64_t stride, int64_t D, float scale) {
  if (D % 32 != 0 || D > 128 || row_stride % kTile != 0) return false;
  const int64_t halves = D / 32;                      // 32-feature slices of a row
  const int64_t num_ptiles = (num_vec8 + 1) / 2;      // 16-position tiles
  const int64_t num_qtiles = (num_queries + kTile - 1) / kTile;
  // K operands, per position tile and slice: hi then lo, each 16 rows (feature pairs) x 32 bf16
  // (16 positions x the pair), the layout tdpbf16ps reads B in. Queries: per query tile, per
  // slice, hi then lo, 16 rows x 32 bf16.
  const int64_t k_elems = num_ptiles * halves * 2 * kTile * 32;
  const int64_t q_elems = num_qtiles * halves * 2 * kTile * 32;
  uint16_t* kbuf = tls_buffers.get(k_elems + q_elems);
  uint16_t* qbuf = kbuf + k_elems;

  for (int64_t n = 0; n < num_ptiles; ++n) {
    const uint16_t* v0 = k8[2 * n];
    const uint16_t* v1 = 2 * n + 1 < num_vec8 ? k8[2 * n + 1] : nullptr;
    for (int64_t r = 0; r < D / 2; ++r) {  // feature pair (2r, 2r + 1)
      const int64_t d = 2 * r;
      const __m512 a = load_k16(v0 + d * stride, v1 ? v1 + d * stride : nullptr);
      const __m512 b = load_k16(v0 + (d + 1) * stride, v1 ? v1 + (d + 1) * stride : nullptr);
      const int64_t slice = r / 16, row = r % 16;
      uint16_t* hi = kbuf + ((n * halves + slice) * 2) * kTile * 32 + row * 32;
      store_pair_row(a, b, hi, hi + kTile * 32);  // 16 positions x (feature 2r, 2r + 1)
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t qt = 0; qt < num_qtiles; ++qt) {
    for (int64_t i = 0; i < kTile; ++i) {
      const int64_t j = qt * kTile + i;
      for (int64_t slice = 0; slice < halves; ++slice) {
        uint16_t* hi = qbuf + ((qt * halves + slice) * 2) * kTile * 32 + i * 32;
        uint16_t* lo = hi + kTile * 32;
        for (int64_t c = 0; c < 2; ++c) {
          const __m512 x = j < num_queries
                               ? _mm512_mul_ps(_mm512_loadu_ps(q_rows[j] + slice * 32 + c * 16), vscale)
                               : _mm512_setzero_ps();
          __m256i h, l;
          split16(x, &h, &l);
          _mm256_store_si256(reinterpret_cast<__m256i*>(hi + 16 * c), h);
          _mm256_store_si256(reinterpret_cast<__m256i*>(lo + 16 * c), l);
        }
      }
    }
  }
  configure_tiles();
  alignas(64) float last[kTile * kTile];  // a query tile's rows past num_queries land here
  for (int64_t qt = 0; qt < num_qtiles; ++qt) {
    const bool full = (qt + 1) * kTile <= num_queries;
    for (int64_t n = 0; n < num_ptiles; ++n) {
      _tile_zero(6);
      for (int64_t slice = 0; slice < halves; ++slice) {
        const uint16_t* qa = qbuf + ((qt * halves + slice) * 2) * kTile * 32;
        const uint16_t* kb = kbuf + ((n * halves + slice) * 2) * kTile * 32;
        _tile_loadd(0, qa, 64);
        _tile_loadd(1, qa + kTile * 32, 64);
        _tile_loadd(4, kb, 64);
        _tile_loadd(5, kb + kTile * 32, 64);
        _tile_dpbf16ps(6, 0, 4);  // hi * hi
        _tile_dpbf16ps(6, 0, 5);  // hi * lo
        _tile_dpbf16ps(6, 1, 4);  // lo * hi
      }
      float* dst = scores + qt * kTile * row_stride + n * kTile;
      if (full) {
        _tile_stored(6, dst, row_stride * sizeof(float));
      } else {
        _tile_stored(6, last, kTile * sizeof(float));
        for (int64_t i = 0; qt * kTile + i < num_queries; ++i) {
          _mm512_storeu_ps(dst + i * row_stride, _mm512_load_ps(last + i * kTile));
        }
      }
    }
  }
  _tile_release();
  return true;
}

namespace {

// The softmax numerators of one query's scores s [0, n): exp(s - max) split into bf16 hi / lo,
// written as row `row` of its P operands (chunk c's hi at p + c * chunk_stride, lo 16 rows
// further), zeros from n to the end of the last chunk. Returns their fp32 sum (16 lanes added
// in position order, then reduced); stores the max in *max_out.
float softmax_split(const float* s, int64_t n, int64_t num_chunks, uint16_t* p,
                    int64_t chunk_stride, float* max_out) {
  const float m = avx512::max_of(s, n);
  *max_out = m;
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t c = 0; c < num_chunks; ++c) {
    uint16_t* hi = p + c * chunk_stride;
    uint16_t* lo = hi + kTile * 32;
    for (int64_t h = 0; h < 2; ++h) {
      const __m512 e = avx512::numerators16(s, 32 * c + 16 * h, n, vm);
      vsum = _mm512_add_ps(vsum, e);
      __m256i hv, lv;
      split16(e, &hv, &lv);
      _mm256_store_si256(reinterpret_cast<__m256i*>(hi + 16 * h), hv);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lo + 16 * h), lv);
    }
  }
  return _mm512_reduce_add_ps(vsum);
}

}  // namespace

bool attention_softmax_values_amx_bf16(const float* const* scores, const int64_t* lengths,
                                       int64_t num_queries, const uint16_t* const* v_rows,
                                       int64_t n_max, int64_t D, float* const* outs,
                                       float* const* maxes, float* const* sums) {
  if (D % 16 != 0) return false;
  constexpr int64_t kChunk = 32;  // positions per tile product (16 pairs)
  const int64_t num_chunks = (n_max + kChunk - 1) / kChunk;
  const int64_t num_ftiles = D / 16;
  const int64_t num_qtiles = (num_queries + kTile - 1) / kTile;
  // V operands per chunk and 16-feature tile: hi then lo, 16 rows (position pairs) x 32 bf16;
  // P operands per query tile and chunk: hi then lo, 16 rows (queries) x 32 bf16 (positions).
  const int64_t v_elems = num_chunks * num_ftiles * 2 * kTile * 32;
  const int64_t p_elems = num_qtiles * num_chunks * 2 * kTile * 32;
  uint16_t* vbuf = tls_buffers.get(v_elems + p_elems);
  uint16_t* pbuf = vbuf + v_elems;
  for (int64_t c = 0; c < num_chunks; ++c) {
    for (int64_t r = 0; r < kTile; ++r) {  // positions 2r, 2r + 1 of the chunk
      const int64_t p0 = c * kChunk + 2 * r, p1 = p0 + 1;
      for (int64_t f = 0; f < num_ftiles; ++f) {
        const __m512 a = p0 < n_max ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(v_rows[p0] + 16 * f)))
                                    : _mm512_setzero_ps();
        const __m512 b = p1 < n_max ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(v_rows[p1] + 16 * f)))
                                    : _mm512_setzero_ps();
        uint16_t* hi = vbuf + ((c * num_ftiles + f) * 2) * kTile * 32 + r * 32;
        store_pair_row(a, b, hi, hi + kTile * 32);  // 16 features x (position 2r, 2r + 1)
      }
    }
  }
  // P: each query's softmax numerators straight into its rows; the padding rows of the last
  // query tile are zeros
  const int64_t chunk_stride = 2 * kTile * 32;
  for (int64_t qt = 0; qt < num_qtiles; ++qt) {
    for (int64_t i = 0; i < kTile; ++i) {
      const int64_t j = qt * kTile + i;
      uint16_t* row = pbuf + qt * num_chunks * chunk_stride + i * 32;
      if (j < num_queries) {
        *sums[j] = softmax_split(scores[j], lengths[j], num_chunks, row, chunk_stride, maxes[j]);
        continue;
      }
      for (int64_t c = 0; c < num_chunks; ++c) {
        for (int64_t h = 0; h < 2; ++h) {
          _mm512_store_si512(row + c * chunk_stride + h * kTile * 32, _mm512_setzero_si512());
        }
      }
    }
  }
  // tmm0-1: P hi / lo; tmm2-3: V hi / lo; tmm4-7: the value sums of up to 4 feature tiles
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float value_tiles[4][kTile * kTile];
  for (int64_t qt = 0; qt < num_qtiles; ++qt) {
    for (int64_t f0 = 0; f0 < num_ftiles; f0 += 4) {
      const int64_t nf = num_ftiles - f0 < 4 ? num_ftiles - f0 : 4;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t c = 0; c < num_chunks; ++c) {
        const uint16_t* pa = pbuf + ((qt * num_chunks + c) * 2) * kTile * 32;
        _tile_loadd(0, pa, 64);
        _tile_loadd(1, pa + kTile * 32, 64);
        const uint16_t* vb = vbuf + ((c * num_ftiles + f0) * 2) * kTile * 32;
        // one feature tile at a time: hi*hi + hi*lo + lo*hi, positions ascending
#define SPECULANT_PV(T, F)                                    \
  _tile_loadd(2, vb + (F) * 2 * kTile * 32, 64);              \
  _tile_loadd(3, vb + (F) * 2 * kTile * 32 + kTile * 32, 64); \
  _tile_dpbf16ps(T, 0, 2);                                    \
  _tile_dpbf16ps(T, 0, 3);                                    \
  _tile_dpbf16ps(T, 1, 2);
        SPECULANT_PV(4, 0)
        if (nf > 1) { SPECULANT_PV(5, 1) }
        if (nf > 2) { SPECULANT_PV(6, 2) }
        if (nf > 3) { SPECULANT_PV(7, 3) }
#undef SPECULANT_PV
      }
      _tile_stored(4, value_tiles[0], 64);
      if (nf > 1) _tile_stored(5, value_tiles[1], 64);
      if (nf > 2) _tile_stored(6, value_tiles[2], 64);
      if (nf > 3) _tile_stored(7, value_tiles[3], 64);
      avx512::copy_value_rows(value_tiles, qt, num_queries, f0, nf, outs);
    }
  }
  _tile_release();
  return true;
}

}  // namespace speculant
