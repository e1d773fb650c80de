// Block-type linear kernels on AVX-512 VNNI (vpdpbusd), over the same 8-row-interleaved weights
// as linear.cpp's AVX2 kernels (layouts there), with bit-identical results.
//
// Compiled apart with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (native.py) and called only
// when the CPU has those features (kernel_path.cpp). It includes nothing shared with the rest of
// the library but linear_blocks.h (see there why), so every helper here is file-local.
//
// Groups g and g + 1 are adjacent output columns, so one 512-bit vector holds the 16 outputs of
// a pair of groups: its lower 256 bits come from group g's 32-byte chunk, its upper 256 bits from
// group g + 1's. Every 32-bit lane holds 4 weights of one output row, so one vpdpbusd against a
// broadcast 4-byte chunk of an activation block adds 4 products to each of the 16 rows' int32
// sums (the AVX2 kernels need vpmaddubsw, an add and vpmaddwd for 8 rows).
//
// vpdpbusd multiplies unsigned by signed bytes. Q4 nibbles are unsigned already. Q8_0 weights w
// are signed, so the kernel feeds w + 128 (w ^ 0x80) and subtracts 128 * sum(x) per block: the
// activations' block sum, which linear.cpp computes anyway for Q4_0's -8 offset.
//
// Bit-identical to AVX2: a block's integer dot product is exact on both paths (|dot| < 2^21), and
// lane r then goes through the same float operations in the same order as the AVX2 kernel's lane
// r: scale = wd * xd, acc = fma(float(dot), scale, acc) (then acc = fma(wm, xd * sum(x), acc) for
// Q4_1), blocks in ascending order from acc = 0. So, as there, no output depends on the tile
// shape, on how groups are paired or on the other activation rows: batch-invariant.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../linear_blocks.h"

namespace speculant {
namespace {

constexpr int64_t kBlock = 32;  // GGML block length
constexpr int kPairTile = 2;    // pairs of groups per tile: 32 output rows
// Activation rows per tile: NP x MR int32 sums and float accumulators take 16 of the 32 vector
// registers, leaving room for the weights and the broadcasts.
constexpr int kRowTile = 4;
// Regions of more rows (on most CPUs: vnni_wide_rows() in kernel_path.h) go one pair at a time
// in tiles of up to 8 rows (acc and dot take 16 registers): each pass over the weights unpacks
// them once for 8 rows instead of 4. Regions of
// up to kFewRows rows (a verification step, c=8 with a few draft rows) take tiles of up to 12
// (24 registers): 9-12 rows in one pass, 13-20 in two. Longer regions keep tiles of 8, where 12
// spill. Measured on a Xeon with AMX at SmolLM2-135M's shapes (2 threads, weights cycled through
// 30 copies, in-process A/B), a step's products (30 layers and the LM head): tiles of 8 against
// 4, 0.895 / 0.91 / 0.93 / 0.94 / 0.94 of the time at 5 / 6 / 8 / 9 / 11 rows; on the VNNI path
// forced, tiles of up to 12 against up to 8, 0.93 / 0.975 / 0.986 at 9 / 12 / 20 rows but 1.025
// / 1.05 / 1.06 at 24 / 64 / 128.
constexpr int kWideRowTile = 8;
constexpr int kFewRowsTile = 12;
constexpr int64_t kFewRows = 20;

// int32 chains per output vector and block: with one or two rows a tile has too few independent
// vpdpbusd chains to hide their latency, so each block's sum is split in two (added at the end,
// exactly); with more rows a second chain would only spill registers.
template <int MR>
constexpr int kChains = MR <= 2 ? 2 : 1;

// The two groups of a pair. A lone last group is paired with itself: its copy in the upper half
// is computed like any lane and never stored.
struct Pair {
  int64_t lo, hi;
};

// Bytes [offset, offset + 32) of block b of both groups: [group lo | group hi].
inline __m512i load_pair(const uint8_t* w, int64_t block_bytes, int64_t nb, Pair pair, int64_t b,
                         int offset) {
  const uint8_t* lo = w + (pair.lo * nb + b) * block_bytes + offset;
  const uint8_t* hi = w + (pair.hi * nb + b) * block_bytes + offset;
  const __m256i lo_bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
  const __m256i hi_bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo_bytes), hi_bytes, 1);
}

