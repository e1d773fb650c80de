// Sampling one token per row of logits with a request's filters: temperature, top-k, top-p,
// min-p, then inverse-CDF sampling in token-id order with one uniform per row (the law of
// engine/sampler.py's `filter_probs` + `TokenProbs.sample`; the repetition penalty is applied
// before, in Python). In PyTorch that pipeline took 130 us a row at temperature 0.8 and
// 280-680 us with top-p 0.95 over the target's 49,152-token vocabulary on an AMD EPYC (2
// threads): topk, logsumexp, softmax, an fp64 cumsum and searchsorted, each a pass, and a whole
// sort when the nucleus is wide; at concurrency 8 a quarter of a decode step. Here a row is two
// or three 8-lane passes:
//   1. the maximum (a row with a NaN gives its first NaN, as greedy does; +inf its first +inf;
//      all -inf gives 0);
//   2. top-k: the entries within a widening distance of the maximum, then nth_element among
//      them for the k-th largest; every entry >= it is kept (ties with the k-th included);
//   3. top-p: the mass Z of exp(t - max) (t = logit / temperature) over the top-k set or the
//      whole row; the nucleus lies among the entries with exp(t - max) >= Z (1 - top_p) / V
//      (the others together hold less than (1 - top_p) Z), so only those are looked at: their
//      mass is binned by value (order-preserving bins) down to the bin where the running mass
//      reaches top_p Z, and that bin alone is sorted; the cut is the first value where it does
//      and every entry >= the cut is kept (ties included);
//   4. min-p: entries with t >= max + log(min_p) are kept;
//   5. u * (kept mass) walked in token-id order; with `with_prob`, the drawn token's share of
//      the kept mass too.
// Masses are summed in float64 over float32 exps (simd.h's exp8); rounding differs from
// PyTorch's, so a uniform within ~1e-6 of a CDF boundary may give the neighbouring token, the
// law is the same. A row is read by one thread in one fixed order: batch-invariant.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace speculant {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 64;  // entries per partial sum of the dense walk
constexpr int kNumBins = 512;   // value bins of the top-p search

struct Filters {
  float temperature;  // > 0
  int64_t top_k;      // 0 or >= V: off
  double top_p;       // 1: off
  double min_p;       // 0: off
};

// The kept entries of a row as lists in token-id order: id, tempered logit, exp(t - max).
struct Kept {
  std::vector<int32_t> id;
  std::vector<float> t;
  std::vector<float> e;
  void clear() {
    id.clear();
    t.clear();
    e.clear();
  }
};

// 8 entries from x + i, padded with -inf past n.
inline __m256 load8_padded(const float* x, int64_t i, int64_t n) {
  if (i + 8 <= n) return _mm256_loadu_ps(x + i);
  alignas(32) float buf[8];
  for (int l = 0; l < 8; ++l) buf[l] = i + l < n ? x[i + l] : -kInf;
  return _mm256_load_ps(buf);
}

inline __m256 temper8(__m256 v, __m256 temperature, bool scaled) {
  return scaled ? _mm256_div_ps(v, temperature) : v;
}

// Row maximum; *special set to the row's answer when it has a NaN (first NaN), a +inf (first
// +inf) or only -inf (0), else -1.
float row_max(const float* x, int64_t n, int64_t* special) {
  __m256 m8 = _mm256_set1_ps(-kInf);
  __m256 nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = load8_padded(x, i, n);
    m8 = _mm256_max_ps(m8, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  const float m = hmax(m8);
  *special = -1;
  if (_mm256_movemask_ps(nan) != 0) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) {
        *special = i;
        break;
      }
    }
  } else if (m == kInf) {
    *special = std::find(x, x + n, kInf) - x;
  } else if (m == -kInf) {
    *special = 0;
  }
  return m;
}

