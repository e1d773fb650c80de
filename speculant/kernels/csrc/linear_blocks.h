// The interface between linear.cpp and the block-type kernels of each kernel path: plain
// pointers and integers only.
//
// Kernels built with other instruction-set flags (avx512/, compiled apart by native.py) include
// nothing but this header and <immintrin.h>. Any inline function or template they shared with
// the rest of the library (torch's headers, the STL, simd.h) would be compiled there with
// AVX-512 enabled, and the linker keeps one copy of each for the whole library: an AVX2-only CPU
// could then hit an AVX-512 instruction outside the kernels it never selects.
#pragma once

#include <cstdint>

namespace speculant {

// Activation rows are allocated in multiples of this (q only): an AMX tile loads 16 rows at a
// time, and a partial last tile reads rows past M (their products are never read back).
constexpr int64_t kActsRowPad = 16;

// Raw pointers into the activations quantized per row per block of 32 (linear.cpp).
struct ActsView {
  const int8_t* q;       // [M, K] int8, room for M rounded up to kActsRowPad rows
  const float* d;        // [M, nb] block scale: x ~= d * q
  const float* dsum;     // [M, nb] d * sum(q), Q4_1's min term
  const int32_t* sum;    // [M, nb] sum(q), Q4_0's offset term (and Q8_0's on the VNNI path)
};

// One block-type product out = x @ W.T (weight layouts in linear.cpp), shared by the threads.
struct BlockLinear {
  const void* weight;      // Q4_0 / Q4_1: uint8 [G, nb, 128]; Q8_0: int8 [G, nb, 256]
  const uint16_t* scales;  // [G, nb, 8] fp16
  const uint16_t* mins;    // [G, nb, 8] fp16, Q4_1 only
  ActsView acts;
  int64_t nb;              // blocks per row: in_features / 32
  int64_t N;               // out_features: the row length of out
  float* out;              // [M, N]
  int64_t prefetch_blocks; // VNNI kernels: weight blocks requested ahead of use (0: none;
                           // weight_prefetch_blocks() in kernel_path.h says why it varies)
  int64_t wide_rows;       // VNNI kernels: regions of at least this many activation rows take
                           // the wide row tiles (vnni_wide_rows() in kernel_path.h)
};

// Computes out[m0:m1, 8 * g0 : min(N, 8 * g1)] (weight groups [g0, g1) against activation rows
// [m0, m1)); a thread runs one such region at a time.
using BlockLinearFn = void (*)(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0,
                               int64_t m1);

// AVX-512 VNNI kernels (avx512/linear_vnni.cpp); call them only on CPUs that have the features.
void linear_q4_0_avx512_vnni(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0,
                             int64_t m1);
void linear_q4_1_avx512_vnni(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0,
                             int64_t m1);
void linear_q8_0_avx512_vnni(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0,
                             int64_t m1);

// AMX-INT8 kernels (avx512/linear_amx.cpp); call them only on CPUs that have AMX-INT8, once the
// OS has allowed this process the tile registers (kernel_path.cpp asks).
void linear_q4_0_amx_int8(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1);
void linear_q4_1_amx_int8(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1);
void linear_q8_0_amx_int8(const BlockLinear& p, int64_t g0, int64_t g1, int64_t m0, int64_t m1);

}  // namespace speculant
