// MoE experts on the GPU: grouping, gate/up, down, combine (cuda/moe.h has the plan).
//
// Roofline per layer at verify sizes: the active experts' weights, 3 * hidden * intermediate * 2
// bytes each (11 MB per Kimi-K2 expert slice under TP8 split inside, 88 MB per whole expert),
// read once per pass of up to kTokensPerPass tokens; activations are a rounding error beside them.
#include <algorithm>

#include "element_convert.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokensPerPass = 8;
constexpr int kRowPairsPerWarp = 2;  // gate/up: a work item is kWarps * 2 row pairs
constexpr int kDownRowsPerWarp = 8;  // down: a work item is kWarps * 8 rows
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

// One block. Thread t owns local experts [t * per_thread, (t + 1) * per_thread): it counts their
// pairs, the block scans the counts (offsets) and the active flags (the active list), and it
// writes their pairs in token order.
__global__ void __launch_bounds__(kGroupThreads)
    GroupKernel(const int32_t* __restrict__ topk_ids, int64_t tokens, int32_t top_k,
                int32_t first_expert, int32_t num_local, Workspace w) {
  const int32_t per_thread = (num_local + kGroupThreads - 1) / kGroupThreads;
  const int32_t begin = min(num_local, static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = min(num_local, begin + per_thread);
  const int64_t entries = tokens * top_k;
  int32_t pairs = 0, active = 0;
  for (int32_t e = begin; e < end; ++e) {
    int32_t count = 0;
    for (int64_t i = 0; i < entries; ++i) count += topk_ids[i] - first_expert == e;
    pairs += count;
    active += count > 0;
  }
  int32_t total_pairs, total_active;
  BlockExclusiveScan2(pairs, active, total_pairs, total_active);
  for (int32_t e = begin; e < end; ++e) {
    w.offsets[e] = pairs;
    const int32_t first_pair = pairs;
    for (int64_t i = 0; i < entries; ++i) {
      if (topk_ids[i] - first_expert != e) continue;
      w.pair_token[pairs] = static_cast<int32_t>(i / top_k);
      w.pair_entry[pairs] = static_cast<int32_t>(i);
      ++pairs;
    }
    if (pairs > first_pair) w.active[active++] = e;
  }
  if (threadIdx.x == 0) {
    w.offsets[num_local] = total_pairs;
    *w.num_active = total_active;
  }
}

// acc[t] += row . x_t over `length` elements, for the first `count` of kTokensPerPass tokens: each
// lane takes 8-element (16-byte) chunks 256 elements apart; the caller reduces over the warp.
// Vector loads need length % 8 == 0 and 16-byte aligned rows; otherwise element by element.
__device__ __forceinline__ void WarpDot(const Bf16* __restrict__ row, int64_t length,
                                        const Bf16* const* xs, int count,
                                        float (&acc)[kTokensPerPass], bool vectorized) {
  const int lane = threadIdx.x % 32;
  if (vectorized) {
#pragma unroll 4
    for (int64_t c = lane * 8; c < length; c += 256) {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(row + c));
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
      float wf[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 pair = __bfloat1622float2(w2[i]);
        wf[2 * i] = pair.x;
        wf[2 * i + 1] = pair.y;
      }
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) {
        if (t >= count) break;
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(xs[t] + c));
        const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 pair = __bfloat1622float2(x2[i]);
          acc[t] = fmaf(wf[2 * i], pair.x, acc[t]);
          acc[t] = fmaf(wf[2 * i + 1], pair.y, acc[t]);
        }
      }
    }
  } else {
    for (int64_t c = lane; c < length; c += 32) {
      const float wf = ToFloat(row[c]);
      for (int t = 0; t < count; ++t) acc[t] = fmaf(wf, ToFloat(xs[t][c]), acc[t]);
    }
  }
}

__device__ __forceinline__ float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Gate and up: work item = (active expert, kWarps * kRowPairsPerWarp rows of the intermediate).
__global__ void __launch_bounds__(kThreads)
    GateUpKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t row_tiles,
                 bool vectorized) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t items = int64_t{*w.num_active} * row_tiles;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / row_tiles];
    const int64_t tile = item % row_tiles;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    const Bf16* gate = p.gate_proj[expert];
    const Bf16* up = p.up_proj[expert];
    for (int r = 0; r < kRowPairsPerWarp; ++r) {
      const int64_t i = (tile * kWarps + warp) * kRowPairsPerWarp + r;
      if (i >= p.intermediate) break;
      for (int32_t pass = first_pair; pass < end_pair; pass += kTokensPerPass) {
        const int count = min(kTokensPerPass, end_pair - pass);
        const Bf16* xs[kTokensPerPass];
        for (int t = 0; t < kTokensPerPass; ++t) {
          xs[t] = p.x + int64_t{w.pair_token[pass + min(t, count - 1)]} * p.hidden;
        }
        float g[kTokensPerPass] = {}, u[kTokensPerPass] = {};
        WarpDot(gate + i * p.hidden, p.hidden, xs, count, g, vectorized);
        WarpDot(up + i * p.hidden, p.hidden, xs, count, u, vectorized);
        for (int t = 0; t < count; ++t) {
          const float gate_value = WarpSum(g[t]);
          const float up_value = WarpSum(u[t]);
          if (lane == t) {
            // As SiluMul: g / (1 + exp(-g)) in fp32, times up.
            const float silu = __fdiv_rn(gate_value, __fadd_rn(1.0f, expf(-gate_value)));
            w.activated[int64_t{pass + t} * p.intermediate + i] =
                FromFloat<Bf16>(__fmul_rn(silu, up_value));
          }
        }
      }
    }
  }
}

