// Registers the kernels as torch.ops.speculant.* so they dispatch like built-in operators and
// stay traceable by torch.compile (their fake implementations live in native.py).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(speculant, m) {
  m.def(
      "packed_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? mins, str qtype, "
      "int out_features) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor token_seq, Tensor token_pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(speculant, CPU, m) {
  m.impl("packed_linear", &speculant::packed_linear);
  m.impl("paged_attention", &speculant::paged_attention);
}
