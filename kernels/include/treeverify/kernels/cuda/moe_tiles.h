// The routed experts' weights as the GPU's weight stream reads them (bench/NOTES.md, steps
// 117-118): each expert's row-major [rows, cols] matrix cut into tiles of `tile_rows` rows x 64
// columns, each tile stored as the shared memory of the stream's stage holds it (row r's 128 bytes
// at r * 128, its 16-byte unit u at unit u ^ (r % 8): the 128-byte swizzle the consumers'
// ldmatrix reads), the tiles in (expert, row tile, column chunk) order. A work item of the stream
// (an expert's row tile, a range of chunks) is then one run of memory, read by one bulk copy a
// stage: the DRAM delivers such runs at the copy bandwidth, and gate/up's former boxes (64 pieces
// of 128 bytes, 14 KB apart) at 86 % of it. Rows and columns past the matrix are zeros.
//
// Gate and up: 64-row tiles ([intermediate, hidden]: a stage takes the same tile of each); down:
// 128-row tiles ([hidden, intermediate]).
//
//   const MoeTileLayout gate = GateUpTileLayout(intermediate, hidden);
//   std::vector<Bf16> tiles = PackExpertTiles(experts, gate, [&](int64_t e, int64_t r,
//                                             int64_t c) { return gate_proj[e][r * hidden + c]; });
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels::cuda {

struct MoeTileLayout {
  static constexpr int64_t kColumns = 64;  // a tile's columns: one 128-byte row of bf16

  int64_t rows = 0, cols = 0;  // one expert's matrix
  int64_t tile_rows = 0;

  TV_HOST_DEVICE constexpr int64_t RowTiles() const { return (rows + tile_rows - 1) / tile_rows; }
  TV_HOST_DEVICE constexpr int64_t Chunks() const { return (cols + kColumns - 1) / kColumns; }
  TV_HOST_DEVICE constexpr int64_t TileElements() const { return tile_rows * kColumns; }
  TV_HOST_DEVICE constexpr int64_t ExpertElements() const {
    return RowTiles() * Chunks() * TileElements();
  }
  // Where tile (row_tile, chunk) of `expert` starts, in elements.
  TV_HOST_DEVICE constexpr int64_t TileOffset(int64_t expert, int64_t row_tile,
                                              int64_t chunk) const {
    return ((expert * RowTiles() + row_tile) * Chunks() + chunk) * TileElements();
  }
  // Where element (row, col) of `expert` is, in elements; the 8 elements of a 16-byte unit
  // (col a multiple of 8) stay together.
  TV_HOST_DEVICE constexpr int64_t Offset(int64_t expert, int64_t row, int64_t col) const {
    const int64_t r = row % tile_rows, unit = (col % kColumns) / 8;
    return TileOffset(expert, row / tile_rows, col / kColumns) + r * kColumns +
           ((unit ^ (r % 8)) * 8) + col % 8;
  }
};

TV_HOST_DEVICE inline constexpr MoeTileLayout GateUpTileLayout(int64_t intermediate,
                                                               int64_t hidden) {
  return {.rows = intermediate, .cols = hidden, .tile_rows = 64};
}
TV_HOST_DEVICE inline constexpr MoeTileLayout DownTileLayout(int64_t hidden, int64_t intermediate) {
  return {.rows = hidden, .cols = intermediate, .tile_rows = 128};
}

// `experts` matrices in the layout, rounded to bf16 (to nearest even); value(e, r, c) is element
// (r, c) of expert e's row-major matrix.
template <typename Value>
std::vector<Bf16> PackExpertTiles(int64_t experts, const MoeTileLayout& layout, Value value) {
  std::vector<Bf16> tiles(static_cast<size_t>(experts * layout.ExpertElements()),
                          __float2bfloat16_rn(0.0f));
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = 0; r < layout.rows; ++r) {
      for (int64_t c = 0; c < layout.cols; ++c) {
        tiles[static_cast<size_t>(layout.Offset(e, r, c))] =
            __float2bfloat16_rn(static_cast<float>(value(e, r, c)));
      }
    }
  }
  return tiles;
}

}  // namespace treeverify::kernels::cuda
