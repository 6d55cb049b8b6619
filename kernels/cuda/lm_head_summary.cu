#include <cfloat>
#include <cstdint>

#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/lm_head_summary.h"
#include "treeverify/kernels/philox.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// (value, index) ordered by larger value, then smaller index; index -1 is "none".
struct Best {
  double value;
  int64_t index;
};

__device__ __forceinline__ bool Beats(const Best& a, const Best& b) {
  return a.index >= 0 &&
         (b.index < 0 || a.value > b.value || (a.value == b.value && a.index < b.index));
}

// The block's best; every thread gets it.
__device__ Best BlockBest(Best best, Best* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const Best other{__shfl_xor_sync(0xffffffffu, best.value, offset),
                     __shfl_xor_sync(0xffffffffu, best.index, offset)};
    if (Beats(other, best)) best = other;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = best;
  __syncthreads();
  Best result = scratch[0];
  for (int w = 1; w < kWarps; ++w) {
    if (Beats(scratch[w], result)) result = scratch[w];
  }
  __syncthreads();
  return result;
}

__device__ double BlockSum(double value, double* scratch) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  double sum = 0.0;
  for (int w = 0; w < kWarps; ++w) sum += scratch[w];
  __syncthreads();
  return sum;
}

// log sum_v exp(logits[v] / divisor), shifted by the maximum, in double (the CPU op's rule).
__device__ float LogSumExp(const float* logits, int64_t n, float max_logit, double divisor,
                           double* scratch) {
  if (!isfinite(max_logit)) return max_logit;
  const double shift = static_cast<double>(max_logit) / divisor;
  double sum = 0.0;
  for (int64_t v = threadIdx.x; v < n; v += kThreads) {
    sum += exp(static_cast<double>(logits[v]) / divisor - shift);
  }
  sum = BlockSum(sum, scratch);
  return static_cast<float>(shift + log(sum));
}

__global__ void __launch_bounds__(kThreads) LmHeadSummaryKernel(LmHeadSummaryParams p) {
  __shared__ Best best_scratch[kWarps];
  __shared__ double sum_scratch[kWarps];
  const int64_t r = blockIdx.x;
  const float* logits = p.logits + r * p.vocab_shard;
  const int64_t n = p.vocab_shard;

  Best max{-DBL_MAX, -1};
  for (int64_t v = threadIdx.x; v < n; v += kThreads) {
    const Best candidate{static_cast<double>(logits[v]), v};
    if (Beats(candidate, max)) max = candidate;
  }
  max = BlockBest(max, best_scratch);
  const float max_logit = logits[max.index];
  NodeSummary summary;
  summary.max_logit = max_logit;
  summary.argmax = static_cast<int32_t>(p.vocab_begin + max.index);
  summary.log_sum_exp = LogSumExp(logits, n, max_logit, 1.0, sum_scratch);

  if (p.temperature > 0.0f) {
    const int64_t position = p.positions[r];
    const double temperature = p.temperature;
    // Every thread starts from the argmax's score, so that the skipping rule bites at once.
    Best sampled{GumbelMaxScore(max_logit, p.temperature, p.seed, position, summary.argmax),
                 max.index};
    for (int64_t v = threadIdx.x; v < n; v += kThreads) {
      if (static_cast<double>(logits[v]) / temperature + kGumbelNoiseBound < sampled.value) {
        continue;
      }
      const Best candidate{GumbelMaxScore(logits[v], p.temperature, p.seed, position,
                                          static_cast<int32_t>(p.vocab_begin + v)),
                           v};
      if (Beats(candidate, sampled)) sampled = candidate;
    }
    sampled = BlockBest(sampled, best_scratch);
    summary.sampled_token = static_cast<int32_t>(p.vocab_begin + sampled.index);
    summary.sampled_logit = logits[sampled.index];
    summary.sampled_score = sampled.value;
    summary.log_sum_exp_at_temperature = LogSumExp(logits, n, max_logit, temperature, sum_scratch);
  }
  if (threadIdx.x == 0) p.out[r] = summary;

  // Candidates: round k takes the best column ranked below round k - 1's; once none is left
  // (a shard smaller than K), the rest is padding.
  Best previous{DBL_MAX, -1};
  bool exhausted = false;
  for (int32_t k = 0; k < p.num_candidates; ++k) {
    Best best{-DBL_MAX, -1};
    if (exhausted) {
      if (threadIdx.x == 0) p.candidates[r * p.num_candidates + k] = Candidate{-1, -INFINITY};
      continue;
    }
    for (int64_t v = threadIdx.x; v < n; v += kThreads) {
      const Best candidate{static_cast<double>(logits[v]), v};
      const bool below = previous.index < 0 || candidate.value < previous.value ||
                         (candidate.value == previous.value && v > previous.index);
      if (below && Beats(candidate, best)) best = candidate;
    }
    best = BlockBest(best, best_scratch);
    if (threadIdx.x == 0) {
      p.candidates[r * p.num_candidates + k] =
          best.index < 0
              ? Candidate{-1, -INFINITY}
              : Candidate{static_cast<int32_t>(p.vocab_begin + best.index), logits[best.index]};
    }
    previous = best;
    exhausted = best.index < 0;
  }
}

}  // namespace

absl::Status LmHeadSummary(const LmHeadSummaryParams& p, cudaStream_t stream) {
  if (p.vocab_shard <= 0 || p.rows < 0 || p.rows > 0x7fffffff || p.vocab_begin < 0 ||
      p.vocab_begin + p.vocab_shard - 1 > 0x7fffffff || !isfinite(p.temperature) ||
      p.temperature < 0.0f || p.num_candidates < 0 || p.num_candidates > kMaxSummaryCandidates) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::LmHeadSummary: rows=", p.rows, " vocab_shard=", p.vocab_shard, " vocab_begin=",
        p.vocab_begin, " temperature=", p.temperature, " candidates=", p.num_candidates));
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.logits == nullptr || p.out == nullptr || (p.temperature > 0.0f && p.positions == nullptr) ||
      (p.num_candidates > 0 && p.candidates == nullptr)) {
    return absl::InvalidArgumentError(
        "cuda::LmHeadSummary: logits and out (positions with a temperature, candidates when "
        "requested) must be non-null");
  }
  LmHeadSummaryKernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "LmHeadSummaryKernel launch");
}

}  // namespace treeverify::kernels::cuda
