// The MoE expert projections at verify sizes: the active experts' weights stream through shared
// memory once per 16 of their tokens, on tensor cores (mma.sync m16n8k16, bf16 in, fp32
// accumulate), for reduction lengths that are a multiple of 32 (sm_80 and later).
//
// A verify step reads each active expert's weights and does almost nothing else, so the kernel is
// a multistage copy pipeline (bench/NOTES.md, step 89): every thread issues cp.async for the stage
// kStreamStages - 1 ahead of the one its warp computes on. A stage holds 32 row segments of up to
// 256 reduction elements (the same 16 rows of gate and of up, or 32 rows of down) and the segments
// of up to 16 token rows, each segment copied by one warp instruction of 512 contiguous bytes.
// Each warp takes one 32-element chunk of the stage; at the end of a group's pass over an item the
// warps' partial tiles are added through shared memory in warp order (the sum's order is fixed).
//
// Work items: (active expert, row tile, block part) in that order, each block taking a contiguous
// range of them (consecutive items mostly share an expert: its ids and pairs are read once, and
// down's rows stream in address order). Block parts (GateUpParts) split gate/up's long reduction
// across blocks, each writing its sums to w.gate_up_parts for FinishGateUp, so that few active
// experts still fill the machine. An expert with more than 16 pairs streams its tile once per
// group of 16.
//
// Fragments from shared memory, 16 bytes per lane per row: lane (g, t) reads elements [8t, 8t + 8)
// of its warp's chunk of rows g and g + 8 (A) and of token g of the pass (B). The mma sums over k
// in its own order, so any permutation of k applied alike to A and B gives the same product:
// elements 8t..8t+3 serve the first k-step as its logical columns 2t, 2t + 1, 2t + 8, 2t + 9, and
// 8t+4..8t+7 the second.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "element_convert.cuh"
#include "mma_sync_primitives.cuh"
#include "moe_workspace.cuh"
#include "silu_times_up.cuh"
#include "treeverify/kernels/moe.h"

namespace treeverify::kernels::cuda::moe {

inline constexpr int kStreamWarps = 8;
inline constexpr int kStreamThreads = kStreamWarps * 32;
inline constexpr int kStreamChunk = 32;                          // reduction elements per warp
inline constexpr int kStreamCols = kStreamChunk * kStreamWarps;  // per stage: 256
inline constexpr int kStreamRows = 32;                           // weight row segments per stage
// Token rows per stage (two mma passes of N = 8) and stages: 16 and 3 measured faster than 8 and
// 4 at 1, 16 and 64 nodes (bench/NOTES.md, step 89), and two blocks still fit an sm_90
// multiprocessor.
inline constexpr int kStreamTokens = 16;
inline constexpr int kStreamPasses = kStreamTokens / 8;
inline constexpr int kStreamStages = 3;
// Row segments are 512 bytes apart plus 64: rows g and g + 1 then start in opposite halves of
// the banks, so the 16-byte reads of a quarter warp (rows g, g + 1 x 4 lanes) never conflict.
inline constexpr int kStreamRowBytes = kStreamCols * 2 + 64;
inline constexpr int kStreamStageRows = kStreamRows + kStreamTokens;
inline constexpr int kStreamStageBytes = kStreamStageRows * kStreamRowBytes;
// A partial sum per (warp, pass, 16-row tile, accumulator, lane).
inline constexpr int kStreamPartialFloats = kStreamWarps * kStreamPasses * 2 * 4 * 32;
inline constexpr int kStreamSmemBytes =
    kStreamStages * kStreamStageBytes + kStreamPartialFloats * int{sizeof(float)};
static_assert(kStreamRows % kStreamWarps == 0 && kStreamTokens % kStreamWarps == 0);  // turns
static_assert(2 * kStreamSmemBytes <= 226 * 1024);  // two blocks per sm_90 multiprocessor

// The walk over a block's stages: its items, their token groups, and the stages of each group's
// reduction range. Two walks per thread, one kStreamStages - 1 stages ahead of the other (copies
// issued there, mma here). The item's coordinates advance by counting: a 64-bit division is a
// hundred-odd instructions, and a down item is a single stage.
struct StreamWalk {
  int64_t rows_total, length, chunks, per_part, tiles, items_left;
  int32_t parts;
  // The current stage: item (active expert, row tile, block part), group and the reduction
  // columns [k0, k0 + kStreamCols).
  int32_t active = -1, expert = 0, part = 0;
  int64_t tile = 0;
  int64_t row0 = 0, k_begin = 0, k_end = 0, k0 = 0;
  int32_t pairs_begin = 0, pairs_end = 0, group_begin = 0, group_end = 0;
  int rows_per_tile;

