// One row's greedy pick (argmax.cpp), shared with the kernels that find it as they write the row
// (linear.cpp: the LM head's logits and each row's argmax in one call).
#pragma once

#include <cstdint>

namespace speculant {

// Index of the first maximum of x[0..n) (n >= 1), or of the first NaN when x has one;
// *max_out gets x at that index. torch.argmax's answer.
int64_t argmax_row(const float* x, int64_t n, float* max_out);

}  // namespace speculant
