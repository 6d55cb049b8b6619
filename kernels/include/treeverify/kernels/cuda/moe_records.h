// The routed experts' quantized weights as the GPU's weight stream reads them
// (moe_expert_tma_kernel.cuh): one expert's matrix cut into records of 128 rows x 64 reduction
// columns (gate/up: 64 rows of gate over the same 64 rows of up), each record laid out so that a
// consumer thread's A fragments of mma.sync m16n8k16 are one or two loads, the records in
// (expert, row tile, chunk of 64 columns) order as the bf16 tiles (moe_tiles.h) are, so that an
// item of the stream is one run of memory and a stage of several records one bulk copy. What a
// record holds is its format's: moe_int4_tiles.h (INT4 groups of 32), moe_fp8_tiles.h (FP8
// blocks of 128 x 128).
//
// The stream's eight consumer warps own 16 "fragment rows" each: fragment row i of warp w is row
// 16w + i of a down tile; of a gate/up tile, row 8w + i of gate for i < 8, row 8w + i - 8 of up
// otherwise (a thread holds gate and up of one row and token). Thread (g = lane / 4, q = lane % 4)
// holds, for k-step k (columns 16k..16k + 15 of the record), A register p: p = 0 row g, columns
// 2q and 2q + 1; p = 1 row g + 8, the same columns; p = 2 row g, columns 2q + 8 and 2q + 9; p = 3
// row g + 8, those columns.
#pragma once

#include <cstdint>

#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels::cuda {

struct MoeRecordLayout {
  static constexpr int64_t kColumns = 64;  // reduction columns per record
  static constexpr int64_t kRows = 128;    // fragment rows per record

  int64_t rows = 0, cols = 0;  // one expert's matrix (gate/up: each of the two)
  bool gate_up = false;        // records of 64 gate rows over the same 64 up rows
  int64_t record_bytes = 0;    // the format's

  TV_HOST_DEVICE constexpr int64_t TileRows() const { return gate_up ? kRows / 2 : kRows; }
  TV_HOST_DEVICE constexpr int64_t RowTiles() const { return (rows + TileRows() - 1) / TileRows(); }
  TV_HOST_DEVICE constexpr int64_t Chunks() const { return (cols + kColumns - 1) / kColumns; }
  TV_HOST_DEVICE constexpr int64_t ExpertBytes() const {
    return RowTiles() * Chunks() * record_bytes;
  }
  // Where record (row_tile, chunk) of `expert` starts, in bytes.
  TV_HOST_DEVICE constexpr int64_t RecordOffset(int64_t expert, int64_t row_tile,
                                                int64_t chunk) const {
    return ((expert * RowTiles() + row_tile) * Chunks() + chunk) * record_bytes;
  }
  // Fragment row i (0-15) of consumer warp w: its matrix (gate 0, up 1; down 0) and its row in
  // the record's row tile.
  TV_HOST_DEVICE constexpr int FragmentMatrix(int i) const { return gate_up ? i / 8 : 0; }
  TV_HOST_DEVICE constexpr int64_t FragmentRow(int w, int i) const {
    return gate_up ? 8 * w + i % 8 : 16 * w + i;
  }
  // The record column of A register p's element `half` (0 low, 1 high) for k-step k and lane
  // quad position q; its fragment row is g + 8 * (p % 2).
  TV_HOST_DEVICE static constexpr int64_t FragmentColumn(int k, int q, int p, int half) {
    return 16 * k + 2 * q + 8 * (p / 2) + half;
  }
};

}  // namespace treeverify::kernels::cuda
