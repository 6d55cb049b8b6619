// The merge of a sequence's splits by the wide kernel's split blocks themselves, for launches of
// one wave (MlaVerifyPlan::merge_in_grid).
//
// When every block of the split kernel is resident at once (the plan's waves <= 1), the blocks
// of one (sequence, row tile) can meet at a counter in the workspace once each has stored its
// bf16 partial result, and then merge a share of the rows each, so that no second kernel starts.
// That saves the kernel boundary, about 1 us; the merge itself is bound by reading the partials
// back (about 1.5 TB/s at batch 1), and with one block of 256 threads per multiprocessor this
// merge has fewer loads in flight than the merge kernel: it wins where the merge kernel's blocks
// are many and light (many row tiles of few splits) and loses from about 44 splits up, so the
// planner takes it up to 40 (bench/NOTES.md, step 56; with step 61's shorter code still 1-8 %
// slower at 66 and 132 splits).
//
// Forward progress: a block waits for the other splits of its group only, all of which are
// resident or about to be (one wave, and a programmatic dependent launch of the next kernel
// cannot start before every block of this one has run). A waiter gives up with a trap after
// kMergeWaitLimitNs rather than hang the device: that only happens if the counters were not
// zeroed (PrepareMlaVerifyWorkspace) or the grid was not resident.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "mla_verify_common.cuh"
#include "sm90_primitives.cuh"

namespace treeverify::kernels::cuda::mla {

inline constexpr uint64_t kMergeWaitLimitNs = 20ull * 1000 * 1000 * 1000;

__device__ inline uint32_t LoadAcquireGpu(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

inline constexpr int kMergeBarrier = 7;  // named barrier of the 256 threads that merge
inline constexpr int kMergeThreads = 256;

// Out of line: a trap inlined into the kernels made ptxas spill the wide kernel's registers.
__device__ __noinline__ void MergeWaitTimedOut() { __trap(); }

// One thread per split block, after a block barrier that follows the block's stores of its
// partial result: returns once all `splits` blocks of `group` have arrived, their results
// visible. The group's words are [arrivals, departures]; a block arrives by a release increment
// and waits until the arrivals reach `splits` (one hop after the last arrival lands, where a
// separate release flag would take two). DepartFromSplits resets both once every block of the
// group has seen the arrivals complete.
__device__ inline void ArriveAndWaitForSplits(uint32_t* counters, int group, int splits) {
  uint32_t* arrivals = counters + 2 * group;
  // A release arrival publishes the block's partial results (ordered before it by the barrier);
  // the acquire polls make the other blocks' visible to this block (ordered after by the next
  // barrier). No sequentially consistent fence (__threadfence) either side.
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrivals) : "memory");
  const uint64_t start = sm90::GlobalTimerNs();
  for (uint32_t polls = 1; LoadAcquireGpu(arrivals) < static_cast<uint32_t>(splits); ++polls) {
    if (polls % 4096 == 0 && sm90::GlobalTimerNs() - start > kMergeWaitLimitNs) MergeWaitTimedOut();
  }
}

// One thread per split block, after ArriveAndWaitForSplits: the last block of the group to get
// here zeroes the group's counters for the next launch (which starts after this one ends).
__device__ inline void DepartFromSplits(uint32_t* counters, int group, int splits) {
  uint32_t* arrivals = counters + 2 * group;
  if (atomicAdd(arrivals + 1, 1u) == static_cast<uint32_t>(splits - 1)) {
    arrivals[0] = 0;
    arrivals[1] = 0;
  }
}

// 8 bf16 dims (16 bytes) of a partial output row, added with a weight into 8 fp32 sums.
__device__ inline void AddBf16x8(float (&acc)[8], uint4 raw, float w) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    acc[2 * i] += w * f.x;
    acc[2 * i + 1] += w * f.y;
  }
}

