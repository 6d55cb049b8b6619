// The second pass of split-KV MLA verify attention: merges each packed row's split results.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "grid_dependency.cuh"
#include "mla_verify_common.cuh"

namespace treeverify::kernels::cuda::mla {

// Merges the splits of each packed row by log-sum-exp. A block takes one row and 64 of its
// dims: 16 groups of 16 threads stride over the splits (up to 9 partial loads in flight per
// thread, so up to 144 splits take one memory round trip), then the groups' sums are added in
// group order, so the result depends on NSPLIT only.
inline constexpr int kCombineThreads = 256;
inline constexpr int kCombineDims = 64;  // dims per block
inline constexpr int kCombineGroups = kCombineThreads / (kCombineDims / 4);
inline constexpr int kMaxSplits = 256;

__global__ void __launch_bounds__(kCombineThreads)
    MlaVerifyCombineKernel(MlaVerifyParamsBf16 p, PartialLayout partial, int32_t min_split_keys) {
  __shared__ float weights[kMaxSplits];
  __shared__ float reduce[kCombineGroups][kCombineDims];
  __shared__ float warp_max[kCombineThreads / 32];
  __shared__ float warp_sum[kCombineThreads / 32];
  AllowDependentGridLaunch();
  const int seq = blockIdx.z;
  const int row = blockIdx.x;
  // Lengths and offsets were written before the split kernel started: read them while it runs.
  const SequenceSpan span = LoadSequence(p, seq);
  WaitForPredecessorGrid();  // the split kernel's partial results
  const int heads = p.num_heads;
  if (row >= span.rows * heads) return;
  const int32_t splits = NumSplits(span.keys(), partial.nsplit, min_split_keys);
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  float lse[kMaxSplits / kCombineThreads];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxSplits / kCombineThreads; ++i) {
    const int s = tid + i * kCombineThreads;
    lse[i] = s < splits ? partial.lse[partial.Index(seq, s, row)] : -INFINITY;
    m = fmaxf(m, lse[i]);
  }
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  m = warp_max[0];
  for (int w = 1; w < kCombineThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxSplits / kCombineThreads; ++i) {
    const int s = tid + i * kCombineThreads;
    const float w = lse[i] == -INFINITY ? 0.f : expf(lse[i] - m);
    if (s < kMaxSplits) weights[s] = w;
    sum += w;
  }
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) warp_sum[warp] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < kCombineThreads / 32; ++w) sum += warp_sum[w];

  const int group = tid / (kCombineDims / 4);
  const int d0 = blockIdx.y * kCombineDims + (tid % (kCombineDims / 4)) * 4;
  const int latent = p.latent_dim;
  // Nine 16-byte loads in flight per thread before any is used: a loop that waited for each
  // partial in turn spent a memory latency per split (10.9 us for 120 splits, measured).
  constexpr int kInFlight = 9;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (d0 < latent) {
    for (int s0 = group; s0 < splits; s0 += kCombineGroups * kInFlight) {
      float w[kInFlight];
      float4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int s = s0 + u * kCombineGroups;
        w[u] = s < splits ? weights[s] : 0.f;
        v[u] = w[u] != 0.f ? *reinterpret_cast<const float4*>(partial.Out(seq, s, row) + d0)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        acc.x += w[u] * v[u].x;
        acc.y += w[u] * v[u].y;
        acc.z += w[u] * v[u].z;
        acc.w += w[u] * v[u].w;
      }
    }
  }
  const float acc_array[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) reduce[group][(tid % (kCombineDims / 4)) * 4 + k] = acc_array[k];
  __syncthreads();
  const int64_t global_row = static_cast<int64_t>(span.row_begin) * heads + row;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (tid < kCombineDims && blockIdx.y * kCombineDims + tid < latent) {
    float total = 0.f;
    for (int g = 0; g < kCombineGroups; ++g) total += reduce[g][tid];
    p.out[global_row * latent + blockIdx.y * kCombineDims + tid] = __float2bfloat16(total * inv);
  }
  if (blockIdx.y == 0 && tid == 0) p.lse[global_row] = sum > 0.f ? m + logf(sum) : -INFINITY;
}

}  // namespace treeverify::kernels::cuda::mla
