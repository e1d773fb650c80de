// Batch-invariant linear kernels over 8-row-interleaved weights (AVX2 / FMA / F16C), and the
// dispatch of the block types to the active kernel path's kernels (kernel_path.h).
//
// Weight layouts, with G = ceil(out_features / 8) groups of 8 output rows (the last group padded
// with zero rows) and nb = in_features / 32 blocks per row:
//   Q4_0, Q4_1  weight uint8 [G, nb, 128]: four 32-byte chunks v, each holding for row r = 0..7
//               the GGML bytes 4v..4v+3 of that row's block (low nibbles = elements 4v..4v+3,
//               high nibbles = elements 16+4v..19+4v); scales (and Q4_1 mins) fp16 [G, nb, 8]
//   Q8_0        weight int8 [G, nb, 256]: eight chunks c, row r holding elements 4c..4c+3;
//               scales fp16 [G, nb, 8]
//   F32, F16    weight [G, in_features, 8]: for each input feature, the 8 rows side by side
// Because every 32-bit lane holds 4 weights of one row, one vpmaddubsw against a broadcast 4-byte
// chunk of the activation block yields partial dots of all 8 rows at once, with no horizontal
// reduction; the 8 fp16 scales of a block convert in one vcvtph2ps.
//
// Activations are quantized on the fly, row by row, to int8 blocks of 32 with an fp32 scale and
// the block's integer sum (Q8_1-style: it carries Q4_0's -8 offset and Q4_1's min term).
//
// Batch invariance: one output element accumulates its blocks (or, for F32/F16, its even and odd
// input features) in ascending order with the same instruction sequence whatever M or the row
// tile is. Row i of the output is therefore bit-identical however many rows are computed with it,
// and at whatever position.
//
// Kernel paths: the block types (Q4_0, Q4_1, Q8_0) run on the active path's kernels, AVX2 here,
// AVX-512 VNNI (avx512/linear_vnni.cpp) or AMX-INT8 (avx512/linear_amx.cpp, whole 16-row tiles
// on the tile unit, the rest on VNNI), which compute every block's exact integer dot product and
// then the same float operations in the same order, so all paths give bit-identical outputs.
// F32 / F16 weights always run the AVX2 FMA kernel below.
#include "ops.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "argmax.h"
#include "kernel_path.h"
#include "linear_blocks.h"
#include "pool.h"
#include "scratch.h"
#include "simd.h"

namespace speculant {
namespace {

constexpr int64_t kBlock = 32;  // GGML block length

// One activation matrix quantized block by block (per row, so rows never influence each other).
struct QuantizedActs {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> d;     // [M, nb] block scale: x ~= d * q
  std::vector<float> dsum;  // [M, nb] d * sum(q), Q4_1's min term
  std::vector<int32_t> sum;  // [M, nb] sum(q), Q4_0's offset term
};

// An empty asm that claims to modify v: the integer sums then accumulate in program order in a
// register. Without it GCC computes all products of a block first and spills them to the stack.
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* dsum, int32_t* sum) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    }
    const float max_abs = hmax(amax);
    const float scale = max_abs / 127.0f;
    const __m256 inv = _mm256_set1_ps(max_abs != 0.0f ? 127.0f / max_abs : 0.0f);
    __m256i iv[4];
    for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // to even
    const int32_t block_sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]),
                                                        _mm256_add_epi32(iv[2], iv[3])));
    // packs interleave 128-bit lanes; the permute puts the 32 bytes back in element order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                              _mm256_packs_epi32(iv[2], iv[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(packed, order));
    d[b] = scale;
    dsum[b] = scale * static_cast<float>(block_sum);
    sum[b] = block_sum;
  }
}

void quantize_acts(const float* x, int64_t M, int64_t K, QuantizedActs& a) {
  const int64_t nb = K / kBlock;
  // Room for M rounded up to whole 16-row tiles: the AMX kernel loads a region's last, partial
  // tile whole and reads back only its own rows (linear_blocks.h, ActsView).
  ensure_size(a.q, (M + kActsRowPad - 1) / kActsRowPad * kActsRowPad * K);
  ensure_size(a.d, M * nb);
  ensure_size(a.dsum, M * nb);
  ensure_size(a.sum, M * nb);
  parallel_for(M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(x + m * K, nb, a.q.data() + m * K, a.d.data() + m * nb,
                   a.dsum.data() + m * nb, a.sum.data() + m * nb);
    }
  });
}

