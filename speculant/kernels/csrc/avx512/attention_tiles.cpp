// Attention over a bf16 KV cache kept in the AMX tiles' own layout (kernels/kv_layout.py): the
// scores, the softmax and the value sums of a unit's queries over one partition, every query
// position alike (prompt, decode, verification rows), compiled apart with the AVX-512 and AMX
// flags and included only through attention_wide.h (linear_blocks.h says why).
//
// Why a layout of its own: a tile product reads its B operand as 16 rows of 32 bf16, each row
// holding the element pairs (2r, 2r + 1) of 16 columns. K blocks are stored [Hkv, D / 2,
// block_size, 2] (a 16-position tile of 32 features is 16 rows 4 * block_size bytes apart) and V
// blocks [Hkv, block_size / 2, D, 2] (a tile of 16 features over up to 32 positions is the
// block's position-pair rows, 4 * D bytes apart), so both load straight from the cache: the fp16
// cache had to be converted per call, which made a decode token 2.7x slower on the tiles.
//
// Precision: bf16 operands, fp32 sums, as bf16 attention runs on GPUs. K and V are bf16 as
// stored (rounded to nearest when written); the scaled query and the softmax numerators are
// rounded to bf16 too; a score is the fp32 sum of the exact products over the features, a value
// sum over the positions, added by the tile unit in a fixed order per output element. The
// softmax's max, exponentials and their sum stay fp32 (the sum adds the fp32 numerators).
//
// Batch invariance: a tile row is one query; the unit computes each row's dot products apart from
// the other rows, so a query's scores, softmax and value sums never depend on the other queries of
// its unit, on how many there are, or on the partition's extent beyond the query's own length
// (its numerators there are exact zeros, which add nothing). One query position therefore gets
// the same bits as a decode token, a verification row or a prompt token.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

#include "../attention_wide.h"
#include "aligned_scratch.h"
#include "exp16.h"
#include "tile_config.h"

namespace speculant {
namespace {

constexpr int kTile = 16;      // query rows of a tile; positions of a score tile
constexpr int kRowBf16 = 32;   // bf16 elements in a 64-byte tile row
constexpr int kChunk = 32;     // positions of a value-sum product (16 pairs)
constexpr int kMaxSlices = 4;  // 32-feature slices of a query (head_dim <= 128)

// Every tile register is 16 rows of 64 bytes. Scores: tmm0-3 the query tile's 32-feature
// slices, tmm4/5 the scores of two 16-position tiles, tmm6/7 K. Value sums: tmm0-3 the sums of
// four 16-feature tiles, tmm4 the softmax numerators of a 32-position chunk, tmm6/7 V.
void configure_tiles() {
  avx512::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  _tile_loadconfig(&cfg);
}

inline __m256i to_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

thread_local avx512::AlignedScratch tls_scratch;  // grown as needed

// Query operands: per query tile and 32-feature slice, 16 rows x 32 bf16 of scale * q; rows
// past num_queries are zeros.
void round_queries(const float* const* q_rows, int64_t num_queries, int64_t num_qtiles,
                   int64_t slices, float scale, uint16_t* qbuf) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t qt = 0; qt < num_qtiles; ++qt) {
    for (int64_t i = 0; i < kTile; ++i) {
      const int64_t j = qt * kTile + i;
      for (int64_t s = 0; s < slices; ++s) {
        uint16_t* row = qbuf + (qt * slices + s) * kTile * kRowBf16 + i * kRowBf16;
        for (int64_t c = 0; c < 2; ++c) {
          const __m512 x = j < num_queries
                               ? _mm512_mul_ps(_mm512_loadu_ps(q_rows[j] + s * 32 + c * 16), vscale)
                               : _mm512_setzero_ps();
          _mm256_store_si256(reinterpret_cast<__m256i*>(row + 16 * c), to_bf16(x));
        }
      }
    }
  }
}