// Down: work item = (active expert, kWarps * kDownRowsPerWarp rows of the hidden dim).
__global__ void __launch_bounds__(kThreads)
    DownKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t row_tiles, bool vectorized) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t items = int64_t{*w.num_active} * row_tiles;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int32_t expert = w.active[item / row_tiles];
    const int64_t tile = item % row_tiles;
    const int32_t first_pair = w.offsets[expert], end_pair = w.offsets[expert + 1];
    const Bf16* down = p.down_proj[expert];
    for (int r = 0; r < kDownRowsPerWarp; ++r) {
      const int64_t h = (tile * kWarps + warp) * kDownRowsPerWarp + r;
      if (h >= p.hidden) break;
      for (int32_t pass = first_pair; pass < end_pair; pass += kTokensPerPass) {
        const int count = min(kTokensPerPass, end_pair - pass);
        const Bf16* xs[kTokensPerPass];
        for (int t = 0; t < kTokensPerPass; ++t) {
          xs[t] = w.activated + int64_t{pass + min(t, count - 1)} * p.intermediate;
        }
        float acc[kTokensPerPass] = {};
        WarpDot(down + h * p.intermediate, p.intermediate, xs, count, acc, vectorized);
        for (int t = 0; t < count; ++t) {
          const float value = WarpSum(acc[t]);
          if (lane == t) w.expert_out[int64_t{w.pair_entry[pass + t]} * p.hidden + h] = value;
        }
      }
    }
  }
}

// out[t] = sum over the token's local experts, ascending id, of weight * output; then + shared.
__global__ void CombineKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w) {
  const int64_t token = blockIdx.x;
  const int32_t* ids = p.topk_ids + token * p.top_k;
  const float* weights = p.topk_weights + token * p.top_k;
  for (int64_t h = threadIdx.x; h < p.hidden; h += blockDim.x) {
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
}

}  // namespace

int64_t MoeExpertsWorkspaceBytes(int64_t tokens, int32_t top_k, int32_t num_local_experts,
                                 int64_t intermediate, int64_t hidden) {
  return Carve(nullptr, tokens, top_k, num_local_experts, intermediate, hidden).bytes;
}

absl::Status MoeExperts(const MoeExpertsParamsOf<Bf16, Bf16>& p, void* workspace,
                        int64_t workspace_bytes, cudaStream_t stream) {
  if (p.hidden <= 0 || p.intermediate <= 0 || p.top_k <= 0 || p.first_expert < 0 ||
      p.num_local_experts <= 0 || p.tokens < 0 || p.tokens * p.top_k > 0x7fffffff) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeExperts: tokens=", p.tokens, " top_k=", p.top_k,
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

  GroupKernel<<<1, kGroupThreads, 0, stream>>>(p.topk_ids, p.tokens, p.top_k, p.first_expert,
                                               p.num_local_experts, w);
  TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int32_t up_tiles = static_cast<int32_t>((p.intermediate + kWarps * kRowPairsPerWarp - 1) /
                                                (kWarps * kRowPairsPerWarp));
  const int64_t most_active = std::min<int64_t>(p.num_local_experts, p.tokens * p.top_k);
  GateUpKernel<<<static_cast<unsigned>(std::min<int64_t>(max_blocks, most_active * up_tiles)),
                 kThreads, 0, stream>>>(p, w, up_tiles, x_vectorized);
  TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int32_t down_tiles = static_cast<int32_t>((p.hidden + kWarps * kDownRowsPerWarp - 1) /
                                                  (kWarps * kDownRowsPerWarp));
  DownKernel<<<static_cast<unsigned>(std::min<int64_t>(max_blocks, most_active * down_tiles)),
               kThreads, 0, stream>>>(p, w, down_tiles, down_vectorized);
  TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  CombineKernel<<<static_cast<unsigned>(p.tokens), 256, 0, stream>>>(p, w);
  return CudaStatus(cudaGetLastError(), "MoeExperts launches");
}

}  // namespace treeverify::kernels::cuda
