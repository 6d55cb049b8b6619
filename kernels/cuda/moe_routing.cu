// MoE routing, one block per token. The scores are computed by all threads; the group top-k
// runs on one thread with the CPU op's own TopK (top_k.h; a few groups); the expert top-k as
// rounds of a warp-wide maximum on 64-bit rank keys (choice, then id): each warp's best top_k of
// its experts, then warp 0's best of those. A single thread walking 384 experts took 66 us a
// layer; top_k rounds of a block-wide arg-max 11.7; one warp inserting all 384 experts one
// compare-exchange after another 12.1 (bench/NOTES.md, step 97); sorted lists merged by bitonic
// merges across lanes and warps 10.1 us from the router's end to the routing's, these rounds 9.0
// (steps 129-130: every phase of this kernel costs a microsecond or two, whatever its work).
//
// MoeRoutingAndGrouping: the same kernel, whose last block to finish then groups the step's
// pairs for MoeExperts (moe_grouping.cuh), one dependent kernel fewer on the MoE's critical path
// (bench/NOTES.md, step 116).
#include <cfloat>
#include <cstdint>

#include "grid_dependency.cuh"
#include "moe_grouping.cuh"
#include "moe_workspace.cuh"
#include "programmatic_launch.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/kernels/status.h"
#include "treeverify/kernels/top_k.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;
constexpr int kRoutingThreads = 256;
constexpr int kExpertsPerThread = kMaxExperts / kRoutingThreads;  // expert threadIdx.x + i * 256

// An expert's rank key: the order bits of its choice above, the complement of its id below, so
// that a larger key is a larger choice or, among equal choices, the lower id (the CPU's TopK
// order; -0 counts as +0, as the float comparison has them equal; NaN ranks below every number).
// 0 is no expert, below every key.
__device__ __forceinline__ uint64_t RankKey(float choice, int32_t id) {
  uint32_t bits = __float_as_uint(choice + 0.0f);
  bits = (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
  if (isnan(choice)) bits = 0;
  return (uint64_t{bits} << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}

__device__ __forceinline__ int32_t IdOf(uint64_t key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key));
}

__device__ __forceinline__ uint64_t Larger(uint64_t a, uint64_t b) { return a > b ? a : b; }

// The largest of the keys the warp's lanes hold (kPerLane each; 0: none), on every lane, cleared
// where it was: a warp-wide maximum by two redux.sync (the keys' high words, then the low words of
// the lanes whose best has the maximal high word). Keys are unique, so exactly one lane clears it.
template <int kPerLane>
__device__ __forceinline__ uint64_t TakeWarpMax(uint64_t (&keys)[kPerLane]) {
  uint64_t mine = keys[0];
#pragma unroll
  for (int i = 1; i < kPerLane; ++i) mine = Larger(mine, keys[i]);
  const uint32_t high = static_cast<uint32_t>(mine >> 32);
  const uint32_t max_high = __reduce_max_sync(0xffffffffu, high);
  const uint32_t low = high == max_high ? static_cast<uint32_t>(mine) : 0u;
  const uint32_t max_low = __reduce_max_sync(0xffffffffu, low);
  const uint64_t best = (uint64_t{max_high} << 32) | max_low;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) keys[i] = keys[i] == best ? 0 : keys[i];
  return best;
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

