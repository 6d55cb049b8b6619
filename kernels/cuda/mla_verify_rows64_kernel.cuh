// The sm_90a MLA verify kernel for many packed rows (the compute-bound shapes: H * Q above 32).
//
// A block owns 64 packed (node, head) rows of one sequence and one split of its keys, in the
// plain orientation: S[64 rows x 64 keys] = Q * K^T, O[64 x 512] += P * V. Warpgroup w keeps the
// output for dims 256w..256w+255 and owns the key tiles i with i % 2 == w: for those it computes
// S with wgmma (Q and the key tile in shared memory, N = 64) and the online softmax (a row's
// scores live in one quad of lanes: no shared-memory reduction), multiplies P from its registers,
// and hands P (bf16), the rescale factors and the row statistics to the other warpgroup through
// shared memory. It computes the scores of its next tile (i + 2) after its part of the P*V of
// tile i + 1, which it does not own, so that the P*V that releases a stage never waits behind a
// load (bench/NOTES.md, step 28); the tensor cores run those scores while the other warpgroup
// does its softmax. The owner's softmax is on every tile's critical path (the other warpgroup
// waits for P), so it is kept short: P goes to shared memory by stmatrix, the exponentials are
// single MUFU ops, and a row's reference max moves only when a score passes it by more than 2^8,
// so that most tiles need no rescale of O (bench/NOTES.md, steps 52-54). V is the first 512 dims
// of the key tile, read as an MN-major B operand; nothing is copied. Each warpgroup's output dims
// leave, as soon as its last tile is done, through the stage that tile did not use, in 16-byte
// bf16 pieces (bench/NOTES.md, step 64).
//
// Shared memory (226 KB of the 227 a block may have): two 64-key stages (72 KB each), the query
// tile (72 KB), P (8 KB). The producer, masks and partial-tile zeroing follow the row-tile
// kernel (mla_verify_wgmma_kernel.cuh).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cmath>

#include "mla_verify_common.cuh"
#include "mla_verify_grid_merge.cuh"
#include "mla_verify_wgmma_kernel.cuh"
#include "mma_sync_primitives.cuh"
#include "sm90_primitives.cuh"
#include "sm90_wgmma_wide.cuh"