  __device__ StreamWalk(const MoeExpertsParamsOf<Bf16, Bf16>& p, const Workspace& w,
                        int32_t block_parts, bool is_gate_up)
      : rows_total(is_gate_up ? p.intermediate : p.hidden),
        length(is_gate_up ? p.hidden : p.intermediate),
        chunks(length / kStreamChunk),
        per_part((chunks + block_parts - 1) / block_parts),
        tiles((rows_total + RowsPerTile(is_gate_up) - 1) / RowsPerTile(is_gate_up)),
        parts(block_parts),
        rows_per_tile(RowsPerTile(is_gate_up)) {
    const int64_t items_per_expert = tiles * parts;
    const int64_t items = int64_t{*w.num_active} * items_per_expert;
    const int64_t first = items * blockIdx.x / gridDim.x;
    items_left = items * (blockIdx.x + 1) / gridDim.x - first;
    // One item before the first, so that Next's count lands on it.
    const int64_t before = first - 1;
    counted_active = before < 0 ? -1 : static_cast<int32_t>(before / items_per_expert);
    tile = before < 0 ? tiles - 1 : before % items_per_expert / parts;
    part = before < 0 ? parts - 1 : static_cast<int32_t>(before % parts);
  }

  // Rows of one item: 16 of gate and the same 16 of up, or 32 of down.
  __host__ __device__ static constexpr int RowsPerTile(bool is_gate_up) {
    return is_gate_up ? kStreamRows / 2 : kStreamRows;
  }

  __device__ bool FirstOfGroup() const { return k0 == k_begin; }
  __device__ bool LastOfGroup() const { return k0 + kStreamCols >= k_end; }

  // Advances to the next stage; false past the block's last, and from then on.
  __device__ bool Next(const Workspace& w) {
    if (done) return false;
    if (started && k0 + kStreamCols < k_end) {
      k0 += kStreamCols;
      return true;
    }
    if (started && group_end < pairs_end) {
      group_begin = group_end;
      group_end = min(pairs_end, group_begin + kStreamTokens);
      k0 = k_begin;
      return true;
    }
    // The next item; an item of an empty part range (more parts than chunks) has no stages.
    do {
      if (items_left-- <= 0) {
        done = true;  // k_end may hold a skipped item's: the branches above must not see it
        return false;
      }
      if (++part == parts) {
        part = 0;
        if (++tile == tiles) {
          tile = 0;
          ++counted_active;
        }
      }
      if (!started || active != counted_active) {
        started = true;
        active = counted_active;
        expert = w.active[active];
        pairs_begin = w.offsets[expert];
        pairs_end = w.offsets[expert + 1];
      }
      k_begin = min(chunks, part * per_part) * kStreamChunk;
      k_end = min(chunks, (part + 1) * per_part) * kStreamChunk;
    } while (k_begin >= k_end);
    row0 = tile * rows_per_tile;
    group_begin = pairs_begin;
    group_end = min(pairs_end, group_begin + kStreamTokens);
    k0 = k_begin;
    return true;
  }

