// Block-type linear kernels on AMX-INT8 (tdpbssd / tdpbsud), over the same 8-row-interleaved
// weights as linear.cpp's AVX2 kernels (layouts there), with bit-identical results.
//
// Compiled apart with the AVX-512 and AMX flags (native.py) and called only when the CPU has
// AMX-INT8 and the OS let this process use the tile registers (kernel_path.cpp). Like
// linear_vnni.cpp it includes nothing shared with the rest of the library but linear_blocks.h.
//
// Shapes. Every GGML block (32 input features) needs its own integer dot product, because its
// scales differ, so a tile product spans K = 32. Output columns come in pairs of groups (16
// columns): the B operand of block b is 8 rows of 64 bytes, row k holding input features
// 4k..4k+3 of each of the 16 columns, i.e. [group lo's chunk k | group hi's chunk k]. The
// weights are stored a group at a time, so a pair's blocks are first laid out that way in a
// buffer (a copy for Q8_0; for Q4 the nibbles are unpacked on the way: low nibbles are chunks
// 0-3, high nibbles chunks 4-7), a span of blocks at a time, then serve every row tile. The A
// operand is up to 16 activation rows of one block (32 bytes each, stride K); C is their exact
// int32 dots with the 16 columns.
//
// Epilogue. There is no move from a tile to a vector register, so C goes through a small buffer;
// then, lane for lane, what the AVX2 kernel does: scale = wd * xd, acc = fma(float(dot), scale,
// acc) (then acc = fma(wm, xd * sum(x), acc) for Q4_1), blocks in ascending order from acc = 0,
// the accumulators of a row tile in registers. The integer dots are the same integers as on the
// AVX2 path (Q4_0's are sum((q - 8) * x) here, sum(q * x) - 8 * sum(x) there), so outputs are
// bit-identical to it and, as there, independent of how rows are tiled: batch-invariant. While
// block b's epilogue runs, block b + 1's tile product is already issued (two sets of A and C
// tiles).
//
// Few rows do not pay for a tile product: they run the VNNI kernel (bit-identical too), so plain
// decode keeps the VNNI path's speed (see run_region).
//
// Tile state is per thread: every call loads its own configuration (ldtilecfg) and releases the
// tiles at the end, so it runs on any thread of the pool or of torch's OpenMP team, and whatever
// else used the tiles there in between (oneDNN, say) does not matter.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../linear_blocks.h"
#include "tile_config.h"

namespace speculant {
namespace {

constexpr int64_t kBlock = 32;         // GGML block length
constexpr int kTileRows = 16;          // activation rows per tile product
constexpr int64_t kPairBytes = 512;    // one block of a pair as a B operand: 8 rows x 64 bytes
constexpr int64_t kSpanBlocks = 64;    // blocks laid out at a time (32 KB, stays in L1/L2)
constexpr int64_t kMaxRows = 128;      // rows whose accumulators wait between spans

using avx512::TileConfig;

// Tile registers: 0-1 the activation block (two sets), 2 the weight block of the set 0, 3 of
// set 1, 4-5 the dots. The intrinsics take literal register numbers.
// A: `rows` x 32 bytes; B: 8 x 64 bytes (K = 32 features x 16 columns); C: `rows` x 16 int32.
void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) {
    cfg.colsb[t] = kBlock;
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  for (int t = 2; t < 4; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kBlock / 4;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.colsb[t] = 16 * sizeof(int32_t);
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  _tile_loadconfig(&cfg);
}

enum class Kind { kQ4_0, kQ4_1, kQ8_0 };

// Blocks [b0, b0 + n) of groups lo and hi as B operands: out + 512 * j holds block b0 + j.
template <Kind kKind>
void lay_out_pair(const BlockLinear& p, int64_t lo, int64_t hi, int64_t b0, int64_t n,
                  uint8_t* out) {
  if constexpr (kKind == Kind::kQ8_0) {
    const uint8_t* w = static_cast<const uint8_t*>(p.weight);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* wl = w + (lo * p.nb + b0 + j) * 256;
      const uint8_t* wh = w + (hi * p.nb + b0 + j) * 256;
      uint8_t* dst = out + kPairBytes * j;
      for (int c = 0; c < 8; ++c) {
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wl + 32 * c));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + 32 * c));
        _mm512_store_si512(dst + 64 * c, _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1));
      }
    }
  } else {
    const uint8_t* w = static_cast<const uint8_t*>(p.weight);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i offset = _mm256_set1_epi8(kKind == Kind::kQ4_0 ? 8 : 0);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* wl = w + (lo * p.nb + b0 + j) * 128;
      const uint8_t* wh = w + (hi * p.nb + b0 + j) * 128;
      uint8_t* dst = out + kPairBytes * j;
      for (int v = 0; v < 4; ++v) {  // chunk v: low nibbles = row v, high nibbles = row 4 + v
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wl + 32 * v));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + 32 * v));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
        const __m512i nib = _mm512_broadcast_i64x4(nibble);
        const __m512i off = _mm512_broadcast_i64x4(offset);
        const __m512i low = _mm512_sub_epi8(_mm512_and_si512(both, nib), off);
        const __m512i high = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(both, 4), nib),
                                             off);
        _mm512_store_si512(dst + 64 * v, low);
        _mm512_store_si512(dst + 64 * (4 + v), high);
      }
    }
  }
}

