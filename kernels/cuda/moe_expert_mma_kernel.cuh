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
#include "moe_workspace.cuh"
#include "silu_times_up.cuh"
#include "treeverify/kernels/moe.h"

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

// The tensor-core path (cuda/moe_expert_mma_kernel.cuh): gate/up (kGateUp) or down tiles of 16
// rows of one active expert. The block's warps form groups of `split` warps that share one tile
// and split its reduction (long rows: the hidden dim); short rows (256 columns under split
// inside) take split 1, a tile per warp. A work item is (active expert, kMmaWarps / split tiles).
// With block_parts > 1 (gate/up only, GateUpParts), the reduction is further split across
// blocks: an item is (active expert, tiles, block part), and each block writes its part's sums
// to w.gate_up_parts for FinishGateUp.
template <bool kGateUp, int kUnroll>
__global__ void __launch_bounds__(kMmaThreads)
    ExpertMmaKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t split,
                    int32_t item_tiles, int32_t block_parts) {
  constexpr int kMatrices = kGateUp ? 2 : 1;
  __shared__ float partial[kMmaWarps][kMatrices][32][4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int part = warp % split;  // which share of the block's reduction
  const int tile_in_item = warp / split;
  const int64_t length = kGateUp ? p.hidden : p.intermediate;  // the reduction
  const int64_t rows_total = kGateUp ? p.intermediate : p.hidden;
  const int64_t chunks = length / kMmaChunk;
  const int64_t per_block_part = (chunks + block_parts - 1) / block_parts;
  const int64_t per_part = (per_block_part + split - 1) / split;
  const int64_t tiles = (rows_total + kMmaRows - 1) / kMmaRows;
  const int64_t items_per_expert = (tiles + item_tiles - 1) / item_tiles * block_parts;
  const int64_t items = int64_t{*w.num_active} * items_per_expert;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / items_per_expert];
    const int64_t block_part = item % block_parts;
    const int64_t part_end = min(chunks, (block_part + 1) * per_block_part);
    const int64_t begin = min(part_end, block_part * per_block_part + part * per_part);
    const int64_t end = min(part_end, begin + per_part);
    const int64_t row0 =
        ((item % items_per_expert) / block_parts * item_tiles + tile_in_item) * kMmaRows;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    // Rows past the last repeat it (their results are not stored).
    const int64_t row_g = min(row0 + g, rows_total - 1);
    const int64_t row_g8 = min(row0 + g + 8, rows_total - 1);
    const Bf16* matrices[kMatrices];
    if constexpr (kGateUp) {
      matrices[0] = p.gate_proj[expert];
      matrices[1] = p.up_proj[expert];
    } else {
      matrices[0] = p.down_proj[expert];
    }
    const Bf16* rows_g[kMatrices];
    const Bf16* rows_g8[kMatrices];
#pragma unroll
    for (int m = 0; m < kMatrices; ++m) {
      rows_g[m] = matrices[m] + row_g * length;
      rows_g8[m] = matrices[m] + row_g8 * length;
    }
    for (int32_t pass = first_pair; pass < end_pair; pass += kMmaTokens) {
      const int count = min(kMmaTokens, end_pair - pass);
      const bool has_token = g < count;
      const int32_t pair = pass + min(g, count - 1);
      const Bf16* x = kGateUp ? p.x + int64_t{w.pair_token[pair]} * p.hidden
                              : w.activated + int64_t{pair} * p.intermediate;
      float acc[kMatrices][4] = {};
      if (row0 < rows_total) {
        MmaRows<kMatrices, kUnroll>(rows_g, rows_g8, x, has_token, begin, end, t, acc);
      }
      if (split > 1) {
#pragma unroll
        for (int m = 0; m < kMatrices; ++m) {
#pragma unroll
          for (int i = 0; i < 4; ++i) partial[warp][m][lane][i] = acc[m][i];
        }
        __syncthreads();
        if (part == 0) {  // the group's first warp adds the others' shares in warp order
          for (int from = warp + 1; from < warp + split; ++from) {
#pragma unroll
            for (int m = 0; m < kMatrices; ++m) {
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[m][i] += partial[from][m][lane][i];
            }
          }
        }
      }
      if (part == 0) {
        // Accumulator i: row g (+ 8 for i >= 2), token 2t + (i & 1).
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t row = row0 + g + (i >= 2 ? 8 : 0);
          const int token = 2 * t + (i & 1);
          if (row >= rows_total || token >= count) continue;
          if constexpr (kGateUp) {
            if (block_parts > 1) {
              float* sums = w.gate_up_parts +
                            ((block_part * p.tokens * p.top_k + pass + token) * 2) * p.intermediate;
              sums[row] = acc[0][i];
              sums[p.intermediate + row] = acc[1][i];
              continue;
            }
            w.activated[int64_t{pass + token} * p.intermediate + row] =
                FromFloat<Bf16>(SiluTimesUp(acc[0][i], acc[1][i]));
          } else {
            w.expert_out[int64_t{w.pair_entry[pass + token]} * p.hidden + row] = acc[0][i];
          }
        }
      }
      if (split > 1) __syncthreads();  // partial is reused
    }
  }
}

// activated = silu(gate) * up from the blocks' partial sums, added in part order. A thread per
// (grouped pair, row); pairs past the step's count return.
__global__ void FinishGateUp(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t block_parts) {
  const int64_t index = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t pair = index / p.intermediate, row = index % p.intermediate;
  if (pair >= w.offsets[p.num_local_experts]) return;
  const int64_t stride = p.tokens * p.top_k * 2 * p.intermediate;
  const float* sums = w.gate_up_parts + pair * 2 * p.intermediate + row;
  float gate = sums[0], up = sums[p.intermediate];
  for (int32_t part = 1; part < block_parts; ++part) {
    gate = __fadd_rn(gate, sums[part * stride]);
    up = __fadd_rn(up, sums[part * stride + p.intermediate]);
  }
  w.activated[pair * p.intermediate + row] = FromFloat<Bf16>(SiluTimesUp(gate, up));
}

// Warps sharing a tile's reduction: enough that each still streams at least 8 chunks (16 KB of
// a 16-row tile), at most the block.
inline int32_t MmaSplit(int64_t length) {
  int32_t split = 1;
  while (split < kMmaWarps && length / kMmaChunk / (2 * split) >= 8) split *= 2;
  return split;
}

}  // namespace treeverify::kernels::cuda::moe
