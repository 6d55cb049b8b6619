// The second pass of split-KV MLA verify attention: merges each packed row's split results.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "mla_verify_common.cuh"

namespace treeverify::kernels::cuda::mla {

// Merges the splits of each packed row by log-sum-exp. A block takes one row and 64 of its
// dims: 8 groups of 16 threads stride over the splits (several partial loads in flight per
// thread), then the groups' sums are added in group order, so the result depends on NSPLIT only.
inline constexpr int kCombineThreads = 128;
inline constexpr int kCombineDims = 64;  // dims per block
inline constexpr int kCombineGroups = kCombineThreads / (kCombineDims / 4);
inline constexpr int kMaxSplits = 256;

__global__ void __launch_bounds__(kCombineThreads)
    MlaVerifyCombineKernel(MlaVerifyParamsBf16 p, PartialLayout partial, int32_t min_split_keys) {
  __shared__ float weights[kMaxSplits];
  __shared__ float reduce[kCombineGroups][kCombineDims];
  __shared__ float warp_max[kCombineThreads / 32];
  __shared__ float warp_sum[kCombineThreads / 32];
  const int seq = blockIdx.z;
  const int row = blockIdx.x;
  const SequenceSpan span = LoadSequence(p, seq);
  const int heads = p.num_heads;
  if (row >= span.rows * heads) return;
  const int32_t keys = span.keys();
  const int32_t splits =
      CeilDiv(CeilDiv(keys, kMlaKeyTile), TilesPerSplit(keys, partial.nsplit, min_split_keys));
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
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s = group; s < splits; s += kCombineGroups) {
    const float w = weights[s];
    if (w == 0.f) continue;
    const float* src = partial.Out(seq, s, row);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (d0 + k < latent) acc[k] += w * src[d0 + k];
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) reduce[group][(tid % (kCombineDims / 4)) * 4 + k] = acc[k];
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
