// Which instruction-set path the block-type linear kernels run on, chosen once per process from
// the CPU's features (or forced with SPECULANT_KERNEL_PATH), and switchable at run time so tests
// and benchmarks can compare paths in one process.
//
// Every path gives bit-identical results (see linear.cpp), so the choice only changes speed.
// A path is a row of kKernelPaths; a new one adds an enumerator, a row naming its CPU features,
// and its kernels in linear.cpp's table.
#pragma once

#include <string>
#include <vector>

namespace speculant {

enum class KernelPath : int { kAvx2, kAvx512Vnni, kAmxInt8, kNumPaths };

// The active path: SPECULANT_KERNEL_PATH (auto, or a path name) on first use, else the last
// set_kernel_path. Throws if the variable names an unknown path or one this CPU cannot run.
KernelPath active_kernel_path();

// Whether `path` runs attention's inner loops with 512-bit vectors (attention_wide.h).
bool wide_attention(KernelPath path);

// Whether attention runs the query rows of prompt positions on AMX-BF16 tiles (avx512/
// attention_amx.cpp): on the amx_int8 path of a CPU with AMX-BF16 and AVX512_BF16, unless
// SPECULANT_PROMPT_ATTENTION=fp32 (read on first use; a bad value throws) or
// set_prompt_attention("fp32"). Changes prompt positions' float order (not bit-identical to
// the other paths); generated positions always take the fp32 path.
bool prompt_attention_tiles();

// Whether this CPU can attend over a bf16 KV cache in the AMX tiles' layout: on AMX-BF16 tiles
// (avx512/attention_tiles.cpp; AMX-BF16 and AVX512_BF16, and the OS's leave to use tiles) or on
// AVX512_BF16 dot products (avx512/attention_bf16dot.cpp; AVX-512 VNNI and AVX512_BF16).
// Whatever the active path: the cache's dtype, chosen when it is made, decides how it is
// attended.
bool tile_kv_cache();

// What a bf16 cache is attended on: true for the AMX-BF16 tiles, false for the AVX512_BF16 dot
// products. The tiles where the CPU has them, unless SPECULANT_KV_ATTENTION=avx512_bf16 (read on
// first use; a bad value, or a CPU without AVX512_BF16, throws) or
// set_kv_attention("avx512_bf16"). The two are not bit-identical to each other.
bool kv_attention_tiles();

// How many weight blocks ahead the AVX-512 VNNI and AVX2 kernels request into L1 (0: none), chosen
// once per process from the CPU (or SPECULANT_PREFETCH_BLOCKS, 0-64): a matter of the CPU's
// hardware prefetchers, not of its instruction set. Measured on 2-core KVM guests (whole target
// forwards, in one process, alternating): an AMD EPYC Zen 4 (family 19h) ran forwards of 1-4 rows
// 5-6% faster without the requests; on an AMD EPYC Zen 5 (family 1Ah) the 1-row LM head had
// needed them to reach the memory bandwidth; on an AMD EPYC Zen 1 (family 17h, AVX2 only) 4
// blocks made a decode step at c=1 8% shorter (2 and 6 blocks less so). So none on family 19h,
// 4 elsewhere. Never changes results.
int64_t weight_prefetch_blocks();

// The fewest activation rows for which the VNNI kernels run a region in wide row tiles (one
// pair of weight groups against up to 8-12 rows, avx512/linear_vnni.cpp) instead of tiles of
// two pairs against 4 rows; chosen once per process from the CPU (or SPECULANT_VNNI_WIDE_ROWS,
// 2-4096; 4096 is never: a pass holds at most 128 rows). Measured on 2-core KVM guests, whole
// target forwards in one process: on an Intel Xeon with AMX (VNNI path forced) the wide tiles
// took 0.895-0.94 of the time at 5-11 rows; on an AMD EPYC Zen 4 (family 19h; the two
// settings alternating forward by forward, medians of 20-100 pairs) the narrow tiles took
// 0.94-0.97 of it at 5-12 rows, 0.97-0.98 at 16-32 and at 64-256 (prefill), 0.95 for 8
// sequences of one row (c=8 decoding); the EAGLE-3 head's catch-up forward there took
// 740-820 us at 5 rows against 400-440 at 4. So never on family 19h, from 5 rows elsewhere.
// Never changes results: every tile shape gives the same bits (linear.cpp).
int64_t vnni_wide_rows();

// Operators (registered in ops.cpp): the active path's name; the paths this CPU supports, best
// last; set_kernel_path(name or "auto") -> the previous path's name.
std::string kernel_path();
std::vector<std::string> kernel_paths();
std::string set_kernel_path(const std::string& name);
// prompt_attention(): "amx_bf16" or "fp32", what prompt positions run on now;
// set_prompt_attention("auto" or "fp32") -> the previous setting ("auto" or "fp32").
std::string prompt_attention();
std::string set_prompt_attention(const std::string& mode);
// kv_attention(): "amx_bf16", "avx512_bf16" or "none" (no bf16 cache here), what a bf16 cache is
// attended on now; set_kv_attention("auto" or "avx512_bf16") -> the previous setting.
std::string kv_attention();
std::string set_kv_attention(const std::string& mode);
// set_weight_prefetch_blocks(n, 0-64) -> the previous value (tests and A/B measurements).
int64_t set_weight_prefetch_blocks(int64_t blocks);
// set_vnni_wide_rows(n, 2-4096) -> the previous value (tests and A/B measurements).
int64_t set_vnni_wide_rows(int64_t rows);

}  // namespace speculant
