// The sm_90a MLA verify kernel: 512 latent + 64 rope dims, tensor cores through wgmma, keys
// streamed by TMA.
//
// Shape of the work. A block owns one row tile (kRows packed (node, head) rows of one sequence,
// all sharing the sequence's KV) and one split of the sequence's keys. It computes the scores
// transposed, S^T[64 keys x kRows] = K[64 x 576] * Q^T, so the rows are wgmma's N dimension
// (kRows = 8, 16, 24 or 32: a sequence of 8 or 24 packed rows wastes nothing, where a 64-row M
// tile would be mostly padding at TP8's 8 heads), and the output transposed,
// O^T[512 x kRows] += V^T[512 x 64] * P^T, with V^T read straight from the key tile (the first
// 512 dims of each latent row) as an MN-major operand.
//
// Roles. Warpgroup 2 gives its registers to the consumers; one of its threads is the producer
// (ProduceTiles): the first tiles of the committed prefix, the row tile's queries, then the
// split's remaining 64-key tiles into two stages, in TMA boxes of gcd(64, page_size) keys (pages
// in any order). Warpgroups 0 and 1 are consumers that both work on every tile, so that one tile
// is computed while the next lands: each computes S^T over its half of the 576 dims (its four
// value chunks and half of the rope chunk), the halves are added through shared memory, both run
// the same online softmax, and each accumulates its 256 of the 512 value dims. They then write
// either the final output (one split) or the split's partial result.
//
// Masks. Only tiles that reach past the committed prefix look at ancestor bitmasks; keys past the
// sequence's end score -inf, and their rows in shared memory are zeroed so that stale or
// uninitialized bytes (NaN patterns) never meet a zero probability in the P*V product.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cmath>

#include "grid_dependency.cuh"
#include "mla_verify_common.cuh"
#include "sm90_primitives.cuh"

namespace treeverify::kernels::cuda::mla {

inline constexpr int kWgmmaLatent = kMlaLatent;
inline constexpr int kWgmmaRope = kMlaRope;
inline constexpr int kWgmmaChunks = (kWgmmaLatent + kWgmmaRope) / 64;  // 64-dim chunks per row
inline constexpr int kWgmmaThreads = 384;  // consumer WGs 0 and 1, producer WG 2
inline constexpr int kStageBytes = kWgmmaChunks * kMlaKeyTile * 128;  // 73728
inline constexpr int kOutStride = kWgmmaLatent + 4;                   // staging row, in floats
inline constexpr int kEpilogueBarrier = 3;  // named barrier of the epilogue (the consumers)
inline constexpr int kScoresBarrier = 4;    // the narrow kernel's two consumer warpgroups

template <int kRows>
struct WgmmaSmem {
  static constexpr int kScoreRegs = kRows / 2;  // a consumer thread's share of S^T
  static constexpr int kQ = 2 * kStageBytes;
  static constexpr int kProbs = kQ + kWgmmaChunks * kRows * 128;  // P^T per consumer WG
  static constexpr int kReduce = kProbs + 2 * kRows * 128;        // [WG][warp][row] floats
  // Partial scores, [tile parity][WG][register][thread] floats.
  static constexpr int kExchange = kReduce + 2 * 4 * kRows * 4;
  static constexpr int kLse = kExchange + 2 * 2 * kScoreRegs * 128 * 4;
  static constexpr int kBarriers = kLse + kRows * 4;  // full[2], empty[2], q
  static constexpr int kEnd = kBarriers + 5 * 8;
  static constexpr int kBytes = kEnd + 1024;  // slack to align the base to 1024
  static_assert(kRows * kOutStride * 4 <= kStageBytes, "output staging must fit in a stage");
};

struct WgmmaArgs {
  MlaVerifyParamsBf16 p;
  PartialLayout partial;
  int32_t min_split_keys;
  int32_t row_tiles;
  int32_t box_rows;  // keys per TMA box: divides both 64 and the page size
  bool direct_output;
  bool merge_in_grid;        // MlaVerifyPlan::merge_in_grid: the wide kernel only
  bool stagger_first_tiles;  // MlaVerifyPlan::stagger_first_tiles
  uint64_t* timestamps;      // profiling aid, usually null: see MlaVerifyOptions::timestamps
};

// Profiling aid: %globaltimer (ns) at point `what` of this block, written by one thread (thread
// 0: the last tile and the end are warpgroup 0's, the warpgroups leaving on their own).
enum TimestampPoint {
  kBlockStart = 0,
  kFirstTile = 1,
  kLastTileDone = 2,
  kBlockEnd = 3,
  kSmId = 4,
  kPartialStored = 5,  // in-grid merge: the block's partial result is out; it arrives
  kMergeReleased = 6,  // in-grid merge: the group's last split has arrived
};
static_assert(kMergeReleased + 1 == kMlaVerifyTimestampsPerBlock, "one entry per point");
__device__ inline void RecordTimestamp(uint64_t* timestamps, int what) {
  if (timestamps == nullptr) return;
  const uint64_t now = sm90::GlobalTimerNs();
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  uint64_t* mine = timestamps + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) *
                                    kMlaVerifyTimestampsPerBlock;
  mine[what] = now;
  mine[kSmId] = sm;
}

