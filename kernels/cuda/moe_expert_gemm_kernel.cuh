// The MoE expert projections as a grouped GEMM, for batches with many tokens per expert (prefill
// chunks): the weight-streaming kernel (moe_expert_tma_kernel.cuh) reads an expert's weights
// once per 32 tokens, right for a verify step's few tokens per expert and too often for a
// 4096-token chunk's ~85. Here a block owns one tile of up to 64 grouped pairs of one expert and
// 128 weight rows (gate/up: 64 columns of each), and walks the reduction in stages of 64 elements
// (three cp.async stages, rows padded by 16 bytes so that ldmatrix is free of bank conflicts). Its
// four warps split the tile 2 x 2: 32 pairs x 64 weight rows each, mma.sync m16n8k16.
//
// Quantized experts (moe_records.h: INT4 or FP8 records, one record a stage's 128 weight rows x 64
// columns) are copied as stored beside the stage and dequantized there by the block into the
// stage's bf16 rows (moe_dequantize.cuh: the values the weight stream computes), once per 64
// pairs; then the same mma loop runs.
//
// The tiles come from the grouping kernel (Workspace.tile_expert / tile_pair, device memory), and
// the grid is sized by their upper bound, so any routing runs (and replays from a CUDA graph) with
// the same launch; blocks past the step's tiles return at once. The reduction order within a tile
// is fixed: results do not depend on scheduling.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "element_convert.cuh"
#include "mma_sync_primitives.cuh"
#include "moe_dequantize.cuh"
#include "moe_workspace.cuh"
#include "silu_times_up.cuh"
#include "treeverify/kernels/cuda/moe_fp8_tiles.h"
#include "treeverify/kernels/cuda/moe_int4_tiles.h"
#include "treeverify/kernels/cuda/moe_tiles.h"
#include "treeverify/kernels/moe.h"

