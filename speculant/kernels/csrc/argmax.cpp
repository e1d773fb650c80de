// Greedy picks over rows of logits: each row's argmax (torch.argmax's answer: the first index of
// the maximum, or the first NaN when the row has one) and, when asked, the softmax probability of
// that entry. torch.argmax over the target's 49,152-token vocabulary took ~70 us a row on an AMD
// EPYC (2 threads; 0.8 ms for the 20 rows of a c=8 verification step, ~5% of the step); one
// 8-lane pass takes a few us. A row is read by one thread in one fixed order: batch-invariant.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <tuple>

#include "argmax.h"
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

}  // namespace

// Index of the first maximum of x[0..n) (the first NaN if any); *max_out its value.
//
// Four independent 8-lane chains over 32-element steps, each lane keeping the first maximum of
// its own elements (a strictly greater value replaces it): one chain's compare-and-blend
// latency bounded a row at ~15 us for 49,152 entries (6,144 dependent steps), ~48 us inside the
// engine's verification steps. The row's first maximum is the lowest index among the lanes of
// all chains that hold the largest value, so the answer is the same whatever the split.
int64_t argmax_row(const float* x, int64_t n, float* max_out) {
  int64_t best = 0;
  float m = x[0];
  int64_t i = 1;
  bool nan_seen = std::isnan(m);
  if (n >= 64) {
    __m256 lane_max[4];
    __m256i lane_idx[4], cur[4];
    __m256 nan = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      lane_max[c] = _mm256_loadu_ps(x + 8 * c);
      cur[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                _mm256_set1_epi32(8 * c));
      lane_idx[c] = cur[c];
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(lane_max[c], lane_max[c], _CMP_UNORD_Q));
    }
    const __m256i step = _mm256_set1_epi32(32);
    for (i = 32; i + 32 <= n; i += 32) {
      for (int c = 0; c < 4; ++c) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
        cur[c] = _mm256_add_epi32(cur[c], step);
        const __m256 gt = _mm256_cmp_ps(v, lane_max[c], _CMP_GT_OQ);
        lane_max[c] = _mm256_blendv_ps(lane_max[c], v, gt);
        lane_idx[c] = _mm256_blendv_epi8(lane_idx[c], cur[c], _mm256_castps_si256(gt));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    }
    nan_seen = _mm256_movemask_ps(nan) != 0;
    const __m256 all_max = _mm256_max_ps(_mm256_max_ps(lane_max[0], lane_max[1]),
                                         _mm256_max_ps(lane_max[2], lane_max[3]));
    m = hmax(all_max);
    best = n;
    alignas(32) float vals[8];
    alignas(32) int32_t idx[8];
    for (int c = 0; c < 4; ++c) {
      _mm256_store_ps(vals, lane_max[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(idx), lane_idx[c]);
      for (int l = 0; l < 8; ++l) {
        if (vals[l] == m && idx[l] < best) best = idx[l];
      }
    }
  }
  for (; i < n; ++i) {  // the tail after the vector part (or a short row)
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

namespace {

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
