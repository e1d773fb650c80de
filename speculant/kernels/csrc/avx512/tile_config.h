// The AMX tile configuration (ldtilecfg's 64-byte operand, palette 1), shared by the tile
// kernels of this folder (included only here, compiled with the AMX flags: see
// linear_blocks.h why).
#pragma once

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

}  // namespace avx512
}  // namespace speculant
