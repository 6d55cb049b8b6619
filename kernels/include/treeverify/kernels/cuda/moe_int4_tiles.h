// INT4 experts (compressed-tensors pack-quantized: 4-bit symmetric, stored value + 8, a bf16
// scale per group of 32 along the reduction; Kimi-K2-Thinking's experts) as the GPU's weight stream
// reads them (moe_records.h): W4A16, dequantized in registers, never in memory.
//
// A record is 4 KB of nibbles and 512 bytes of scales:
// - Words: byte ((warp * 32 + lane) * 4 + k) * 4 is the 32-bit word of the lane for k-step k; its
//   pair p (the nibbles at bits 4p and 16 + 4p) is A register p (moe_records.h). So
//   (word >> 4p) & 0x000f000f | 0x43004300 is the pair as bf16 128 + nibble, exactly.
// - Scales, after the words: byte 4096 + ((warp * 8 + g) * 2 + group) * 4 holds the bf16 scales
//   of fragment rows g (low half) and g + 8 (high half) for the record's group 0 (columns 0-31,
//   k-steps 0 and 1) or 1 (32-63, k-steps 2 and 3).
//
// A weight is bf16((nibble - 8) x scale), rounded once: the bf16 a loader makes of the
// dequantized fp32 weight. So the stream's products are the bf16 tiles' of the same weights
// dequantized (its sums too, bit for bit, where neither stream cuts the reduction into parts).
// Rows and columns past the matrix are nibble 8 with scale 0 (zeros).
//
//   const MoeRecordLayout gate_up = Int4GateUpLayout(intermediate, hidden);
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
#include "treeverify/kernels/cuda/moe_records.h"
#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels::cuda {

struct MoeInt4Records {
  static constexpr int64_t kGroup = 32;  // columns per scale: the only group size read here
  static constexpr int64_t kWordBytes = MoeRecordLayout::kRows * MoeRecordLayout::kColumns / 2;
  static constexpr int64_t kScaleBytes =
      MoeRecordLayout::kRows * (MoeRecordLayout::kColumns / kGroup) * 2;
  static constexpr int64_t kRecordBytes = kWordBytes + kScaleBytes;  // 4608
};

TV_HOST_DEVICE inline constexpr MoeRecordLayout Int4GateUpLayout(int64_t intermediate,
                                                                 int64_t hidden) {
  return {.rows = intermediate,
          .cols = hidden,
          .gate_up = true,
          .record_bytes = MoeInt4Records::kRecordBytes};
}
TV_HOST_DEVICE inline constexpr MoeRecordLayout Int4DownLayout(int64_t hidden,
                                                               int64_t intermediate) {
  return {.rows = hidden,
          .cols = intermediate,
          .gate_up = false,
          .record_bytes = MoeInt4Records::kRecordBytes};
}

// `experts` experts' checkpoint tensors into the layout's records at `tiles`
// (layout.ExpertBytes() * experts bytes, 16-byte aligned; every byte written). words[m] /
// scales[m] are matrix m's (gate and up for a gate/up layout, down alone otherwise): per expert
// [rows, ceil(cols / 8)] words and [rows, ceil(cols / 32)] bf16 scales, experts one after another.
absl::Status PackInt4ExpertTilesOnDevice(const std::array<const uint32_t*, 2>& words,
                                         const std::array<const Bf16*, 2>& scales, int64_t experts,
                                         const MoeRecordLayout& layout, uint8_t* tiles,
                                         cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