// The `bytes` at p requested into L1, a cache line at a time (weights p.prefetch_blocks ahead of
// use, when > 0: weight_prefetch_blocks() in kernel_path.h says why it varies by CPU). A request
// past the group's last block reaches the next group's first, which the next tile reads; one
// past the array's end is a hint the CPU drops. Never changes results.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
  }
}

// Every kernel computes a tile of NG weight groups (8 NG output rows) x MR activation rows:
// tile<NG, MR>(g, m0, out) leaves out[n * MR + i] = the 8 outputs of group g + n for row m0 + i.
// Loaded weights serve MR rows and each activation broadcast serves NG groups; kGroupTile x
// kRowTile is the largest tile that fits the 16 vector registers. Each (group, row) pair runs the
// same instruction sequence in every tile shape: results never depend on NG or MR.

// Q4_0 (kHasMin = false: w = d * (q - 8)) and Q4_1 (kHasMin = true: w = d * q + m).
template <bool kHasMin>
struct Q4Kernel {
  const uint8_t* weight;   // [G, nb, 128]
  const uint16_t* scales;  // [G, nb, 8] fp16
  const uint16_t* mins;    // [G, nb, 8] fp16, Q4_1 only
  ActsView acts;
  int64_t nb;
  int64_t prefetch_blocks;  // weight blocks requested ahead of use (0: none)
  static constexpr int kGroupTile = 2, kRowTile = 3;

  template <int NG, int MR>
  void tile(int64_t g, int64_t m0, __m256* out) const {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t nb = this->nb;
    const int8_t* xq = acts.q + m0 * nb * kBlock;
    __m256 acc[NG][MR];
    for (int n = 0; n < NG; ++n)
      for (int i = 0; i < MR; ++i) acc[n][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if (prefetch_blocks > 0) {
        for (int n = 0; n < NG; ++n) {
          const int64_t ahead = (g + n) * nb + b + prefetch_blocks;
          prefetch_bytes(weight + ahead * 128, 128);
          prefetch_bytes(scales + ahead * 8, 16);
          if constexpr (kHasMin) prefetch_bytes(mins + ahead * 8, 16);
        }
      }
      // 4-bit x int8 products summed in int16: at most 8 * 2 * 15 * 127 = 30480, no overflow
      __m256i sums[NG][MR];
      for (int v = 0; v < 4; ++v) {
        __m256i lo[NG], hi[NG];
        for (int n = 0; n < NG; ++n) {
          const uint8_t* wq = weight + ((g + n) * nb + b) * 128 + 32 * v;
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
          lo[n] = _mm256_and_si256(w, nibble);
          hi[n] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        }
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = xq + (i * nb + b) * kBlock;
          const __m256i x_lo = broadcast4(x, v), x_hi = broadcast4(x, v + 4);
          for (int n = 0; n < NG; ++n) {
            const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo[n], x_lo),
                                               _mm256_maddubs_epi16(hi[n], x_hi));
            sums[n][i] = v == 0 ? s : _mm256_add_epi16(sums[n][i], s);
            keep_in_register(sums[n][i]);
          }
        }
      }
      for (int n = 0; n < NG; ++n) {
        const int64_t gb = (g + n) * nb + b;
        const __m256 wd = load8(scales + gb * 8);
        const __m256 wm = kHasMin ? load8(mins + gb * 8) : wd;
        for (int i = 0; i < MR; ++i) {
          const int64_t xb = (m0 + i) * nb + b;  // this row's block in the activation arrays
          __m256i dot = _mm256_madd_epi16(sums[n][i], ones);  // [8 rows] int32
          if constexpr (!kHasMin) {
            dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * acts.sum[xb]));
          }
          const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(acts.d[xb]));
          acc[n][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[n][i]);
          if constexpr (kHasMin) {
            acc[n][i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(acts.dsum[xb]), acc[n][i]);
          }
        }
      }
    }
    for (int n = 0; n < NG; ++n)
      for (int i = 0; i < MR; ++i) out[n * MR + i] = acc[n][i];
  }
};

// Q8_0: w = d * q with signed q; vpmaddubsw needs one unsigned operand, so it multiplies |w| by
// x carrying w's sign (each int16 pair sum stays within 2 * 128 * 127).
struct Q8Kernel {
  const int8_t* weight;    // [G, nb, 256]
  const uint16_t* scales;  // [G, nb, 8] fp16
  ActsView acts;
  int64_t nb;
  int64_t prefetch_blocks;  // weight blocks requested ahead of use (0: none)
  static constexpr int kGroupTile = 2, kRowTile = 3;