namespace treeverify::kernels::cuda::mla {

inline constexpr int kRows64 = 64;
// How far (log2 units) a row's scores may pass its reference max before the max moves and O is
// rescaled (FlashAttention-4's conditional rescaling): probabilities up to 2^8 are exact enough in
// bf16 (relative precision does not depend on magnitude) and far from fp32's range in O and l.
inline constexpr float kMaxGrowth = 8.f;

struct Rows64Smem {
  static constexpr int kQ = 2 * kStageBytes;
  static constexpr int kProbs = kQ + kWgmmaChunks * kRows64 * 128;  // P [64 rows][64 keys] bf16
  static constexpr int kAlpha = kProbs + kRows64 * 128;             // rescale per row
  static constexpr int kStats = kAlpha + kRows64 * 4;               // running max, sum per row
  static constexpr int kBarriers = kStats + 2 * kRows64 * 4;        // full[2], empty[2], q
  static constexpr int kEnd = kBarriers + 5 * 8;
  static constexpr int kBytes = kEnd + 1024;
};

// "Tile ready": the owner of a tile (warpgroup tile % 2) signals that P, alpha and the row
// statistics of the tile are in shared memory; the other warpgroup waits for it. One barrier id
// per tile parity: with a single id, an owner without a next tile could reach the wait for the
// following tile while its own signal still counts toward the current one.
inline constexpr int kTileReadyEven = 4;
inline constexpr int kTileReadyOdd = 5;
// bf16 per staged output row: 16 bytes of padding put the 8 rows a warp writes at once in
// different banks.
inline constexpr int kStagingStride = kWgmmaLatent + 8;
static_assert(kRows64 * kStagingStride * 2 <= kStageBytes, "output staging fits one stage");

__device__ inline void SignalTileReady(int tile) {
  if (tile & 1) {
    sm90::NamedBarrierArrive<kTileReadyOdd, 256>();
  } else {
    sm90::NamedBarrierArrive<kTileReadyEven, 256>();
  }
}
__device__ inline void WaitTileReady(int tile) {
  if (tile & 1) {
    sm90::NamedBarrier<kTileReadyOdd, 256>();
  } else {
    sm90::NamedBarrier<kTileReadyEven, 256>();
  }
}

// The end of a split block under the in-grid merge, by the 256 consumer threads after the
// block's partial result is stored: meet the group's other splits, then merge this block's share.
// `scratch` (kMergeScratchFloats) and `pieces` (kMergePieceBytes): shared memory nobody uses any
// more once the block's threads have met at the first barrier below.
__device__ inline void MergeInGrid(const WgmmaArgs& args, const MergeGroup& group, int group_index,
                                   float* scratch, uint8_t* pieces) {
  sm90::NamedBarrier<kMergeBarrier, kMergeThreads>();
  if (threadIdx.x == 0) {
    RecordTimestamp(args.timestamps, kPartialStored);
    ArriveAndWaitForSplits(args.partial.merge_counters, group_index, group.splits);
    RecordTimestamp(args.timestamps, kMergeReleased);
    DepartFromSplits(args.partial.merge_counters, group_index, group.splits);
  }
  sm90::NamedBarrier<kMergeBarrier, kMergeThreads>();
  MergeShare<kWgmmaLatent>(args.p, args.partial, group, scratch, pieces, threadIdx.x);
}

// kMergeInGrid: WgmmaArgs::merge_in_grid, as a template parameter so that launches with the merge
// kernel do not carry the in-grid merge's code (bench/NOTES.md, step 60).
template <bool kMergeInGrid>
__global__ void __launch_bounds__(kWgmmaThreads, 1)
    MlaVerifyRows64Kernel(const __grid_constant__ WgmmaArgs args,
                          const __grid_constant__ CUtensorMap kv_map,
                          const __grid_constant__ CUtensorMap q_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = Rows64Smem;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = sm90::AlignSharedUp<1024>(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers);
  uint64_t* empty = full + 2;
  uint64_t* q_ready = full + 4;

  const MlaVerifyParamsBf16& p = args.p;
  if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kBlockStart);
  // The prologue and the producer role are spelled out here rather than taken from
  // LocateBlockWork / RunProducer (mla_verify_wgmma_kernel.cuh): with those, ptxas made this
  // kernel 6 % slower at every shape (bench/NOTES.md, step 11).
  const int seq = blockIdx.y;
  const int split = blockIdx.x / args.row_tiles;
  const int row0 = (blockIdx.x % args.row_tiles) * kRows64;
  const SequenceSpan span = LoadSequence(p, seq);
  const int heads = p.num_heads;
  const int rows = span.rows * heads;
  // Blocks without work wait for the previous kernel too, as the narrow kernel's do.
  if (row0 >= rows) {
    WaitForPredecessorGrid();
    return;
  }
  const int32_t keys = span.keys();
  const int32_t nsplit = args.partial.LaunchSplits();
  const SplitTiles tiles = SplitRange(keys, nsplit, args.min_split_keys, split);
  if (tiles.begin == tiles.end) {
    WaitForPredecessorGrid();
    return;
  }
  const int num_tiles = tiles.end - tiles.begin;