// Barrier of one consumer warpgroup (ids 1 and 2).
__device__ inline void WarpgroupBarrier(int wg) {
  if (wg == 0) {
    sm90::NamedBarrier<1, 128>();
  } else {
    sm90::NamedBarrier<2, 128>();
  }
}

// The producer (one thread): the row tile's queries once, then the split's key tiles into the two
// stages, tile i into stage i % 2 once the consumers released its previous tile; a tile is loaded
// in TMA boxes of args.box_rows keys (each inside one page), 9 boxes of 64 dims per key group.
template <int kRows>
__device__ inline void ProduceTiles(const WgmmaArgs& args, const SequenceSpan& span, int seq,
                                    int row0, SplitTiles tiles, uint8_t* smem, int q_offset,
                                    uint64_t* full, uint64_t* empty, uint64_t* q_ready,
                                    const CUtensorMap* kv_map, const CUtensorMap* q_map) {
  const MlaVerifyParamsBf16& p = args.p;
  sm90::PrefetchTensorMap(kv_map);
  sm90::PrefetchTensorMap(q_map);
  const int32_t keys = span.keys();
  const int32_t* page_table = p.page_table + static_cast<int64_t>(seq) * p.max_pages_per_seq;
  // A block reads its key tiles once: first out of L2, so that the partial results (stored
  // evict-last) are still there when the merge reads them (bench/NOTES.md, step 57: 1-6 % faster
  // at batch 1; launches whose other row tiles read the same tiles at most 2.4 % slower).
  const uint64_t evict_first = sm90::L2EvictFirstPolicy();
  auto load_tile = [&](int i) {
    const int stage = i & 1;
    if (i >= 2) sm90::MbarrierWait(&empty[stage], ((i >> 1) - 1) & 1);
    const int key0 = (tiles.begin + i) * kMlaKeyTile;
    const int valid = min(kMlaKeyTile, keys - key0);
    const int boxes = CeilDiv(valid, args.box_rows);
    sm90::MbarrierArriveExpectTx(&full[stage], boxes * args.box_rows * 128 * kWgmmaChunks);
    uint8_t* stage_smem = smem + stage * kStageBytes;
    for (int b = 0; b < boxes; ++b) {
      const int key = key0 + b * args.box_rows;
      const int y = page_table[key / p.page_size] * p.page_size + key % p.page_size;
      for (int c = 0; c < kWgmmaChunks; ++c) {
        sm90::TmaLoad2dHinted(stage_smem + c * kMlaKeyTile * 128 + b * args.box_rows * 128, kv_map,
                              c * 64, y, &full[stage], evict_first);
      }
    }
  };
  // Tiles wholly inside the committed prefix were written by earlier steps: the first is requested
  // before waiting for the previous kernel, whose queries and tree-node keys this launch reads
  // (see WaitForPredecessorGrid). The second follows the queries, not before them: the first scores
  // need the first tile and the queries, and at one wave every block's requests share the L2's
  // bandwidth (bench/NOTES.md, step 62). With args.stagger_first_tiles it follows only once the
  // first tile has landed, so that the first computes while the second lands: that pays where the
  // launch is memory-bound and cost 1-5 % on long compute-bound ones (step 38).
  const int num_tiles = tiles.end - tiles.begin;
  int early = 0;
  if (num_tiles > 0 && (tiles.begin + 1) * kMlaKeyTile <= span.committed) load_tile(early++);
  WaitForPredecessorGrid();
  sm90::MbarrierArriveExpectTx(q_ready, kWgmmaChunks * kRows * 128);
  const int q_row = span.row_begin * p.num_heads + row0;
  for (int c = 0; c < kWgmmaChunks; ++c) {
    sm90::TmaLoad2d(smem + q_offset + c * kRows * 128, q_map, c * 64, q_row, q_ready);
  }
  if (args.stagger_first_tiles && early == 1 && num_tiles > 1) sm90::MbarrierWait(&full[0], 0);
  for (int i = early; i < num_tiles; ++i) load_tile(i);
}