  template <int NG, int MR>
  void tile(int64_t g, int64_t m0, __m256* out) const {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t nb = this->nb;
    const int8_t* xq = acts.q + m0 * nb * kBlock;
    __m256 acc[NG][MR];
    for (int n = 0; n < NG; ++n)
      for (int i = 0; i < MR; ++i) acc[n][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i dot[NG][MR];
      for (int n = 0; n < NG; ++n)
        for (int i = 0; i < MR; ++i) dot[n][i] = _mm256_setzero_si256();
      if (prefetch_blocks > 0) {
        for (int n = 0; n < NG; ++n) {
          const int64_t ahead = (g + n) * nb + b + prefetch_blocks;
          prefetch_bytes(weight + ahead * 256, 256);
          prefetch_bytes(scales + ahead * 8, 16);
        }
      }
      for (int c = 0; c < 8; ++c) {
        __m256i w[NG], w_abs[NG];
        for (int n = 0; n < NG; ++n) {
          const int8_t* wq = weight + ((g + n) * nb + b) * 256 + 32 * c;
          w[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
          w_abs[n] = _mm256_abs_epi8(w[n]);
        }
        for (int i = 0; i < MR; ++i) {
          const __m256i x = broadcast4(xq + (i * nb + b) * kBlock, c);
          for (int n = 0; n < NG; ++n) {
            const __m256i p = _mm256_maddubs_epi16(w_abs[n], _mm256_sign_epi8(x, w[n]));
            dot[n][i] = _mm256_add_epi32(dot[n][i], _mm256_madd_epi16(p, ones));
            keep_in_register(dot[n][i]);
          }
        }
      }
      for (int n = 0; n < NG; ++n) {
        const __m256 wd = load8(scales + ((g + n) * nb + b) * 8);
        for (int i = 0; i < MR; ++i) {
          const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(acts.d[(m0 + i) * nb + b]));
          acc[n][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[n][i]), scale, acc[n][i]);
        }
      }
    }
    for (int n = 0; n < NG; ++n)
      for (int i = 0; i < MR; ++i) out[n * MR + i] = acc[n][i];
  }
};

// F32 / F16 weights against fp32 activations: two FMA chains (even and odd input features) per
// output vector, added once at the end.
template <typename T>
struct FloatKernel {
  const T* weight;  // [G, K, 8]
  const float* x;   // [M, K]
  int64_t K;
  int64_t prefetch_blocks = 0;  // unused: float weights stream without requests
  static constexpr int kGroupTile = 1, kRowTile = 4;

  template <int NG, int MR>
  void tile(int64_t g, int64_t m0, __m256* out) const {
    const int64_t K = this->K;
    const float* xr = x + m0 * K;
    __m256 even[NG][MR], odd[NG][MR];
    for (int n = 0; n < NG; ++n)
      for (int i = 0; i < MR; ++i) even[n][i] = odd[n][i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      __m256 w0[NG], w1[NG];
      for (int n = 0; n < NG; ++n) {
        w0[n] = load8(weight + ((g + n) * K + k) * 8);
        w1[n] = load8(weight + ((g + n) * K + k + 1) * 8);
      }
      for (int i = 0; i < MR; ++i) {
        const __m256 x0 = _mm256_set1_ps(xr[i * K + k]), x1 = _mm256_set1_ps(xr[i * K + k + 1]);
        for (int n = 0; n < NG; ++n) {
          even[n][i] = _mm256_fmadd_ps(w0[n], x0, even[n][i]);
          odd[n][i] = _mm256_fmadd_ps(w1[n], x1, odd[n][i]);
        }
      }
    }
    if (k < K) {
      for (int n = 0; n < NG; ++n) {
        const __m256 w0 = load8(weight + ((g + n) * K + k) * 8);
        for (int i = 0; i < MR; ++i) {
          even[n][i] = _mm256_fmadd_ps(w0, _mm256_set1_ps(xr[i * K + k]), even[n][i]);
        }
      }
    }
    for (int n = 0; n < NG; ++n)
      for (int i = 0; i < MR; ++i) out[n * MR + i] = _mm256_add_ps(even[n][i], odd[n][i]);
  }
};

