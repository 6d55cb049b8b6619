// The second pass of split-KV MLA verify attention: merges each packed row's split results.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "grid_dependency.cuh"
#include "mla_verify_common.cuh"

namespace treeverify::kernels::cuda::mla {

// Merges the splits of each packed row by log-sum-exp. A block takes one row and 64 of its
// dims; its kGroups groups of 16 threads take splits g, g + kGroups, ... (kPerGroup each).
// Everything that does not depend on the split kernel's results is done before the wait for it:
// the sequence's lengths (written before the split kernel started), its split count (integer
// divisions) and the addresses of the first split's LSE and outputs, which the others are strides
// past. The blocks wait on the device while the split kernel's last blocks run (programmatic
// dependent launch), so that work is off the path; after the wait a thread issues its loads (the
// split LSEs and 4-dim partial outputs of the sequence's splits only) before it uses any: one
// memory round trip after the split kernel (bench/NOTES.md, steps 20, 42 and 67; the merge was
// bound by issuing its ~1300 instructions per warp, most of them address arithmetic and
// divisions). The launcher sizes (kGroups, kPerGroup) to NSPLIT (CombineVariantFor): few splits
// give small, light blocks, as many batches need; many splits give 256 threads with up to 16
// loads in flight each. Group sums are added in group order, so the result depends on NSPLIT
// only. Partial is the element type the split kernel wrote its outputs in (float or
// __nv_bfloat16).
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
  // Before the wait: lengths and offsets were written before the split kernel started.
  const SequenceSpan span = LoadSequence(p, seq);
  const bool row_exists = row < span.rows * p.num_heads;
  const int32_t splits = NumSplits(span.keys(), partial.LaunchSplits(), min_split_keys);
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int group = tid / kCombineThreadsPerGroup;
  const int d0 = blockIdx.y * kCombineDims + (tid % kCombineThreadsPerGroup) * 4;
  const bool has_dims = d0 < p.latent_dim;
  // Split group + u * kGroups: its LSE and outputs are u strides past split group's.
  const float* lse_at = partial.lse + partial.Index(seq, group, row);
  const Partial* out_at = partial.Out<Partial>(seq, group, row) + d0;
  const int64_t lse_stride = static_cast<int64_t>(kGroups) * partial.max_rows;
  const int64_t out_stride = lse_stride * partial.latent_dim;
  // Pinned before the wait by a shared-memory store of them, a slot per thread (ptxas keeps
  // memory accesses on their side of the wait, but schedules arithmetic past it to cover the
  // lengths' load latency).
  __shared__ int pin[kThreads];
  const uintptr_t addresses =
      reinterpret_cast<uintptr_t>(lse_at) ^ reinterpret_cast<uintptr_t>(out_at) ^ out_stride;
  *reinterpret_cast<volatile int*>(&pin[tid]) =
      splits ^ static_cast<int>(addresses) ^ static_cast<int>(row_exists);
  WaitForPredecessorGrid();  // the split kernel's partial results

  float lse[kPerGroup];
  PartialDims4<Partial> v[kPerGroup];
#pragma unroll
  for (int u = 0; u < kPerGroup; ++u) {
    const bool used = group + u * kGroups < splits;
    if (used && has_dims) {
      v[u].Load(out_at);
    } else {
      v[u].Zero();
    }
    lse[u] = used ? *lse_at : -INFINITY;
    lse_at += lse_stride;
    out_at += out_stride;
  }
  // The loads (in the workspace whether or not the row exists) stay ahead of the LSEs' uses, so
  // that they overlap the LSEs' round trip: ptxas otherwise sinks the outputs' loads past the max
  // reduction in most variants (a second round trip), past the branch below too; not past a warp
  // barrier. The exit comes after the wait even without a row: this grid's end must still imply
  // the split kernel's, which a programmatic dependent launch of the next kernel relies on.
  __syncwarp();
  if (!row_exists) return;  // the whole block: one row
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