// Ids (in id order) of the entries >= thr.
void collect_at_least(const float* x, int64_t n, float thr, std::vector<int32_t>* ids) {
  ids->clear();
  const __m256 vthr = _mm256_set1_ps(thr);
  for (int64_t i = 0; i < n; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(load8_padded(x, i, n), vthr, _CMP_GE_OQ));
    while (mask != 0) {
      const int l = __builtin_ctz(mask);
      ids->push_back(static_cast<int32_t>(i + l));
      mask &= mask - 1;
    }
  }
}

// Number of entries >= thr.
int64_t count_at_least(const float* x, int64_t n, float thr) {
  const __m256 vthr = _mm256_set1_ps(thr);
  int64_t count = 0;
  for (int64_t i = 0; i < n; i += 8) {
    count += __builtin_popcount(
        _mm256_movemask_ps(_mm256_cmp_ps(load8_padded(x, i, n), vthr, _CMP_GE_OQ)));
  }
  return count;
}

// A threshold below which no more than a few times k entries of x lie above it, yet at least
// k do: distances from the maximum doubled until k entries are within, then bisected (count
// passes, no lists: a row's logits often go from a handful within 8 of the maximum to most of
// the vocabulary within 32).
float top_k_floor(const float* x, int64_t n, int64_t k, float max) {
  const int64_t enough = std::max<int64_t>(4 * k, 256);
  float near = 0.0f, far = 8.0f;
  for (;; far *= 2.0f) {
    if (far > 1e30f) return -kInf;
    if (count_at_least(x, n, max - far) >= k) break;
    near = far;
  }
  for (int step = 0; step < 12; ++step) {
    if (count_at_least(x, n, max - far) <= enough) break;
    const float mid = 0.5f * (near + far);
    if (count_at_least(x, n, max - mid) >= k) {
      far = mid;
    } else {
      near = mid;
    }
  }
  return max - far;
}

// Ids (in id order) of the k largest raw logits and every entry tied with the k-th (k < n).
void top_k_ids(const float* x, int64_t n, int64_t k, float max, std::vector<int32_t>* ids,
               std::vector<float>* scratch) {
  collect_at_least(x, n, top_k_floor(x, n, k, max), ids);
  scratch->resize(ids->size());
  for (size_t j = 0; j < ids->size(); ++j) (*scratch)[j] = x[(*ids)[j]];
  std::nth_element(scratch->begin(), scratch->begin() + (k - 1), scratch->end(),
                   std::greater<float>());
  const float kth = (*scratch)[k - 1];
  ids->erase(std::remove_if(ids->begin(), ids->end(), [&](int32_t i) { return x[i] < kth; }),
             ids->end());
}

// out[j] = exp(t[j] - max) for every j, each through exp8 (the tail padded), so an entry's value
// does not depend on where it sits in the list.
void exp_shifted(const float* t, int64_t n, float max, float* out) {
  const __m256 vmax = _mm256_set1_ps(max);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(out + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(t + j), vmax)));
  }
  if (j < n) {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, exp8(_mm256_sub_ps(load8_padded(t, j, n), vmax)));
    for (int64_t l = 0; j + l < n; ++l) out[j + l] = buf[l];
  }
}

// The kept list from ids: tempered logits and their exps.
void fill_kept(const float* x, const std::vector<int32_t>& ids, const Filters& f, float max_t,
               Kept* kept) {
  kept->id = ids;
  kept->t.resize(ids.size());
  for (size_t j = 0; j < ids.size(); ++j) {
    kept->t[j] = f.temperature == 1.0f ? x[ids[j]] : x[ids[j]] / f.temperature;
  }
  kept->e.resize(ids.size());
  exp_shifted(kept->t.data(), static_cast<int64_t>(ids.size()), max_t, kept->e.data());
}

double kept_mass(const Kept& kept) {
  double z = 0.0;
  for (float e : kept.e) z += e;
  return z;
}