// full[0..1] (one producer arrival plus bytes), empty[0..1] = full + 2 (`consumers` arrivals)
// and q_ready, then makes them visible to the async proxy.
__device__ inline void InitStageBarriers(uint64_t* full, uint64_t* q_ready, int consumers) {
  for (int s = 0; s < 2; ++s) {
    sm90::MbarrierInit(&full[s], 1);
    sm90::MbarrierInit(&full[2 + s], consumers);
  }
  sm90::MbarrierInit(q_ready, 1);
  sm90::FenceBarrierInit();
}

// Zeroes key rows valid..63 of a stage in `chunks` chunks from `first_chunk` (whole rows:
// swizzle-agnostic), by the 128 threads of one warpgroup, and orders the stores before wgmma reads
// them; the caller then synchronizes the warpgroup.
__device__ inline void ZeroRowsFrom(uint8_t* stage_smem, int valid, int tid, int first_chunk = 0,
                                    int chunks = kWgmmaChunks) {
  // Thread tid clears 16-byte unit tid % 8 of rows valid + tid / 8, + 16, ... of every chunk:
  // no division by the run-time row count in the kernels' tile loops.
  stage_smem += first_chunk * kMlaKeyTile * 128;
  for (int r = valid + tid / 8; r < kMlaKeyTile; r += 16) {
    for (int c = 0; c < chunks; ++c) {
      reinterpret_cast<uint4*>(stage_smem + c * kMlaKeyTile * 128 + r * 128)[tid % 8] =
          make_uint4(0, 0, 0, 0);
    }
  }
  sm90::FenceProxyAsync();
}

// What one block of a wgmma kernel works on: row tile row0.. of sequence `seq`, key tiles
// `tiles` of split `split`. valid is false for blocks past the sequence's rows or splits.
struct BlockWork {
  bool valid;
  int seq;
  int split;
  int row0;
  int rows;  // packed (node, head) rows of the sequence
  SequenceSpan span;
  SplitTiles tiles;
};

__device__ inline BlockWork LocateBlockWork(const WgmmaArgs& args, int rows_per_tile) {
  BlockWork w{};
  w.seq = blockIdx.y;
  w.split = blockIdx.x / args.row_tiles;
  w.row0 = (blockIdx.x % args.row_tiles) * rows_per_tile;
  w.span = LoadSequence(args.p, w.seq);
  w.rows = w.span.rows * args.p.num_heads;
  if (w.row0 >= w.rows) return w;
  w.tiles = SplitRange(w.span.keys(), args.partial.LaunchSplits(), args.min_split_keys, w.split);
  w.valid = w.tiles.begin != w.tiles.end;
  return w;
}