// Block blockIdx.x's token: its top_k ids and weights. A programmatic dependent of the router's
// product (programmatic_launch.h): its launch, and noaux_tc's correction bias (a weight, often out
// of the L2 by the next layer: into `choice`, which the scores then add to), hide behind the
// predecessor's tail.
template <int kK>  // a power of two >= top_k
__device__ void RouteToken(const MoeRoutingParams& p) {
  __shared__ float scores[kMaxExperts];
  __shared__ float choice[kMaxExperts];
  __shared__ float group_scores[kMaxExperts];
  __shared__ bool group_kept[kMaxExperts];
  __shared__ double scratch[kRoutingThreads / 32];
  const int32_t num_experts = p.num_experts;
  const bool biased = p.method == MoeTopkMethod::kNoauxTc;
  if (biased) {
    for (int32_t e = threadIdx.x; e < num_experts; e += kRoutingThreads) {
      choice[e] = p.correction_bias[e];  // read back by this thread only
    }
  }
  WaitForPredecessorGrid();
  AllowDependentGridLaunch();
  if (p.routed_tokens != nullptr && static_cast<int32_t>(blockIdx.x) >= *p.routed_tokens) {
    for (int32_t j = threadIdx.x; j < p.top_k; j += blockDim.x) {
      p.topk_ids[static_cast<int64_t>(blockIdx.x) * p.top_k + j] = -1;
      p.topk_weights[static_cast<int64_t>(blockIdx.x) * p.top_k + j] = 0.0f;
    }
    return;
  }
  const float* logits = p.router_logits + static_cast<int64_t>(blockIdx.x) * num_experts;

  if (p.scoring == MoeScoring::kSigmoid) {
#pragma unroll 1
    for (int32_t e = threadIdx.x; e < num_experts; e += kRoutingThreads) {
      const float score = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(logits[e]))));
      scores[e] = score;
      choice[e] = biased ? __fadd_rn(score, choice[e]) : score;
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
    for (int32_t e = threadIdx.x; e < num_experts; e += kRoutingThreads) {
      const float score = static_cast<float>(exp(static_cast<double>(logits[e]) - max_logit) / sum);
      scores[e] = score;
      choice[e] = biased ? __fadd_rn(score, choice[e]) : score;
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

  // The top top_k: each warp's best of its threads' experts, then warp 0's best of those, one
  // round a key. The rounds are loops, one copy of their code (unrolled they were no faster:
  // bench/NOTES.md, step 130).
  constexpr int kWarps = kRoutingThreads / 32;
  constexpr int kCandidatesPerLane = kWarps * kK / 32;
  static_assert(kWarps * kK % 32 == 0);
  __shared__ uint64_t warp_lists[kWarps * kK];
  __shared__ uint64_t top[kK];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  uint64_t keys[kExpertsPerThread];
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int32_t e = static_cast<int32_t>(threadIdx.x) + i * kRoutingThreads;
    keys[i] = e < num_experts ? RankKey(choice[e], e) : 0;
  }
  if (lane < kK) warp_lists[warp * kK + lane] = 0;  // past top_k: no expert
  __syncwarp();
#pragma unroll 1
  for (int32_t j = 0; j < p.top_k; ++j) {
    const uint64_t best = TakeWarpMax(keys);
    if (lane == 0) warp_lists[warp * kK + j] = best;
  }
  __syncthreads();
  if (warp != 0) return;
  uint64_t candidates[kCandidatesPerLane];
#pragma unroll
  for (int i = 0; i < kCandidatesPerLane; ++i) candidates[i] = warp_lists[lane + 32 * i];
  // Lane j < top_k takes the j-th best; its place in the output is its rank by id (ascending
  // ids, as the CPU writes them), and the normalizing sum adds the weights in that order.
  uint64_t mine = 0;
#pragma unroll 1
  for (int32_t j = 0; j < p.top_k; ++j) {
    const uint64_t best = TakeWarpMax(candidates);
    if (lane == j) mine = best;
    if (lane == 0) top[j] = best;
  }
  __syncwarp();
  const bool holds = lane < p.top_k;
  const int32_t id = IdOf(mine);
  int32_t place = 0;
#pragma unroll 1
  for (int32_t j = 0; j < p.top_k; ++j) place += IdOf(top[j]) < id ? 1 : 0;
  // noaux_tc weighs by the plain scores; the softmax routers by the (masked) scores they ranked.
  const float* weight_source = p.method == MoeTopkMethod::kNoauxTc ? scores : choice;
  float weight = holds ? weight_source[id] : 0.0f;
  if (p.normalize) {
    double sum = 0.0;
    for (int32_t r = 0; r < p.top_k; ++r) {
      const int source = __ffs(__ballot_sync(0xffffffffu, holds && place == r)) - 1;
      sum += __shfl_sync(0xffffffffu, weight, source);
    }
    weight = __fdiv_rn(weight, __fadd_rn(static_cast<float>(sum), 1e-20f));
  }
  if (holds) {
    const int64_t at = static_cast<int64_t>(blockIdx.x) * p.top_k + place;
    p.topk_ids[at] = id;
    p.topk_weights[at] = __fmul_rn(weight, p.routed_scaling_factor);
  }
}

// Where the last routing block groups the pairs (MoeRoutingAndGrouping); w.routing_arrivals is
// null for MoeRouting alone.
struct GroupTarget {
  moe::Workspace w;
  int32_t first_expert = 0;
  int32_t num_local = 0;
  int32_t* active_count = nullptr;
};

// The last block to arrive groups the ids every block wrote (each thread fences its writes
// before its block arrives; the last one reads them from the L2) and zeroes the count for the
// next launch: every other block has counted by then.
__device__ void GroupIfLast(const MoeRoutingParams& p, const GroupTarget& g) {
  extern __shared__ int32_t staged[];  // moe::GroupKernelSmemBytes
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(g.w.routing_arrivals, 1) == static_cast<int>(gridDim.x) - 1;
    if (last) *g.w.routing_arrivals = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  moe::GroupStaged<kRoutingThreads>(p.topk_ids, p.tokens, p.top_k, g.first_expert, g.num_local, g.w,
                                    g.active_count, staged);
}

