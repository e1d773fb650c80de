// A per-thread scratch buffer for the AVX-512 attention files, 64-byte aligned (tile loads and
// 512-bit vectors), grown as needed and never shrunk or zero-filled (callers write what they
// read). Plain malloc, no STL: these files include nothing shared with the AVX2 objects
// (linear_blocks.h says why).
#pragma once

#include <cstdint>
#include <cstdlib>

namespace speculant {
namespace avx512 {

struct AlignedScratch {
  void* data = nullptr;
  int64_t bytes = 0;
  ~AlignedScratch() { free(data); }
  void* get(int64_t n) {
    if (n > bytes) {
      free(data);
      bytes = (n + 63) / 64 * 64;
      data = aligned_alloc(64, bytes);
    }
    return data;
  }
};

}  // namespace avx512
}  // namespace speculant
