// The interface between attention.cpp and its 512-bit inner loops (avx512/attention.cpp, compiled
// apart with the AVX-512 flags): plain pointers and integers only, for the reason given in
// linear_blocks.h. The avx512_vnni kernel path runs them (every AVX-512 VNNI CPU has AVX-512F).
//
// Both compute every score and every value-sum lane with the same operations, in the same order,
// as attention.cpp's AVX2 loops (scores8, values_tile): the outputs are bit-identical.
#pragma once

#include <cstdint>

namespace speculant {

// Scores over num_vec8 vectors of 8 consecutive positions of transposed K blocks (vector i's
// feature d at k8[i][d * stride], kernels/kv_layout.py): for each query j < num_queries,
// dst[j][8 i + l] = scale * (the FMA chain over d = 0..D-1 of q_rows[j][d] * k8[i][d * stride + l]).
// Adjacent vectors of one block (k8[i + 1] == k8[i] + 8) run as 16 lanes.
void attention_scores_avx512(const float* const* q_rows, float* const* dst, int64_t num_queries,
                             const float* const* k8, int64_t num_vec8, int64_t stride, int64_t D,
                             float scale);
void attention_scores_avx512(const float* const* q_rows, float* const* dst, int64_t num_queries,
                             const uint16_t* const* k8, int64_t num_vec8, int64_t stride,
                             int64_t D, float scale);

// softmax_numerators (attention.cpp) with the exponentials 16 at a time: s [L rounded up to 8]
// -> exp(s - max) in place (exactly 0 from L on); returns their sum, stores the max in *max_out.
float attention_softmax_avx512(float* s, int64_t L, float* max_out);

// For each query j < nq (nq <= kMaxWideQueries): outs[j][d] = sum_p probs[j][p] * v_rows[p][d]
// over p < lengths[j] in ascending order, for all D features (a multiple of 8); V rows fp32 or
// fp16. The queries share each loaded V row over the positions they all read.
constexpr int kMaxWideQueries = 6;
void attention_values_avx512(const float* const* v_rows, const float* const* probs,
                             const int64_t* lengths, int nq, int64_t D, float* const* outs);
void attention_values_avx512(const uint16_t* const* v_rows, const float* const* probs,
                             const int64_t* lengths, int nq, int64_t D, float* const* outs);

// AMX-BF16 (avx512/attention_amx.cpp; only where prompt_attention_tiles() in kernel_path.h):
// the scores of num_queries queries over num_vec8 8-position vectors of fp16 transposed K
// blocks, as attention_scores_avx512 takes them, into scores + j * row_stride (row_stride a
// multiple of 16: whole 16-position tiles are stored; past the last vector, K counts as 0).
// Not bit-identical to the fp32 loops (see that file); returns false, computing nothing, for a
// head_dim it does not take (a multiple of 32 up to 128).
bool attention_scores_amx_bf16(const float* const* q_rows, float* scores, int64_t row_stride,
                               int64_t num_queries, const uint16_t* const* k8, int64_t num_vec8,
                               int64_t stride, int64_t D, float scale);

// AMX-BF16 softmax and value sums: for each query j, over its scores[j][p], p < lengths[j]:
// *maxes[j] = their max, *sums[j] = the sum of e_p = exp(s_p - max) (16 lanes in position
// order, then reduced), outs[j][d] = sum_p e_p * v_rows[p][d] (fp16 V rows, positions < n_max),
// all D features (a multiple of 16), e and V split as above and summed on the tiles in position
// order. Returns false, computing nothing, for another head_dim.
bool attention_softmax_values_amx_bf16(const float* const* scores, const int64_t* lengths,
                                       int64_t num_queries, const uint16_t* const* v_rows,
                                       int64_t n_max, int64_t D, float* const* outs,
                                       float* const* maxes, float* const* sums);

// AMX-BF16 over a bf16 cache in the tiles' layout (avx512/attention_tiles.cpp; K blocks [Hkv,
// D / 2, block_size, 2], V blocks [Hkv, block_size / 2, D, 2], kernels/kv_layout.py): for each
// query j < num_queries over positions p < lengths[j] (1 <= lengths[j] <= n_max) of one
// partition, whose blocks' K and V at the unit's KV head start at k_blocks[p / block_size] and
// v_blocks[p / block_size]: *maxes[j] = the max of the scores scale * q.k, *sums[j] = the sum of
// e_p = exp(score - max), outs[j][d] = sum_p e_p * v_p[d]. Not bit-identical to the fp32 loops
// (see that file), batch-invariant. Returns false, computing nothing, unless head_dim is a
// multiple of 32 up to 128 and block_size a multiple of 32.
bool attention_partition_tiles(const float* const* q_rows, const int64_t* lengths,
                               int64_t num_queries, const uint16_t* const* k_blocks,
                               const uint16_t* const* v_blocks, int64_t n_max,
                               int64_t block_size, int64_t D, float scale, float* const* outs,
                               float* const* maxes, float* const* sums);

// AVX512_BF16 dot products over the same bf16 cache in the tiles' layout (avx512/
// attention_bf16dot.cpp), for CPUs without AMX: the same contract as attention_partition_tiles,
// the same bf16 operands and fp32 softmax, not bit-identical to the tiles (each adds its products
// in its own order), batch-invariant.
bool attention_partition_bf16dot(const float* const* q_rows, const int64_t* lengths,
                                 int64_t num_queries, const uint16_t* const* k_blocks,
                                 const uint16_t* const* v_blocks, int64_t n_max,
                                 int64_t block_size, int64_t D, float scale, float* const* outs,
                                 float* const* maxes, float* const* sums);

}  // namespace speculant
