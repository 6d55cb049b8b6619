// MoE experts on the GPU: grouping, gate/up, down, combine (cuda/moe.h has the plan).
//
// Roofline per layer at verify sizes: the active experts' weights, 3 * hidden * intermediate * 2
// bytes each (11 MB per Kimi-K2 expert slice under TP8 split inside, 88 MB per whole expert),
// read once per pass of up to kTokensPerPass tokens; activations are a rounding error beside them.
#include <algorithm>

#include "element_convert.cuh"
#include "moe_expert_mma_kernel.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokensPerPass = 8;
constexpr int kGroupThreads = 1024;

int64_t Align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Where the workspace's pieces are.
struct Workspace {
  int32_t* num_active;  // [1]
  int32_t* active;      // [num_local] local ids of the experts with tokens, ascending
  int32_t* offsets;     // [num_local + 1] each local expert's pairs
  int32_t* pair_token;  // [tokens * top_k] grouped by expert, token order within
  int32_t* pair_entry;  // [tokens * top_k] token * top_k + slot of each grouped pair
  Bf16* activated;      // [tokens * top_k, intermediate] by grouped pair
  float* expert_out;    // [tokens * top_k, hidden] by entry (token * top_k + slot)
  int64_t bytes;
};

Workspace Carve(void* base, int64_t tokens, int32_t top_k, int32_t num_local, int64_t intermediate,
                int64_t hidden) {
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
  w.activated = reinterpret_cast<Bf16*>(take(pairs * intermediate * sizeof(Bf16)));
  w.expert_out = reinterpret_cast<float*>(take(pairs * hidden * sizeof(float)));
  w.bytes = offset;
  return w;
}

// Exclusive prefix sums of two per-thread values over the block, in thread order.
__device__ void BlockExclusiveScan2(int32_t& a, int32_t& b, int32_t& total_a, int32_t& total_b) {
  __shared__ int32_t warp_a[kGroupThreads / 32], warp_b[kGroupThreads / 32];
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
  for (int w = 0; w < kGroupThreads / 32; ++w) {
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

// One block. The routing's ids are first copied to shared memory (when they fit: a verify step's
// always do), then thread t owns local experts [t * per_thread, (t + 1) * per_thread): it counts
// their pairs, the block scans the counts (offsets) and the active flags (the active list), and
// it writes their pairs in token order.
constexpr int64_t kStagedEntries = 8192;  // 32 KB of shared memory

__global__ void __launch_bounds__(kGroupThreads)
    GroupKernel(const int32_t* __restrict__ topk_ids, int64_t tokens, int32_t top_k,
                int32_t first_expert, int32_t num_local, Workspace w, int32_t* active_count) {
  extern __shared__ int32_t staged[];  // [entries] local expert ids, when they fit
  const int64_t entries = tokens * top_k;
  const bool stage = entries <= kStagedEntries;
  if (stage) {
    for (int64_t i = threadIdx.x; i < entries; i += kGroupThreads) {
      staged[i] = topk_ids[i] - first_expert;
    }
  }
  __syncthreads();
  const int32_t per_thread = (num_local + kGroupThreads - 1) / kGroupThreads;
  const int32_t begin = min(num_local, static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = min(num_local, begin + per_thread);
  int32_t pairs = 0, active = 0;
  for (int32_t e = begin; e < end; ++e) {
    int32_t count = 0;
    for (int64_t i = 0; i < entries; ++i) {
      const int32_t local = stage ? staged[i] : topk_ids[i] - first_expert;
      count += local == e;
    }
    pairs += count;
    active += count > 0;
  }
  int32_t total_pairs, total_active;
  BlockExclusiveScan2(pairs, active, total_pairs, total_active);
  for (int32_t e = begin; e < end; ++e) {
    w.offsets[e] = pairs;
    const int32_t first_pair = pairs;
    for (int64_t i = 0; i < entries; ++i) {
      const int32_t local = stage ? staged[i] : topk_ids[i] - first_expert;
      if (local != e) continue;
      w.pair_token[pairs] = static_cast<int32_t>(i / top_k);
      w.pair_entry[pairs] = static_cast<int32_t>(i);
      ++pairs;
    }
    if (pairs > first_pair) w.active[active++] = e;
  }
  if (threadIdx.x == 0) {
    w.offsets[num_local] = total_pairs;
    *w.num_active = total_active;
    if (active_count != nullptr) *active_count = total_active;
  }
}

// acc[t] += row . xs[t] over `length` elements, for the first `count` tokens, by a group of
// kLanes lanes (the warp holds 32 / kLanes groups, each with its own row). Lane l of a group
// takes the 16-byte chunks l, l + kLanes, l + 2 kLanes, ... and loads kUnroll of them before it
// uses any, so that a warp keeps 32 * kUnroll * 16 bytes of weights in flight (Little's law at
// 4.2 TB/s wants ~32 KB per multiprocessor); the sums are then reduced over the group's lanes
// only (log2 kLanes shuffles). Short rows take small groups: the down projection's 256-column
// rows (split inside) take 4 lanes of 8 chunks each. Needs length % 8 == 0 and 16-byte aligned
// rows; RowDotScalar does the same sums element by element for anything else.
template <int kLanes, int kUnroll, int kTokens>
__device__ __forceinline__ void RowDot(const Bf16* __restrict__ row, int64_t length,
                                       const Bf16* const (&xs)[kTokensPerPass], int count,
                                       float (&acc)[kTokensPerPass]) {
  const int lane = threadIdx.x % kLanes;
  for (int64_t base = lane * 8; base < length; base += int64_t{kLanes} * 8 * kUnroll) {
    uint4 w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + int64_t{u} * kLanes * 8;
      w[u] = c < length ? __ldg(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + int64_t{u} * kLanes * 8;
      const bool inside = c < length;  // past the row, w is zero and x is not loaded
      float wf[8];
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w[u]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 pair = __bfloat1622float2(w2[i]);
        wf[2 * i] = pair.x;
        wf[2 * i + 1] = pair.y;
      }
      // Every token's load is issued (a zero for tokens past count): a loop that stopped at
      // count would wait out each load's latency in turn (GateUp at 0.76 TB/s, step 79). kTokens
      // is count rounded up to a power of two, so that the FMAs past count stay few: at eight
      // tokens the fp32 FMAs and conversions, not DRAM, bound the kernel.
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        const uint4 x = t < count && inside ? __ldg(reinterpret_cast<const uint4*>(xs[t] + c))
                                            : make_uint4(0, 0, 0, 0);
        const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 pair = __bfloat1622float2(x2[i]);
          acc[t] = fmaf(wf[2 * i], pair.x, acc[t]);
          acc[t] = fmaf(wf[2 * i + 1], pair.y, acc[t]);
        }
      }
    }
  }
}

