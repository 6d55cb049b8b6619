// Dense products whose weight is FP8 block-scaled as DeepSeek-V3 ships its projections: e4m3
// bytes, and one fp32 scale for each 128 x 128 block (quantized_weights.h). Their weight value is
// bf16(fp32(e4m3) x scale), the bf16 the format's own dequantization makes and the CPU oracle
// holds, so a product of FP8 weights computes what the bf16 product of those values computes.
//
// GemmRunner (gemm.h) runs them: at verify sizes ResidentGemm streams the bytes and dequantizes in
// registers (W8A16, half the bf16 weight's bytes); larger products are dequantized into the
// runner's scratch and go to cuBLASLt as bf16 (prefill: the tensor cores bound them, not the
// weight's bytes).
//
//   TV_RETURN_IF_ERROR(gemm->Run(BlockFp8GemmParamsOf<Bf16>{
//       .product = {.x = x, .weight = w.values, .y = y, .m = rows, .n = 1536, .k = 7168},
//       .scales = w.scales}, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/gemm.h"

namespace treeverify::kernels::cuda {

inline constexpr int64_t kFp8BlockSize = 128;  // rows and columns of a scale's block

// Scale columns of a weight k wide: its blocks along a row.
constexpr int64_t Fp8ScaleColumns(int64_t k) { return (k + kFp8BlockSize - 1) / kFp8BlockSize; }
// Scales of one product's n x k weight.
constexpr int64_t Fp8ScaleCount(int64_t n, int64_t k) {
  return (n + kFp8BlockSize - 1) / kFp8BlockSize * Fp8ScaleColumns(k);
}

// `product.weight` is the e4m3 bytes [batch][n, k], rows k apart (weight_stride 0 or k), products
// weight_batch_stride bytes apart; `scales` [batch][ceil(n / 128), ceil(k / 128)], products
// scale_batch_stride floats apart (0: Fp8ScaleCount(n, k)).
template <typename Output>
struct BlockFp8GemmParamsOf {
  GemmParamsOf<Bf16, uint8_t, Output> product;
  const float* scales = nullptr;
  int64_t scale_batch_stride = 0;
};

// Every product's weight of `p` as bf16 into `out` [batch][n, k] (contiguous): the values the
// products compute with. Asynchronous on `stream`.
absl::Status DequantizeBlockFp8(const BlockFp8GemmParamsOf<Bf16>& p, Bf16* out,
                                cudaStream_t stream);
absl::Status DequantizeBlockFp8(const BlockFp8GemmParamsOf<float>& p, Bf16* out,
                                cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
