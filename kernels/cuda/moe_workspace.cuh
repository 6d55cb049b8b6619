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

// Blocks that share one gate/up tile's reduction (the weight-streaming kernel), each writing its
// partial sums for FinishGateUp to add in part order. A verify step under split inside has few
// active experts of few rows (16-row tiles of 256 columns): 30 experts make 480 tiles, too few
// to share out evenly among the blocks (bench/NOTES.md, steps 87 and 89). Long reductions and few
// pairs only, so the partials stay small; a reduction of 4096 or more has 128 chunks of 32, so
// every part has columns (FinishGateUp reads every part's sums).
inline constexpr int64_t kMaxPartedPairs = 4096;
inline int32_t GateUpParts(int64_t tokens, int32_t top_k, int64_t intermediate, int64_t hidden) {
  return hidden >= 4096 && intermediate <= 512 && tokens * top_k <= kMaxPartedPairs ? 4 : 1;
}

// Where the workspace's pieces are.
struct Workspace {
  int32_t* num_active;  // [1]
  int32_t* active;      // [num_local] local ids of the experts with tokens, ascending
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
  float* expert_out;     // [tokens * top_k, hidden] by entry (token * top_k + slot)
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
  w.num_active = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  w.active = reinterpret_cast<int32_t*>(take(num_local * sizeof(int32_t)));
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
  w.expert_out = reinterpret_cast<float*>(take(pairs * hidden * sizeof(float)));
  w.bytes = offset;
  return w;
}

}  // namespace treeverify::kernels::cuda::moe
