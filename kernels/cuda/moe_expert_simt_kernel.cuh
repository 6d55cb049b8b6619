// The MoE expert projections on CUDA cores: the path for reductions that are not a multiple of
// 32 elements or rows not 16-byte aligned (the tensor-core kernels take every production shape).
// Gate and up: a warp per row pair, gate in lanes 0-15 and up in 16-31; down: a group of 4 lanes
// per row, 8 rows per warp. Blocks loop over (active expert, row tile) work items read on the
// device.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "element_convert.cuh"
#include "moe_workspace.cuh"
#include "silu_times_up.cuh"
#include "treeverify/kernels/moe.h"

namespace treeverify::kernels::cuda::moe {

// acc[t] += row . xs[t] over `length` elements, for the first `count` tokens, by a group of
// kLanes lanes (the warp holds 32 / kLanes groups, each with its own row). Lane l of a group
// takes the 16-byte chunks l, l + kLanes, l + 2 kLanes, ... and loads kUnroll of them before it
// uses any, so that a warp keeps 32 * kUnroll * 16 bytes of weights in flight (Little's law at
// 4.2 TB/s wants ~32 KB per multiprocessor); the sums are then reduced over the group's lanes
// only (log2 kLanes shuffles). Short rows take small groups: the down projection's 256-column
// rows (split inside) take 4 lanes of 8 chunks each. Needs length % 8 == 0 and 16-byte aligned
// rows; RowDotScalar does the same sums element by element for anything else.
template <int kLanes, int kUnroll, int kTokens>
__device__ __forceinline__ void RowDot(const Bf16* __restrict__ row, int64_t length,
                                       const Bf16* const (&xs)[kTokensPerPass], int count,
                                       float (&acc)[kTokensPerPass]) {
  const int lane = threadIdx.x % kLanes;
  for (int64_t base = lane * 8; base < length; base += int64_t{kLanes} * 8 * kUnroll) {
    uint4 w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + int64_t{u} * kLanes * 8;
      w[u] = c < length ? __ldg(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + int64_t{u} * kLanes * 8;
      const bool inside = c < length;  // past the row, w is zero and x is not loaded
      float wf[8];
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w[u]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 pair = __bfloat1622float2(w2[i]);
        wf[2 * i] = pair.x;
        wf[2 * i + 1] = pair.y;
      }
      // Every token's load is issued (a zero for tokens past count): a loop that stopped at
      // count would wait out each load's latency in turn (GateUp at 0.76 TB/s, step 79). kTokens
      // is count rounded up to a power of two, so that the FMAs past count stay few: at eight
      // tokens the fp32 FMAs and conversions, not DRAM, bound the kernel.
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        const uint4 x = t < count && inside ? __ldg(reinterpret_cast<const uint4*>(xs[t] + c))
                                            : make_uint4(0, 0, 0, 0);
        const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 pair = __bfloat1622float2(x2[i]);
          acc[t] = fmaf(wf[2 * i], pair.x, acc[t]);
          acc[t] = fmaf(wf[2 * i + 1], pair.y, acc[t]);
        }
      }
    }
  }
}

// RowDot for `count` <= kTokensPerPass tokens, with the token loop sized to count.
template <int kLanes, int kUnroll>
__device__ __forceinline__ void RowDotTokens(const Bf16* __restrict__ row, int64_t length,
                                             const Bf16* const (&xs)[kTokensPerPass], int count,
                                             float (&acc)[kTokensPerPass]) {
  if (count <= 1) {
    RowDot<kLanes, kUnroll, 1>(row, length, xs, count, acc);
  } else if (count <= 2) {
    RowDot<kLanes, kUnroll, 2>(row, length, xs, count, acc);
  } else if (count <= 4) {
    RowDot<kLanes, kUnroll, 4>(row, length, xs, count, acc);
  } else {
    RowDot<kLanes, kUnroll, kTokensPerPass>(row, length, xs, count, acc);
  }
}