namespace treeverify::kernels::cuda::moe {

inline constexpr int kGemmThreads = 128;
inline constexpr int kGemmK = 64;  // reduction elements per stage
inline constexpr int kGemmStages = 3;
inline constexpr int kGemmWeightRows = 128;            // per block: gate 64 + up 64, or down 128
inline constexpr int kGemmRowBytes = kGemmK * 2 + 16;  // one staged row, padded
inline constexpr int kGemmStageBytes = (kGemmPairs + kGemmWeightRows) * kGemmRowBytes;

// How the block reads the experts' weights: bf16 (tiles or pointer arrays), or one quantized
// format's records.
enum class GemmWeights { kBf16, kInt4, kFp8 };

// A record's bytes (0 for bf16), staged beside each stage's rows.
template <GemmWeights kWeights>
inline constexpr int kGemmRecordBytes = kWeights == GemmWeights::kInt4
                                            ? static_cast<int>(MoeInt4Records::kRecordBytes)
                                        : kWeights == GemmWeights::kFp8
                                            ? static_cast<int>(MoeFp8Records::kRecordBytes)
                                            : 0;
template <GemmWeights kWeights>
inline constexpr int kGemmSlotBytes = kGemmStageBytes + kGemmRecordBytes<kWeights>;
template <GemmWeights kWeights>
inline constexpr int kGemmSmemBytes = kGemmStages* kGemmSlotBytes<kWeights>;
static_assert(kGemmStageBytes % 16 == 0 && MoeInt4Records::kRecordBytes % 16 == 0 &&
              MoeFp8Records::kRecordBytes % 16 == 0);
// A record is one stage's weight rows: 64 of gate over the same 64 of up, or 128 of down, by 64.
static_assert(MoeRecordLayout::kColumns == kGemmK && MoeRecordLayout::kRows == kGemmWeightRows);

// A stage's weight rows are one tile of each matrix where the experts come as tiles.
static_assert(kGemmK == MoeTileLayout::kColumns &&
              GateUpTileLayout(0, 0).tile_rows == kGemmWeightRows / 2 &&
              DownTileLayout(0, 0).tile_rows == kGemmWeightRows);

// Whether the grouped GEMM takes these shapes: whole stages of the reduction and whole tiles of
// the outputs (every production shape; the weight-streaming kernels take the rest).
inline bool GemmFits(int64_t hidden, int64_t intermediate) {
  return hidden % kGemmWeightRows == 0 && intermediate % (kGemmWeightRows / 2) == 0;
}

// Queues stage `chunk` of the tile: its pairs' inputs (rows past the tile's pairs zero-filled)
// and its weight rows (quantized: the record, after the stage's rows).
template <bool kGateUp, GemmWeights kWeights>
__device__ __forceinline__ void LoadGemmStage(const MoeExpertsParamsOf<Bf16, Bf16>& p,
                                              const Workspace& w, int32_t expert, int32_t first,
                                              int pairs, int64_t weight_row0, int64_t chunk,
                                              uint8_t* stage) {
  const int64_t length = kGateUp ? p.hidden : p.intermediate;
  const int64_t column = chunk * kGemmK;
  for (int i = threadIdx.x; i < kGemmPairs * (kGemmK / 8); i += kGemmThreads) {
    const int r = i / (kGemmK / 8), c = i % (kGemmK / 8);
    const bool valid = r < pairs;
    const int32_t pair = first + (valid ? r : 0);
    const Bf16* row = kGateUp ? p.x + int64_t{w.pair_token[pair]} * p.hidden
                              : w.activated + int64_t{pair} * p.intermediate;
    mma::CpAsync16(stage + r * kGemmRowBytes + c * 16, row + column + c * 8, valid);
  }
  uint8_t* weights = stage + kGemmPairs * kGemmRowBytes;
  if constexpr (kWeights != GemmWeights::kBf16) {
    const ExpertRecords records = RecordsOf(p, kWeights == GemmWeights::kInt4, kGateUp);
    const uint8_t* record = records.Record(expert, weight_row0 / records.layout.TileRows(), chunk);
    uint8_t* staged = stage + kGemmStageBytes;
    for (int i = threadIdx.x; i < kGemmRecordBytes<kWeights> / 16; i += kGemmThreads) {
      mma::CpAsync16(staged + 16 * i, record + 16 * i, true);
    }
    return;
  }
  // With tiles (MoeExperts checks all three or none), the stage's rows are one tile of each
  // matrix (moe_tiles.h): 64 of gate and of up, or 128 of down, at the stage's chunk.
  const bool tiled = p.packed_gate != nullptr;
  const MoeTileLayout layout = kGateUp ? GateUpTileLayout(p.intermediate, p.hidden)
                                       : DownTileLayout(p.hidden, p.intermediate);
  const int64_t tile = layout.TileOffset(expert, weight_row0 / layout.tile_rows, chunk);
  for (int i = threadIdx.x; i < kGemmWeightRows * (kGemmK / 8); i += kGemmThreads) {
    const int r = i / (kGemmK / 8), c = i % (kGemmK / 8);
    const bool up = kGateUp && r >= kGemmWeightRows / 2;  // rows 64..127: up, of the same rows
    const int in_tile = kGateUp ? r % (kGemmWeightRows / 2) : r;
    const Bf16* source;
    if (tiled) {
      const Bf16* tiles = !kGateUp ? p.packed_down : up ? p.packed_up : p.packed_gate;
      source = tiles + tile + MoeTileLayout::UnitInTile(in_tile, c);
    } else {
      const int64_t row = weight_row0 + in_tile;
      const Bf16* matrix = !kGateUp ? p.down_proj[expert]
                           : up     ? p.up_proj[expert]
                                    : p.gate_proj[expert];
      source = matrix + row * length + column + c * 8;
    }
    mma::CpAsync16(weights + r * kGemmRowBytes + c * 16, source, true);
  }
}

// The stage's record, landed after its rows, into those rows as bf16: a thread per fragment word
// of the record (moe_records.h: warp w, lane (g, q), k-step k), four pairs each, each pair a row's
// two adjacent columns (one 4-byte store). Gate/up rows: gate's 0-63, up's 64-127.
template <bool kGateUp, GemmWeights kWeights>
__device__ __forceinline__ void DequantizeGemmStage(uint8_t* stage) {
  const uint8_t* record = stage + kGemmStageBytes;
  uint8_t* weights = stage + kGemmPairs * kGemmRowBytes;
  constexpr int kWords = 8 * 32 * 4;  // record warps x lanes x k-steps
  for (int index = threadIdx.x; index < kWords; index += kGemmThreads) {
    const int rw = index / 128, lane = index / 4 % 32, k = index % 4;
    const int g = lane / 4, q = lane % 4;
    uint32_t pairs[4];
    if constexpr (kWeights == GemmWeights::kInt4) {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(record + 4 * index);
      const uint32_t scales = *reinterpret_cast<const uint32_t*>(
          record + MoeInt4Records::kWordBytes + ((rw * 8 + g) * 2 + k / 2) * 4);
      DequantizeInt4Word(word, scales, pairs);
    } else {
      const uint2 bytes = *reinterpret_cast<const uint2*>(
          record + ((rw * 2 + k / 2) * 32 + lane) * 16 + (k % 2) * 8);
      const float* scales = reinterpret_cast<const float*>(record + MoeFp8Records::kWeightBytes);
      DequantizeFp8Word(bytes.x, bytes.y, scales[0], kGateUp ? scales[1] : scales[0], pairs);
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int i = g + 8 * (p % 2);  // fragment row
      const int row = kGateUp ? (i / 8) * (kGemmWeightRows / 2) + 8 * rw + i % 8 : 16 * rw + i;
      const int column = static_cast<int>(MoeRecordLayout::FragmentColumn(k, q, p, 0));
      *reinterpret_cast<uint32_t*>(weights + row * kGemmRowBytes + column * 2) = pairs[p];
    }
  }
}

// Block = (tile, column block): blockIdx.x = turn * max_tiles + tile, column block = (turn +
// the tile's expert) mod the column blocks. The tiles of one expert (adjacent in the list) read
// the same weight rows at about the same time, through L2, and the experts side by side read
// different row tiles: with the weights as tiles, each expert's row tile is one run of memory,
// and runs at the same offset of every expert at once were a third of what reading the tiles
// cost this kernel (27 %; bench/NOTES.md, steps 118 and 123).
template <bool kGateUp, GemmWeights kWeights>
__global__ void __launch_bounds__(kGemmThreads)
    ExpertGemmKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t max_tiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) uint8_t smem[];
  const int32_t tile = blockIdx.x % max_tiles;
  if (tile >= *w.num_tiles) return;
  const int32_t expert = w.tile_expert[tile];
  const int64_t column_blocks =
      kGateUp ? p.intermediate / (kGemmWeightRows / 2) : p.hidden / kGemmWeightRows;
  const int64_t column_block = (blockIdx.x / max_tiles + expert) % column_blocks;
  const int32_t first = w.tile_pair[tile];
  const int pairs = min(kGemmPairs, w.offsets[expert + 1] - first);
  // Output columns of this block: 64 of gate/up (intermediate), or 128 of down (hidden).
  const int64_t weight_row0 = column_block * (kGateUp ? kGemmWeightRows / 2 : kGemmWeightRows);
  const int64_t stages = (kGateUp ? p.hidden : p.intermediate) / kGemmK;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_m = warp / 2, warp_n = warp % 2;
  // This warp's eight n8 tiles of weight rows: gate/up, 32 columns of each; down, 64 rows.
  int b_row[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    b_row[j] = kGateUp ? (j < 4 ? 32 * warp_n + 8 * j : 64 + 32 * warp_n + 8 * (j - 4))
                       : 64 * warp_n + 8 * j;
  }
  float acc[2][8][4] = {};