// The 8 fp16 fields of block b of both groups (scales or mins), as 16 floats (exact).
inline __m512 load_pair_halves(const uint16_t* h, int64_t nb, int64_t lo, int64_t hi,
                               int64_t b) {
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + (lo * nb + b) * 8));
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + (hi * nb + b) * 8));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(l), u, 1));
}

// Issues block b's tile product for rows [m, m + MR) on set kSet (A tile kSet, B tile 2 + kSet,
// C tile 4 + kSet) from the laid-out weight block `wb`.
template <Kind kKind, int kSet>
inline void issue_dots(const int8_t* a, int64_t K, const uint8_t* wb) {
  if constexpr (kSet == 0) {
    _tile_loadd(0, a, K);
    _tile_loadd(2, wb, 64);
    _tile_zero(4);
    if constexpr (kKind == Kind::kQ4_1) {
      _tile_dpbsud(4, 0, 2);  // unsigned weights
    } else {
      _tile_dpbssd(4, 0, 2);
    }
  } else {
    _tile_loadd(1, a, K);
    _tile_loadd(3, wb, 64);
    _tile_zero(5);
    if constexpr (kKind == Kind::kQ4_1) {
      _tile_dpbsud(5, 1, 3);
    } else {
      _tile_dpbssd(5, 1, 3);
    }
  }
}

template <int kSet>
inline void store_dots(int32_t* dot) {
  if constexpr (kSet == 0) {
    _tile_stored(4, dot, 64);
  } else {
    _tile_stored(5, dot, 64);
  }
}

// A pair of groups against a tile of MR activation rows starting at m, of which the first
// `rows` are wanted (a region's last tile may be partial: the tile still loads MR rows, which
// the activations' padding holds, and only `rows` are read back), over one span of blocks.
template <Kind kKind, int MR>
struct RowTile {
  const BlockLinear& p;
  int64_t lo, hi, m;
  int rows;

  // acc += blocks [b0, b0 + n) (laid out in `span`); dot: two [MR, 16] int32 buffers. Block j's
  // dots are stored while block j + 1's product runs, and read back one block later still: a
  // vector load right after a tile store of the same bytes waits for the store to complete.
  void accumulate(int64_t b0, int64_t n, const uint8_t* span, int32_t* dot, __m512* acc) const {
    const int64_t K = p.nb * kBlock;
    const int8_t* a = p.acts.q + m * K + b0 * kBlock;
    issue_dots<kKind, 0>(a, K, span);
    for (int64_t j = 0; j < n; ++j) {
      int32_t* d = dot + (j & 1) * MR * 16;
      const bool next = j + 1 < n;
      if (j & 1) {
        store_dots<1>(d);
        if (next) issue_dots<kKind, 0>(a + (j + 1) * kBlock, K, span + kPairBytes * (j + 1));
      } else {
        store_dots<0>(d);
        if (next) issue_dots<kKind, 1>(a + (j + 1) * kBlock, K, span + kPairBytes * (j + 1));
      }
      if (j > 0) epilogue(b0 + j - 1, dot + ((j - 1) & 1) * MR * 16, acc);
    }
    epilogue(b0 + n - 1, dot + ((n - 1) & 1) * MR * 16, acc);
  }

  void epilogue(int64_t b, const int32_t* d, __m512* acc) const {
    const __m512 wd = load_pair_halves(p.scales, p.nb, lo, hi, b);
    __m512 wm = wd;
    if constexpr (kKind == Kind::kQ4_1) wm = load_pair_halves(p.mins, p.nb, lo, hi, b);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      if (i < rows) {
        const int64_t xb = (m + i) * p.nb + b;  // this row's block in the activation arrays
        const __m512 s = _mm512_mul_ps(wd, _mm512_set1_ps(p.acts.d[xb]));
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(d + 16 * i));
        acc[i] = _mm512_fmadd_ps(dot, s, acc[i]);
        if constexpr (kKind == Kind::kQ4_1) {
          acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(p.acts.dsum[xb]), acc[i]);
        }
      }
    }
  }
};

