// Causal attention over a paged KV cache, one (query token, query head) pair at a time.
//
// Token t of sequence s = token_seq[t] attends to positions 0..token_pos[t] of s, whose K/V rows
// live at k_cache[block_tables[s][p / block_size], p % block_size]. Query head h reads KV head
// h / (Hq / Hkv) (grouped-query attention).
//
// Batch invariance: a pair's output is computed by one thread in a fixed order (scores in position
// order, one max, exp and sum in 8-lane chunks, then the value sum in position order), so it
// depends only on its own query, its sequence's cache and its position; never on the other tokens
// in the batch.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace speculant {
namespace {

struct PagedKV {
  const float* k;          // [num_blocks, block_size, Hkv, D]
  const float* v;          // [num_blocks, block_size, Hkv, D]
  const int32_t* table;    // this sequence's row of block_tables
  int64_t max_blocks, num_blocks, block_size, num_kv_heads, head_dim;

  // Offset of position p's row for KV head kvh.
  int64_t offset(int64_t p, int64_t kvh) const {
    const int64_t block = table[p / block_size];
    TORCH_CHECK(block >= 0 && block < num_blocks, "speculant::paged_attention: block id ", block,
                " out of range [0, ", num_blocks, ")");
    return ((block * block_size + p % block_size) * num_kv_heads + kvh) * head_dim;
  }
};

// q . k over D (a multiple of 8) with two FMA chains, combined once.
inline float dot(const float* q, const float* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
  }
  if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
  return hsum(_mm256_add_ps(a0, a1));
}

// out[d0 : d0 + 8 NV] = sum_p probs[p] * v_p[d0 : ...] / denom, positions in ascending order.
template <int NV>
void weighted_values(const PagedKV& kv, int64_t kvh, const float* probs, int64_t L, int64_t d0,
                     float denom, float* out) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < L; ++p) {
    const float* v = kv.v + kv.offset(p, kvh) + d0;
    const __m256 w = _mm256_set1_ps(probs[p]);
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
  }
  const __m256 den = _mm256_set1_ps(denom);
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_div_ps(acc[i], den));
}

void attend(const float* q, const PagedKV& kv, int64_t kvh, int64_t L, float scale, float* out,
            std::vector<float>& buf) {
  const int64_t D = kv.head_dim;
  const int64_t L8 = (L + 7) / 8 * 8;
  buf.resize(L8);
  float* s = buf.data();
  // 1) scores, and their max
  float smax = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < L; ++p) {
    s[p] = dot(q, kv.k + kv.offset(p, kvh), D) * scale;
    smax = std::max(smax, s[p]);
  }
  // 2) probabilities exp(s - max) in place; -inf padding up to a multiple of 8 becomes exactly 0
  std::fill(s + L, s + L8, -std::numeric_limits<float>::infinity());
  const __m256 vmax = _mm256_set1_ps(smax);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t p = 0; p < L8; p += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmax));
    _mm256_storeu_ps(s + p, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const float denom = hsum(vsum);
  // 3) probability-weighted values, in slices of at most 64 features (8 accumulators)
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) weighted_values<8>(kv, kvh, s, L, d0, denom, out);
  for (; d0 + 32 <= D; d0 += 32) weighted_values<4>(kv, kvh, s, L, d0, denom, out);
  for (; d0 + 16 <= D; d0 += 16) weighted_values<2>(kv, kvh, s, L, d0, denom, out);
  for (; d0 + 8 <= D; d0 += 8) weighted_values<1>(kv, kvh, s, L, d0, denom, out);
}

void check(bool ok, const char* what) {
  TORCH_CHECK(ok, "speculant::paged_attention: ", what);
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& token_seq, const at::Tensor& token_pos,
                           double scale) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &token_seq, &token_pos}) {
    check(t->device().is_cpu() && t->is_contiguous(), "all tensors must be contiguous on CPU");
  }
  check(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
            v_cache.scalar_type() == at::kFloat, "q and the caches must be float32");
  check(block_tables.scalar_type() == at::kInt && token_seq.scalar_type() == at::kInt &&
            token_pos.scalar_type() == at::kInt, "block_tables, token_seq, token_pos must be int32");
  check(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
            block_tables.dim() == 2, "expected q [T, Hq, D], caches [blocks, block_size, Hkv, D]");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2);
  check(k_cache.size(3) == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  check(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  check(token_seq.numel() == T && token_pos.numel() == T, "token_seq, token_pos must have T entries");
  const int64_t S = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t block_size = k_cache.size(1), group = Hq / Hkv;

  const int32_t* seq = token_seq.const_data_ptr<int32_t>();
  const int32_t* pos = token_pos.const_data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    check(seq[t] >= 0 && seq[t] < S, "token_seq entry out of range");
    check(pos[t] >= 0 && pos[t] < max_blocks * block_size, "token_pos beyond the block table");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const float* qp = q.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t num_pairs = T * Hq;
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i) {
      // Zigzag order: each thread's contiguous share mixes early (short) and late (long)
      // tokens of a causal prefill, which balances the threads.
      const int64_t pair = (i % 2 == 0) ? i / 2 : num_pairs - 1 - i / 2;
      const int64_t t = pair / Hq, h = pair % Hq;
      const PagedKV kv{k_cache.const_data_ptr<float>(), v_cache.const_data_ptr<float>(),
                       block_tables.const_data_ptr<int32_t>() + seq[t] * max_blocks,
                       max_blocks, k_cache.size(0), block_size, Hkv, D};
      attend(qp + pair * D, kv, h / group, pos[t] + 1, static_cast<float>(scale), op + pair * D,
             buf);
    }
  });
  return out;
}

}  // namespace speculant