  if (threadIdx.x == 0) InitStageBarriers(full, q_ready, 256);  // both WGs read every tile
  __syncthreads();
  AllowDependentGridLaunch();  // the merge kernel may take its place in the queue now

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= 8) {
    // ---- producer: every tile goes to both consumer warpgroups ----
    sm90::DecreaseRegisters<24>();
    if (warp == 8 && lane == 0) {
      ProduceTiles<kRows64>(args, span, seq, row0, tiles, smem, Layout::kQ, full, empty, q_ready,
                            &kv_map, &q_map);
    }
    return;  // the consumers' epilogues meet only each other (kMergeBarrier)
  }

  sm90::IncreaseRegisters<240>();
  const int wg = warp / 4;
  const int wg_warp = warp % 4;
  const int quad = lane % 4;
  const int tid = threadIdx.x % 128;
  // This thread's rows of the tile (both warpgroups: the accumulator layout of m64nN).
  const int r_lo = 16 * wg_warp + lane / 4;  // h = 0; h = 1 is r_lo + 8
  uint8_t* probs = smem + Layout::kProbs;
  float* alpha_smem = reinterpret_cast<float*>(smem + Layout::kAlpha);
  float* stats_smem = reinterpret_cast<float*>(smem + Layout::kStats);  // [max | sum][row]
  const float scale = p.softmax_scale * 1.4426950408889634f;
  const uint64_t* mask =
      p.ancestor_mask + static_cast<int64_t>(span.row_begin) * kAncestorMaskWords;

  // O[rows r_lo + 8h][dims 256 * wg + 8j + 2 * quad + e]: index 4j + 2h + e.
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  // The running row max and row sum after the last tile seen, the same in both warpgroups.
  float m_row[2] = {-INFINITY, -INFINITY};
  float l_row[2] = {0.f, 0.f};
  float s[32];  // scores of the next tile this warpgroup owns

  // S = Q * K^T of tile i into s, after the tile has landed and its rows past the sequence's end
  // are zeroed. The whole wgmma sequence (fence to wait) stays inside one call: a sequence that
  // spans branches makes ptxas serialize it (C7518).
  auto compute_scores = [&](int i) {
    uint8_t* stage_smem = smem + (i & 1) * kStageBytes;
    sm90::MbarrierWait(&full[i & 1], (i >> 1) & 1);
    const int valid = min(kMlaKeyTile, keys - (tiles.begin + i) * kMlaKeyTile);
    if (valid < kMlaKeyTile) {
      ZeroRowsFrom(stage_smem, valid, tid);
      WarpgroupBarrier(wg);
    }
    sm90::WgmmaFence();
#pragma unroll
    for (int c = 0; c < kWgmmaChunks; ++c) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint64_t a =
            sm90::MakeSmemDescriptor(smem + Layout::kQ + c * kRows64 * 128 + k * 32, 16, 1024);
        const uint64_t b =
            sm90::MakeSmemDescriptor(stage_smem + c * kMlaKeyTile * 128 + k * 32, 16, 1024);
        sm90::WgmmaM64N64<0, 0>::Run(s, a, b, (c | k) != 0);
      }
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(s);
  };
  auto rescale = [&](const float(&alpha)[2]) {
    // Warp-uniform: a warp skips its multiplies when none of its rows moved its reference max.
    if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        o[4 * j + 2 * h] *= alpha[h];
        o[4 * j + 2 * h + 1] *= alpha[h];
      }
    }
  };

  // Tiles alternate between the warpgroups: the owner of tile i (warpgroup i % 2) computes its
  // scores and softmax and publishes P, alpha and the new row max and sum ("ready"); both then
  // multiply P by their half of V. A warpgroup computes the scores of its next tile (i + 2) after
  // its part of the P*V of tile i + 1, which it does not own.
  sm90::MbarrierWait(q_ready, 0);
  if (wg < num_tiles) compute_scores(wg);
  if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kFirstTile);
  for (int i = 0; i < num_tiles; ++i) {
    const int stage = i & 1;
    uint8_t* v_smem = smem + stage * kStageBytes + wg * 4 * kMlaKeyTile * 128;
    if ((i & 1) == wg) {
      // Owner: s holds this tile's scores.
      const int key0 = (tiles.begin + i) * kMlaKeyTile;
#pragma unroll
      for (int r = 0; r < 32; ++r) s[r] *= scale;
      // Masks in a pass of their own, behind one branch: inside the loops below, a branch per
      // score made the softmax of every tile three times slower (bench/NOTES.md, step 27).
      if (key0 + kMlaKeyTile > span.committed) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int node = min(row0 + r_lo + 8 * h, rows - 1) / heads;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = key0 + 8 * j + 2 * quad + e;
              if (key >= keys || !KeyVisible(mask, span.committed, node, key)) {
                s[4 * j + 2 * h + e] = -INFINITY;
              }
            }
          }
        }
      }
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) tile_max = fmaxf(tile_max, s[4 * j + 2 * h + e]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        // The reference max moves only when a score passes it by more than kMaxGrowth: the
        // probabilities stay under 2^kMaxGrowth, and most tiles leave O as it is (alpha 1).
        const bool grow = tile_max > m_row[h] + kMaxGrowth;
        const float m_new = grow ? tile_max : m_row[h];
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[h] = grow ? sm90::Exp2FlushDenormals(m_row[h] - m_use) : 1.f;
        m_row[h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[4 * j + 2 * h + e];
            x = sm90::Exp2FlushDenormals(x - m_use);
            sum += x;
          }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l_row[h] = l_row[h] * alpha[h] + sum;
      }
      // P as A fragments: k16 step t covers keys 16t..16t+15 = accumulator columns j = 2t, 2t+1.
      uint32_t p_frag[4][4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        p_frag[t][0] = mma::PackBf16x2(s[8 * t + 0], s[8 * t + 1]);
        p_frag[t][1] = mma::PackBf16x2(s[8 * t + 2], s[8 * t + 3]);
        p_frag[t][2] = mma::PackBf16x2(s[8 * t + 4], s[8 * t + 5]);
        p_frag[t][3] = mma::PackBf16x2(s[8 * t + 6], s[8 * t + 7]);
      }
      // Publish P, alpha and the row statistics. P's buffer is free: its last reader was this
      // warpgroup, as the non-owner of tile i - 1, and that multiply has completed.
      // Four stmatrix per warp: matrix k of step t is rows + 8 (k % 2), keys 16t + 8 (k / 2).
      {
        const int k = lane / 8;
        const int row = 16 * wg_warp + 8 * (k % 2) + lane % 8;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          sm90::StoreMatrices8x8x4(probs + sm90::Swizzle128(row, 16 * t + 8 * (k / 2)),
                                   p_frag[t][0], p_frag[t][1], p_frag[t][2], p_frag[t][3]);
        }
      }
      // The quad's other lanes read these as the non-owner of the previous tile: order those
      // reads before this write (racecheck, bench/NOTES.md step 40).
      __syncwarp();
      if (quad == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          alpha_smem[r_lo + 8 * h] = alpha[h];
          stats_smem[r_lo + 8 * h] = m_row[h];
          stats_smem[kRows64 + r_lo + 8 * h] = l_row[h];
        }
      }
      sm90::FenceProxyAsync();
      SignalTileReady(i);

      rescale(alpha);
      sm90::WgmmaFence();
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint64_t b = sm90::MakeSmemDescriptor(v_smem + t * 16 * 128, kMlaKeyTile * 128, 1024);
        sm90::WgmmaM64N256RegA<1>::Run(o, p_frag[t], b, 1);
      }
      sm90::WgmmaCommit();
      sm90::WgmmaWait<0>();
      sm90::FenceRegisters(o);
      sm90::MbarrierArrive(&empty[stage]);
    } else {
      // Non-owner: P, alpha and the row statistics of tile i come from the owner.
      sm90::MbarrierWait(&full[stage], (i >> 1) & 1);
      WaitTileReady(i);
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        alpha[h] = alpha_smem[r_lo + 8 * h];
        m_row[h] = stats_smem[r_lo + 8 * h];
        l_row[h] = stats_smem[kRows64 + r_lo + 8 * h];
      }
      rescale(alpha);
      sm90::WgmmaFence();
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint64_t a = sm90::MakeSmemDescriptor(probs + t * 32, 16, 1024);
        const uint64_t b = sm90::MakeSmemDescriptor(v_smem + t * 16 * 128, kMlaKeyTile * 128, 1024);
        sm90::WgmmaM64N256<0, 1>::Run(o, a, b, 1);
      }
      sm90::WgmmaCommit();
      sm90::WgmmaWait<0>();
      sm90::FenceRegisters(o);
      sm90::MbarrierArrive(&empty[stage]);
      // The scores of the next tile, which this warpgroup owns (tiles 0 and 1 were computed
      // before the loop), only now: tile i + 1 reuses the stage of tile i - 1, which the producer
      // refills once both warpgroups are done with it, and computing them right after this
      // warpgroup's own P*V of tile i - 1 put that load's latency between this P*V of tile i and
      // the stage release it makes (step 28 of bench/NOTES.md).
      if (i + 1 < num_tiles && i + 1 >= 2) compute_scores(i + 1);
    }
  }

  if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kLastTileDone);
  // ---- epilogue: both warpgroups hold the final row max and sum; each stages and stores its
  // own 256 dims as soon as its last tile is done, without waiting for the other ----
  // The stage the last tile did not use is free once both warpgroups have released the tile
  // before (num_tiles - 2); with one tile it was never loaded.
  const int free_stage = num_tiles & 1;
  if (num_tiles >= 2) sm90::MbarrierWait(&empty[free_stage], ((num_tiles - 2) >> 1) & 1);
  // The previous kernel may still read the buffers written below (a launch that overlaps it).
  WaitForPredecessorGrid();
  const int valid_rows = min(kRows64, rows - row0);
  const int64_t global_row0 = static_cast<int64_t>(span.row_begin) * heads + row0;
  // A sequence of one split needs no merge: under the in-grid merge its block writes the output.
  const int splits = kMergeInGrid ? NumSplits(keys, nsplit, args.min_split_keys) : 0;
  const bool write_final = args.direct_output || (kMergeInGrid && splits == 1);
  // The rows go out through shared memory (the free stage above), in bf16 whether final
  // or partial: the accumulator layout gives a thread 4 bytes of bf16 per 8 dims, and stores that
  // fill half of a 32-byte sector make the L2 read the sector first (bench/NOTES.md, step 33).
  // Staged, every store is 16 bytes of a row.
  __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(smem + free_stage * kStageBytes);
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) inv[h] = l_row[h] > 0.f ? 1.f / l_row[h] : 0.f;
  // A thread's O pairs are the fragments of 8x8 bf16 matrices (rows r_lo + 8h, dims 8j..8j+7):
  // four matrices per stmatrix, matrix k = (h = k % 2, dims 8 (j + k / 2)), 16 per thread instead
  // of 64 four-byte stores.
  {
    const int k = lane / 8;
    const int row = 16 * wg_warp + 8 * (k % 2) + lane % 8;
    __nv_bfloat16* row_smem = staging + row * kStagingStride + 256 * wg + 8 * (k / 2);
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      sm90::StoreMatrices8x8x4(row_smem + 8 * j,
                               mma::PackBf16x2(o[4 * j] * inv[0], o[4 * j + 1] * inv[0]),
                               mma::PackBf16x2(o[4 * j + 2] * inv[1], o[4 * j + 3] * inv[1]),
                               mma::PackBf16x2(o[4 * j + 4] * inv[0], o[4 * j + 5] * inv[0]),
                               mma::PackBf16x2(o[4 * j + 6] * inv[1], o[4 * j + 7] * inv[1]));
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    const float m = m_row[h];
    const float l = l_row[h];
    if (wg == 0 && quad == 0 && r < valid_rows) {
      const float lse = NaturalLse(m, l);
      if (write_final) {
        p.lse[global_row0 + r] = lse;
      } else {
        args.partial.lse[args.partial.Index(seq, split, row0 + r)] = lse;
      }
    }
  }
  WarpgroupBarrier(wg);
  // The final output or this split's partial, both bf16 normalized by this block's sum.
  constexpr int kPieces = kWgmmaLatent / 2 / 8;     // a warpgroup's 16-byte pieces per row
  const uint64_t keep = sm90::L2EvictLastPolicy();  // partials: read back by the merge
  for (int u = tid; u < valid_rows * kPieces; u += 128) {
    const int r = u / kPieces;
    const int d = kWgmmaLatent / 2 * wg + (u % kPieces) * 8;
    const uint4 v = *reinterpret_cast<const uint4*>(staging + r * kStagingStride + d);
    if (write_final) {
      *reinterpret_cast<uint4*>(p.out + (global_row0 + r) * kWgmmaLatent + d) = v;
    } else {
      sm90::StoreGlobalHinted(args.partial.Out<__nv_bfloat16>(seq, split, row0 + r) + d, v, keep);
    }
  }
  if (kMergeInGrid && !write_final) {
    // Both stages are free once the two warpgroups have met at the merge's first barrier, after
    // their stores.
    static_assert(kMergeScratchFloats * 4 <= kStageBytes && kMergePieceBytes <= kStageBytes);
    MergeInGrid(args, {seq, row0, valid_rows, global_row0, split, splits},
                seq * args.row_tiles + row0 / kRows64, reinterpret_cast<float*>(smem + kStageBytes),
                smem);
  }
  if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kBlockEnd);
#else
  __trap();  // built without sm_90a code: the planner never picks this kernel then
#endif
}

}  // namespace treeverify::kernels::cuda::mla
