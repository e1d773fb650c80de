// The AMX tile configuration (ldtilecfg's 64-byte operand, palette 1), shared by the tile
// kernels of this folder (included only here, compiled with the AMX flags: see
// linear_blocks.h why).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace speculant {
namespace avx512 {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile register i
  uint8_t rows[16] = {};    // rows of tile register i
};

// The value sums of query tile qt, stored from nf C tiles of 16 features into value_tiles[f]
// ([16 rows][16]), copied to their queries' outputs (features [16 f0, 16 (f0 + nf))); the tile's
// rows past num_queries are left where they are.
inline void copy_value_rows(const float (*value_tiles)[16 * 16], int64_t qt, int64_t num_queries,
                            int64_t f0, int64_t nf, float* const* outs) {
  for (int64_t i = 0; i < 16 && qt * 16 + i < num_queries; ++i) {
    float* out = outs[qt * 16 + i];
    for (int64_t f = 0; f < nf; ++f) {
      _mm512_storeu_ps(out + 16 * (f0 + f), _mm512_load_ps(value_tiles[f] + i * 16));
    }
  }
}

}  // namespace avx512
}  // namespace speculant
