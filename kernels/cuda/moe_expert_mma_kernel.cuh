// The MoE expert projections on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate), for
// reduction lengths that are a multiple of 32. A block takes one tile of 16 weight rows of one
// active expert and one pass of up to 8 of its tokens (the mma's N); its warps split the
// reduction dimension and add their partial tiles through shared memory in warp order, so the
// sum's order is fixed. Gate and up tiles are computed together and leave as silu(gate) * up.
//
// Fragments are loaded straight from global memory, 16 bytes per lane per row: lane (g, t) reads
// elements [8t, 8t + 8) of a 32-element chunk of rows g and g + 8 (A) and of token g (B). The mma
// sums over k in its own order, so any permutation of k applied alike to A and B gives the same
// product: physical elements 8t..8t+3 serve the first k-step as its logical columns 2t, 2t + 1,
// 2t + 8, 2t + 9, and 8t+4..8t+7 the second. A warp keeps kUnroll chunks of every row in flight.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "element_convert.cuh"
#include "mma_sync_primitives.cuh"

namespace treeverify::kernels::cuda::moe {

inline constexpr int kMmaWarps = 8;
inline constexpr int kMmaThreads = kMmaWarps * 32;
inline constexpr int kMmaRows = 16;   // weight rows per tile (the mma's M)
inline constexpr int kMmaTokens = 8;  // tokens per pass (the mma's N)
inline constexpr int kMmaChunk = 32;  // reduction elements per 16-byte load of every lane

// A volatile load: the compiler keeps it ahead of the (volatile) mma instructions that follow it
// in the source, so a warp's kUnroll chunks are all in flight before the first mma. (Plain loads
// were moved down next to their use: 63 registers, 1.3 TB/s at one token, step 81.)
__device__ __forceinline__ uint4 LoadChunk(const __nv_bfloat16* row, int64_t chunk, int t,
                                           bool valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (valid) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(row + chunk * kMmaChunk + 8 * t));
  }
  return v;
}

// acc += rows (g, g + 8) x token g over chunks [begin, end) of `length`-element rows.
template <int kMatrices, int kUnroll>
__device__ __forceinline__ void MmaRows(const __nv_bfloat16* const (&rows_g)[kMatrices],
                                        const __nv_bfloat16* const (&rows_g8)[kMatrices],
                                        const __nv_bfloat16* x, bool has_token, int64_t begin,
                                        int64_t end, int t, float (&acc)[kMatrices][4]) {
  for (int64_t chunk = begin; chunk < end; chunk += kUnroll) {
    uint4 a_g[kUnroll][kMatrices], a_g8[kUnroll][kMatrices], b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool inside = chunk + u < end;
#pragma unroll
      for (int m = 0; m < kMatrices; ++m) {
        a_g[u][m] = LoadChunk(rows_g[m], chunk + u, t, inside);
        a_g8[u][m] = LoadChunk(rows_g8[m], chunk + u, t, inside);
      }
      b[u] = LoadChunk(x, chunk + u, t, inside && has_token);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int m = 0; m < kMatrices; ++m) {
        const uint32_t first[4] = {a_g[u][m].x, a_g8[u][m].x, a_g[u][m].y, a_g8[u][m].y};
        const uint32_t second[4] = {a_g[u][m].z, a_g8[u][m].z, a_g[u][m].w, a_g8[u][m].w};
        mma::MmaBf16(acc[m], first, b[u].x, b[u].y);
        mma::MmaBf16(acc[m], second, b[u].z, b[u].w);
      }
    }
  }
}

}  // namespace treeverify::kernels::cuda::moe
