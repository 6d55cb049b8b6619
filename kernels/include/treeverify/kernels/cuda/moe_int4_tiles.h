// The routed experts' INT4 weights (compressed-tensors pack-quantized: 4-bit symmetric, stored
// value + 8, a bf16 scale per group of 32 along the reduction; Kimi-K2-Thinking's experts) as the
// GPU's weight stream reads them: W4A16, dequantized in registers, never in memory.
//
// The stream's stage is the bf16 tiles' (moe_tiles.h): 128 rows x 64 reduction columns (gate/up:
// 64 rows of gate and the same 64 of up), its eight consumer warps owning 16 "fragment rows"
// each. Here a stage is 4 KB of nibbles and 512 bytes of scales, laid out so that each consumer
// thread's A fragments of mma.sync m16n8k16 are one 16-byte load and its scales one 8-byte load:
//
// - Words: byte ((warp * 32 + lane) * 4 + k) * 4 is the 32-bit word of lane (g = lane / 4,
//   q = lane % 4) for k-step k (columns 16k..16k + 15 of the stage). Its pair p (nibble at bits 4p
//   and at bits 16 + 4p) is A register p: p = 0 row g, columns 2q and 2q + 1; p = 1 row g + 8,
//   the same columns; p = 2 row g, columns 2q + 8 and 2q + 9; p = 3 row g + 8, those columns. So
//   (word >> 4p) & 0x000f000f | 0x43004300 is the pair as bf16 128 + nibble, exactly.
// - Scales, after the words: byte 4096 + ((warp * 8 + g) * 2 + group) * 4 holds the bf16 scales
//   of fragment rows g (low half) and g + 8 (high half) for the stage's group 0 (columns 0-31,
//   k-steps 0 and 1) or 1 (32-63, k-steps 2 and 3).
// - Fragment row i of warp w is row 16w + i of a down tile; of a gate/up tile, row 8w + i of gate
//   for i < 8, row 8w + i - 8 of up otherwise (a thread holds gate and up of one row and token).
//
// A weight is bf16((nibble - 8) x scale), rounded once: the bf16 a loader makes of the
// dequantized fp32 weight. So the stream's products are the bf16 tiles' of the same weights
// dequantized (its sums too, bit for bit, where neither stream cuts the reduction into parts).
// Rows and columns past the matrix are nibble 8 with scale 0 (zeros). Stages follow each other in
// (expert, row tile, chunk of 64 columns) order, as the bf16 tiles do, so an item of the stream is
// one run of memory, and the stream's four-stage steps one bulk copy each.
//
//   const MoeInt4Layout gate_up = Int4GateUpLayout(intermediate, hidden);
//   // words / scales: the checkpoint's weight_packed (I32 [rows, ceil(cols / 8)]) and
//   // weight_scale (BF16 [rows, ceil(cols / 32)]) of every expert, one expert after another
//   TV_RETURN_IF_ERROR(PackInt4ExpertTilesOnDevice({gate_words, up_words}, {gate_scales,
//                                                  up_scales}, experts, gate_up, tiles, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels::cuda {

struct MoeInt4Layout {
  static constexpr int64_t kColumns = 64;  // reduction columns per stage
  static constexpr int64_t kGroup = 32;    // columns per scale: the only group size read here
  static constexpr int64_t kStageRows = 128;
  static constexpr int64_t kWordBytes = kStageRows * kColumns / 2;              // 4096
  static constexpr int64_t kScaleBytes = kStageRows * (kColumns / kGroup) * 2;  // 512
  static constexpr int64_t kStageBytes = kWordBytes + kScaleBytes;              // 4608

  int64_t rows = 0, cols = 0;  // one expert's matrix (gate/up: each of the two)
  bool gate_up = false;        // stages of 64 gate rows over the same 64 up rows

  TV_HOST_DEVICE constexpr int64_t TileRows() const { return gate_up ? 64 : 128; }
  TV_HOST_DEVICE constexpr int64_t RowTiles() const { return (rows + TileRows() - 1) / TileRows(); }
  TV_HOST_DEVICE constexpr int64_t Chunks() const { return (cols + kColumns - 1) / kColumns; }
  TV_HOST_DEVICE constexpr int64_t ExpertBytes() const {
    return RowTiles() * Chunks() * kStageBytes;
  }
  // Where stage (row_tile, chunk) of `expert` starts, in bytes.
  TV_HOST_DEVICE constexpr int64_t StageOffset(int64_t expert, int64_t row_tile,
                                               int64_t chunk) const {
    return ((expert * RowTiles() + row_tile) * Chunks() + chunk) * kStageBytes;
  }
  // Fragment row i (0-15) of consumer warp w: its matrix (gate 0, up 1; down 0) and row in the
  // stage's row tile.
  TV_HOST_DEVICE constexpr int FragmentMatrix(int i) const { return gate_up ? i / 8 : 0; }
  TV_HOST_DEVICE constexpr int64_t FragmentRow(int w, int i) const {
    return gate_up ? 8 * w + i % 8 : 16 * w + i;
  }
};

TV_HOST_DEVICE inline constexpr MoeInt4Layout Int4GateUpLayout(int64_t intermediate,
                                                               int64_t hidden) {
  return {.rows = intermediate, .cols = hidden, .gate_up = true};
}
TV_HOST_DEVICE inline constexpr MoeInt4Layout Int4DownLayout(int64_t hidden, int64_t intermediate) {
  return {.rows = hidden, .cols = intermediate, .gate_up = false};
}

// `experts` experts' checkpoint tensors into the layout's stages at `tiles`
// (layout.ExpertBytes() * experts bytes, 16-byte aligned; every byte written). words[m] /
// scales[m] are matrix m's (gate and up for a gate/up layout, down alone otherwise): per expert
// [rows, ceil(cols / 8)] words and [rows, ceil(cols / 32)] bf16 scales, experts one after another.
absl::Status PackInt4ExpertTilesOnDevice(const std::array<const uint32_t*, 2>& words,
                                         const std::array<const Bf16*, 2>& scales, int64_t experts,
                                         const MoeInt4Layout& layout, uint8_t* tiles,
                                         cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