// The producer warpgroup's whole life: hands its registers to the consumers and one thread
// streams the tiles; it leaves after the last request (the consumers' barriers count only them).
template <int kRows, int kRegisters>
__device__ inline void RunProducer(const WgmmaArgs& args, const BlockWork& work, uint8_t* smem,
                                   int q_offset, uint64_t* full, uint64_t* q_ready,
                                   const CUtensorMap* kv_map, const CUtensorMap* q_map) {
  sm90::DecreaseRegisters<kRegisters>();
  if (threadIdx.x == 8 * 32) {
    ProduceTiles<kRows>(args, work.span, work.seq, work.row0, work.tiles, smem, q_offset, full,
                        full + 2, q_ready, kv_map, q_map);
  }
}

// Reduces v over the 8 lanes that share lane % 4 (the 8 key rows of an accumulator fragment).
template <typename Op>
__device__ inline float ReduceOverLaneRows(float v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return op(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

// Combines one value per accumulator column (packed row) over the tile's 64 keys: the 8 key rows
// of a warp through shuffles, the 4 warps of the warpgroup through `reduce` ([warp][column]),
// in warp order. `values[2j + e]` belongs to column 8j + 2 * (lane % 4) + e.
template <int kRows, typename Op>
__device__ inline void CombineColumns(float (&values)[kRows / 4], float* reduce, int wg,
                                      int wg_warp, int lane, Op op) {
#pragma unroll
  for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float v = ReduceOverLaneRows(values[2 * j + e], op);
      if (lane < 4) reduce[wg_warp * kRows + 8 * j + 2 * (lane % 4) + e] = v;
    }
  }
  WarpgroupBarrier(wg);
#pragma unroll
  for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * (lane % 4) + e;
      float v = reduce[col];
#pragma unroll
      for (int w = 1; w < 4; ++w) v = op(v, reduce[w * kRows + col]);
      values[2 * j + e] = v;
    }
  }
}