// Dense mass: per block of kBlock entries, sum of exp(t - max) over entries with t >= thr.
void dense_block_sums(const float* x, int64_t n, const Filters& f, float max_t, float thr,
                      std::vector<double>* sums) {
  const bool scaled = f.temperature != 1.0f;
  const __m256 vT = _mm256_set1_ps(f.temperature), vmax = _mm256_set1_ps(max_t),
               vthr = _mm256_set1_ps(thr);
  sums->resize((n + kBlock - 1) / kBlock);
  for (int64_t b = 0; b * kBlock < n; ++b) {
    __m256 acc = _mm256_setzero_ps();
    const int64_t end = std::min(n, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; i += 8) {
      const __m256 t = temper8(load8_padded(x, i, n), vT, scaled);
      const __m256 e = exp8(_mm256_sub_ps(t, vmax));
      acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_cmp_ps(t, vthr, _CMP_GE_OQ)));
    }
    (*sums)[b] = hsum(acc);
  }
}

// Distances below the maximum (tempered units) at which the row's mass above is measured in
// the same pass as its whole mass: the nearest whose mass reaches top_p bounds the nucleus,
// far tighter than the (1 - top_p) / V bound on real logits.
constexpr float kFloors[] = {4.0f, 8.0f, 16.0f};
constexpr int kNumFloors = sizeof(kFloors) / sizeof(kFloors[0]);

// Mass of exp(t - max) over the row -> the whole; above[j]: over the entries >= max - kFloors[j].
double dense_mass(const float* x, int64_t n, const Filters& f, float max_t,
                  double above[kNumFloors]) {
  const bool scaled = f.temperature != 1.0f;
  const __m256 vT = _mm256_set1_ps(f.temperature), vmax = _mm256_set1_ps(max_t);
  __m256 floors[kNumFloors];
  for (int j = 0; j < kNumFloors; ++j) floors[j] = _mm256_set1_ps(max_t - kFloors[j]);
  double whole = 0.0;
  for (int j = 0; j < kNumFloors; ++j) above[j] = 0.0;
  for (int64_t b = 0; b * kBlock < n; ++b) {
    __m256 acc = _mm256_setzero_ps();
    __m256 acc_above[kNumFloors];
    for (int j = 0; j < kNumFloors; ++j) acc_above[j] = _mm256_setzero_ps();
    const int64_t end = std::min(n, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; i += 8) {
      const __m256 t = temper8(load8_padded(x, i, n), vT, scaled);
      const __m256 e = exp8(_mm256_sub_ps(t, vmax));
      acc = _mm256_add_ps(acc, e);
      for (int j = 0; j < kNumFloors; ++j) {
        acc_above[j] = _mm256_add_ps(
            acc_above[j], _mm256_and_ps(e, _mm256_cmp_ps(t, floors[j], _CMP_GE_OQ)));
      }
    }
    whole += hsum(acc);
    for (int j = 0; j < kNumFloors; ++j) above[j] += hsum(acc_above[j]);
  }
  return whole;
}

// The cut of the nucleus among `cand` (a superset of it, in id order), `target` = top_p times
// the mass the nucleus is a share of: the first value, in descending order, where the running
// mass reaches `target`; -inf when the candidates never reach it (rounding: keep them all).
float nucleus_cut(const Kept& cand, float max_t, double target) {
  float lo = max_t;
  double total = 0.0;
  for (size_t j = 0; j < cand.e.size(); ++j) {
    if (cand.e[j] > 0.0f) {
      lo = std::min(lo, cand.t[j]);
      total += cand.e[j];
    }
  }
  if (total < target) return -kInf;
  if (lo == max_t) return max_t;
  // bins by (max - t): equal values share a bin, a larger value never sits in a later bin
  const double scale = kNumBins / static_cast<double>(max_t - lo);
  auto bin_of = [&](float t) {
    return std::min(kNumBins - 1, static_cast<int>(static_cast<double>(max_t - t) * scale));
  };
  std::vector<double> mass(kNumBins, 0.0);
  for (size_t j = 0; j < cand.e.size(); ++j) {
    if (cand.e[j] > 0.0f) mass[bin_of(cand.t[j])] += cand.e[j];
  }
  double above = 0.0;
  int bin = 0;
  for (; bin < kNumBins - 1 && above + mass[bin] < target; ++bin) above += mass[bin];
  std::vector<std::pair<float, float>> in_bin;  // (t, e) of the bin holding the cut
  for (size_t j = 0; j < cand.e.size(); ++j) {
    if (cand.e[j] > 0.0f && bin_of(cand.t[j]) == bin) in_bin.emplace_back(cand.t[j], cand.e[j]);
  }
  std::sort(in_bin.begin(), in_bin.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [t, e] : in_bin) {
    above += e;
    if (above >= target) return t;
  }
  return in_bin.empty() ? -kInf : in_bin.back().first;
}