// Requests into L1 the K of the score tiles two ahead of tile n and the V they will be summed
// with: a block's K lines sit 4 * block_size bytes apart, and blocks are scattered, jumps the
// hardware prefetchers miss (the cache is read from L3 or DRAM at every step).
inline void prefetch_ahead(const uint16_t* const* k_blocks, const uint16_t* const* v_blocks,
                           int64_t n, int64_t num_ptiles, int64_t block_size, int64_t D) {
  for (int64_t m = n + 2; m < n + 4 && m < num_ptiles; ++m) {
    const int64_t p = m * kTile;
    const uint16_t* k = k_blocks[p / block_size] + p % block_size * 2;
    for (int64_t r = 0; r < D / 2; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(k + r * block_size * 2), _MM_HINT_T0);
    }
    const char* v = reinterpret_cast<const char*>(v_blocks[p / block_size] + p % block_size * D);
    for (int64_t x = 0; x < kTile * D * 2; x += 64) _mm_prefetch(v + x, _MM_HINT_T0);
  }
}

#define SPECULANT_DOT(C, S, K_TILE)                                   \
  _tile_loadd(K_TILE, k_tile(n + ((C) - 4), S), k_stride);           \
  _tile_dpbf16ps(C, S, K_TILE);

// Scores of query tile qt (its slices already in tmm0..slices-1) over the positions
// [0, 16 * num_ptiles) of the partition, into scores [16 rows][row_stride]: tile n's K is in
// block n * 16 / block_size at position offset n * 16 % block_size.
void tile_scores(int64_t slices, const uint16_t* const* k_blocks,
                 const uint16_t* const* v_blocks, int64_t block_size, int64_t D,
                 int64_t num_ptiles, bool prefetch, float* scores, int64_t row_stride) {
  const int64_t k_stride = 4 * block_size;  // bytes between feature-pair rows of a K block
  auto k_tile = [&](int64_t m, int64_t s) {
    const int64_t p = m * kTile;
    return k_blocks[p / block_size] + (s * kTile * block_size + p % block_size) * 2;
  };
  for (int64_t n = 0; n < num_ptiles; n += 2) {
    if (prefetch) prefetch_ahead(k_blocks, v_blocks, n, num_ptiles, block_size, D);
    const bool pair = n + 1 < num_ptiles;
    _tile_zero(4);
    _tile_zero(5);
    // slices in ascending order for each score; the two tiles' products interleaved
    SPECULANT_DOT(4, 0, 6)
    if (pair) { SPECULANT_DOT(5, 0, 7) }
    if (slices > 1) {
      SPECULANT_DOT(4, 1, 6)
      if (pair) { SPECULANT_DOT(5, 1, 7) }
    }
    if (slices > 2) {
      SPECULANT_DOT(4, 2, 6)
      if (pair) { SPECULANT_DOT(5, 2, 7) }
    }
    if (slices > 3) {
      SPECULANT_DOT(4, 3, 6)
      if (pair) { SPECULANT_DOT(5, 3, 7) }
    }
    _tile_stored(4, scores + n * kTile, row_stride * sizeof(float));
    if (pair) _tile_stored(5, scores + (n + 1) * kTile, row_stride * sizeof(float));
  }
}
#undef SPECULANT_DOT

#define SPECULANT_PV(T, V_TILE) \
  _tile_loadd(V_TILE, vb + (T) * 2 * 16, v_stride); \
  _tile_dpbf16ps(T, 4, V_TILE);

// Value sums of one query tile over the partition's chunks (its P operands at pbuf), features
// [16 f0, 16 (f0 + nf)) (nf 2 or 4), into value_tiles[f] [16 rows][16].
void tile_values(const uint16_t* pbuf, const uint16_t* const* v_blocks, int64_t block_size,
                 int64_t D, int64_t num_chunks, int64_t f0, int64_t nf,
                 float (*value_tiles)[kTile * kTile]) {
  const int64_t v_stride = 4 * D;  // bytes between position-pair rows of a V block
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < num_chunks; ++c) {
    _tile_loadd(4, pbuf + c * kTile * kChunk, 64);
    const int64_t p = c * kChunk;
    const uint16_t* vb = v_blocks[p / block_size] + (p % block_size / 2) * 2 * D + 2 * 16 * f0;
    SPECULANT_PV(0, 6)
    SPECULANT_PV(1, 7)
    if (nf > 2) {
      SPECULANT_PV(2, 6)
      SPECULANT_PV(3, 7)
    }
  }
  _tile_stored(0, value_tiles[0], 64);
  _tile_stored(1, value_tiles[1], 64);
  if (nf > 2) {
    _tile_stored(2, value_tiles[2], 64);
    _tile_stored(3, value_tiles[3], 64);
  }
}
#undef SPECULANT_PV

}  // namespace

