// The second pass of split-KV MLA verify attention: merges each packed row's split results.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "grid_dependency.cuh"
#include "mla_verify_common.cuh"

namespace treeverify::kernels::cuda::mla {

// Merges the splits of each packed row by log-sum-exp. A block takes one row and 64 of its
// dims; its kGroups groups of 16 threads take splits g, g + kGroups, ... (kPerGroup each).
// Every thread issues all its loads, split LSEs and 4-dim partial outputs alike, before it uses
// any, and before it uses the sequence's lengths (requested before the wait): one memory round
// trip after the split kernel, not one for the lengths, then one for the LSEs, then one for the
// partials. So it loads every split of the layout, and splits past the sequence's last one
// (results of an earlier launch, or never written) are dropped once the lengths are there
// (bench/NOTES.md, steps 20 and 42). The launcher sizes (kGroups, kPerGroup) to NSPLIT
// (CombineVariantFor): few splits give small, light blocks, as many batches need; many splits give
// 256 threads with up to 16 loads in flight each. Group sums are added in group order, so the
// result depends on NSPLIT only. Partial is the element type the split kernel wrote its outputs in
// (float or __nv_bfloat16).
inline constexpr int kCombineDims = 64;  // dims per block
inline constexpr int kCombineThreadsPerGroup = kCombineDims / 4;

// 4 partial-output dims: one 16-byte load in fp32, one 8-byte load in bf16.
template <typename Partial>
struct PartialDims4;
template <>
struct PartialDims4<float> {
  float4 raw;
  __device__ void Load(const float* p) { raw = *reinterpret_cast<const float4*>(p); }
  __device__ void Zero() { raw = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ float4 Get() const { return raw; }
};
template <>
struct PartialDims4<__nv_bfloat16> {
  uint2 raw;
  __device__ void Load(const __nv_bfloat16* p) { raw = *reinterpret_cast<const uint2*>(p); }
  __device__ void Zero() { raw = make_uint2(0u, 0u); }
  __device__ float4 Get() const {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
};

template <int kGroups, int kPerGroup, typename Partial>
__global__ void __launch_bounds__(kGroups* kCombineThreadsPerGroup)
    MlaVerifyCombineKernel(MlaVerifyParamsBf16 p, PartialLayout partial, int32_t min_split_keys) {
  constexpr int kThreads = kGroups * kCombineThreadsPerGroup;
  static_assert(kThreads % 32 == 0 && kGroups * kPerGroup <= kMaxSplits);
  __shared__ float reduce[kGroups][kCombineDims];
  __shared__ float warp_max[kThreads / 32];
  __shared__ float group_weight[kGroups];
  AllowDependentGridLaunch();
  const int seq = blockIdx.z;
  const int row = blockIdx.x;
  // Lengths and offsets were written before the split kernel started: read them while it runs.
  const SequenceSpan span = LoadSequence(p, seq);
  WaitForPredecessorGrid();  // the split kernel's partial results
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int group = tid / kCombineThreadsPerGroup;
  const int d0 = blockIdx.y * kCombineDims + (tid % kCombineThreadsPerGroup) * 4;
  const bool has_dims = d0 < p.latent_dim;

  float lse[kPerGroup];
  PartialDims4<Partial> v[kPerGroup];
#pragma unroll
  for (int u = 0; u < kPerGroup; ++u) {
    const int s = group + u * kGroups;
    const bool in_layout = s < partial.nsplit;
    lse[u] = in_layout ? partial.lse[partial.Index(seq, s, row)] : -INFINITY;
    if (in_layout && has_dims) {
      v[u].Load(partial.Out<Partial>(seq, s, row) + d0);
    } else {
      v[u].Zero();
    }
  }
  if (row >= span.rows * p.num_heads) return;  // the whole block: one row
  const int32_t splits = NumSplits(span.keys(), partial.nsplit, min_split_keys);
#pragma unroll
  for (int u = 0; u < kPerGroup; ++u) {
    if (group + u * kGroups >= splits) lse[u] = -INFINITY;
  }
  float m = -INFINITY;
#pragma unroll
  for (int u = 0; u < kPerGroup; ++u) m = fmaxf(m, lse[u]);
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  m = warp_max[0];
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);

  float weight_sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int u = 0; u < kPerGroup; ++u) {
    // __expf: two instructions where expf takes a dozen on the merge's path; its relative error
    // (about 1e-6 for the weights that matter) is far under the bf16 output's.
    const float w = lse[u] == -INFINITY ? 0.f : __expf(lse[u] - m);
    weight_sum += w;
    // A dropped split's stale output may hold anything, NaN included: keep it out, not times 0.
    const float4 x = w != 0.f ? v[u].Get() : make_float4(0.f, 0.f, 0.f, 0.f);
    acc.x += w * x.x;
    acc.y += w * x.y;
    acc.z += w * x.z;
    acc.w += w * x.w;
  }
  if (tid % kCombineThreadsPerGroup == 0) group_weight[group] = weight_sum;
  const float acc_array[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) reduce[group][(tid % kCombineThreadsPerGroup) * 4 + k] = acc_array[k];
  __syncthreads();
  float sum = 0.f;
  for (int g = 0; g < kGroups; ++g) sum += group_weight[g];
  const int64_t global_row = static_cast<int64_t>(span.row_begin) * p.num_heads + row;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const int latent = p.latent_dim;
  for (int d = tid; d < kCombineDims && blockIdx.y * kCombineDims + d < latent; d += kThreads) {
    float total = 0.f;
    for (int g = 0; g < kGroups; ++g) total += reduce[g][d];
    p.out[global_row * latent + blockIdx.y * kCombineDims + d] = __float2bfloat16(total * inv);
  }
  if (blockIdx.y == 0 && tid == 0) p.lse[global_row] = sum > 0.f ? m + logf(sum) : -INFINITY;
}

}  // namespace treeverify::kernels::cuda::mla