void keep_at_least(Kept* kept, float thr) {
  size_t w = 0;
  for (size_t j = 0; j < kept->id.size(); ++j) {
    if (kept->t[j] >= thr) {
      kept->id[w] = kept->id[j];
      kept->t[w] = kept->t[j];
      kept->e[w] = kept->e[j];
      ++w;
    }
  }
  kept->id.resize(w);
  kept->t.resize(w);
  kept->e.resize(w);
}

// A drawn token and its probability under the filtered distribution.
struct Drawn {
  int64_t id;
  float prob;
};

// u * (kept mass), walked in id order over the list.
Drawn walk_kept(const Kept& kept, double u) {
  const double z = kept_mass(kept), target = u * z;
  double acc = 0.0;
  Drawn last{kept.id.empty() ? 0 : kept.id.back(), 0.0f};
  for (size_t j = 0; j < kept.id.size(); ++j) {
    if (kept.e[j] <= 0.0f) continue;
    acc += kept.e[j];
    last = {kept.id[j], static_cast<float>(kept.e[j] / z)};
    if (acc > target) return last;
  }
  return last;  // rounding: the last entry with mass
}

// u * (mass of the entries >= thr), walked in id order over the whole row.
Drawn walk_dense(const float* x, int64_t n, const Filters& f, float max_t, float thr, double u,
                 std::vector<double>* sums) {
  dense_block_sums(x, n, f, max_t, thr, sums);
  double z = 0.0;
  for (double s : *sums) z += s;
  const double target = u * z;
  double acc = 0.0;
  int64_t b = 0, last_block = -1;
  const int64_t num_blocks = static_cast<int64_t>(sums->size());
  for (; b < num_blocks; ++b) {
    if ((*sums)[b] <= 0.0) continue;
    last_block = b;
    if (acc + (*sums)[b] > target) break;
    acc += (*sums)[b];
  }
  if (b == num_blocks) {  // rounding (u * z reached z): the last block with mass
    b = last_block;
    acc -= (*sums)[b];
  }
  const int64_t start = b * kBlock, end = std::min(n, start + kBlock);
  alignas(32) float t[kBlock], e[kBlock];
  for (int64_t i = start; i < end; ++i) {
    t[i - start] = f.temperature == 1.0f ? x[i] : x[i] / f.temperature;
  }
  exp_shifted(t, end - start, max_t, e);
  Drawn last{start, 0.0f};
  for (int64_t i = start; i < end; ++i) {
    const float ei = t[i - start] >= thr ? e[i - start] : 0.0f;
    if (ei <= 0.0f) continue;
    acc += ei;
    last = {i, static_cast<float>(ei / z)};
    if (acc > target) return last;
  }
  return last;
}

struct Scratch {
  std::vector<int32_t> ids;
  std::vector<float> values;
  std::vector<double> sums;
  Kept kept;
};