template <int kLanes>
__device__ __forceinline__ void RowDotScalar(const Bf16* row, int64_t length,
                                             const Bf16* const (&xs)[kTokensPerPass], int count,
                                             float (&acc)[kTokensPerPass]) {
  for (int64_t c = threadIdx.x % kLanes; c < length; c += kLanes) {
    const float w = ToFloat(row[c]);
    for (int t = 0; t < count; ++t) acc[t] = fmaf(w, ToFloat(xs[t][c]), acc[t]);
  }
}

// Sum over the kLanes lanes of a group (xor offsets below kLanes stay inside it).
template <int kLanes>
__device__ __forceinline__ float GroupSum(float value) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Gate and up: a warp takes one row pair, gate in lanes 0-15 and up in lanes 16-31; a work item
// is (active expert, kWarps row pairs).
constexpr int kGateUpLanes = 16;

template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    GateUpKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t row_tiles,
                 bool vectorized) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool is_up = lane >= kGateUpLanes;
  const int64_t items = int64_t{*w.num_active} * row_tiles;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / row_tiles];
    const int64_t i = (item % row_tiles) * kWarps + warp;
    if (i >= p.intermediate) continue;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    const Bf16* row = (is_up ? p.up_proj[expert] : p.gate_proj[expert]) + i * p.hidden;
    for (int32_t pass = first_pair; pass < end_pair; pass += kTokensPerPass) {
      const int count = min(kTokensPerPass, end_pair - pass);
      const Bf16* xs[kTokensPerPass];
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        xs[t] = p.x + int64_t{w.pair_token[pass + min(t, count - 1)]} * p.hidden;
      }
      float acc[kTokensPerPass] = {};
      if (vectorized) {
        RowDotTokens<kGateUpLanes, kUnroll>(row, p.hidden, xs, count, acc);
      } else {
        RowDotScalar<kGateUpLanes>(row, p.hidden, xs, count, acc);
      }
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        if (t >= count) break;
        const float value = GroupSum<kGateUpLanes>(acc[t]);
        const float up_value = __shfl_sync(0xffffffffu, value, kGateUpLanes);
        if (lane == 0) {
          w.activated[int64_t{pass + t} * p.intermediate + i] =
              FromFloat<Bf16>(SiluTimesUp(value, up_value));
        }
      }
    }
  }
}

// Down: groups of kDownLanes lanes take one hidden row each (32 / kDownLanes rows per warp); a
// work item is (active expert, kWarps * 32 / kDownLanes rows).
constexpr int kDownLanes = 4;
constexpr int kDownRowsPerWarp = 32 / kDownLanes;

template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    DownKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t row_tiles, bool vectorized) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t items = int64_t{*w.num_active} * row_tiles;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / row_tiles];
    const int64_t h = ((item % row_tiles) * kWarps + warp) * kDownRowsPerWarp + lane / kDownLanes;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    // Lanes past the last row repeat it (their sums are not stored): the shuffles need them.
    const Bf16* row = p.down_proj[expert] + min(h, p.hidden - 1) * p.intermediate;
    for (int32_t pass = first_pair; pass < end_pair; pass += kTokensPerPass) {
      const int count = min(kTokensPerPass, end_pair - pass);
      const Bf16* xs[kTokensPerPass];
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        xs[t] = w.activated + int64_t{pass + min(t, count - 1)} * p.intermediate;
      }
      float acc[kTokensPerPass] = {};
      if (vectorized) {
        RowDotTokens<kDownLanes, kUnroll>(row, p.intermediate, xs, count, acc);
      } else {
        RowDotScalar<kDownLanes>(row, p.intermediate, xs, count, acc);
      }
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        if (t >= count) break;
        const float value = GroupSum<kDownLanes>(acc[t]);
        if (lane % kDownLanes == 0 && h < p.hidden) {
          w.expert_out[int64_t{w.pair_entry[pass + t]} * p.hidden + h] = value;
        }
      }
    }
  }
}

}  // namespace treeverify::kernels::cuda::moe