// RowDot for `count` <= kTokensPerPass tokens, with the token loop sized to count.
template <int kLanes, int kUnroll>
__device__ __forceinline__ void RowDotTokens(const Bf16* __restrict__ row, int64_t length,
                                             const Bf16* const (&xs)[kTokensPerPass], int count,
                                             float (&acc)[kTokensPerPass]) {
  if (count <= 1) {
    RowDot<kLanes, kUnroll, 1>(row, length, xs, count, acc);
  } else if (count <= 2) {
    RowDot<kLanes, kUnroll, 2>(row, length, xs, count, acc);
  } else if (count <= 4) {
    RowDot<kLanes, kUnroll, 4>(row, length, xs, count, acc);
  } else {
    RowDot<kLanes, kUnroll, kTokensPerPass>(row, length, xs, count, acc);
  }
}

template <int kLanes>
__device__ __forceinline__ void RowDotScalar(const Bf16* row, int64_t length,
                                             const Bf16* const (&xs)[kTokensPerPass], int count,
                                             float (&acc)[kTokensPerPass]) {
  for (int64_t c = threadIdx.x % kLanes; c < length; c += kLanes) {
    const float w = ToFloat(row[c]);
    for (int t = 0; t < count; ++t) acc[t] = fmaf(w, ToFloat(xs[t][c]), acc[t]);
  }
}

// Sum over the kLanes lanes of a group (xor offsets below kLanes stay inside it).
template <int kLanes>
__device__ __forceinline__ float GroupSum(float value) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Gate and up: a warp takes one row pair, gate in lanes 0-15 and up in lanes 16-31; a work item
// is (active expert, kWarps row pairs).
constexpr int kGateUpLanes = 16;

