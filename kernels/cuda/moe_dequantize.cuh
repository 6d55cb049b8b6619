// Quantized expert weights: where their records are, and to bf16 in registers, a pair of weights
// (one bf16x2 A or B register of mma.sync) at a time, each the bf16 a loader makes of the fp32
// product (moe_int4_tiles.h, moe_fp8_tiles.h): the weight stream (moe_expert_tma_kernel.cuh) and
// the grouped GEMM (moe_expert_gemm_kernel.cuh) read the same records through these.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fp8_dequantize.cuh"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/cuda/moe_fp8_tiles.h"
#include "treeverify/kernels/cuda/moe_int4_tiles.h"
#include "treeverify/kernels/moe.h"

namespace treeverify::kernels::cuda::moe {

// Where one quantized format's records of gate/up (or of down) are in MoeExperts' params
// (moe_records.h), and their layout.
struct ExpertRecords {
  const uint8_t* base;
  MoeRecordLayout layout;
  __device__ const uint8_t* Record(int64_t expert, int64_t row_tile, int64_t chunk) const {
    return base + layout.RecordOffset(expert, row_tile, chunk);
  }
};
__device__ inline ExpertRecords RecordsOf(const MoeExpertsParamsOf<Bf16, Bf16>& p, bool int4,
                                          bool gate_up) {
  if (gate_up) {
    return {int4 ? p.int4_gate_up : p.fp8_gate_up, int4
                                                       ? Int4GateUpLayout(p.intermediate, p.hidden)
                                                       : Fp8GateUpLayout(p.intermediate, p.hidden)};
  }
  return {int4 ? p.int4_down : p.fp8_down, int4 ? Int4DownLayout(p.hidden, p.intermediate)
                                                : Fp8DownLayout(p.hidden, p.intermediate)};
}

// bf16 128 + n for the nibbles n at bits 0-3 and 16-19, exactly (the bf16 spacing at 128 is 1).
inline constexpr uint32_t kInt4Magic = 0x43004300u;
// bf16 136 twice: the magic's 128 and the format's offset of 8, subtracted exactly.
inline constexpr uint32_t kInt4Offset = 0x43084308u;

// (a & b) | c in one instruction: with b and c in registers (constants are materialised once), not
// immediates, of which a LOP3 takes one (C's `&` then `|` compiled to two).
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// bf16((n - 8) x scale) for the pair of nibbles at bits 0-3 and 16-19 of `shifted`: the
// subtraction is exact and the multiply rounds once, as a loader rounding the fp32 weight would.
__device__ __forceinline__ uint32_t DequantizeInt4Pair(uint32_t shifted, uint32_t scale_pair) {
  const uint32_t biased = AndOr(shifted, 0x000f000fu, kInt4Magic);
  const __nv_bfloat162 value =
      __hmul2(__hsub2(BitCast<__nv_bfloat162>(biased), BitCast<__nv_bfloat162>(kInt4Offset)),
              BitCast<__nv_bfloat162>(scale_pair));
  return BitCast<uint32_t>(value);
}

// A fragment word of an INT4 record (moe_int4_tiles.h) as its k-step's four A registers: `scales`
// holds the bf16 scales of the word's group for fragment rows g (low half) and g + 8 (high half),
// and register p is row g's for even p, row g + 8's for odd.
__device__ __forceinline__ void DequantizeInt4Word(uint32_t word, uint32_t scales,
                                                   uint32_t (&registers)[4]) {
  const uint32_t row_g = __byte_perm(scales, 0, 0x1010);   // row g's scale, twice
  const uint32_t row_g8 = __byte_perm(scales, 0, 0x3232);  // row g + 8's
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    registers[p] = DequantizeInt4Pair(word >> (4 * p), p % 2 == 0 ? row_g : row_g8);
  }
}

// A k-step's eight e4m3 bytes of an FP8 record (moe_fp8_tiles.h), `first` registers 0 and 1,
// `second` 2 and 3, as its four A registers, rows g and g + 8 scaled by their blocks' scales.
__device__ __forceinline__ void DequantizeFp8Word(uint32_t first, uint32_t second, float row_g,
                                                  float row_g8, uint32_t (&registers)[4]) {
  registers[0] = DequantizeFp8Pair(first, row_g);
  registers[1] = DequantizeFp8Pair(first >> 16, row_g8);
  registers[2] = DequantizeFp8Pair(second, row_g);
  registers[3] = DequantizeFp8Pair(second >> 16, row_g8);
}

}  // namespace treeverify::kernels::cuda::moe