template <int NG, int MR, typename Kernel>
void tile_and_store(const Kernel& kernel, int64_t g, int64_t m0, int64_t N, float* out) {
  __m256 acc[NG * MR];
  kernel.template tile<NG, MR>(g, m0, acc);
  for (int n = 0; n < NG; ++n) {
    const int64_t n0 = (g + n) * 8;
    for (int i = 0; i < MR; ++i) {
      float* dst = out + (m0 + i) * N + n0;
      if (n0 + 8 <= N) {
        _mm256_storeu_ps(dst, acc[n * MR + i]);
      } else {  // last group: only the rows that exist
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, acc[n * MR + i]);
        std::copy(tmp, tmp + (N - n0), dst);
      }
    }
  }
}

// Rows [m_begin, m_end) against NG groups starting at g, in row tiles of kRowTile and a remainder.
template <int NG, typename Kernel>
void run_groups(const Kernel& kernel, int64_t g, int64_t m_begin, int64_t m_end, int64_t N,
                float* out) {
  constexpr int kRowTile = Kernel::kRowTile;
  // Only the first row tile requests weights ahead: the later ones find them in L1 (requested
  // by every tile, prefill of 512 tokens ran 10% slower on a Zen 1 EPYC).
  Kernel later = kernel;
  later.prefetch_blocks = 0;
  int64_t m = m_begin;
  for (; m + kRowTile <= m_end; m += kRowTile) {
    tile_and_store<NG, kRowTile>(m == m_begin ? kernel : later, g, m, N, out);
  }
  const Kernel& rest = m == m_begin ? kernel : later;
  switch (m_end - m) {
    case 3: tile_and_store<NG, 3>(rest, g, m, N, out); break;
    case 2: tile_and_store<NG, 2>(rest, g, m, N, out); break;
    case 1: tile_and_store<NG, 1>(rest, g, m, N, out); break;
    default: break;
  }
}

// Weight groups [g0, g1) kGroupTile at a time, each against all rows [m0, m1), so its weights
// come from memory once and then from L1.
template <typename Kernel>
void run_region(const Kernel& kernel, int64_t g0, int64_t g1, int64_t m0, int64_t m1, int64_t N,
                float* out) {
  constexpr int kGroupTile = Kernel::kGroupTile;
  int64_t g = g0;
  for (; g + kGroupTile <= g1; g += kGroupTile) run_groups<kGroupTile>(kernel, g, m0, m1, N, out);
  for (; g < g1; ++g) run_groups<1>(kernel, g, m0, m1, N, out);
}

// Each output row's argmax (torch.argmax's answer: the first maximum, or the first NaN), found
// while the linear kernels write the row: the thread that computed a chunk of output columns
// scans them at once, from its cache, and the chunks' picks combine in column order (the first
// chunk holding a NaN gives its first NaN; otherwise the largest value, the earliest chunk on
// ties), which is the whole row's argmax however the columns were split. Why: the LM head's
// logits read again by a separate argmax took ~38 us a step at c=1 and ~74 us at c=8 inside the
// engine (Intel Xeon with AMX, 2 threads; ~9 us a row in a loop), 1.2-1.4% of plain decoding.
class RowArgmax {
 public:
  RowArgmax(const float* out, int64_t N, int64_t* index) : out_(out), N_(N), index_(index) {}

  // A pass over rows [m0, m1) whose weight groups go out in chunks of `chunk` groups.
  void begin_pass(int64_t m0, int64_t m1, int64_t num_groups, int64_t chunk) {
    m0_ = m0;
    rows_ = m1 - m0;
    chunk_ = chunk;
    num_chunks_ = (num_groups + chunk - 1) / chunk;
    picks_.assign(num_chunks_ * rows_, Pick{});
  }

  // Output columns of groups [g0, g1) are written for the pass's rows (a call may cover
  // several chunks: each keeps its own pick).
  void computed(int64_t g0, int64_t g1) {
    for (int64_t c = g0 / chunk_; c * chunk_ < g1; ++c) {
      const int64_t col0 = std::max(g0, c * chunk_) * 8;
      const int64_t col1 = std::min({g1, (c + 1) * chunk_, (N_ + 7) / 8}) * 8;
      const int64_t n = std::min(col1, N_) - col0;
      for (int64_t r = 0; r < rows_; ++r) {
        Pick& pick = picks_[c * rows_ + r];
        pick.index = col0 + argmax_row(out_ + (m0_ + r) * N_ + col0, n, &pick.value);
      }
    }
  }