 private:
  int32_t counted_active = 0;  // the count's active expert (`active` once loaded)
  bool started = false;
  bool done = false;
};

// 16 bytes of shared memory by shared-space address.
__device__ __forceinline__ uint4 LoadShared16(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
  return v;
}

// 16 bytes from global to shared memory, asynchronously (zeros, and no read, when !valid).
__device__ __forceinline__ void CopyAsync16(uint32_t smem_dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Gate/up (kGateUp: rows of gate then the same rows of up; out: silu(gate) * up, or the block
// part's sums) or down (32 rows; out: fp32 per entry) for every active expert.
template <bool kGateUp>
__global__ void __launch_bounds__(kStreamThreads, 2)
    ExpertStreamKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t block_parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t stages = mma::SmemAddress(smem);
  float* partial = reinterpret_cast<float*>(smem + kStreamStages * kStreamStageBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // Copies: warp w copies row segments w, w + 8, ... of each stage (weights, then token rows w,
  // w + 8), lane l the 16 bytes at column 8l. Row pointers change with the item, the tokens'
  // with the group.
  StreamWalk fetch(p, w, block_parts, kGateUp);
  constexpr int kWeightTurns = kStreamRows / kStreamWarps;
  const Bf16* weight_rows[kWeightTurns] = {};
  constexpr int kTokenTurns = kStreamTokens / kStreamWarps;
  const Bf16* token_rows[kTokenTurns] = {};
  const Bf16* first_matrix = nullptr;  // gate or down of the expert `matrices_active`
  const Bf16* up = nullptr;
  int32_t matrices_active = -1;
  int64_t rows_tile = -1;
  int32_t rows_active = -1;
  int32_t token_group = -1;
  auto issue_stage = [&](uint32_t slot) {
    if (fetch.Next(w)) {
      if (fetch.tile != rows_tile || fetch.active != rows_active) {
        rows_tile = fetch.tile;
        rows_active = fetch.active;
        if (fetch.active != matrices_active) {
          matrices_active = fetch.active;
          first_matrix = kGateUp ? p.gate_proj[fetch.expert] : p.down_proj[fetch.expert];
          if constexpr (kGateUp) up = p.up_proj[fetch.expert];
        }
#pragma unroll
        for (int turn = 0; turn < kWeightTurns; ++turn) {
          const int segment = warp + kStreamWarps * turn;
          const Bf16* matrix = kGateUp && segment >= 16 ? up : first_matrix;
          const int64_t row =
              min(fetch.row0 + (kGateUp ? segment % 16 : segment), fetch.rows_total - 1);
          weight_rows[turn] = matrix + row * fetch.length;
        }
      }
      if (fetch.group_begin != token_group) {
        token_group = fetch.group_begin;
#pragma unroll
        for (int turn = 0; turn < kTokenTurns; ++turn) {
          const int32_t pair = fetch.group_begin + warp + kStreamWarps * turn;
          token_rows[turn] = nullptr;  // rows past the group's count are not copied (nor read)
          if (pair < fetch.group_end) {
            token_rows[turn] = kGateUp ? p.x + int64_t{w.pair_token[pair]} * p.hidden
                                       : w.activated + int64_t{pair} * p.intermediate;
          }
        }
      }
      const int64_t column = fetch.k0 + 8 * lane;
      const bool inside = column < fetch.k_end;  // lanes past a short stage's end: zeros
      const uint32_t at = stages + slot * kStreamStageBytes + 16 * lane;
#pragma unroll
      for (int turn = 0; turn < kWeightTurns; ++turn) {
        CopyAsync16(at + (warp + kStreamWarps * turn) * kStreamRowBytes, weight_rows[turn] + column,
                    inside);
      }
#pragma unroll
      for (int turn = 0; turn < kTokenTurns; ++turn) {
        if (token_rows[turn] == nullptr) continue;
        CopyAsync16(at + (kStreamRows + warp + kStreamWarps * turn) * kStreamRowBytes,
                    token_rows[turn] + column, inside);
      }
    }
    mma::CpAsyncCommit();  // an empty group past the last stage keeps the count uniform
  };
  for (int s = 0; s < kStreamStages - 1; ++s) issue_stage(s);

  StreamWalk walk(p, w, block_parts, kGateUp);
  float acc[kStreamPasses][2][4] = {};
  int32_t entry_group = -1, entry = 0;  // down: the entry of this thread's output pair
  for (uint32_t stage = 0; walk.Next(w); ++stage) {
    const uint32_t slot = stage % kStreamStages;
    mma::CpAsyncWait<kStreamStages - 2>();
    __syncthreads();  // the stage has landed for every thread; the slot refilled next is free
    issue_stage((stage + kStreamStages - 1) % kStreamStages);
    const int count = walk.group_end - walk.group_begin;
    if (walk.FirstOfGroup()) {
#pragma unroll
      for (int pass = 0; pass < kStreamPasses; ++pass) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[pass][m][i] = 0.0f;
        }
      }
    }
    if (walk.k0 + warp * kStreamChunk < walk.k_end) {
      const uint32_t chunk = stages + slot * kStreamStageBytes + (warp * kStreamChunk + 8 * t) * 2;
      uint4 a_g[2], a_g8[2];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        a_g[m] = LoadShared16(chunk + (16 * m + g) * kStreamRowBytes);
        a_g8[m] = LoadShared16(chunk + (16 * m + g + 8) * kStreamRowBytes);
      }
#pragma unroll
      for (int pass = 0; pass < kStreamPasses; ++pass) {
        if (8 * pass >= count) break;
        // Token rows past the group's count hold stale bytes: zero (their sums are not stored).
        uint4 b = make_uint4(0, 0, 0, 0);
        if (8 * pass + g < count) {
          b = LoadShared16(chunk + (kStreamRows + 8 * pass + g) * kStreamRowBytes);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const uint32_t first[4] = {a_g[m].x, a_g8[m].x, a_g[m].y, a_g8[m].y};
          const uint32_t second[4] = {a_g[m].z, a_g8[m].z, a_g[m].w, a_g8[m].w};
          mma::MmaBf16(acc[pass][m], first, b.x, b.y);
          mma::MmaBf16(acc[pass][m], second, b.z, b.w);
        }
      }
    }
    // At a group's last stage, the warps' partial tiles, added in warp order by thread (pass,
    // accumulator, lane) of the first 4 * kStreamPasses warps. The next stage's __syncthreads
    // keeps the buffer until they have read it.
    if (!walk.LastOfGroup()) continue;
#pragma unroll
    for (int pass = 0; pass < kStreamPasses; ++pass) {
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          partial[(((warp * kStreamPasses + pass) * 2 + m) * 4 + i) * 32 + lane] = acc[pass][m][i];
        }
      }
    }
    __syncthreads();
    const int pass = warp / 4, i = warp % 4;       // accumulator i: row g (+ 8 for i >= 2),
    const int token = 8 * pass + 2 * t + (i & 1);  // token 2t + (i & 1) of the pass
    if (pass >= kStreamPasses || token >= count) continue;
    float sums[2];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      sums[m] = 0.0f;
