// The routed experts' weights as the GPU's weight stream reads them (bench/NOTES.md, steps
// 117-118): each expert's row-major [rows, cols] matrix cut into tiles of `tile_rows` rows x 64
// columns, each tile stored as the shared memory of the stream's stage holds it (row r's 128 bytes
// at r * 128, its 16-byte unit u at unit u ^ (r % 8): the 128-byte swizzle the consumers'
// ldmatrix reads), the tiles in (expert, row tile, column chunk) order, and the tiles of
// `interleave` matrices of the same shape alternating (gate and up: a stage takes the same tile of
// each, 16 KB end to end). A work item of the stream (an expert's row tile, a range of chunks) is
// then one run of memory, read by one bulk copy a stage: the DRAM delivers such runs at the copy
// bandwidth, and gate/up's former boxes (64 pieces of 128 bytes, 14 KB apart) at 86 % of it. Rows
// and columns past the matrix are zeros.
//
// Gate and up: 64-row tiles of [intermediate, hidden], interleaved, in one allocation whose up
// tiles start one tile in; down: 128-row tiles of [hidden, intermediate].
//
//   const MoeTileLayout gate_up = GateUpTileLayout(intermediate, hidden);  // on the host:
//   std::vector<Bf16> tiles = PackExpertTiles(experts, gate_up, [&](int m, int64_t e, int64_t r,
//       int64_t c) { return (m == 0 ? gate : up)[e][r * hidden + c]; });
//   params.packed_gate = device_tiles; params.packed_up = device_tiles + gate_up.TileElements();
//   // or on the device, from row-major bf16: PackExpertTilesOnDevice(gate, experts, gate_up, 0,
//   // device_tiles, stream), the same for up with matrix 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels::cuda {

struct MoeTileLayout {
  static constexpr int64_t kColumns = 64;  // a tile's columns: one 128-byte row of bf16

  int64_t rows = 0, cols = 0;  // one expert's matrix
  int64_t tile_rows = 0;
  int64_t interleave = 1;  // matrices whose tiles alternate

  TV_HOST_DEVICE constexpr int64_t RowTiles() const { return (rows + tile_rows - 1) / tile_rows; }
  TV_HOST_DEVICE constexpr int64_t Chunks() const { return (cols + kColumns - 1) / kColumns; }
  TV_HOST_DEVICE constexpr int64_t TileElements() const { return tile_rows * kColumns; }
  // One expert's elements, of all the interleaved matrices.
  TV_HOST_DEVICE constexpr int64_t ExpertElements() const {
    return RowTiles() * Chunks() * TileElements() * interleave;
  }
  // Where tile (row_tile, chunk) of `expert` starts, in elements, for the first of the
  // interleaved matrices (matrix m's is TileElements() * m further).
  TV_HOST_DEVICE constexpr int64_t TileOffset(int64_t expert, int64_t row_tile,
                                              int64_t chunk) const {
    return ((expert * RowTiles() + row_tile) * Chunks() + chunk) * TileElements() * interleave;
  }
  // Where row r's 16-byte unit u of a tile is, in elements from the tile's start.
  TV_HOST_DEVICE static constexpr int64_t UnitInTile(int64_t r, int64_t u) {
    return r * kColumns + ((u ^ (r % 8)) * 8);
  }
  // Where element (row, col) of `expert` is, in elements (first matrix); the 8 elements of a
  // 16-byte unit (col a multiple of 8) stay together.
  TV_HOST_DEVICE constexpr int64_t Offset(int64_t expert, int64_t row, int64_t col) const {
    return TileOffset(expert, row / tile_rows, col / kColumns) +
           UnitInTile(row % tile_rows, col % kColumns / 8) + col % 8;
  }
};

TV_HOST_DEVICE inline constexpr MoeTileLayout GateUpTileLayout(int64_t intermediate,
                                                               int64_t hidden) {
  return {.rows = intermediate, .cols = hidden, .tile_rows = 64, .interleave = 2};
}
TV_HOST_DEVICE inline constexpr MoeTileLayout DownTileLayout(int64_t hidden, int64_t intermediate) {
  return {.rows = hidden, .cols = intermediate, .tile_rows = 128};
}

// `experts` experts' matrices in the layout, rounded to bf16 (to nearest even); value(m, e, r, c)
// is element (r, c) of interleaved matrix m's (0 for a layout of one) of expert e, row-major.
template <typename Value>
std::vector<Bf16> PackExpertTiles(int64_t experts, const MoeTileLayout& layout, Value value) {
  std::vector<Bf16> tiles(static_cast<size_t>(experts * layout.ExpertElements()),
                          __float2bfloat16_rn(0.0f));
  for (int m = 0; m < layout.interleave; ++m) {
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t r = 0; r < layout.rows; ++r) {
        for (int64_t c = 0; c < layout.cols; ++c) {
          tiles[static_cast<size_t>(layout.Offset(e, r, c) + m * layout.TileElements())] =
              __float2bfloat16_rn(static_cast<float>(value(m, e, r, c)));
        }
      }
    }
  }
  return tiles;
}

// The same on the device, for one of the interleaved matrices (`matrix`): `experts` row-major
// [rows, cols] matrices, one after another at `row_major` (cols a multiple of 8), into `tiles`
// (layout.ExpertElements() * experts elements; the padding, where the shape has any, is left as
// it is: zero the allocation first). Both 16-byte aligned.
absl::Status PackExpertTilesOnDevice(const Bf16* row_major, int64_t experts,
                                     const MoeTileLayout& layout, int matrix, Bf16* tiles,
                                     cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