bool attention_partition_tiles(const float* const* q_rows, const int64_t* lengths,
                               int64_t num_queries, const uint16_t* const* k_blocks,
                               const uint16_t* const* v_blocks, int64_t n_max,
                               int64_t block_size, int64_t D, float scale, float* const* outs,
                               float* const* maxes, float* const* sums) {
  if (D % 32 != 0 || D > 32 * kMaxSlices || block_size % kChunk != 0 || num_queries <= 0 ||
      n_max <= 0) {
    return false;
  }
  const int64_t slices = D / 32;                           // 32-feature slices of a query
  const int64_t num_ptiles = (n_max + kTile - 1) / kTile;  // 16-position score tiles
  const int64_t num_chunks = (n_max + kChunk - 1) / kChunk;
  const int64_t row_stride = num_chunks * kChunk;          // a query's scores in the scratch
  const int64_t num_qtiles = (num_queries + kTile - 1) / kTile;
  const int64_t num_ftiles = D / 16;
  // scratch: query operands | one query tile's softmax numerators | its scores
  const int64_t q_elems = num_qtiles * slices * kTile * kRowBf16;
  const int64_t p_elems = num_chunks * kTile * kChunk;
  char* base = static_cast<char*>(tls_scratch.get(
      (q_elems + p_elems) * 2 + kTile * row_stride * sizeof(float)));
  uint16_t* qbuf = reinterpret_cast<uint16_t*>(base);
  uint16_t* pbuf = qbuf + q_elems;
  float* scores = reinterpret_cast<float*>(pbuf + p_elems);
  round_queries(q_rows, num_queries, num_qtiles, slices, scale, qbuf);
  configure_tiles();
  alignas(64) float value_tiles[4][kTile * kTile];
  for (int64_t qt = 0; qt < num_qtiles; ++qt) {
    const uint16_t* qa = qbuf + qt * slices * kTile * kRowBf16;  // slice s at s * 16 * 32
    _tile_loadd(0, qa, 64);
    if (slices > 1) _tile_loadd(1, qa + kTile * kRowBf16, 64);
    if (slices > 2) _tile_loadd(2, qa + 2 * kTile * kRowBf16, 64);
    if (slices > 3) _tile_loadd(3, qa + 3 * kTile * kRowBf16, 64);
    tile_scores(slices, k_blocks, v_blocks, block_size, D, num_ptiles, qt == 0, scores,
                row_stride);
    // rows past the last query keep whatever they hold: a tile row only ever meets its own row
    // of the other operand, so they change nothing that is read
    for (int64_t i = 0; i < kTile && qt * kTile + i < num_queries; ++i) {
      const int64_t j = qt * kTile + i;
      // chunk c of row i of the P operands at pbuf + c * 16 * 32 + i * 32
      *sums[j] = avx512::softmax_bf16_row(scores + i * row_stride, lengths[j], num_chunks,
                                          pbuf + i * kChunk, kTile * kChunk, maxes[j]);
    }
    for (int64_t f0 = 0; f0 < num_ftiles; f0 += 4) {
      const int64_t nf = num_ftiles - f0 < 4 ? num_ftiles - f0 : 4;  // even: D % 32 == 0
      tile_values(pbuf, v_blocks, block_size, D, num_chunks, f0, nf, value_tiles);
      avx512::copy_value_rows(value_tiles, qt, num_queries, f0, nf, outs);
    }
  }
  _tile_release();
  return true;
}

}  // namespace speculant