// A group's rows and this block's place among its splits.
struct MergeGroup {
  int seq;
  int row0;        // first packed row of the group within the sequence
  int valid_rows;  // rows of the group that exist
  int64_t global_row0;
  int split;   // this block's split, 0 .. splits - 1
  int splits;  // splits of the sequence that have keys
};

// Scratch for MergeShare, in floats: the rows' split weights (at most rows + 3 * splits of them:
// a share spans splits / 4 rows past its chunks' own, and two partial rows) and the slots' sums.
inline constexpr int kMergeWeightFloats = 64 + 3 * kMaxSplits;
inline constexpr int kMergeScratchFloats = kMergeWeightFloats + 16 * 128;
// The partial pieces a thread has in flight (one round), and the shared memory they land in.
inline constexpr int kMergePiecesPerRound = 16;
inline constexpr int kMergePieceBytes = kMergePiecesPerRound * kMergeThreads * 16;

// 8 floats to bf16, in one 16-byte store.
__device__ inline void StoreBf16x8(__nv_bfloat16* dst, const float (&v)[8]) {
  __nv_bfloat162 packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) packed[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(packed);
}

// This block's share of its group's merge, by kMergeThreads threads (`tid`), `scratch` and
// `pieces` (kMergePieceBytes) in shared memory. The group's rows are cut into chunks of 16 x 16
// bytes of partial output (128 dims); the block takes chunks [split * chunks / splits, ...),
// about rows * 2 KB / 64 of reads whatever the number of splits.
//  - 16 threads read a chunk of one split, 16 bytes each, side by side (whole sectors); the 16
//    slots of 16 threads take G = 16 / chunks (a power of two) splits apart of each chunk, or
//    chunks apart when there are 16 or more. A thread copies up to kMergePiecesPerRound pieces
//    into its own slots of `pieces` with cp.async before it uses any, its first round before the
//    weights below, so that both round trips overlap.
//  - Each row the share touches gets its splits' weights, exp(lse_s - max) / sum, a warp per
//    row, its lanes over splits; the block that holds a row's first chunk writes its LSE.
//  - The slots of a chunk add their weighted sums through `scratch` in slot order: the result
//    depends on NSPLIT only.
// The code is short on purpose: it runs once per block, so every instruction is fetched cold,
// and an unrolled form (24 loads in registers, 2700 instructions) spent most of its time waiting
// for instructions (ncu, bench/NOTES.md step 61).
// kLatentDim: p.latent_dim, known to the caller (no run-time divisions by chunks_per_row).
template <int kLatentDim>
__device__ inline void MergeShare(const MlaVerifyParamsBf16& p, const PartialLayout& partial,
                                  const MergeGroup& g, float* scratch, uint8_t* pieces, int tid) {
  constexpr int kDims = 8;
  constexpr int kChunkDims = 16 * kDims;
  static_assert(kLatentDim % kChunkDims == 0);
  constexpr int chunks_per_row = kLatentDim / kChunkDims;
  const int chunks = g.valid_rows * chunks_per_row;
  const int begin = static_cast<int>(static_cast<int64_t>(chunks) * g.split / g.splits);
  const int end = static_cast<int>(static_cast<int64_t>(chunks) * (g.split + 1) / g.splits);
  if (begin == end) return;  // the whole block
  const int row_first = begin / chunks_per_row;
  const int rows_here = (end - 1) / chunks_per_row - row_first + 1;
  const int S = g.splits;
  float* weights = scratch;  // [rows_here][S]
  float* sums = scratch + kMergeWeightFloats;

  int G = 16;  // slots per chunk; with G > 1 every chunk has its own slots (16 / G >= share)
  while (G > 1 && G * (end - begin) > 16) G /= 2;
  const int slot = tid / 16;
  const int g_slot = slot % G;
  const int d = (tid % 16) * kDims;
  // Split s's piece of a chunk is `split_step` elements past split s - 1's.
  const int64_t split_step = static_cast<int64_t>(partial.max_rows) * partial.latent_dim;
  uint8_t* my_pieces = pieces + tid * 16;  // piece k at k * kMergeThreads * 16
  // One round: the pieces of splits s0, s0 + G, ... (at most kMergePiecesPerRound) of chunk c;
  // returns how many.
  auto copy_round = [&](int c, int s0) {
    const __nv_bfloat16* from = partial.Out<__nv_bfloat16>(g.seq, s0, g.row0 + c / chunks_per_row) +
                                (c % chunks_per_row) * kChunkDims + d;
    const int n = min(kMergePiecesPerRound, (S - s0 + G - 1) / G);
    for (int k = 0; k < n; ++k) {
      sm90::CpAsync16(my_pieces + k * kMergeThreads * 16, from + k * G * split_step);
    }
    return n;
  };
  const int c_first = begin + slot / G;
  int first_round = c_first < end ? copy_round(c_first, g_slot) : 0;

  const int warp = tid / 32;
  const int lane = tid % 32;
  for (int rr = warp; rr < rows_here; rr += kMergeThreads / 32) {
    // Split s's LSE of the row is s * max_rows floats past split 0's.
    const float* lse = partial.lse + partial.Index(g.seq, lane, g.row0 + row_first + rr);
    const int64_t lse_step = 32 * static_cast<int64_t>(partial.max_rows);  // 32 splits on
    float e[kMaxSplits / 32];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      e[j] = lane + 32 * j < S ? __ldcg(lse + j * lse_step) : -INFINITY;
      m = fmaxf(m, e[j]);
    }
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      e[j] = e[j] == -INFINITY ? 0.f : __expf(e[j] - m);
      sum += e[j];
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(~0u, sum, o);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      if (lane + 32 * j < S) weights[rr * S + lane + 32 * j] = e[j] * inv;
    }
    if (lane == 0 && (row_first + rr) * chunks_per_row >= begin) {
      p.lse[g.global_row0 + row_first + rr] = sum > 0.f ? m + logf(sum) : -INFINITY;
    }
  }
  sm90::NamedBarrier<kMergeBarrier, kMergeThreads>();

  for (int c = c_first; c < end; c += 16 / G) {
    const float* w_row = weights + (c / chunks_per_row - row_first) * S;
    float acc[kDims] = {};
    for (int s0 = g_slot; s0 < S; s0 += G * kMergePiecesPerRound) {
      // A thread reads only its own pieces: its wait orders them, no barrier needed.
      const int n = first_round > 0 ? first_round : copy_round(c, s0);
      first_round = 0;
      sm90::CpAsyncWaitAll();
#pragma unroll 4
      for (int k = 0; k < n; ++k) {
        // A zero weight (an empty split's -inf) keeps the split out, whatever its bytes hold.
        // Every piece read is used before the next round's copies overwrite it.
        const float w = w_row[s0 + k * G];
        if (w != 0.f) {
          AddBf16x8(acc, *reinterpret_cast<const uint4*>(my_pieces + k * kMergeThreads * 16), w);
        }
      }
    }
    const int64_t out_row = g.global_row0 + c / chunks_per_row;
    if (G == 1) {
      StoreBf16x8(p.out + out_row * kLatentDim + (c % chunks_per_row) * kChunkDims + d, acc);
    } else {
#pragma unroll
      for (int k = 0; k < kDims; ++k) sums[slot * kChunkDims + d + k] = acc[k];
    }
  }
  if (G == 1) return;
  sm90::NamedBarrier<kMergeBarrier, kMergeThreads>();
  if (g_slot != 0 || c_first >= end) return;
  float total[kDims] = {};
  for (int from = slot; from < slot + G; ++from) {
#pragma unroll
    for (int k = 0; k < kDims; ++k) total[k] += sums[from * kChunkDims + d + k];
  }
  const int64_t out_row = g.global_row0 + c_first / chunks_per_row;
  StoreBf16x8(p.out + out_row * kLatentDim + (c_first % chunks_per_row) * kChunkDims + d, total);
}

}  // namespace treeverify::kernels::cuda::mla