Drawn sample_row(const float* x, int64_t n, const Filters& f, double u, Scratch* s) {
  int64_t special;
  const float max_raw = row_max(x, n, &special);
  if (special >= 0) return {special, 1.0f};
  const float max_t = f.temperature == 1.0f ? max_raw : max_raw / f.temperature;
  const float min_p_thr =
      f.min_p > 0.0 ? max_t + static_cast<float>(std::log(f.min_p)) : -kInf;
  const bool top_k = f.top_k > 0 && f.top_k < n;
  if (!top_k && f.top_p >= 1.0) return walk_dense(x, n, f, max_t, min_p_thr, u, &s->sums);
  double z;  // the mass the nucleus is a share of: the top-k set's, or the whole row's
  if (top_k) {
    top_k_ids(x, n, f.top_k, max_raw, &s->ids, &s->values);
    fill_kept(x, s->ids, f, max_t, &s->kept);
    z = kept_mass(s->kept);
  } else {
    double above[kNumFloors];
    z = dense_mass(x, n, f, max_t, above);
    // the nearest floor whose mass reaches top_p z holds the nucleus; else the bound that
    // always does: entries below max + log(z (1 - top_p) / V) hold less than (1 - top_p) z
    double floor_t = max_t + std::log(z * (1.0 - f.top_p) / static_cast<double>(n));
    for (int j = 0; j < kNumFloors; ++j) {
      if (above[j] >= f.top_p * z * (1.0 + 1e-6)) {
        floor_t = std::max(floor_t, static_cast<double>(max_t - kFloors[j]));
        break;
      }
    }
    // raw logits >= this hold every tempered value >= floor_t (lowered so rounding in the
    // division cannot leave one out)
    const float thr_raw = static_cast<float>((floor_t - 1e-3) * f.temperature) -
                          1e-3f * std::fabs(max_raw);
    collect_at_least(x, n, thr_raw, &s->ids);
    fill_kept(x, s->ids, f, max_t, &s->kept);
  }
  if (f.top_p < 1.0) {
    const float cut = nucleus_cut(s->kept, max_t, f.top_p * z);
    if (cut == -kInf && !top_k) {  // rounding left the nucleus short: every entry (as PyTorch)
      return walk_dense(x, n, f, max_t, min_p_thr, u, &s->sums);
    }
    keep_at_least(&s->kept, cut);
  }
  keep_at_least(&s->kept, min_p_thr);
  return walk_kept(s->kept, u);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits,
                                               const at::Tensor& uniforms, double temperature,
                                               int64_t top_k, double top_p, double min_p,
                                               bool with_prob) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
                  logits.size(1) < std::numeric_limits<int32_t>::max(),
              "speculant::sample_rows: logits must be a contiguous 2-D float32 CPU tensor with "
              "at least one column, got ", logits.sizes(), " ", logits.scalar_type());
  TORCH_CHECK(uniforms.device().is_cpu() && uniforms.scalar_type() == at::kDouble &&
                  uniforms.dim() == 1 && uniforms.size(0) == logits.size(0),
              "speculant::sample_rows: uniforms must be a float64 CPU tensor [", logits.size(0),
              "], got ", uniforms.sizes(), " ", uniforms.scalar_type());
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature),
              "speculant::sample_rows: temperature must be > 0, got ", temperature);
  TORCH_CHECK(top_k >= 0, "speculant::sample_rows: top_k must be >= 0, got ", top_k);
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "speculant::sample_rows: top_p must be in (0, 1], got ",
              top_p);
  TORCH_CHECK(min_p >= 0.0 && min_p <= 1.0,
              "speculant::sample_rows: min_p must be in [0, 1], got ", min_p);
  const int64_t R = logits.size(0), V = logits.size(1);
  const at::Tensor u = uniforms.contiguous();
  at::Tensor ids = at::empty({R}, logits.options().dtype(at::kLong));
  at::Tensor probs = at::empty({with_prob ? R : 0}, logits.options());
  const float* xp = logits.const_data_ptr<float>();
  const double* up = u.const_data_ptr<double>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* pp = with_prob ? probs.data_ptr<float>() : nullptr;
  const Filters f{static_cast<float>(temperature), top_k, top_p, min_p};
  parallel_for(R, 1, [&](int64_t r0, int64_t r1) {
    Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const Drawn d = sample_row(xp + r * V, V, f, up[r], &scratch);
      ip[r] = d.id;
      if (pp != nullptr) pp[r] = d.prob;
    }
  });
  return {ids, probs};
}

}  // namespace speculant