template <int kRows>
__global__ void __launch_bounds__(kWgmmaThreads, 1)
    MlaVerifyWgmmaKernel(const __grid_constant__ WgmmaArgs args,
                         const __grid_constant__ CUtensorMap kv_map,
                         const __grid_constant__ CUtensorMap q_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = WgmmaSmem<kRows>;
  constexpr int kColsPerThread = kRows / 4;  // accumulator columns (packed rows) a thread holds
  constexpr int kAcc = kRows / 2;            // fp32 accumulators per thread per m64 block
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = sm90::AlignSharedUp<1024>(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers);
  uint64_t* empty = full + 2;
  uint64_t* q_ready = full + 4;

  const MlaVerifyParamsBf16& p = args.p;
  if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kBlockStart);
  const BlockWork work = LocateBlockWork(args, kRows);
  if (!work.valid) {
    // Even a block without work waits for the previous kernel: were none of this grid's blocks
    // to wait (a step without tree rows, NSPLIT 1), its end would no longer imply the previous
    // kernel's, which a programmatic dependent launch after it relies on.
    WaitForPredecessorGrid();
    return;
  }
  const int seq = work.seq;
  const int split = work.split;
  const int row0 = work.row0;
  const SequenceSpan& span = work.span;
  const int heads = p.num_heads;
  const int rows = work.rows;
  const int32_t keys = span.keys();
  const SplitTiles tiles = work.tiles;
  const int num_tiles = tiles.end - tiles.begin;

  if (threadIdx.x == 0) InitStageBarriers(full, q_ready, 256);  // both WGs read every tile
  __syncthreads();
  AllowDependentGridLaunch();  // the merge kernel may take its place in the queue now

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= 8) {
    RunProducer<kRows, 40>(args, work, smem, Layout::kQ, full, q_ready, &kv_map, &q_map);
    return;
  }

  // ---- consumers ----
  // Both warpgroups work on every tile: each computes S^T over half of the 576 dims, the halves
  // are added through shared memory (fp32 addition commutes, so both hold the same scores), each
  // runs the same online softmax on them and accumulates its own 256 of the 512 value dims. So one
  // tile is in the tensor cores while the next one lands in the other stage.
  sm90::IncreaseRegisters<232>();
  const int wg = warp / 4;       // which consumer warpgroup
  const int wg_warp = warp % 4;  // warp within it: keys 16 * wg_warp .. + 15 of a tile
  const int tid = threadIdx.x % 128;
  const int quad = lane % 4;
  const uint8_t* q_smem = smem + Layout::kQ;
  uint8_t* probs = smem + Layout::kProbs + wg * kRows * 128;
  float* reduce = reinterpret_cast<float*>(smem + Layout::kReduce) + wg * 4 * kRows;
  float* exchange = reinterpret_cast<float*>(smem + Layout::kExchange);
  const float scale = p.softmax_scale * 1.4426950408889634f;  // scores in the log2 domain
  const uint64_t* mask =
      p.ancestor_mask + static_cast<int64_t>(span.row_begin) * kAncestorMaskWords;
  constexpr int kScoreSteps = kWgmmaChunks * 4 / 2;  // k16 steps of S^T per warpgroup
  static_assert(kScoreSteps == 18, "4 value chunks and half of the rope chunk per warpgroup");
  constexpr int kValueBlocks = kWgmmaLatent / 64 / 2;  // m64 blocks of O^T per warpgroup

  // Accumulator element (j, h, e) of a thread: key 16 * wg_warp + lane / 4 + 8 * h of the tile
  // (value dim 256 * wg + 64 * mb + that for O^T), packed row 8 * j + 2 * quad + e of the row tile;
  // register index 4 * j + 2 * h + e.
  float o[kValueBlocks][kAcc];
  float s[kAcc];
  float m_col[kColsPerThread];
  float l_col[kColsPerThread];
