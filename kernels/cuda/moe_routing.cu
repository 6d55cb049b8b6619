// MoE routing, one block per token. The scores are computed by all threads; the group top-k
// runs on one thread with the CPU op's own TopK (top_k.h; a few groups); the expert top-k on one
// warp, each lane keeping a sorted list of its experts' best in registers, the lanes' lists then
// merged by a butterfly of bitonic merges (WarpTopK). A single thread walking 384 experts took 66
// us a layer; top_k rounds of a block-wide arg-max, two barriers and a serial merge of the warps'
// winners a round, 11.7 (bench/NOTES.md, step 97).
#include <cfloat>
#include <cstdint>

#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/kernels/top_k.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;
constexpr int kRoutingThreads = 256;

// (value, id): the larger value first, the lower id among equal values (the CPU's TopK picks the
// same set); id -1 (no expert) after every expert.
__device__ __forceinline__ bool Before(float value, int32_t id, float other_value,
                                       int32_t other_id) {
  return id >= 0 &&
         (other_id < 0 || value > other_value || (value == other_value && id < other_id));
}

__device__ __forceinline__ void SwapIfBefore(float& value, int32_t& id, float& other_value,
                                             int32_t& other_id) {
  if (Before(value, id, other_value, other_id)) {
    const float v = value;
    const int32_t i = id;
    value = other_value;
    id = other_id;
    other_value = v;
    other_id = i;
  }
}

// The best kK of choice[0, n) in order (kK a power of two), on every lane of the calling warp.
// Each lane inserts its experts (lane, lane + 32, ...) into a sorted list in registers; then five
// butterfly steps each keep the best kK of two lanes' lists: the pairwise better of one list and
// the other reversed is bitonic, and a bitonic merge sorts it. The order is total (ids are
// unique), so both lanes of a pair, and finally all 32, hold the same list.
template <int kK>
__device__ void WarpTopK(const float* choice, int32_t n, float (&value)[kK], int32_t (&id)[kK]) {
  static_assert(kK >= 2 && (kK & (kK - 1)) == 0);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kK; ++j) {
    value[j] = -INFINITY;
    id[j] = -1;
  }
  for (int32_t e = lane; e < n; e += 32) {
    float v = choice[e];
    int32_t i = e;
#pragma unroll
    for (int j = 0; j < kK; ++j) SwapIfBefore(v, i, value[j], id[j]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    float other_value[kK];
    int32_t other_id[kK];
#pragma unroll
    for (int j = 0; j < kK; ++j) {
      other_value[j] = __shfl_xor_sync(0xffffffffu, value[j], offset);
      other_id[j] = __shfl_xor_sync(0xffffffffu, id[j], offset);
    }
#pragma unroll
    for (int j = 0; j < kK; ++j) {
      if (Before(other_value[kK - 1 - j], other_id[kK - 1 - j], value[j], id[j])) {
        value[j] = other_value[kK - 1 - j];
        id[j] = other_id[kK - 1 - j];
      }
    }
#pragma unroll
    for (int stride = kK / 2; stride > 0; stride /= 2) {
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        if ((j & stride) == 0) SwapIfBefore(value[j + stride], id[j + stride], value[j], id[j]);
      }
    }
  }
}

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

template <int kK>  // a power of two >= top_k
__global__ void __launch_bounds__(kRoutingThreads) MoeRoutingKernel(MoeRoutingParams p) {
  __shared__ float scores[kMaxExperts];
  __shared__ float choice[kMaxExperts];
  __shared__ float group_scores[kMaxExperts];
  __shared__ bool group_kept[kMaxExperts];
  __shared__ double scratch[kRoutingThreads / 32];
  if (p.routed_tokens != nullptr && static_cast<int32_t>(blockIdx.x) >= *p.routed_tokens) {
    for (int32_t j = threadIdx.x; j < p.top_k; j += blockDim.x) {
      p.topk_ids[static_cast<int64_t>(blockIdx.x) * p.top_k + j] = -1;
      p.topk_weights[static_cast<int64_t>(blockIdx.x) * p.top_k + j] = 0.0f;
    }
    return;
  }
  const int32_t num_experts = p.num_experts;
  const float* logits = p.router_logits + static_cast<int64_t>(blockIdx.x) * num_experts;

  const bool biased = p.method == MoeTopkMethod::kNoauxTc;
  if (p.scoring == MoeScoring::kSigmoid) {
    for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
      const float logit = logits[e];
      const float bias = biased ? p.correction_bias[e] : 0.0f;  // loaded beside the logit
      const float score = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(logit))));
      scores[e] = score;
      choice[e] = biased ? __fadd_rn(score, bias) : score;
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
      const float score = static_cast<float>(exp(static_cast<double>(logits[e]) - max_logit) / sum);
      scores[e] = score;
      choice[e] = biased ? __fadd_rn(score, p.correction_bias[e]) : score;
    }
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

  if (threadIdx.x >= 32) return;
  float best_value[kK];
  int32_t best_id[kK];
  WarpTopK<kK>(choice, num_experts, best_value, best_id);
  if (threadIdx.x != 0) return;
  int32_t sorted[kK];
#pragma unroll
  for (int32_t i = 0; i < kK; ++i) sorted[i] = best_id[i];
  for (int32_t i = 1; i < p.top_k; ++i) {  // ascending ids
    const int32_t id = sorted[i];
    int32_t j = i;
    for (; j > 0 && sorted[j - 1] > id; --j) sorted[j] = sorted[j - 1];
    sorted[j] = id;
  }
  // noaux_tc weighs by the plain scores; the softmax routers by the (masked) scores they ranked.
  const float* weight_source = p.method == MoeTopkMethod::kNoauxTc ? scores : choice;
  float weights[kK];
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
  const unsigned blocks = static_cast<unsigned>(p.tokens);
  if (p.top_k <= 8) {
    MoeRoutingKernel<8><<<blocks, kRoutingThreads, 0, stream>>>(p);
  } else if (p.top_k <= 16) {
    MoeRoutingKernel<16><<<blocks, kRoutingThreads, 0, stream>>>(p);
  } else {
    MoeRoutingKernel<32><<<blocks, kRoutingThreads, 0, stream>>>(p);
  }
  return CudaStatus(cudaGetLastError(), "MoeRoutingKernel launch");
}

}  // namespace treeverify::kernels::cuda
