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
  const float* k;        // [num_blocks, block_size, Hkv, D]
  const float* v;        // [num_blocks, block_size, Hkv, D]
  const int32_t* table;  // this sequence's row of block_tables
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
};

// Per-thread scratch, reused across pairs and calls.
struct Scratch {
  std::vector<float> scores;            // [L rounded up to 8]
  std::vector<const float*> k_rows, v_rows;  // [L] position p's K / V row for this KV head
};

// Row pointers of positions 0..L-1 for KV head kvh, walking the block table (no division).
void gather_rows(const PagedKV& kv, int64_t kvh, int64_t L, Scratch& sc) {
  sc.k_rows.resize(L);
  sc.v_rows.resize(L);
  const int64_t row_stride = kv.num_kv_heads * kv.head_dim;
  for (int64_t p0 = 0, b = 0; p0 < L; p0 += kv.block_size, ++b) {
    const int64_t block = kv.table[b];
    TORCH_CHECK(block >= 0 && block < kv.num_blocks, "speculant::paged_attention: block id ",
                block, " out of range [0, ", kv.num_blocks, ")");
    const int64_t base = (block * kv.block_size * kv.num_kv_heads + kvh) * kv.head_dim;
    for (int64_t r = 0; r < kv.block_size && p0 + r < L; ++r) {
      sc.k_rows[p0 + r] = kv.k + base + r * row_stride;
      sc.v_rows[p0 + r] = kv.v + base + r * row_stride;
    }
  }
}

// scores[p0 + j] = scale * q . k_{p0 + j} for j < 8. Each position is one FMA chain over D (a
// multiple of 8) followed by the same hadd tree, so a score never depends on its slot j or on L;
// slots past the last position repeat it and are overwritten by the caller.
void scores8(const float* q, const Scratch& sc, int64_t p0, int64_t L, int64_t D, float scale,
             float* scores) {
  const float* k[8];
  for (int j = 0; j < 8; ++j) k[j] = sc.k_rows[std::min(p0 + j, L - 1)];
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + d), a[j]);
  }
  // 8 vectors -> one vector of their 8 lane sums, slot j = position p0 + j
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                    _mm256_permute2f128_ps(h0123, h4567, 0x31));
  _mm256_storeu_ps(scores + p0, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

// out[d0 : d0 + 8 NV] = sum_p probs[p] * v_p[d0 : ...] / denom, positions in ascending order.
template <int NV>
void weighted_values(const Scratch& sc, const float* probs, int64_t L, int64_t d0, float denom,
                     float* out) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < L; ++p) {
    const float* v = sc.v_rows[p] + d0;
    const __m256 w = _mm256_set1_ps(probs[p]);
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
  }
  const __m256 den = _mm256_set1_ps(denom);
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_div_ps(acc[i], den));
}

void attend(const float* q, const PagedKV& kv, int64_t kvh, int64_t L, float scale, float* out,
            Scratch& sc) {
  const int64_t D = kv.head_dim;
  const int64_t L8 = (L + 7) / 8 * 8;
  gather_rows(kv, kvh, L, sc);
  sc.scores.resize(L8);
  float* s = sc.scores.data();
  // 1) scores, and their max; padding up to a multiple of 8 is -inf
  for (int64_t p0 = 0; p0 < L; p0 += 8) scores8(q, sc, p0, L, D, scale, s);
  std::fill(s + L, s + L8, -std::numeric_limits<float>::infinity());
  __m256 vmax = _mm256_loadu_ps(s);
  for (int64_t p = 8; p < L8; p += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + p));
  vmax = _mm256_set1_ps(hmax(vmax));
  // 2) probabilities exp(s - max) in place (the padding becomes exactly 0), and their sum
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t p = 0; p < L8; p += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmax));
    _mm256_storeu_ps(s + p, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const float denom = hsum(vsum);
  // 3) probability-weighted values, in slices of at most 64 features (8 accumulators)
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) weighted_values<8>(sc, s, L, d0, denom, out);
  for (; d0 + 32 <= D; d0 += 32) weighted_values<4>(sc, s, L, d0, denom, out);
  for (; d0 + 16 <= D; d0 += 16) weighted_values<2>(sc, s, L, d0, denom, out);
  for (; d0 + 8 <= D; d0 += 8) weighted_values<1>(sc, s, L, d0, denom, out);
}

void check(bool ok, const char* what) {
  TORCH_CHECK(ok, "speculant::paged_attention: ", what);
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const at::Tensor& tables_in, const at::Tensor& seq_in,
                           const at::Tensor& pos_in, double scale) {
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &tables_in, &seq_in, &pos_in}) {
    check(t->device().is_cpu(), "all tensors must be on the CPU");
  }
  // no-ops for the usual contiguous inputs
  const at::Tensor q = q_in.contiguous(), k_cache = k_in.contiguous(), v_cache = v_in.contiguous();
  const at::Tensor block_tables = tables_in.contiguous(), token_seq = seq_in.contiguous();
  const at::Tensor token_pos = pos_in.contiguous();
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
  int64_t num_positions = 0;  // summed over tokens: the work, in units of one K and one V row
  for (int64_t t = 0; t < T; ++t) {
    check(seq[t] >= 0 && seq[t] < S, "token_seq entry out of range");
    check(pos[t] >= 0 && pos[t] < max_blocks * block_size, "token_pos beyond the block table");
    num_positions += pos[t] + 1;
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const float* qp = q.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t num_pairs = T * Hq;
  // under ~2K (position, head) pairs, about 10 us of work, a second thread costs more than it saves
  const int64_t grain = num_positions * Hq < 2048 ? num_pairs : 1;
  at::parallel_for(0, num_pairs, grain, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      // Zigzag order: each thread's contiguous share mixes early (short) and late (long)
      // tokens of a causal prefill, which balances the threads.
      const int64_t pair = (i % 2 == 0) ? i / 2 : num_pairs - 1 - i / 2;
      const int64_t t = pair / Hq, h = pair % Hq;
      const PagedKV kv{k_cache.const_data_ptr<float>(), v_cache.const_data_ptr<float>(),
                       block_tables.const_data_ptr<int32_t>() + seq[t] * max_blocks,
                       k_cache.size(0), block_size, Hkv, D};
      attend(qp + pair * D, kv, h / group, pos[t] + 1, static_cast<float>(scale), op + pair * D,
             scratch);
    }
  });
  return out;
}

}  // namespace speculant