#pragma unroll
      for (int from = 0; from < kStreamWarps; ++from) {
        sums[m] += partial[(((from * kStreamPasses + pass) * 2 + m) * 4 + i) * 32 + lane];
      }
    }
    const int32_t pair = walk.group_begin + token;
    const int64_t row = walk.row0 + g + (i >= 2 ? 8 : 0);
    if constexpr (kGateUp) {
      if (row >= walk.rows_total) continue;
      if (walk.parts > 1) {
        float* out =
            w.gate_up_parts + ((walk.part * p.tokens * p.top_k + pair) * 2) * p.intermediate + row;
        out[0] = sums[0];
        out[p.intermediate] = sums[1];
      } else {
        w.activated[int64_t{pair} * p.intermediate + row] =
            FromFloat<Bf16>(SiluTimesUp(sums[0], sums[1]));
      }
    } else {
      if (entry_group != walk.group_begin) {
        entry_group = walk.group_begin;
        entry = w.pair_entry[pair];
      }
      float* out = w.expert_out + int64_t{entry} * p.hidden;
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        if (row + 16 * m < walk.rows_total) out[row + 16 * m] = sums[m];
      }
    }
  }
#else
  __trap();  // launched only on sm_80 and later (MoeExperts checks the device)
#endif
}

// activated = silu(gate) * up from the blocks' partial sums, added in part order. A thread per
// (grouped pair, row); pairs past the step's count return.
__global__ void FinishGateUp(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t block_parts) {
  const int64_t index = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t pair = index / p.intermediate, row = index % p.intermediate;
  if (pair >= w.offsets[p.num_local_experts]) return;
  const int64_t stride = p.tokens * p.top_k * 2 * p.intermediate;
  const float* sums = w.gate_up_parts + pair * 2 * p.intermediate + row;
  float gate = sums[0], up = sums[p.intermediate];
  for (int32_t part = 1; part < block_parts; ++part) {
    gate = __fadd_rn(gate, sums[part * stride]);
    up = __fadd_rn(up, sums[part * stride + p.intermediate]);
  }
  w.activated[pair * p.intermediate + row] = FromFloat<Bf16>(SiluTimesUp(gate, up));
}

}  // namespace treeverify::kernels::cuda::moe