// Block b of both groups requested into L1 ahead of use (p.prefetch_blocks ahead, when > 0). On
// some CPUs the hardware prefetchers alone leave a single-row product (the LM head at decode,
// 28 MB from DRAM) short of the memory bandwidth; on others the requests only cost issue slots
// (kernel_path.h, weight_prefetch_blocks).
inline void prefetch_pair(const uint8_t* w, int64_t block_bytes, int64_t nb, Pair pair,
                          int64_t b) {
  if (b >= nb) return;
  for (int64_t off = 0; off < block_bytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (pair.lo * nb + b) * block_bytes + off),
                 _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (pair.hi * nb + b) * block_bytes + off),
                 _MM_HINT_T0);
  }
}

// The 8 fp16 fields of block b of both groups (scales or mins), as 16 floats (exact).
inline __m512 load_pair_halves(const uint16_t* h, int64_t nb, Pair pair, int64_t b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + (pair.lo * nb + b) * 8));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + (pair.hi * nb + b) * 8));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// The 4 bytes at p, repeated in all sixteen 32-bit lanes (a broadcast load).
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc = fma(float(dot), wd * xd, acc): the AVX2 kernels' per-block step, lane for lane.
inline __m512 scale_block(__m512i dot, __m512 wd, float xd, __m512 acc) {
  const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(xd));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}

// Every kernel computes a tile of NP pairs x MR activation rows: tile<NP, MR>(pairs, m0, out)
// leaves out[n * MR + i] = the 16 outputs of pairs[n] for row m0 + i.

// Q4_0 (kHasMin = false: w = d * (q - 8)) and Q4_1 (kHasMin = true: w = d * q + m).
template <bool kHasMin>
struct Q4Pairs {
  const BlockLinear& p;

  template <int NP, int MR>
  void tile(const Pair* pairs, int64_t m0, __m512* out) const {
    const uint8_t* weight = static_cast<const uint8_t*>(p.weight);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int64_t nb = p.nb;
    const int8_t* xq = p.acts.q + m0 * nb * kBlock;
    __m512 acc[NP][MR];
    for (int n = 0; n < NP; ++n)
      for (int i = 0; i < MR; ++i) acc[n][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      constexpr int kHi = kChains<MR> - 1;  // the high nibbles' chain
      __m512i dot[NP][MR][kChains<MR>];
      for (int n = 0; n < NP; ++n)
        for (int i = 0; i < MR; ++i)
          for (int c = 0; c < kChains<MR>; ++c) dot[n][i][c] = _mm512_setzero_si512();
      if (p.prefetch_blocks > 0) {
        for (int n = 0; n < NP; ++n) prefetch_pair(weight, 128, nb, pairs[n], b + p.prefetch_blocks);
      }
      for (int v = 0; v < 4; ++v) {  // chunk v: elements 4v..4v+3 (low) and 16+4v.. (high)
        __m512i lo[NP], hi[NP];
        for (int n = 0; n < NP; ++n) {
          const __m512i w = load_pair(weight, 128, nb, pairs[n], b, 32 * v);
          lo[n] = _mm512_and_si512(w, nibble);
          hi[n] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        }
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = xq + (i * nb + b) * kBlock;
          const __m512i x_lo = broadcast4(x + 4 * v), x_hi = broadcast4(x + 16 + 4 * v);
          for (int n = 0; n < NP; ++n) {
            dot[n][i][0] = _mm512_dpbusd_epi32(dot[n][i][0], lo[n], x_lo);
            dot[n][i][kHi] = _mm512_dpbusd_epi32(dot[n][i][kHi], hi[n], x_hi);
          }
        }
      }
      for (int n = 0; n < NP; ++n) {
        const __m512 wd = load_pair_halves(p.scales, nb, pairs[n], b);
        const __m512 wm = kHasMin ? load_pair_halves(p.mins, nb, pairs[n], b) : wd;
        for (int i = 0; i < MR; ++i) {
          const int64_t xb = (m0 + i) * nb + b;  // this row's block in the activation arrays
          __m512i d = kHi ? _mm512_add_epi32(dot[n][i][0], dot[n][i][kHi]) : dot[n][i][0];
          if constexpr (!kHasMin) d = _mm512_sub_epi32(d, _mm512_set1_epi32(8 * p.acts.sum[xb]));
          acc[n][i] = scale_block(d, wd, p.acts.d[xb], acc[n][i]);
          if constexpr (kHasMin) {
            acc[n][i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(p.acts.dsum[xb]), acc[n][i]);
          }
        }
      }
    }
    for (int n = 0; n < NP; ++n)
      for (int i = 0; i < MR; ++i) out[n * MR + i] = acc[n][i];
  }
};

