// The MoE experts' device workspace and the block shapes of their kernels, shared by the grouping,
// the expert kernels (tensor-core and CUDA-core paths) and the combine (cuda/moe.h has the plan).
#pragma once

#include <algorithm>
#include <cstdint>

#include "treeverify/kernels/cuda/bf16.h"

namespace treeverify::kernels::cuda::moe {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kTokensPerPass = 8;
inline constexpr int kGroupThreads = 1024;
inline constexpr int kGemmPairs = 64;  // grouped pairs per tile of the grouped GEMM

inline constexpr int kGroupChunkEntries = 256;  // entries per block of the chunked grouping
inline int64_t GroupChunks(int64_t entries) {
  return (entries + kGroupChunkEntries - 1) / kGroupChunkEntries;
}

// Tiles of kGemmPairs pairs of one expert: at most one partial tile per expert with pairs.
inline int64_t MaxGemmTiles(int64_t pairs, int32_t num_local) {
  return (pairs + kGemmPairs - 1) / kGemmPairs + std::min<int64_t>(num_local, pairs);
}

inline int64_t Align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Work items of the weight-streaming kernel (moe_expert_tma_kernel.cuh): rows per item of gate/up
// (64 of gate with the same 64 of up) and of down, and reduction columns per stage (bf16 tiles;
// INT4 stages hold four times as many).
inline constexpr int kGateUpTileRows = 64;
inline constexpr int kDownTileRows = 128;
inline constexpr int kStageColumns = 64;

// Blocks that share one item's reduction in the weight-streaming kernel, each writing its partial
// sums for the next kernel to add in part order (FinishGateUp for gate/up, the combine for down).
// A verify step has few active experts with few row tiles each (under TP8 split inside, 30
// experts of 4 gate/up tiles at 16 tokens; with whole experts, 1 to 3 experts of 32 gate/up and 56
// down tiles), too few items to share out evenly among two blocks per multiprocessor
// (bench/NOTES.md, steps 87, 89 and 90). So about 256 items per active expert, at most 8 parts, and
// at least 8 bf16 stages (of 64 columns) per part: then every part has columns (the sums read every
// part's) and the partial sums stay small beside the weights (a 4-stage down reduction is not
// parted). Few pairs only, so the workspace stays small. The walk cuts parts at its stages'
// edges (`stage_columns` each).
inline constexpr int64_t kMaxPartedPairs = 512;
inline constexpr int32_t kMaxReductionParts = 8;
inline int32_t ReductionParts(int64_t pairs, int64_t rows, int64_t tile_rows, int64_t length,
                              int64_t stage_columns = kStageColumns) {
  if (pairs > kMaxPartedPairs) return 1;
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  const int64_t stages = (length + stage_columns - 1) / stage_columns;
  const int64_t bf16_stages = (length + kStageColumns - 1) / kStageColumns;
  int64_t parts = std::clamp<int64_t>(std::min((256 + tiles - 1) / tiles, bf16_stages / 8), 1,
                                      kMaxReductionParts);
  // The walk gives part p the stages [p * per_part, (p + 1) * per_part) of the reduction: with
  // the bounds above every part has some, and this keeps it so whatever the bounds become.
  while (parts > 1 && (parts - 1) * ((stages + parts - 1) / parts) >= stages) --parts;
  return static_cast<int32_t>(parts);
}
// At most the bf16 stages' parts at any stage_columns (the workspace is carved for those).
inline int32_t GateUpParts(int64_t tokens, int32_t top_k, int64_t intermediate, int64_t hidden,
                           int64_t stage_columns = kStageColumns) {
  return ReductionParts(tokens * top_k, intermediate, kGateUpTileRows, hidden, stage_columns);
}
inline int32_t DownParts(int64_t tokens, int32_t top_k, int64_t intermediate, int64_t hidden,
                         int64_t stage_columns = kStageColumns) {
  return ReductionParts(tokens * top_k, hidden, kDownTileRows, intermediate, stage_columns);
}

// Where the workspace's pieces are.
struct Workspace {
  // [1] routing blocks done (MoeRoutingAndGrouping: the last one groups and zeroes it); zero when
  // the workspace is allocated (MoeExpertsWorkspaceBytes).
  int32_t* routing_arrivals;
  int32_t* num_active;  // [1]
  // [2] the weight streams' next work items (gate/up, down), zeroed by the grouping.
  int32_t* claims;
  int32_t* active;      // [num_local] local ids of the experts with tokens, ascending
  int2* active_pairs;   // [num_local] each active expert's grouped pairs [x, y), beside `active`
  int32_t* offsets;     // [num_local + 1] each local expert's pairs
  int32_t* pair_token;  // [tokens * top_k] grouped by expert, token order within
  int32_t* pair_entry;  // [tokens * top_k] token * top_k + slot of each grouped pair
  // [num_local, GroupChunks(tokens * top_k)]: the chunked grouping's counts, then positions.
  int32_t* chunk_counts;
  int32_t* num_tiles;    // [1] the grouped GEMM's tiles (moe_expert_gemm_kernel.cuh)
  int32_t* tile_expert;  // [MaxGemmTiles] each tile's local expert
  int32_t* tile_pair;    // [MaxGemmTiles] each tile's first grouped pair
  float* gate_up_parts;  // [GateUpParts, tokens * top_k, 2, intermediate] when parts > 1
  Bf16* activated;       // [tokens * top_k, intermediate] by grouped pair
  // [DownParts, tokens * top_k, hidden] by part and entry (token * top_k + slot); the kernels
  // other than the weight stream write part 0 only.
  float* expert_out;
  int64_t bytes;
};

inline Workspace Carve(void* base, int64_t tokens, int32_t top_k, int32_t num_local,
                       int64_t intermediate, int64_t hidden) {
  const int64_t pairs = tokens * top_k;
  Workspace w{};
  auto* at = static_cast<uint8_t*>(base);
  int64_t offset = 0;
  auto take = [&](int64_t bytes) {
    uint8_t* piece = at == nullptr ? nullptr : at + offset;
    offset += Align256(bytes);
    return piece;
  };
  w.routing_arrivals = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  w.num_active = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  w.claims = reinterpret_cast<int32_t*>(take(2 * sizeof(int32_t)));
  w.active = reinterpret_cast<int32_t*>(take(num_local * sizeof(int32_t)));
  w.active_pairs = reinterpret_cast<int2*>(take(num_local * sizeof(int2)));
  w.offsets = reinterpret_cast<int32_t*>(take((num_local + 1) * sizeof(int32_t)));
  w.pair_token = reinterpret_cast<int32_t*>(take(pairs * sizeof(int32_t)));
  w.pair_entry = reinterpret_cast<int32_t*>(take(pairs * sizeof(int32_t)));
  w.chunk_counts =
      reinterpret_cast<int32_t*>(take(num_local * GroupChunks(pairs) * sizeof(int32_t)));
  const int64_t max_tiles = MaxGemmTiles(pairs, num_local);
  w.num_tiles = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  w.tile_expert = reinterpret_cast<int32_t*>(take(max_tiles * sizeof(int32_t)));
  w.tile_pair = reinterpret_cast<int32_t*>(take(max_tiles * sizeof(int32_t)));
  const int32_t parts = GateUpParts(tokens, top_k, intermediate, hidden);
  w.gate_up_parts = reinterpret_cast<float*>(
      take(parts > 1 ? parts * pairs * 2 * intermediate * int64_t{sizeof(float)} : 0));
  w.activated = reinterpret_cast<Bf16*>(take(pairs * intermediate * sizeof(Bf16)));
  w.expert_out = reinterpret_cast<float*>(take(DownParts(tokens, top_k, intermediate, hidden) *
                                               pairs * hidden * int64_t{sizeof(float)}));
  w.bytes = offset;
  return w;
}

}  // namespace treeverify::kernels::cuda::moe
