// MoE experts on the GPU: grouping, gate/up, down, combine (cuda/moe.h has the plan).
//
// Roofline per layer at verify sizes: the active experts' weights, 3 * hidden * intermediate * 2
// bytes each (11 MB per Kimi-K2 expert slice under TP8 split inside, 88 MB per whole expert),
// read once per pass of up to 8 tokens; activations are a rounding error beside them. The expert
// kernels: moe_expert_mma_kernel.cuh (tensor cores), moe_expert_simt_kernel.cuh (CUDA cores).
#include <algorithm>

#include "element_convert.cuh"
#include "moe_expert_mma_kernel.cuh"
#include "moe_expert_simt_kernel.cuh"
#include "moe_workspace.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe.h"

namespace treeverify::kernels::cuda {
namespace {

using moe::Carve;
using moe::DownKernel;
using moe::ExpertMmaKernel;
using moe::GateUpKernel;
using moe::kGroupThreads;
using moe::kThreads;
using moe::kWarps;
using moe::Workspace;

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
  // The loops read either the staged ids or global memory, never a choice per element: a select
  // per element kept the compiler from pipelining the loads (18 us at 128 entries, step 83).
  const int32_t n = static_cast<int32_t>(entries);
  int32_t pairs = 0, active = 0;
  for (int32_t e = begin; e < end; ++e) {
    int32_t count = 0;
    if (stage) {
#pragma unroll 8
      for (int32_t i = 0; i < n; ++i) count += staged[i] == e;
    } else {
      for (int32_t i = 0; i < n; ++i) count += topk_ids[i] - first_expert == e;
    }
    pairs += count;
    active += count > 0;
  }
  int32_t total_pairs, total_active;
  BlockExclusiveScan2(pairs, active, total_pairs, total_active);
  for (int32_t e = begin; e < end; ++e) {
    w.offsets[e] = pairs;
    const int32_t first_pair = pairs;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t local = stage ? staged[i] : topk_ids[i] - first_expert;
      if (local != e) continue;
      w.pair_token[pairs] = i / top_k;
      w.pair_entry[pairs] = i;
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
    const int32_t up_split = moe::MmaSplit(p.hidden), down_split = moe::MmaSplit(p.intermediate);
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
    const int64_t down_rows_per_tile = kWarps * moe::kDownRowsPerWarp;
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
