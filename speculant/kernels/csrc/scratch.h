// Scratch buffers kept across calls (thread_local or per-thread structs): grown to a call's
// size, never shrunk. std::vector::resize zero-fills what it regrows, so resizing to each call's
// own size wrote zeros into memory the call was about to overwrite whenever a call needed more
// than the one before (every layer's down projection after its up projection; attention
// partials of a verification chunk: ~470 KB per layer at 17 tokens and 3,000 positions). Callers
// write every element they read.
#pragma once

#include <cstdint>
#include <vector>

namespace speculant {

template <typename T>
void ensure_size(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

}  // namespace speculant