// Q8_0: w = d * q with signed q, fed to vpdpbusd as q + 128 (see the top of the file).
struct Q8Pairs {
  const BlockLinear& p;

  template <int NP, int MR>
  void tile(const Pair* pairs, int64_t m0, __m512* out) const {
    const uint8_t* weight = static_cast<const uint8_t*>(p.weight);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // w ^ 0x80 = w + 128 as u8
    const int64_t nb = p.nb;
    const int8_t* xq = p.acts.q + m0 * nb * kBlock;
    __m512 acc[NP][MR];
    for (int n = 0; n < NP; ++n)
      for (int i = 0; i < MR; ++i) acc[n][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i dot[NP][MR][kChains<MR>];  // even and odd chunks, when split
      for (int n = 0; n < NP; ++n)
        for (int i = 0; i < MR; ++i)
          for (int c = 0; c < kChains<MR>; ++c) dot[n][i][c] = _mm512_setzero_si512();
      if (p.prefetch_blocks > 0) {
        for (int n = 0; n < NP; ++n) prefetch_pair(weight, 256, nb, pairs[n], b + p.prefetch_blocks);
      }
      for (int c = 0; c < 8; ++c) {  // chunk c: elements 4c..4c+3
        __m512i w[NP];
        for (int n = 0; n < NP; ++n) {
          w[n] = _mm512_xor_si512(load_pair(weight, 256, nb, pairs[n], b, 32 * c), flip);
        }
        for (int i = 0; i < MR; ++i) {
          const __m512i x = broadcast4(xq + (i * nb + b) * kBlock + 4 * c);
          for (int n = 0; n < NP; ++n) {
            __m512i& chain = dot[n][i][c % kChains<MR>];
            chain = _mm512_dpbusd_epi32(chain, w[n], x);
          }
        }
      }
      for (int n = 0; n < NP; ++n) {
        const __m512 wd = load_pair_halves(p.scales, nb, pairs[n], b);
        for (int i = 0; i < MR; ++i) {
          const int64_t xb = (m0 + i) * nb + b;
          const __m512i sum =
              kChains<MR> == 2 ? _mm512_add_epi32(dot[n][i][0], dot[n][i][1]) : dot[n][i][0];
          const __m512i d = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * p.acts.sum[xb]));
          acc[n][i] = scale_block(d, wd, p.acts.d[xb], acc[n][i]);
        }
      }
    }
    for (int n = 0; n < NP; ++n)
      for (int i = 0; i < MR; ++i) out[n * MR + i] = acc[n][i];
  }
};

// Stores the tile's rows: pair n covers columns 8 * lo .. 8 * lo + 15 (only the first 8 for a
// lone group), clipped to N.
template <int NP, int MR, typename Kernel>
void tile_and_store(const Kernel& kernel, const Pair* pairs, int64_t m0, int64_t N, float* out) {
  __m512 acc[NP * MR];
  kernel.template tile<NP, MR>(pairs, m0, acc);
  for (int n = 0; n < NP; ++n) {
    const int64_t n0 = pairs[n].lo * 8;
    const int64_t width = pairs[n].hi == pairs[n].lo ? 8 : 16;
    const int64_t cols = N - n0 < width ? N - n0 : width;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    for (int i = 0; i < MR; ++i) {
      _mm512_mask_storeu_ps(out + (m0 + i) * N + n0, mask, acc[n * MR + i]);
    }
  }
}