  // Combines the pass's chunks, in column order, into each row's argmax.
  void end_pass() {
    for (int64_t r = 0; r < rows_; ++r) {
      Pick best = picks_[r];
      for (int64_t c = 1; c < num_chunks_ && !std::isnan(best.value); ++c) {
        const Pick& next = picks_[c * rows_ + r];
        if (std::isnan(next.value) || next.value > best.value) best = next;
      }
      index_[m0_ + r] = best.index;
    }
  }

 private:
  struct Pick {
    int64_t index = 0;
    float value = 0.0f;
  };
  const float* out_;
  int64_t N_;
  int64_t* index_;
  int64_t m0_ = 0, rows_ = 0, chunk_ = 1, num_chunks_ = 0;
  std::vector<Pick> picks_;  // [chunk][row of the pass]
};

// Splits the G weight groups across threads, calling region(g0, g1, m0, m1); long prompts go in
// passes of kRowsPerPass rows, whose quantized activations stay in L2. Chunks hold an even number
// of groups: the AVX2 tiles, the VNNI vectors and the AMX tiles all take groups two at a time.
// With `picks`, each chunk's rows are scanned for their argmax right after they are written.
template <typename Region>
void run_parallel(int64_t M, int64_t G, int64_t group_bytes, const Region& region,
                  RowArgmax* picks = nullptr) {
  constexpr int64_t kRowsPerPass = 128;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int64_t m1 = std::min(M, m0 + kRowsPerPass);
    // at least ~32 KB of weight traffic per chunk, so small products skip threading
    const int64_t min_chunk = std::max<int64_t>(1, (32 << 10) / (group_bytes * (m1 - m0)));
    const int64_t balanced = balanced_chunk(G, min_chunk);
    const int64_t chunk = balanced + balanced % 2;
    if (picks != nullptr) picks->begin_pass(m0, m1, G, chunk);
    parallel_for(G, chunk, [&](int64_t g0, int64_t g1) {
      region(g0, g1, m0, m1);
      if (picks != nullptr) picks->computed(g0, g1);
    });
    if (picks != nullptr) picks->end_pass();
  }
}

template <typename Kernel>
void run(const Kernel& kernel, int64_t M, int64_t N, int64_t group_bytes, float* out,
         RowArgmax* picks) {
  run_parallel(
      M, (N + 7) / 8, group_bytes,
      [&](int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
        run_region(kernel, g0, g1, m0, m1, N, out);
      },
      picks);
}

// The AVX2 block kernels in the form every path's kernels take (linear_blocks.h).
void linear_q4_0_avx2(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  const Q4Kernel<false> k{static_cast<const uint8_t*>(p.weight), p.scales, nullptr, p.acts, p.nb,
                            p.prefetch_blocks};
  run_region(k, g0, g1, m0, m1, p.N, p.out);
}

void linear_q4_1_avx2(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  const Q4Kernel<true> k{static_cast<const uint8_t*>(p.weight), p.scales, p.mins, p.acts, p.nb,
                           p.prefetch_blocks};
  run_region(k, g0, g1, m0, m1, p.N, p.out);
}

void linear_q8_0_avx2(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  const Q8Kernel k{static_cast<const int8_t*>(p.weight), p.scales, p.acts, p.nb, p.prefetch_blocks};
  run_region(k, g0, g1, m0, m1, p.N, p.out);
}

enum BlockType : int { kQ4_0, kQ4_1, kQ8_0, kNumBlockTypes };

// Each kernel path's block kernels, in KernelPath order.
constexpr BlockLinearFn kBlockKernels[][kNumBlockTypes] = {
    {linear_q4_0_avx2, linear_q4_1_avx2, linear_q8_0_avx2},
    {linear_q4_0_avx512_vnni, linear_q4_1_avx512_vnni, linear_q8_0_avx512_vnni},
    {linear_q4_0_amx_int8, linear_q4_1_amx_int8, linear_q8_0_amx_int8},
};
static_assert(std::size(kBlockKernels) == static_cast<size_t>(KernelPath::kNumPaths));