template <int kK>
__global__ void __launch_bounds__(kRoutingThreads)
    MoeRoutingKernel(MoeRoutingParams p, GroupTarget g) {
  RouteToken<kK>(p);
  if (g.w.routing_arrivals != nullptr) GroupIfLast(p, g);
}

// The routing kernel for top_k (a power of two of at least top_k, for its lists).
using RoutingKernel = void (*)(MoeRoutingParams, GroupTarget);
RoutingKernel RoutingKernelFor(int32_t top_k) {
  if (top_k <= 8) return MoeRoutingKernel<8>;
  if (top_k <= 16) return MoeRoutingKernel<16>;
  return MoeRoutingKernel<32>;
}

// Shared memory a block has without the opt-in: the routing's own (~15 KB) and the staged
// grouping's must fit it together.
constexpr int64_t kDefaultBlockSmem = 48 * 1024;

absl::Status LaunchRouting(const MoeRoutingParams& p, const GroupTarget& g, int64_t smem,
                           cudaStream_t stream) {
  const RoutingKernel kernel = RoutingKernelFor(p.top_k);
  return LaunchKernel(kernel, dim3(static_cast<unsigned>(p.tokens)), dim3(kRoutingThreads), smem,
                      stream, WaitsForPredecessor(kernel), "MoeRoutingKernel", p, g);
}

// The routing's sizes and, where it has tokens, its pointers.
absl::Status CheckRouting(const MoeRoutingParams& p) {
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
  if (p.tokens > 0 &&
      (p.router_logits == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr)) {
    return absl::InvalidArgumentError(
        "cuda::MoeRouting: router_logits, topk_ids and topk_weights must be non-null");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeRouting(const MoeRoutingParams& p, cudaStream_t stream) {
  TV_RETURN_IF_ERROR(CheckRouting(p));
  if (p.tokens == 0) return absl::OkStatus();
  return LaunchRouting(p, GroupTarget{}, 0, stream);
}

absl::StatusOr<MoeGrouping> MoeRoutingAndGrouping(const MoeRoutingParams& routing,
                                                  const MoeExpertsParamsOf<Bf16, Bf16>& experts,
                                                  void* workspace, int64_t workspace_bytes,
                                                  cudaStream_t stream, int32_t* active_count) {
  if (experts.topk_ids != routing.topk_ids || experts.tokens != routing.tokens ||
      experts.top_k != routing.top_k || experts.first_expert < 0 ||
      experts.num_local_experts <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::MoeRoutingAndGrouping: the experts must take the routing's ids (tokens ",
        experts.tokens, " vs ", routing.tokens, ", top_k ", experts.top_k, " vs ", routing.top_k,
        ") and hold experts [", experts.first_expert, ", +", experts.num_local_experts, ")"));
  }
  // Everything the host can check, before anything asks the device.
  TV_RETURN_IF_ERROR(CheckRouting(routing));
  const moe::Workspace w =
      moe::Carve(workspace, experts.tokens, experts.top_k, experts.num_local_experts,
                 experts.intermediate, experts.hidden);
  if (workspace == nullptr || workspace_bytes < w.bytes ||
      reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeRoutingAndGrouping: needs a 256-byte aligned workspace of ", w.bytes,
                     " bytes, got ", workspace_bytes));
  }
  const int64_t smem =
      moe::GroupKernelSmemBytes(routing.tokens * routing.top_k, experts.num_local_experts);
  cudaFuncAttributes kernel{};
  TV_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(
      &kernel, reinterpret_cast<const void*>(RoutingKernelFor(routing.top_k))));
  if (smem + static_cast<int64_t>(kernel.sharedSizeBytes) > kDefaultBlockSmem) {
    // A prefill batch: MoeExperts groups it over chunks.
    TV_RETURN_IF_ERROR(MoeRouting(routing, stream));
    return MoeGrouping::kInExperts;
  }
  if (routing.tokens == 0) return MoeGrouping::kInExperts;
  TV_RETURN_IF_ERROR(LaunchRouting(routing,
                                   GroupTarget{.w = w,
                                               .first_expert = experts.first_expert,
                                               .num_local = experts.num_local_experts,
                                               .active_count = active_count},
                                   smem, stream));
  return MoeGrouping::kInRouting;
}

}  // namespace treeverify::kernels::cuda