template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    GateUpKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t row_tiles,
                 bool vectorized) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool is_up = lane >= kGateUpLanes;
  const int64_t items = int64_t{*w.num_active} * row_tiles;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / row_tiles];
    const int64_t i = (item % row_tiles) * kWarps + warp;
    if (i >= p.intermediate) continue;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    const Bf16* row = (is_up ? p.up_proj[expert] : p.gate_proj[expert]) + i * p.hidden;
    for (int32_t pass = first_pair; pass < end_pair; pass += kTokensPerPass) {
      const int count = min(kTokensPerPass, end_pair - pass);
      const Bf16* xs[kTokensPerPass];
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        xs[t] = p.x + int64_t{w.pair_token[pass + min(t, count - 1)]} * p.hidden;
      }
      float acc[kTokensPerPass] = {};
      if (vectorized) {
        RowDotTokens<kGateUpLanes, kUnroll>(row, p.hidden, xs, count, acc);
      } else {
        RowDotScalar<kGateUpLanes>(row, p.hidden, xs, count, acc);
      }
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        if (t >= count) break;
        const float value = GroupSum<kGateUpLanes>(acc[t]);
        const float up_value = __shfl_sync(0xffffffffu, value, kGateUpLanes);
        if (lane == 0) {
          // As SiluMul: g / (1 + exp(-g)) in fp32, times up.
          const float silu = __fdiv_rn(value, __fadd_rn(1.0f, expf(-value)));
          w.activated[int64_t{pass + t} * p.intermediate + i] =
              FromFloat<Bf16>(__fmul_rn(silu, up_value));
        }
      }
    }
  }
}

// Down: groups of kDownLanes lanes take one hidden row each (32 / kDownLanes rows per warp); a
// work item is (active expert, kWarps * 32 / kDownLanes rows).
constexpr int kDownLanes = 4;
constexpr int kDownRowsPerWarp = 32 / kDownLanes;

template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    DownKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t row_tiles, bool vectorized) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t items = int64_t{*w.num_active} * row_tiles;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / row_tiles];
    const int64_t h = ((item % row_tiles) * kWarps + warp) * kDownRowsPerWarp + lane / kDownLanes;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    // Lanes past the last row repeat it (their sums are not stored): the shuffles need them.
    const Bf16* row = p.down_proj[expert] + min(h, p.hidden - 1) * p.intermediate;
    for (int32_t pass = first_pair; pass < end_pair; pass += kTokensPerPass) {
      const int count = min(kTokensPerPass, end_pair - pass);
      const Bf16* xs[kTokensPerPass];
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        xs[t] = w.activated + int64_t{pass + min(t, count - 1)} * p.intermediate;
      }
      float acc[kTokensPerPass] = {};
      if (vectorized) {
        RowDotTokens<kDownLanes, kUnroll>(row, p.intermediate, xs, count, acc);
      } else {
        RowDotScalar<kDownLanes>(row, p.intermediate, xs, count, acc);
      }
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        if (t >= count) break;
        const float value = GroupSum<kDownLanes>(acc[t]);
        if (lane % kDownLanes == 0 && h < p.hidden) {
          w.expert_out[int64_t{w.pair_entry[pass + t]} * p.hidden + h] = value;
        }
      }
    }
  }
}