#pragma unroll
  for (int mb = 0; mb < kValueBlocks; ++mb) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) o[mb][i] = 0.f;
  }
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) {
    m_col[c] = -INFINITY;
    l_col[c] = 0.f;
  }

  sm90::MbarrierWait(q_ready, 0);
  for (int i = 0; i < num_tiles; ++i) {
    const int stage = i & 1;
    uint8_t* stage_smem = smem + stage * kStageBytes;
    sm90::MbarrierWait(&full[stage], (i >> 1) & 1);
    if (i == 0 && threadIdx.x == 0) RecordTimestamp(args.timestamps, kFirstTile);
    const int key0 = (tiles.begin + i) * kMlaKeyTile;
    const int valid = min(kMlaKeyTile, keys - key0);
    if (valid < kMlaKeyTile) {
      // Rows past the end meet P = 0 in this warpgroup's value chunks, which only it reads: they
      // must not hold NaN. (Their scores are masked whatever the chunks hold.)
      ZeroRowsFrom(stage_smem, valid, tid, wg * kValueBlocks, kValueBlocks);
      WarpgroupBarrier(wg);
    }

    // This warpgroup's half of S^T = K * Q^T: its own four value chunks and half of the rope one.
    sm90::WgmmaFence();
#pragma unroll
    for (int t = 0; t < kScoreSteps; ++t) {
      const int c = t < 16 ? kValueBlocks * wg + t / 4 : kWgmmaChunks - 1;
      const int k = t < 16 ? t % 4 : 2 * wg + (t - 16);
      const uint64_t a =
          sm90::MakeSmemDescriptor(stage_smem + c * kMlaKeyTile * 128 + k * 32, 16, 1024);
      const uint64_t b = sm90::MakeSmemDescriptor(q_smem + c * kRows * 128 + k * 32, 16, 1024);
      sm90::Wgmma<kRows, 0>::Run(s, a, b, t != 0);
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(s);
    // The other half from the other warpgroup (same fragment layout, same thread index). One
    // buffer per tile parity: a warpgroup writes this parity's again only after the barrier of
    // the next tile, which the other passes only after reading.
    float* halves = exchange + (i & 1) * 2 * kAcc * 128;
#pragma unroll
    for (int r = 0; r < kAcc; ++r) halves[(wg * kAcc + r) * 128 + tid] = s[r];
    sm90::NamedBarrier<kScoresBarrier, 256>();
#pragma unroll
    for (int r = 0; r < kAcc; ++r) s[r] += halves[((1 - wg) * kAcc + r) * 128 + tid];

#pragma unroll
    for (int r = 0; r < kAcc; ++r) s[r] *= scale;
    // Masks in a pass of their own, behind one branch, not a branch per score (bench/NOTES.md,
    // step 27); then the tile's max per packed row.
    if (key0 + kMlaKeyTile > span.committed) {
      const int key_a = key0 + 16 * wg_warp + lane / 4;  // h = 0; h = 1 is key_a + 8
#pragma unroll
      for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = key_a + 8 * h;
            const int node = min(row0 + 8 * j + 2 * quad + e, rows - 1) / heads;
            if (key >= keys || !KeyVisible(mask, span.committed, node, key)) {
              s[4 * j + 2 * h + e] = -INFINITY;
            }
          }
        }
      }
    }
    float alpha[kColsPerThread];
    float tile_max[kColsPerThread];
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) tile_max[2 * j + e] = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
    }
    CombineColumns<kRows>(tile_max, reduce, wg, wg_warp, lane,
                          [](float a, float b) { return fmaxf(a, b); });
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * quad + e;
        const int ci = 2 * j + e;
        const float m_new = fmaxf(m_col[ci], tile_max[ci]);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[ci] = exp2f(m_col[ci] - m_use);
        m_col[ci] = m_new;
        const float p0 = exp2f(s[4 * j + e] - m_use);
        const float p1 = exp2f(s[4 * j + 2 + e] - m_use);
        l_col[ci] = l_col[ci] * alpha[ci] + p0 + p1;
        const int key_in_tile = 16 * wg_warp + lane / 4;
        *reinterpret_cast<__nv_bfloat16*>(probs + sm90::Swizzle128(col, key_in_tile)) =
            __float2bfloat16(p0);
        *reinterpret_cast<__nv_bfloat16*>(probs + sm90::Swizzle128(col, key_in_tile + 8)) =
            __float2bfloat16(p1);
      }
    }
    sm90::FenceProxyAsync();
    WarpgroupBarrier(wg);

    // This warpgroup's value dims: O^T = alpha * O^T + V^T * P^T.
#pragma unroll
    for (int mb = 0; mb < kValueBlocks; ++mb) {
#pragma unroll
      for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 2; ++e) o[mb][4 * j + 2 * h + e] *= alpha[2 * j + e];
        }
      }
    }
    sm90::WgmmaFence();