// One pair (lo, hi: output columns 8 lo .. 8 lo + 15; a lone last group is paired with itself
// and its copy is never stored) against activation rows [m0, m1) in row tiles of MR, the last
// one possibly partial. `saved` keeps the accumulators of every row between spans.
template <Kind kKind, int MR>
void run_pair(const BlockLinear& p, int64_t lo, int64_t hi, int64_t m0, int64_t m1,
              uint8_t* span, int32_t* dot, float* saved) {
  for (int64_t b0 = 0; b0 < p.nb; b0 += kSpanBlocks) {
    const int64_t n = p.nb - b0 < kSpanBlocks ? p.nb - b0 : kSpanBlocks;
    const bool first = b0 == 0, last = b0 + n == p.nb;
    lay_out_pair<kKind>(p, lo, hi, b0, n, span);
    for (int64_t start = m0; start < m1; start += MR) {
      const int rows = m1 - start < MR ? static_cast<int>(m1 - start) : MR;
      __m512 acc[MR];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        acc[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(saved + 16 * (start - m0 + i));
      }
      RowTile<kKind, MR>{p, lo, hi, start, rows}.accumulate(b0, n, span, dot, acc);
      if (!last) {
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) _mm512_store_ps(saved + 16 * (start - m0 + i), acc[i]);
        continue;
      }
      const int64_t n0 = lo * 8;
      const int64_t width = hi == lo ? 8 : 16;
      const int64_t cols = p.N - n0 < width ? p.N - n0 : width;
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        if (i < rows) _mm512_mask_storeu_ps(p.out + (start + i) * p.N + n0, mask, acc[i]);
      }
    }
  }
}

template <Kind kKind, int MR>
void run_pairs(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  configure_tiles(MR);
  alignas(64) uint8_t span[kSpanBlocks * kPairBytes];
  alignas(64) int32_t dot[2 * MR * 16];
  alignas(64) float saved[kMaxRows * 16];
  for (int64_t lo = g0; lo < g1; lo += 2) {
    const int64_t hi = lo + 1 < g1 ? lo + 1 : lo;
    run_pair<kKind, MR>(p, lo, hi, m0, m1, span, dot, saved);
  }
  _tile_release();
}

using VnniFn = void (*)(const BlockLinear&, int64_t, int64_t, int64_t, int64_t);

// Which rows run on the tiles. A tile product's fixed cost (the weight layout, the tile loads,
// the store of C) is paid per block whatever the rows, so few rows run the VNNI kernel (bit-
// identical too): a decode step, most verification chunks of one sequence. Rows past the last
// whole 16-row tile make a partial tile over the same weight layout when there are at least
// kMinTailRows of them; fewer are cheaper on VNNI. A matrix too large for the caches (an LM
// head) takes partial tiles from kMinStreamedRows rows on and for any tail: a VNNI pass reads
// all of its weights from DRAM again. Measured on a Xeon with AMX (SmolLM2-135M's shapes,
// weights cycled through 30 copies, 2 threads, in-process A/B; tiles / VNNI for those rows):
// the LM head 0.82 / 0.78 at 12 / 14 rows, 0.80 with a tail of 1-3 rows, 0.73-0.75 with one of
// 6-8; the layers' matrices 1.01-1.15 at 12-13 rows, a wash at 14, 0.89-0.98 with a tail of 6
// and 0.83-0.96 with one of 8.
constexpr int64_t kMinTailRows = 6;
constexpr int64_t kMinStreamedRows = 12;
constexpr int64_t kStreamedBytes = 8 << 20;  // weights beyond what L2 and a share of L3 keep

template <Kind kKind>
void run_region(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1,
                VnniFn vnni) {
  constexpr int64_t kGroupBlockBytes = kKind == Kind::kQ8_0 ? 256 : 128;  // 8 rows x 32 weights
  const bool streamed = (p.N + 7) / 8 * p.nb * kGroupBlockBytes >= kStreamedBytes;
  if (m1 - m0 < (streamed ? kMinStreamedRows : kTileRows)) {
    vnni(p, g0, g1, m0, m1);
    return;
  }
  const int64_t whole_end = m0 + (m1 - m0) / kTileRows * kTileRows;
  const int64_t tiled_end = m1 - whole_end >= kMinTailRows || streamed ? m1 : whole_end;
  for (int64_t m = m0; m < tiled_end; m += kMaxRows) {  // `saved` holds kMaxRows rows
    run_pairs<kKind, kTileRows>(p, g0, g1, m, m + kMaxRows < tiled_end ? m + kMaxRows : tiled_end);
  }
  if (tiled_end < m1) vnni(p, g0, g1, tiled_end, m1);
}

}  // namespace

void linear_q4_0_amx_int8(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  run_region<Kind::kQ4_0>(p, g0, g1, m0, m1, linear_q4_0_avx512_vnni);
}

void linear_q4_1_amx_int8(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  run_region<Kind::kQ4_1>(p, g0, g1, m0, m1, linear_q4_1_avx512_vnni);
}

void linear_q8_0_amx_int8(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  run_region<Kind::kQ8_0>(p, g0, g1, m0, m1, linear_q8_0_avx512_vnni);
}

}  // namespace speculant