// The tensor-core path (cuda/moe_expert_mma_kernel.cuh): gate/up (kGateUp) or down tiles of 16
// rows of one active expert. The block's warps form groups of `split` warps that share one tile
// and split its reduction (long rows: the hidden dim); short rows (256 columns under split
// inside) take split 1, a tile per warp. A work item is (active expert, kMmaWarps / split tiles).
template <bool kGateUp, int kUnroll>
__global__ void __launch_bounds__(moe::kMmaThreads)
    ExpertMmaKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t split,
                    int32_t item_tiles) {
  constexpr int kMatrices = kGateUp ? 2 : 1;
  __shared__ float partial[moe::kMmaWarps][kMatrices][32][4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int part = warp % split;  // which share of the reduction
  const int tile_in_item = warp / split;
  const int64_t length = kGateUp ? p.hidden : p.intermediate;  // the reduction
  const int64_t rows_total = kGateUp ? p.intermediate : p.hidden;
  const int64_t chunks = length / moe::kMmaChunk;
  const int64_t per_part = (chunks + split - 1) / split;
  const int64_t begin = min(chunks, part * per_part);
  const int64_t end = min(chunks, begin + per_part);
  const int64_t tiles = (rows_total + moe::kMmaRows - 1) / moe::kMmaRows;
  const int64_t items_per_expert = (tiles + item_tiles - 1) / item_tiles;
  const int64_t items = int64_t{*w.num_active} * items_per_expert;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / items_per_expert];
    const int64_t row0 = ((item % items_per_expert) * item_tiles + tile_in_item) * moe::kMmaRows;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    // Rows past the last repeat it (their results are not stored).
    const int64_t row_g = min(row0 + g, rows_total - 1);
    const int64_t row_g8 = min(row0 + g + 8, rows_total - 1);
    const Bf16* matrices[kMatrices];
    if constexpr (kGateUp) {
      matrices[0] = p.gate_proj[expert];
      matrices[1] = p.up_proj[expert];
    } else {
      matrices[0] = p.down_proj[expert];
    }
    const Bf16* rows_g[kMatrices];
    const Bf16* rows_g8[kMatrices];
#pragma unroll
    for (int m = 0; m < kMatrices; ++m) {
      rows_g[m] = matrices[m] + row_g * length;
      rows_g8[m] = matrices[m] + row_g8 * length;
    }
    for (int32_t pass = first_pair; pass < end_pair; pass += moe::kMmaTokens) {
      const int count = min(moe::kMmaTokens, end_pair - pass);
      const bool has_token = g < count;
      const int32_t pair = pass + min(g, count - 1);
      const Bf16* x = kGateUp ? p.x + int64_t{w.pair_token[pair]} * p.hidden
                              : w.activated + int64_t{pair} * p.intermediate;
      float acc[kMatrices][4] = {};
      if (row0 < rows_total) {
        moe::MmaRows<kMatrices, kUnroll>(rows_g, rows_g8, x, has_token, begin, end, t, acc);
      }
      if (split > 1) {
#pragma unroll
        for (int m = 0; m < kMatrices; ++m) {
#pragma unroll
          for (int i = 0; i < 4; ++i) partial[warp][m][lane][i] = acc[m][i];
        }
        __syncthreads();
        if (part == 0) {  // the group's first warp adds the others' shares in warp order
          for (int from = warp + 1; from < warp + split; ++from) {
#pragma unroll
            for (int m = 0; m < kMatrices; ++m) {
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[m][i] += partial[from][m][lane][i];
            }
          }
        }
      }
      if (part == 0) {
        // Accumulator i: row g (+ 8 for i >= 2), token 2t + (i & 1).
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t row = row0 + g + (i >= 2 ? 8 : 0);
          const int token = 2 * t + (i & 1);
          if (row >= rows_total || token >= count) continue;
          if constexpr (kGateUp) {
            // As SiluMul: g / (1 + exp(-g)) in fp32, times up.
            const float gate = acc[0][i];
            const float silu = __fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate)));
            w.activated[int64_t{pass + token} * p.intermediate + row] =
                FromFloat<Bf16>(__fmul_rn(silu, acc[1][i]));
          } else {
            w.expert_out[int64_t{w.pair_entry[pass + token]} * p.hidden + row] = acc[0][i];
          }
        }
      }
      if (split > 1) __syncthreads();  // partial is reused
    }
  }
}

// Warps sharing a tile's reduction: enough that each still streams at least 8 chunks (16 KB of
// a 16-row tile), at most the block.
int32_t MmaSplit(int64_t length) {
  int32_t split = 1;
  while (split < moe::kMmaWarps && length / moe::kMmaChunk / (2 * split) >= 8) split *= 2;
  return split;
}

// out[t] = sum over the token's local experts, ascending id, of weight * output; then + shared.
// Block (token, 256 hidden dims): every thread's top_k loads are independent.
__global__ void CombineKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w) {
  const int64_t token = blockIdx.y;
  const int64_t h = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (h >= p.hidden) return;
  const int32_t* ids = p.topk_ids + token * p.top_k;
  const float* weights = p.topk_weights + token * p.top_k;
  float sum = 0.0f;
  for (int32_t j = 0; j < p.top_k; ++j) {
    const int32_t local = ids[j] - p.first_expert;
    if (local < 0 || local >= p.num_local_experts) continue;
    const float value = w.expert_out[(token * p.top_k + j) * p.hidden + h];
    sum = __fadd_rn(sum, __fmul_rn(value, weights[j]));
  }
  if (p.shared_out != nullptr) sum = __fadd_rn(sum, p.shared_out[token * p.hidden + h]);
  p.out[token * p.hidden + h] = sum;
}

}  // namespace

int64_t MoeExpertsWorkspaceBytes(int64_t tokens, int32_t top_k, int32_t num_local_experts,
                                 int64_t intermediate, int64_t hidden) {
  return Carve(nullptr, tokens, top_k, num_local_experts, intermediate, hidden).bytes;
}

