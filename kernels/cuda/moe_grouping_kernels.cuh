// The grouping's kernels (moe_grouping.cuh has the scheme): GroupKernel for a verify step's
// entries where the routing did not group them, GroupChunks* for a prefill batch's.
#pragma once

#include <cstdint>

#include "grid_dependency.cuh"
#include "moe_grouping.cuh"
#include "moe_workspace.cuh"

namespace treeverify::kernels::cuda::moe {

__global__ void __launch_bounds__(kGroupThreads)
    GroupKernel(const int32_t* __restrict__ topk_ids, int64_t tokens, int32_t top_k,
                int32_t first_expert, int32_t num_local, Workspace w, int32_t* active_count) {
  extern __shared__ int32_t staged[];  // [entries + 4] local expert ids, -1 for other ranks'
  // A programmatic dependent of the routing, and the expert streams of it (programmatic_launch.h).
  WaitForPredecessorGrid();
  AllowDependentGridLaunch();
  GroupStaged<kGroupThreads>(topk_ids, tokens, top_k, first_expert, num_local, w, active_count,
                             staged);
}

inline constexpr int kGroupChunk = kGroupChunkEntries;

// counts[e * chunks + chunk] = the chunk's pairs of local expert e.
__global__ void __launch_bounds__(kGroupChunk)
    GroupChunksCount(const int32_t* __restrict__ topk_ids, int64_t entries, int32_t first_expert,
                     int32_t num_local, Workspace w) {
  extern __shared__ int32_t histogram[];  // [num_local]
  for (int32_t e = threadIdx.x; e < num_local; e += kGroupChunk) histogram[e] = 0;
  __syncthreads();
  const int64_t i = blockIdx.x * int64_t{kGroupChunk} + threadIdx.x;
  if (i < entries) {
    const int32_t local = topk_ids[i] - first_expert;
    if (local >= 0 && local < num_local) atomicAdd(&histogram[local], 1);  // a count: any order
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < num_local; e += kGroupChunk) {
    w.chunk_counts[int64_t{e} * gridDim.x + blockIdx.x] = histogram[e];
  }
}

// One block: thread t owns experts [t * per_thread, (t + 1) * per_thread). The counts become each
// chunk's first position per expert (in place), and the offsets, active list and tiles follow.
__global__ void __launch_bounds__(kGroupThreads)
    GroupChunksScan(int32_t chunks, int32_t num_local, Workspace w, int32_t* active_count) {
  const int32_t per_thread = (num_local + kGroupThreads - 1) / kGroupThreads;
  const int32_t begin = min(num_local, static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = min(num_local, begin + per_thread);
  int32_t pairs = 0, active = 0, tiles = 0;
  for (int32_t e = begin; e < end; ++e) {
    int32_t count = 0;
    for (int32_t c = 0; c < chunks; ++c) count += w.chunk_counts[int64_t{e} * chunks + c];
    pairs += count;
    active += count > 0;
    tiles += (count + kGemmPairs - 1) / kGemmPairs;
  }
  int32_t total_pairs, total_active, total_tiles;
  ScanGroupCounts<kGroupThreads>(pairs, active, tiles, total_pairs, total_active, total_tiles);
  for (int32_t e = begin; e < end; ++e) {
    const int32_t first_pair = pairs;
    w.offsets[e] = first_pair;
    for (int32_t c = 0; c < chunks; ++c) {
      int32_t& slot = w.chunk_counts[int64_t{e} * chunks + c];
      const int32_t count = slot;
      slot = pairs;
      pairs += count;
    }
    ListExpert(e, first_pair, pairs, active, tiles, w);
  }
  PublishGroupTotals(num_local, total_pairs, total_active, total_tiles, w, active_count);
}

// Each entry of the chunk goes to its expert's chunk position plus its rank among the chunk's
// earlier entries of that expert: within its warp by a match, then the warps before it by their
// counts (shared memory, [warp][expert]).
__global__ void __launch_bounds__(kGroupChunk)
    GroupChunksPlace(const int32_t* __restrict__ topk_ids, int64_t entries, int32_t top_k,
                     int32_t first_expert, int32_t num_local, Workspace w) {
  constexpr int kChunkWarps = kGroupChunk / 32;
  extern __shared__ int32_t warp_counts[];  // [kChunkWarps][num_local]
  for (int32_t i = threadIdx.x; i < kChunkWarps * num_local; i += kGroupChunk) warp_counts[i] = 0;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t i = blockIdx.x * int64_t{kGroupChunk} + threadIdx.x;
  int32_t local = i < entries ? topk_ids[i] - first_expert : -1;
  if (local < 0 || local >= num_local) local = -1;  // another rank's expert, or past the end
  const uint32_t same = __match_any_sync(0xffffffffu, local);
  const int rank_in_warp = __popc(same & ((1u << lane) - 1));
  if (local >= 0 && rank_in_warp == 0) warp_counts[warp * num_local + local] = __popc(same);
  __syncthreads();
  if (local < 0) return;
  int32_t position = w.chunk_counts[int64_t{local} * gridDim.x + blockIdx.x] + rank_in_warp;
  for (int v = 0; v < warp; ++v) position += warp_counts[v * num_local + local];
  w.pair_token[position] = static_cast<int32_t>(i / top_k);
  w.pair_entry[position] = static_cast<int32_t>(i);
}

}  // namespace treeverify::kernels::cuda::moe