// Rows [m_begin, m_end) against NP pairs, in row tiles of kRowTile and a remainder.
template <int NP, typename Kernel>
void run_rows(const Kernel& kernel, const Pair* pairs, int64_t m_begin, int64_t m_end, int64_t N,
              float* out) {
  int64_t m = m_begin;
  for (; m + kRowTile <= m_end; m += kRowTile) {
    tile_and_store<NP, kRowTile>(kernel, pairs, m, N, out);
  }
  switch (m_end - m) {
    case 3: tile_and_store<NP, 3>(kernel, pairs, m, N, out); break;
    case 2: tile_and_store<NP, 2>(kernel, pairs, m, N, out); break;
    case 1: tile_and_store<NP, 1>(kernel, pairs, m, N, out); break;
    default: break;
  }
}

// Rows [m_begin, m_end) against one pair, in the fewest row tiles of at most kFewRowsTile rows
// (kWideRowTile for more than kFewRows), of sizes as equal as they go (13 rows: 6 + 7, not 12 +
// 1: a tile of few rows pays a whole pass over the weights for them).
template <typename Kernel>
void run_wide_rows(const Kernel& kernel, const Pair* pair, int64_t m_begin, int64_t m_end,
                   int64_t N, float* out) {
  const int64_t most = m_end - m_begin <= kFewRows ? kFewRowsTile : kWideRowTile;
  const int64_t num_tiles = (m_end - m_begin + most - 1) / most;
  int64_t m = m_begin;
  for (int64_t left = num_tiles; left > 0; --left) {
    const int64_t rows = (m_end - m) / left;
    switch (rows) {
      case 12: tile_and_store<1, 12>(kernel, pair, m, N, out); break;
      case 11: tile_and_store<1, 11>(kernel, pair, m, N, out); break;
      case 10: tile_and_store<1, 10>(kernel, pair, m, N, out); break;
      case 9: tile_and_store<1, 9>(kernel, pair, m, N, out); break;
      case 8: tile_and_store<1, 8>(kernel, pair, m, N, out); break;
      case 7: tile_and_store<1, 7>(kernel, pair, m, N, out); break;
      case 6: tile_and_store<1, 6>(kernel, pair, m, N, out); break;
      case 5: tile_and_store<1, 5>(kernel, pair, m, N, out); break;
      case 4: tile_and_store<1, 4>(kernel, pair, m, N, out); break;
      case 3: tile_and_store<1, 3>(kernel, pair, m, N, out); break;
      case 2: tile_and_store<1, 2>(kernel, pair, m, N, out); break;
      default: tile_and_store<1, 1>(kernel, pair, m, N, out); break;
    }
    m += rows;
  }
}

// Groups [g0, g1) kPairTile pairs at a time (one pair at a time in wide row tiles when the
// region has at least p.wide_rows rows: vnni_wide_rows() in kernel_path.h says why that varies
// by CPU), each tile against all rows of the region, so its weights come from memory once and
// then from L1.
template <typename Kernel>
void run_region(const Kernel& kernel, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  static_assert(kPairTile == 2, "the loop below handles a partial tile of one pair");
  if (m1 - m0 >= kernel.p.wide_rows) {
    for (int64_t lo = g0; lo < g1; lo += 2) {
      const Pair pair{lo, lo + 1 < g1 ? lo + 1 : lo};
      run_wide_rows(kernel, &pair, m0, m1, kernel.p.N, kernel.p.out);
    }
    return;
  }
  for (int64_t g = g0; g < g1; g += 2 * kPairTile) {
    Pair pairs[kPairTile];
    int np = 0;
    for (int64_t lo = g; np < kPairTile && lo < g1; lo += 2) {
      pairs[np++] = Pair{lo, lo + 1 < g1 ? lo + 1 : lo};
    }
    if (np == kPairTile) {
      run_rows<kPairTile>(kernel, pairs, m0, m1, kernel.p.N, kernel.p.out);
    } else {
      run_rows<1>(kernel, pairs, m0, m1, kernel.p.N, kernel.p.out);
    }
  }
}

}  // namespace

void linear_q4_0_avx512_vnni(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0,
                             int64_t m1) {
  run_region(Q4Pairs<false>{p}, g0, g1, m0, m1);
}

void linear_q4_1_avx512_vnni(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0,
                             int64_t m1) {
  run_region(Q4Pairs<true>{p}, g0, g1, m0, m1);
}

void linear_q8_0_avx512_vnni(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0,
                             int64_t m1) {
  run_region(Q8Pairs{p}, g0, g1, m0, m1);
}

}  // namespace speculant