#pragma unroll
  for (int s = 0; s < kGemmStages - 1; ++s) {
    if (s < stages) {
      LoadGemmStage<kGateUp, kWeights>(p, w, expert, first, pairs, weight_row0, s,
                                       smem + s * kGemmSlotBytes<kWeights>);
    }
    mma::CpAsyncCommit();
  }
  for (int64_t chunk = 0; chunk < stages; ++chunk) {
    mma::CpAsyncWait<kGemmStages - 2>();
    __syncthreads();  // stage `chunk` has landed; every warp is done with the one reloaded next
    const int64_t next = chunk + kGemmStages - 1;
    if (next < stages) {
      LoadGemmStage<kGateUp, kWeights>(p, w, expert, first, pairs, weight_row0, next,
                                       smem + (next % kGemmStages) * kGemmSlotBytes<kWeights>);
    }
    mma::CpAsyncCommit();
    uint8_t* slot = smem + (chunk % kGemmStages) * kGemmSlotBytes<kWeights>;
    if constexpr (kWeights != GemmWeights::kBf16) {
      DequantizeGemmStage<kGateUp, kWeights>(slot);
      __syncthreads();  // the stage's bf16 rows, for every warp's ldmatrix
    }
    const uint8_t* a_stage = slot;
    const uint8_t* b_stage = a_stage + kGemmPairs * kGemmRowBytes;
#pragma unroll
    for (int k = 0; k < kGemmK / 16; k += 2) {
      uint32_t a[2][2][4];  // [m16 tile][k-step]
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          mma::LoadMatrices4(a[mi][ks], a_stage +
                                            (32 * warp_m + 16 * mi + lane % 16) * kGemmRowBytes +
                                            (k + ks) * 32 + (lane / 16) * 16);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t b[4];  // k-step k: b[0], b[1]; k-step k + 1: b[2], b[3]
        mma::LoadMatrices4(
            b, b_stage + (b_row[j] + lane % 8) * kGemmRowBytes + (lane / 8) * 16 + k * 32);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma::MmaBf16(acc[mi][j], a[mi][0], b[0], b[1]);
          mma::MmaBf16(acc[mi][j], a[mi][1], b[2], b[3]);
        }
      }
    }
  }
  mma::CpAsyncWait<0>();

  // Accumulator i of (mi, j): pair 32 warp_m + 16 mi + g (+ 8 for i >= 2), weight row
  // b_row[j] + 2t + (i & 1).
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 32 * warp_m + 16 * mi + g + (i >= 2 ? 8 : 0);
      if (r >= pairs) continue;
      if constexpr (kGateUp) {
        Bf16* out = w.activated + int64_t{first + r} * p.intermediate + weight_row0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          out[b_row[j] + 2 * t + (i & 1)] =
              FromFloat<Bf16>(SiluTimesUp(acc[mi][j][i], acc[mi][j + 4][i]));
        }
      } else {
        float* out = w.expert_out + int64_t{w.pair_entry[first + r]} * p.hidden + weight_row0;
#pragma unroll
        for (int j = 0; j < 8; ++j) out[b_row[j] + 2 * t + (i & 1)] = acc[mi][j][i];
      }
    }
  }
#endif
}

}  // namespace treeverify::kernels::cuda::moe
