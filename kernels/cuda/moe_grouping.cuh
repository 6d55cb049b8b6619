// The grouping of the MoE's (token, slot) pairs by local expert, in token order within each
// expert, with the active experts' list and the grouped GEMM's tiles (moe_workspace.cuh): the
// device functions; the kernels are in moe_grouping_kernels.cuh.
//
// A verify step's few hundred entries: GroupStaged, one block that stages the ids in shared
// memory and places them with one warp; its own kernel (GroupKernel) or the last block of the
// routing's (MoeRoutingAndGrouping, moe_routing.cu). A prefill chunk's tens of thousands: three
// kernels over chunks of kGroupChunk entries (one block each): count each chunk's pairs per expert,
// scan the counts in (expert, chunk) order into each chunk's first position per expert, then place
// each chunk's pairs by their rank among the chunk's pairs of the same expert. Both give the same
// order, and neither uses global atomics (shared-memory counts only), so the result does not depend
// on scheduling.
#pragma once

#include <cstdint>

#include "moe_workspace.cuh"

namespace treeverify::kernels::cuda::moe {

// Exclusive prefix sums of two per-thread values over the block of kBlockThreads, in thread order.
template <int kBlockThreads>
__device__ inline void BlockExclusiveScan2(int32_t& a, int32_t& b, int32_t& total_a,
                                           int32_t& total_b) {
  __shared__ int32_t warp_a[kBlockThreads / 32], warp_b[kBlockThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t inclusive_a = a, inclusive_b = b;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int32_t up_a = __shfl_up_sync(0xffffffffu, inclusive_a, offset);
    const int32_t up_b = __shfl_up_sync(0xffffffffu, inclusive_b, offset);
    if (lane >= offset) {
      inclusive_a += up_a;
      inclusive_b += up_b;
    }
  }
  if (lane == 31) {
    warp_a[warp] = inclusive_a;
    warp_b[warp] = inclusive_b;
  }
  __syncthreads();
  int32_t before_a = 0, before_b = 0;
  total_a = 0;
  total_b = 0;
  for (int w = 0; w < kBlockThreads / 32; ++w) {
    if (w < warp) {
      before_a += warp_a[w];
      before_b += warp_b[w];
    }
    total_a += warp_a[w];
    total_b += warp_b[w];
  }
  a = before_a + inclusive_a - a;
  b = before_b + inclusive_b - b;
}

// The block's exclusive scans of three per-thread counts (pairs, active experts, GEMM tiles),
// each replaced by its prefix; the totals come back in the out-parameters.
template <int kBlockThreads>
__device__ inline void ScanGroupCounts(int32_t& pairs, int32_t& active, int32_t& tiles,
                                       int32_t& total_pairs, int32_t& total_active,
                                       int32_t& total_tiles) {
  BlockExclusiveScan2<kBlockThreads>(pairs, active, total_pairs, total_active);
  __syncthreads();  // the scan's shared totals are read before the next scan writes them
  int32_t no_second = 0, unused = 0;
  BlockExclusiveScan2<kBlockThreads>(tiles, no_second, total_tiles, unused);
}

// Expert e's grouped pairs [first_pair, end_pair): into the active list (at `active`, with the
// range) and the grouped GEMM's tiles (at `tiles`; kGemmPairs pairs each, the last partial).
__device__ inline void ListExpert(int32_t e, int32_t first_pair, int32_t end_pair, int32_t& active,
                                  int32_t& tiles, const Workspace& w) {
  if (end_pair > first_pair) {
    w.active[active] = e;
    w.active_pairs[active++] = make_int2(first_pair, end_pair);
  }
  for (int32_t pair = first_pair; pair < end_pair; pair += kGemmPairs) {
    w.tile_expert[tiles] = e;
    w.tile_pair[tiles] = pair;
    ++tiles;
  }
}

// Thread 0 writes the totals, and zeroes the weight streams' claim counters (ExpertWalk).
__device__ inline void PublishGroupTotals(int32_t num_local, int32_t pairs, int32_t active,
                                          int32_t tiles, const Workspace& w,
                                          int32_t* active_count) {
  if (threadIdx.x != 0) return;
  w.offsets[num_local] = pairs;
  *w.num_active = active;
  w.claims[0] = 0;
  w.claims[1] = 0;
  *w.num_tiles = tiles;
  if (active_count != nullptr) *active_count = active;
}

// The grouping of a verify step (at most kStagedEntries entries; GroupChunks* take more),
// by one block of kBlockThreads threads, in time linear in entries and experts (bench/NOTES.md,
// step 91): the routing's ids are staged in shared memory and counted per local expert
// (shared-memory atomics: a count, in any order); thread t owns local experts [t * per_thread,
// (t + 1) * per_thread) and the block scans their counts (offsets), active flags (the active
// list) and GEMM tiles; then one warp places the entries in index order, 32 at a time: an entry
// goes to its expert's next position plus its rank among the same expert's entries of those 32
// (a match), so each expert's pairs are in token order. The ids are read from the L2 (ld.cg):
// the routing's other blocks may have written them in this same kernel.
constexpr int64_t kStagedEntries = 8192;  // 32 KB of shared memory

// Dynamic shared memory of GroupStaged: the staged ids (padded by 16 bytes: the compiler's vector
// loads of them may read up to three past the last one, step 79) and a counter per local expert.
inline int64_t GroupKernelSmemBytes(int64_t entries, int32_t num_local) {
  return (entries + 4 + num_local) * int64_t{sizeof(int32_t)};
}

// `staged`: GroupKernelSmemBytes(tokens * top_k, num_local) bytes of shared memory.
template <int kBlockThreads>
__device__ void GroupStaged(const int32_t* __restrict__ topk_ids, int64_t tokens, int32_t top_k,
                            int32_t first_expert, int32_t num_local, const Workspace& w,
                            int32_t* active_count, int32_t* staged) {
  const int32_t n = static_cast<int32_t>(tokens * top_k);
  int32_t* next = staged + n + 4;  // [num_local] counts, then each expert's next position
  for (int32_t e = threadIdx.x; e < num_local; e += kBlockThreads) next[e] = 0;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < n; i += kBlockThreads) {
    int32_t local = __ldcg(topk_ids + i) - first_expert;
    if (local < 0 || local >= num_local) local = -1;
    staged[i] = local;
    if (local >= 0) atomicAdd(&next[local], 1);
  }
  __syncthreads();
  const int32_t per_thread = (num_local + kBlockThreads - 1) / kBlockThreads;
  const int32_t begin = min(num_local, static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = min(num_local, begin + per_thread);
  int32_t pairs = 0, active = 0, tiles = 0;
  for (int32_t e = begin; e < end; ++e) {
    const int32_t count = next[e];
    pairs += count;
    active += count > 0;
    tiles += (count + moe::kGemmPairs - 1) / moe::kGemmPairs;
  }
  int32_t total_pairs, total_active, total_tiles;
  ScanGroupCounts<kBlockThreads>(pairs, active, tiles, total_pairs, total_active, total_tiles);
  for (int32_t e = begin; e < end; ++e) {
    const int32_t first_pair = pairs;
    pairs += next[e];
    w.offsets[e] = first_pair;
    next[e] = first_pair;
    ListExpert(e, first_pair, pairs, active, tiles, w);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    for (int32_t base = 0; base < n; base += 32) {
      const int32_t i = base + lane;
      const int32_t local = i < n ? staged[i] : -1;
      const uint32_t same = __match_any_sync(0xffffffffu, local);
      const int rank = __popc(same & ((1u << lane) - 1));
      if (local >= 0) {
        const int32_t position = next[local] + rank;
        w.pair_token[position] = i / top_k;
        w.pair_entry[position] = i;
      }
      __syncwarp();  // every lane has read its expert's position before the first moves it on
      if (local >= 0 && rank == 0) next[local] += __popc(same);
      __syncwarp();
    }
  }
  PublishGroupTotals(num_local, total_pairs, total_active, total_tiles, w, active_count);
}

}  // namespace treeverify::kernels::cuda::moe