absl::Status MoeExperts(const MoeExpertsParamsOf<Bf16, Bf16>& p, void* workspace,
                        int64_t workspace_bytes, cudaStream_t stream, int32_t* active_count) {
  if (p.hidden <= 0 || p.intermediate <= 0 || p.top_k <= 0 || p.first_expert < 0 ||
      p.num_local_experts <= 0 || p.tokens < 0 || p.tokens > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeExperts: tokens=", p.tokens, " (at most 65535)", " top_k=", p.top_k,
                     " hidden=", p.hidden, " intermediate=", p.intermediate, " experts [",
                     p.first_expert, ", +", p.num_local_experts, ")"));
  }
  if (p.tokens == 0) return absl::OkStatus();
  if (p.x == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr ||
      p.gate_proj == nullptr || p.up_proj == nullptr || p.down_proj == nullptr ||
      p.out == nullptr) {
    return absl::InvalidArgumentError(
        "cuda::MoeExperts: x, topk_ids, topk_weights, the projections and out must be non-null");
  }
  const Workspace w =
      Carve(workspace, p.tokens, p.top_k, p.num_local_experts, p.intermediate, p.hidden);
  if (workspace == nullptr || workspace_bytes < w.bytes ||
      reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeExperts: needs a 256-byte aligned "
                     "workspace of ",
                     w.bytes, " bytes, got ", workspace_bytes));
  }
  const bool x_vectorized = p.hidden % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  const bool down_vectorized = p.intermediate % 8 == 0;
  int device = 0, multiprocessors = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  // Enough blocks to cover the machine several times; the items they loop over depend on the
  // routing, read on the device.
  const int max_blocks = multiprocessors * 8;

  const int64_t entries = p.tokens * p.top_k;
  // Padded by 16 bytes: the compiler's vector loads of the staged ids may read up to three past
  // the last one (memcheck saw a 12-byte read there, step 79); those values are never used.
  const size_t staged_bytes = entries <= kStagedEntries ? (entries + 4) * sizeof(int32_t) : 0;
  GroupKernel<<<1, kGroupThreads, staged_bytes, stream>>>(
      p.topk_ids, p.tokens, p.top_k, p.first_expert, p.num_local_experts, w, active_count);
  TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int64_t most_active = std::min<int64_t>(p.num_local_experts, p.tokens * p.top_k);
  // Tensor cores where both reductions come in 32-element chunks of aligned rows (every
  // production shape); the CUDA-core kernels otherwise.
  const bool mma_path = p.hidden % moe::kMmaChunk == 0 && p.intermediate % moe::kMmaChunk == 0 &&
                        reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  if (mma_path) {
    const int32_t up_split = MmaSplit(p.hidden), down_split = MmaSplit(p.intermediate);
    const int64_t up_tiles = (p.intermediate + moe::kMmaRows - 1) / moe::kMmaRows;
    const int64_t down_tiles = (p.hidden + moe::kMmaRows - 1) / moe::kMmaRows;
    const int32_t up_item_tiles = moe::kMmaWarps / up_split;
    const int32_t down_item_tiles = moe::kMmaWarps / down_split;
    const int64_t up_items = most_active * ((up_tiles + up_item_tiles - 1) / up_item_tiles);
    const int64_t down_items = most_active * ((down_tiles + down_item_tiles - 1) / down_item_tiles);
    ExpertMmaKernel<true, 4><<<static_cast<unsigned>(std::min<int64_t>(max_blocks, up_items)),
                               moe::kMmaThreads, 0, stream>>>(p, w, up_split, up_item_tiles);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    ExpertMmaKernel<false, 4><<<static_cast<unsigned>(std::min<int64_t>(max_blocks, down_items)),
                                moe::kMmaThreads, 0, stream>>>(p, w, down_split, down_item_tiles);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  } else {
    const int32_t up_tiles = static_cast<int32_t>((p.intermediate + kWarps - 1) / kWarps);
    const unsigned up_blocks =
        static_cast<unsigned>(std::min<int64_t>(max_blocks, most_active * up_tiles));
    GateUpKernel<8><<<up_blocks, kThreads, 0, stream>>>(p, w, up_tiles, x_vectorized);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const int64_t down_rows_per_tile = kWarps * kDownRowsPerWarp;
    const int32_t down_tiles =
        static_cast<int32_t>((p.hidden + down_rows_per_tile - 1) / down_rows_per_tile);
    const unsigned down_blocks =
        static_cast<unsigned>(std::min<int64_t>(max_blocks, most_active * down_tiles));
    DownKernel<8><<<down_blocks, kThreads, 0, stream>>>(p, w, down_tiles, down_vectorized);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  const dim3 combine_grid(static_cast<unsigned>((p.hidden + 255) / 256),
                          static_cast<unsigned>(p.tokens));
  CombineKernel<<<combine_grid, 256, 0, stream>>>(p, w);
  return CudaStatus(cudaGetLastError(), "MoeExperts launches");
}

}  // namespace treeverify::kernels::cuda
