// The portable MLA verify kernel: any GPU, any latent / rope dims. One block per (packed row,
// split, sequence); warps take keys in turn, lanes take dimensions, scalar bf16 loads, an online
// softmax per warp and a merge of the warps in shared memory. It is the backend for the tiny test
// models and GPUs without wgmma, and it is slow by design at the production shapes: benchmarks
// run it with NSPLIT 16 as the "seed-style" reference point.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "grid_dependency.cuh"
#include "mla_verify_common.cuh"

namespace treeverify::kernels::cuda::mla {

inline constexpr int kSimtThreads = 128;
inline constexpr int kSimtMaxLatentPerLane = 16;  // latent_dim <= 512

// Dynamic shared memory: the query row, then (m, l, latent outputs) per warp.
inline int64_t SimtSmemBytes(int latent_dim, int rope_dim) {
  return static_cast<int64_t>(latent_dim + rope_dim) * 4 +
         static_cast<int64_t>(kSimtThreads / 32) * (latent_dim + 2) * 4;
}

__global__ void __launch_bounds__(kSimtThreads)
    MlaVerifySimtKernel(MlaVerifyParamsBf16 p, PartialLayout partial, int32_t min_split_keys,
                        bool direct_output) {
  extern __shared__ float smem[];
  constexpr int kWarps = kSimtThreads / 32;
  AllowDependentGridLaunch();
  WaitForPredecessorGrid();  // everything below may depend on the previous kernel
  const int seq = blockIdx.z;
  const int split = blockIdx.y;
  const int row = blockIdx.x;  // packed (node, head) row of the sequence
  const SequenceSpan span = LoadSequence(p, seq);
  const int heads = p.num_heads;
  if (row >= span.rows * heads) return;
  const SplitTiles tiles = SplitRange(span.keys(), partial.LaunchSplits(), min_split_keys, split);
  if (tiles.begin == tiles.end) return;  // the combine kernel skips empty splits

  const int node = row / heads;
  const int head = row % heads;
  const int latent = p.latent_dim;
  const int dims = latent + p.rope_dim;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  float* q = smem;
  float* merge = smem + dims;  // per warp: m, l, latent outputs
  const __nv_bfloat16* q_row =
      p.q + (static_cast<int64_t>(span.row_begin + node) * heads + head) * dims;
  for (int d = threadIdx.x; d < dims; d += kSimtThreads) q[d] = __bfloat162float(q_row[d]);
  __syncthreads();

  // Scores in the log2 domain: exp2 is the hardware's exponential.
  const float scale = p.softmax_scale * 1.4426950408889634f;
  const uint64_t* mask =
      p.ancestor_mask + static_cast<int64_t>(span.row_begin) * kAncestorMaskWords;
  const int key_end = min(tiles.end * kMlaKeyTile, span.keys());
  float m = -INFINITY;
  float l = 0.f;
  float acc[kSimtMaxLatentPerLane];
#pragma unroll
  for (int i = 0; i < kSimtMaxLatentPerLane; ++i) acc[i] = 0.f;

  for (int key = tiles.begin * kMlaKeyTile + warp; key < key_end; key += kWarps) {
    if (!KeyVisible(mask, span.committed, node, key)) continue;
    const int32_t page =
        p.page_table[static_cast<int64_t>(seq) * p.max_pages_per_seq + key / p.page_size];
    // A page outside the cache (the caller's bug) reads as zeros, as the TMA kernels' do.
    const bool in_cache = PageInCache(p, page);
    const __nv_bfloat16* kv =
        p.kv_cache + (static_cast<int64_t>(page) * p.page_size + key % p.page_size) * dims;
    float dot = 0.f;
    if (in_cache) {
      for (int d = lane; d < dims; d += 32) dot += q[d] * __bfloat162float(kv[d]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const float score = dot * scale;
    const float m_new = fmaxf(m, score);
    const float alpha = exp2f(m - m_new);  // m == -inf: 0
    const float weight = exp2f(score - m_new);
    l = l * alpha + weight;
#pragma unroll
    for (int i = 0; i < kSimtMaxLatentPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < latent) acc[i] = acc[i] * alpha + (in_cache ? weight * __bfloat162float(kv[d]) : 0.f);
    }
    m = m_new;
  }

  float* mine = merge + warp * (latent + 2);
  if (lane == 0) {
    mine[0] = m;
    mine[1] = l;
  }
#pragma unroll
  for (int i = 0; i < kSimtMaxLatentPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < latent) mine[2 + d] = acc[i];
  }
  __syncthreads();

  float m_all = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, merge[w * (latent + 2)]);
  float l_all = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    const float* theirs = merge + w * (latent + 2);
    if (theirs[0] != -INFINITY) l_all += theirs[1] * exp2f(theirs[0] - m_all);
  }
  const float inv_l = l_all > 0.f ? 1.f / l_all : 0.f;
  // Natural-log sum-exp of the unscaled-by-log2e scores.
  const float lse = NaturalLse(m_all, l_all);
  const int64_t global_row = static_cast<int64_t>(span.row_begin + node) * heads + head;
  for (int d = threadIdx.x; d < latent; d += kSimtThreads) {
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float* theirs = merge + w * (latent + 2);
      if (theirs[0] != -INFINITY) sum += theirs[2 + d] * exp2f(theirs[0] - m_all);
    }
    if (direct_output) {
      p.out[global_row * latent + d] = __float2bfloat16(sum * inv_l);
    } else {
      partial.Out<float>(seq, split, row)[d] = sum * inv_l;
    }
  }
  if (threadIdx.x == 0) {
    if (direct_output) {
      p.lse[global_row] = lse;
    } else {
      partial.lse[partial.Index(seq, split, row)] = lse;
    }
  }
}

}  // namespace treeverify::kernels::cuda::mla
