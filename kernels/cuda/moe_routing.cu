// MoE routing, one block per token. The scores are computed by all threads; the group top-k
// runs on one thread with the CPU op's own TopK (top_k.h; a few groups), the expert top-k as top_k
// rounds of a block-wide arg-max (a single thread walking 384 experts took 66 us per layer).
#include <cfloat>
#include <cstdint>

#include "grid_dependency.cuh"
#include "programmatic_launch.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/kernels/top_k.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;
constexpr int kRoutingThreads = 256;

// Block-wide reductions in double over one value per thread, fixed order.
__device__ double BlockMax(double value, double* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmax(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  double result = scratch[0];
  for (int w = 1; w < kRoutingThreads / 32; ++w) result = fmax(result, scratch[w]);
  __syncthreads();
  return result;
}

__device__ double BlockSum(double value, double* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  double result = 0.0;
  for (int w = 0; w < kRoutingThreads / 32; ++w) result += scratch[w];
  __syncthreads();
  return result;
}

__global__ void __launch_bounds__(kRoutingThreads) MoeRoutingKernel(MoeRoutingParams p) {
  __shared__ float scores[kMaxExperts];
  __shared__ float choice[kMaxExperts];
  __shared__ float group_scores[kMaxExperts];
  __shared__ bool group_kept[kMaxExperts];
  __shared__ double scratch[kRoutingThreads / 32];
  // A programmatic dependent of the router's product (programmatic_launch.h): its launch hides
  // behind the predecessor's tail.
  WaitForPredecessorGrid();
  AllowDependentGridLaunch();
  if (p.routed_tokens != nullptr && static_cast<int32_t>(blockIdx.x) >= *p.routed_tokens) {
    for (int32_t j = threadIdx.x; j < p.top_k; j += blockDim.x) {
      p.topk_ids[static_cast<int64_t>(blockIdx.x) * p.top_k + j] = -1;
      p.topk_weights[static_cast<int64_t>(blockIdx.x) * p.top_k + j] = 0.0f;
    }
    return;
  }
  const int32_t num_experts = p.num_experts;
  const float* logits = p.router_logits + static_cast<int64_t>(blockIdx.x) * num_experts;

  if (p.scoring == MoeScoring::kSigmoid) {
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      scores[e] = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(logits[e]))));
    }
  } else {
    double max_logit = -DBL_MAX;
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      max_logit = fmax(max_logit, static_cast<double>(logits[e]));
    }
    max_logit = static_cast<float>(BlockMax(max_logit, scratch));
    double sum = 0.0;
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      sum += exp(static_cast<double>(logits[e]) - max_logit);
    }
    sum = BlockSum(sum, scratch);
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      scores[e] = static_cast<float>(exp(static_cast<double>(logits[e]) - max_logit) / sum);
    }
  }
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    choice[e] = p.method == MoeTopkMethod::kNoauxTc ? __fadd_rn(scores[e], p.correction_bias[e])
                                                    : scores[e];
  }
  __syncthreads();

  if (p.method != MoeTopkMethod::kGreedy && p.topk_groups < p.num_groups) {
    const int32_t group_size = num_experts / p.num_groups;
    for (int32_t g = threadIdx.x; g < p.num_groups; g += blockDim.x) {
      const float* group = choice + g * group_size;
      if (p.method == MoeTopkMethod::kNoauxTc) {
        int32_t best_two[2];
        TopK(group, group_size, 2, best_two);
        group_scores[g] = __fadd_rn(group[best_two[0]], group[best_two[1]]);
      } else {
        float best = group[0];
        for (int32_t i = 1; i < group_size; ++i) best = fmaxf(best, group[i]);
        group_scores[g] = best;
      }
      group_kept[g] = false;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t kept[kMaxTopK];
      TopK(group_scores, p.num_groups, p.topk_groups, kept);
      for (int32_t i = 0; i < p.topk_groups; ++i) group_kept[kept[i]] = true;
    }
    __syncthreads();
    const float masked = p.method == MoeTopkMethod::kNoauxTc ? -INFINITY : 0.0f;
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      if (!group_kept[e / group_size]) choice[e] = masked;
    }
    __syncthreads();
  }

  // top_k rounds of a block-wide arg-max over the experts not yet taken: the largest choice,
  // the lower id among equals (the CPU's TopK picks the same set).
  __shared__ int32_t ids[kMaxTopK];
  __shared__ bool taken[kMaxExperts];
  __shared__ float warp_best[kRoutingThreads / 32];
  __shared__ int32_t warp_best_id[kRoutingThreads / 32];
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) taken[e] = false;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int32_t round = 0; round < p.top_k; ++round) {
    float best = -INFINITY;
    int32_t best_id = INT32_MAX;
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      if (!taken[e] && (choice[e] > best || best_id == INT32_MAX)) {
        best = choice[e];
        best_id = e;
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int32_t other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (other_id != INT32_MAX &&
          (best_id == INT32_MAX || other > best || (other == best && other_id < best_id))) {
        best = other;
        best_id = other_id;
      }
    }
    if (lane == 0) {
      warp_best[warp] = best;
      warp_best_id[warp] = best_id;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kRoutingThreads / 32; ++w) {
        const int32_t id = warp_best_id[w];
        if (id != INT32_MAX && (best_id == INT32_MAX || warp_best[w] > best ||
                                (warp_best[w] == best && id < best_id))) {
          best = warp_best[w];
          best_id = id;
        }
      }
      ids[round] = best_id;
      taken[best_id] = true;
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  int32_t sorted[kMaxTopK];
  for (int32_t i = 0; i < p.top_k; ++i) sorted[i] = ids[i];
  for (int32_t i = 1; i < p.top_k; ++i) {  // ascending ids
    const int32_t id = sorted[i];
    int32_t j = i;
    for (; j > 0 && sorted[j - 1] > id; --j) sorted[j] = sorted[j - 1];
    sorted[j] = id;
  }
  // noaux_tc weighs by the plain scores; the softmax routers by the (masked) scores they ranked.
  const float* weight_source = p.method == MoeTopkMethod::kNoauxTc ? scores : choice;
  float weights[kMaxTopK];
  for (int32_t j = 0; j < p.top_k; ++j) weights[j] = weight_source[sorted[j]];
  if (p.normalize) {
    double sum = 0.0;
    for (int32_t j = 0; j < p.top_k; ++j) sum += weights[j];
    const float denominator = __fadd_rn(static_cast<float>(sum), 1e-20f);
    for (int32_t j = 0; j < p.top_k; ++j) weights[j] = __fdiv_rn(weights[j], denominator);
  }
  const int64_t at = static_cast<int64_t>(blockIdx.x) * p.top_k;
  for (int32_t j = 0; j < p.top_k; ++j) {
    p.topk_ids[at + j] = sorted[j];
    p.topk_weights[at + j] = __fmul_rn(weights[j], p.routed_scaling_factor);
  }
}

}  // namespace

