// FP8 experts (DeepSeek-V3 / R1: e4m3fn weights, an fp32 `weight_scale_inv` per 128 x 128 block)
// as the GPU's weight stream reads them (moe_records.h): W8A16, dequantized in registers.
//
// A record is 8 KB of weights and 16 bytes of scales:
// - Bytes: byte ((warp * 2 + k / 2) * 32 + lane) * 16 + (k % 2) * 8 + 2p + half is the e4m3 byte
//   of A register p's element `half` (moe_records.h) for k-step k: a thread's record is two 16-byte
//   loads, each lane's 16 bytes right after the previous lane's.
// - Scales, after the bytes: the fp32 scale of the block that holds the record's gate rows (down:
//   its rows), then of the block of its up rows (down: zero), then 8 bytes of zeros. A record's
//   rows (64 of gate or up, 128 of down, from a multiple of as many) and columns (64, from a
//   multiple of 64) lie in one block of each matrix.
//
// A weight is bf16(fp32(fp8) x scale): the fp32 product a loader makes of the checkpoint's
// values, rounded to bf16 as the loader's upload does. So the stream's products are the bf16
// tiles' of the same weights dequantized. Rows and columns past the matrix are zero bytes.
//
//   const MoeRecordLayout gate_up = Fp8GateUpLayout(intermediate, hidden);
//   // weights / scales: the checkpoint's weight (F8_E4M3 [rows, cols]) and weight_scale_inv
//   // (F32 [ceil(rows / 128), ceil(cols / 128)]) of every expert, one expert after another
//   TV_RETURN_IF_ERROR(PackFp8ExpertTilesOnDevice({gate, up}, {gate_scales, up_scales}, experts,
//                                                 gate_up, tiles, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/moe_records.h"
#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels::cuda {

struct MoeFp8Records {
  static constexpr int64_t kBlock = 128;  // rows and columns per scale: the only block size read
  static constexpr int64_t kWeightBytes = MoeRecordLayout::kRows * MoeRecordLayout::kColumns;
  static constexpr int64_t kScaleBytes = 16;
  static constexpr int64_t kRecordBytes = kWeightBytes + kScaleBytes;  // 8208
};

TV_HOST_DEVICE inline constexpr MoeRecordLayout Fp8GateUpLayout(int64_t intermediate,
                                                                int64_t hidden) {
  return {.rows = intermediate,
          .cols = hidden,
          .gate_up = true,
          .record_bytes = MoeFp8Records::kRecordBytes};
}
TV_HOST_DEVICE inline constexpr MoeRecordLayout Fp8DownLayout(int64_t hidden,
                                                              int64_t intermediate) {
  return {.rows = hidden,
          .cols = intermediate,
          .gate_up = false,
          .record_bytes = MoeFp8Records::kRecordBytes};
}

// `experts` experts' checkpoint tensors into the layout's records at `tiles`
// (layout.ExpertBytes() * experts bytes, 16-byte aligned; every byte written). weights[m] /
// scales[m] are matrix m's (gate and up for a gate/up layout, down alone otherwise): per expert
// [rows, cols] e4m3 bytes and [ceil(rows / 128), ceil(cols / 128)] fp32 scales, experts one after
// another.
absl::Status PackFp8ExpertTilesOnDevice(const std::array<const uint8_t*, 2>& weights,
                                        const std::array<const float*, 2>& scales, int64_t experts,
                                        const MoeRecordLayout& layout, uint8_t* tiles,
                                        cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