// Block type `type` with the active path's kernel; group_bytes: one group's weights and fields.
void run_blocks(BlockType type, const BlockLinear& p, int64_t M, int64_t group_bytes,
                RowArgmax* picks) {
  const BlockLinearFn kernel = kBlockKernels[static_cast<int>(active_kernel_path())][type];
  const int64_t G = (p.N + 7) / 8;
  run_parallel(
      M, G, group_bytes,
      [&](int64_t g0, int64_t g1, int64_t m0, int64_t m1) { kernel(p, g0, g1, m0, m1); }, picks);
}

const uint16_t* half_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::Half>());
}

void check_param(const at::Tensor& t, at::ScalarType dtype, int64_t G, int64_t inner,
                 int64_t last, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype,
              "speculant::packed_linear: ", name, " must be a contiguous CPU ", dtype, " tensor");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == G && t.size(1) == inner && t.size(2) == last,
              "speculant::packed_linear: ", name, " has shape ", t.sizes(), ", expected [", G,
              ", ", inner, ", ", last, "]");
}

// packed_linear's work, writing `out` [M, out_features]; with `picks`, each row's argmax too.
void linear_into(const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins,
                 std::string_view qtype, at::Tensor& out, RowArgmax* picks) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), G = (N + 7) / 8;
  float* y = out.data_ptr<float>();

  if (qtype == "F32" || qtype == "F16") {
    const bool f32 = qtype == "F32";
    check_param(weight, f32 ? at::kFloat : at::kHalf, G, K, 8, "weight");
    if (f32) {
      FloatKernel<float> k{weight.const_data_ptr<float>(), x.const_data_ptr<float>(), K};
      run(k, M, N, K * 8 * 4, y, picks);
    } else {
      FloatKernel<uint16_t> k{half_bits(weight), x.const_data_ptr<float>(), K};
      run(k, M, N, K * 8 * 2, y, picks);
    }
    return;
  }

  TORCH_CHECK(qtype == "Q4_0" || qtype == "Q4_1" || qtype == "Q8_0",
              "speculant::packed_linear: unknown qtype ", qtype);
  TORCH_CHECK(K % kBlock == 0, "speculant::packed_linear: in_features ", K,
              " is not a multiple of 32");
  const int64_t nb = K / kBlock;
  TORCH_CHECK(scales.has_value(), "speculant::packed_linear: ", qtype, " needs scales");
  check_param(*scales, at::kHalf, G, nb, 8, "scales");
  thread_local QuantizedActs acts;  // reused across calls: no allocation on the decode path
  quantize_acts(x.const_data_ptr<float>(), M, K, acts);
  const ActsView view{acts.q.data(), acts.d.data(), acts.dsum.data(), acts.sum.data()};

  BlockLinear p{weight.const_data_ptr(), half_bits(*scales), nullptr, view, nb, N, y,
                weight_prefetch_blocks(), vnni_wide_rows()};
  if (qtype == "Q8_0") {
    check_param(weight, at::kChar, G, nb, 256, "weight");
    run_blocks(kQ8_0, p, M, nb * (256 + 16), picks);
  } else if (qtype == "Q4_0") {
    check_param(weight, at::kByte, G, nb, 128, "weight");
    run_blocks(kQ4_0, p, M, nb * (128 + 16), picks);
  } else {
    check_param(weight, at::kByte, G, nb, 128, "weight");
    TORCH_CHECK(mins.has_value(), "speculant::packed_linear: Q4_1 needs mins");
    check_param(*mins, at::kHalf, G, nb, 8, "mins");
    p.mins = half_bits(*mins);
    run_blocks(kQ4_1, p, M, nb * (128 + 32), picks);
  }
}

at::Tensor checked_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "speculant::", op, ": x must be a 2-D float32 CPU tensor");
  return x.contiguous();
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& weight,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, std::string_view qtype,
                         int64_t out_features) {
  const at::Tensor x = checked_input(x_in, "packed_linear");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) > 0 && out_features > 0) linear_into(x, weight, scales, mins, qtype, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> packed_linear_argmax(
    const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
    const std::optional<at::Tensor>& mins, std::string_view qtype, int64_t out_features) {
  const at::Tensor x = checked_input(x_in, "packed_linear_argmax");
  TORCH_CHECK(out_features > 0, "speculant::packed_linear_argmax: no output columns to pick from");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  at::Tensor index = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) > 0) {
    RowArgmax picks(out.const_data_ptr<float>(), out_features, index.data_ptr<int64_t>());
    linear_into(x, weight, scales, mins, qtype, out, &picks);
  }
  return {out, index};
}

}  // namespace speculant