#pragma unroll
    for (int mb = 0; mb < kValueBlocks; ++mb) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint64_t a = sm90::MakeSmemDescriptor(
            stage_smem + (kValueBlocks * wg + mb) * kMlaKeyTile * 128 + k * 16 * 128,
            kMlaKeyTile * 128, 1024);
        const uint64_t b = sm90::MakeSmemDescriptor(probs + k * 32, 16, 1024);
        sm90::Wgmma<kRows, 1>::Run(o[mb], a, b, 1);
      }
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
#pragma unroll
    for (int mb = 0; mb < kValueBlocks; ++mb) sm90::FenceRegisters(o[mb]);
    sm90::MbarrierArrive(&empty[stage]);
  }

  if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kLastTileDone);
  // ---- epilogue: total sums (the same in both warpgroups), output ----
  // l_col held this thread's keys' part of each column's sum; from here on, the whole sum.
  CombineColumns<kRows>(l_col, reduce, wg, wg_warp, lane, [](float a, float b) { return a + b; });
  const int valid_rows = min(kRows, rows - row0);
  if (!args.direct_output) {
    // The split's partial, fp32, straight from the accumulators: the 8 lanes of a quad hold 8
    // consecutive dims of one row, so each store instruction fills whole 32-byte sectors (4 rows),
    // with no staging and no barrier between the last tile and the stores (bench/NOTES.md,
    // step 71). The previous kernel may still read these buffers (a launch that overlaps it).
    WaitForPredecessorGrid();
    const uint64_t keep = sm90::L2EvictLastPolicy();  // read back by the merge
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * quad + e;
        if (col >= valid_rows) continue;
        const float l = l_col[2 * j + e];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        float* out =
            args.partial.Out<float>(seq, split, row0 + col) + 256 * wg + 16 * wg_warp + lane / 4;
#pragma unroll
        for (int mb = 0; mb < kValueBlocks; ++mb) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            sm90::StoreGlobalHinted(out + mb * 64 + 8 * h, o[mb][4 * j + 2 * h + e] * inv, keep);
          }
        }
        if (wg == 0 && wg_warp == 0 && lane < 4) {
          args.partial.lse[args.partial.Index(seq, split, row0 + col)] =
              NaturalLse(m_col[2 * j + e], l);
        }
      }
    }
    if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kBlockEnd);
    return;
  }
  // The final output, bf16, through shared memory (16-byte stores). Both warpgroups are past their
  // last tile: stage 0 is free for the staging rows.
  sm90::NamedBarrierFromAnywhere<kEpilogueBarrier, 256>();
  float* staging = reinterpret_cast<float*>(smem);  // [row][kOutStride], in stage 0
  float* lse_out = reinterpret_cast<float*>(smem + Layout::kLse);
#pragma unroll
  for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * quad + e;
      const int ci = 2 * j + e;
      const float l = l_col[ci];
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int mb = 0; mb < kValueBlocks; ++mb) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          staging[col * kOutStride + 256 * wg + mb * 64 + 16 * wg_warp + lane / 4 + 8 * h] =
              o[mb][4 * j + 2 * h + e] * inv;
        }
      }
      if (wg == 0 && wg_warp == 0 && lane < 4) {
        lse_out[col] = NaturalLse(m_col[ci], l);
      }
    }
  }
  sm90::NamedBarrierFromAnywhere<kEpilogueBarrier, 256>();
  // The previous kernel may still read the buffers written below (a launch that overlaps it).
  WaitForPredecessorGrid();
  const int ctid = threadIdx.x;  // 0..255
  const int64_t global_row0 = static_cast<int64_t>(span.row_begin) * heads + row0;
  // 8 dims (16 bytes) per store.
  for (int u = ctid; u < valid_rows * (kWgmmaLatent / 8); u += 256) {
    const int r = u / (kWgmmaLatent / 8);
    const int d = (u % (kWgmmaLatent / 8)) * 8;
    const float* src = staging + r * kOutStride + d;
    __nv_bfloat162 packed[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) packed[k] = __floats2bfloat162_rn(src[2 * k], src[2 * k + 1]);
    *reinterpret_cast<uint4*>(p.out + (global_row0 + r) * kWgmmaLatent + d) =
        *reinterpret_cast<const uint4*>(packed);
  }
  if (ctid < valid_rows) p.lse[global_row0 + ctid] = lse_out[ctid];
  if (threadIdx.x == 0) RecordTimestamp(args.timestamps, kBlockEnd);
#else
  __trap();  // built without sm_90a code: the planner never picks this kernel then
#endif
}

}  // namespace treeverify::kernels::cuda::mla
