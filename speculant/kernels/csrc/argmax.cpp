// Greedy picks over rows of logits: each row's argmax (torch.argmax's answer: the first index of
// the maximum, or the first NaN when the row has one) and, when asked, the softmax probability of
// that entry. torch.argmax over the target's 49,152-token vocabulary took ~70 us a row on an AMD
// EPYC (2 threads; 0.8 ms for the 20 rows of a c=8 verification step, ~5% of the step); one
// 8-lane pass takes a few us. A row is read by one thread in one fixed order: batch-invariant.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <tuple>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace speculant {
namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
  }
  return -1;
}

// Index of the first maximum of x[0..n) (the first NaN if any); *max_out its value.
int64_t argmax_row(const float* x, int64_t n, float* max_out) {
  int64_t best = 0;
  float m = x[0];
  int64_t i = 1;
  bool nan_seen = std::isnan(m);
  if (n >= 16) {
    // Each lane keeps its own first maximum (a strictly greater value replaces it); the row's
    // first maximum is the lowest index among the lanes that hold the largest value.
    __m256 lane_max = _mm256_loadu_ps(x);
    __m256i lane_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = lane_idx;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(lane_max, lane_max, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      cur = _mm256_add_epi32(cur, step);
      const __m256 gt = _mm256_cmp_ps(v, lane_max, _CMP_GT_OQ);
      lane_max = _mm256_blendv_ps(lane_max, v, gt);
      lane_idx = _mm256_blendv_epi8(lane_idx, cur, _mm256_castps_si256(gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan_seen = _mm256_movemask_ps(nan) != 0;
    alignas(32) float vals[8];
    alignas(32) int32_t idx[8];
    _mm256_store_ps(vals, lane_max);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), lane_idx);
    m = hmax(lane_max);
    best = n;
    for (int l = 0; l < 8; ++l) {
      if (vals[l] == m && idx[l] < best) best = idx[l];
    }
  }
  for (; i < n; ++i) {  // the tail after the 8-lane part (or a short row)
    if (x[i] > m) {
      m = x[i];
      best = i;
    }
    nan_seen = nan_seen || std::isnan(x[i]);
  }
  if (nan_seen) {
    best = first_nan(x, n);
    m = x[best];
  }
  *max_out = m;
  return best;
}

// softmax(x)[argmax] = 1 / sum(exp(x - max)): four 8-lane sums over 32-element steps, then
// 8-element steps into the first, then the scalar tail (one order for a given n).
float max_prob(const float* x, int64_t n, float max) {
  if (std::isnan(max)) return max;
  const __m256 vmax = _mm256_set1_ps(max);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  auto term = [&](int64_t i) { return exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax)); };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, term(i));
    a1 = _mm256_add_ps(a1, term(i + 8));
    a2 = _mm256_add_ps(a2, term(i + 16));
    a3 = _mm256_add_ps(a3, term(i + 24));
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_add_ps(a0, term(i));
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += std::exp(x[i] - max);
  return 1.0f / s;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& logits, bool with_prob) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "speculant::row_argmax: logits must be a contiguous 2-D float32 CPU tensor with "
              "at least one column, got ", logits.sizes(), " ", logits.scalar_type());
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor index = at::empty({R}, logits.options().dtype(at::kLong));
  at::Tensor prob = at::empty({with_prob ? R : 0}, logits.options());
  const float* xp = logits.const_data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  float* pp = with_prob ? prob.data_ptr<float>() : nullptr;
  // a row of the target's vocabulary is a few us of work: rows are shared out one by one
  parallel_for(R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float max;
      ip[r] = argmax_row(xp + r * V, V, &max);
      if (pp != nullptr) pp[r] = max_prob(xp + r * V, V, max);
    }
  });
  return {index, prob};
}

}  // namespace speculant
