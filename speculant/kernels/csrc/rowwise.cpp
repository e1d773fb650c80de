// Row-wise operators: RMSNorm (optionally fused with the residual add) and the SiLU-gated
// product of the MLP. Each row is computed by one thread with rows.h's fixed instruction
// sequence, so a row's result never depends on the other rows of the batch.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "ops.h"
#include "pool.h"
#include "rows.h"

namespace speculant {
namespace {

// Rows per chunk: a row of a few hundred floats is ~0.1 us of work, so small batches (decode)
// stay on the calling thread.
constexpr int64_t kMinRowsPerChunk = 32;

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "speculant::", op, ": ", name, " must be a contiguous 2-D float32 CPU tensor");
}

void check_weight(const at::Tensor& w, int64_t n, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 &&
                  w.size(0) == n && w.is_contiguous(),
              "speculant::", op, ": weight must be a contiguous float32 CPU tensor of ", n,
              " elements");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  const int64_t T = x.size(0), D = x.size(1);
  check_weight(weight, D, "rms_norm");
  at::Tensor y = at::empty({T, D}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  parallel_for(T, balanced_chunk(T, kMinRowsPerChunk), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_norm_row(xp + t * D, wp, e, D, yp + t * D);
  });
  return y;
}

at::Tensor add_rms_norm(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  check_rows(h, "add_rms_norm", "h");
  check_rows(delta, "add_rms_norm", "delta");
  TORCH_CHECK(h.sizes() == delta.sizes(), "speculant::add_rms_norm: h is ", h.sizes(),
              " but delta is ", delta.sizes());
  const int64_t T = h.size(0), D = h.size(1);
  check_weight(weight, D, "add_rms_norm");
  at::Tensor y = at::empty({T, D}, h.options());
  float* hp = h.data_ptr<float>();
  const float* dp = delta.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  parallel_for(T, balanced_chunk(T, kMinRowsPerChunk), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      add_rms_norm_row(hp + t * D, dp + t * D, wp, e, D, yp + t * D);
    }
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "speculant::silu_mul: gate_up has an odd width ",
              gate_up.size(1));
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  at::Tensor y = at::empty({T, F}, gate_up.options());
  const float* gp = gate_up.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // a row of the MLP's width is ~1 us of exp: split across threads from 8 rows up
  parallel_for(T, balanced_chunk(T, 4), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      silu_mul_row(gp + t * 2 * F, gp + t * 2 * F + F, F, yp + t * F);
    }
  });
  return y;
}

}  // namespace speculant
