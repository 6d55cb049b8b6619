// A pair of e4m3 weights to bf16 in registers: one bf16x2 register of an mma.sync fragment, the
// bf16 of the fp32 product with its scale that a loader makes (quantized_weights.h). Shared by the
// FP8 expert records (moe_dequantize.cuh) and the FP8 dense products (block_fp8.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

namespace treeverify::kernels::cuda {

// The bits of `from` as a `To` of the same size (register moves; no conversion).
template <typename To, typename From>
__device__ __forceinline__ To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

// bf16(fp32(e4m3) x scale) for the pair of e4m3 bytes in the low 16 bits of `bytes` (low byte the
// low half): the e4m3 to half conversion is exact, the multiply rounds once in fp32, then once
// more to bf16, as the loader's fp32 product rounded by its upload.
__device__ __forceinline__ uint32_t DequantizeFp8Pair(uint32_t bytes, float scale) {
  const __half2_raw halves =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bytes & 0xffffu), __NV_E4M3);
  const float2 values = __half22float2(BitCast<__half2>(halves));
  return BitCast<uint32_t>(
      __floats2bfloat162_rn(__fmul_rn(values.x, scale), __fmul_rn(values.y, scale)));
}

}  // namespace treeverify::kernels::cuda