absl::Status MoeRouting(const MoeRoutingParams& p, cudaStream_t stream) {
  const int32_t group_size = p.num_groups > 0 ? p.num_experts / p.num_groups : 0;
  if (p.num_experts <= 0 || p.num_experts > kMaxExperts || p.top_k <= 0 || p.top_k > kMaxTopK ||
      p.top_k > p.num_experts || p.num_groups <= 0 || p.num_experts % p.num_groups != 0 ||
      p.topk_groups <= 0 || p.topk_groups > p.num_groups || p.topk_groups > kMaxTopK ||
      p.tokens < 0 || p.tokens > 0x7fffffff ||
      (p.method != MoeTopkMethod::kGreedy &&
       int64_t{p.top_k} > int64_t{p.topk_groups} * group_size) ||
      (p.method == MoeTopkMethod::kNoauxTc && (group_size < 2 || p.correction_bias == nullptr))) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeRouting: tokens=", p.tokens, " experts=", p.num_experts,
                     " (at most ", kMaxExperts, ") top_k=", p.top_k, " (at most ", kMaxTopK,
                     ") groups=", p.num_groups, " topk_groups=", p.topk_groups,
                     "; noaux_tc needs a correction bias and 2+ experts per "
                     "group, group-limited methods top_k <= topk_groups * group size"));
  }
  if (p.tokens == 0) return absl::OkStatus();
  if (p.router_logits == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr) {
    return absl::InvalidArgumentError(
        "cuda::MoeRouting: router_logits, topk_ids and topk_weights must be non-null");
  }
  return LaunchKernel(MoeRoutingKernel, dim3(static_cast<unsigned>(p.tokens)),
                      dim3(kRoutingThreads), 0, stream, WaitsForPredecessor(MoeRoutingKernel),
                      "MoeRoutingKernel", p);
}

}  // namespace treeverify::kernels::cuda
