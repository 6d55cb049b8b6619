#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/lm_head_summary.h"
#include "treeverify/kernels/philox.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 1024;  // the row-per-block kernel's
constexpr int kSliceThreads = 256;

// (value, index) ordered by larger value, then smaller index; index -1 is "none".
struct Best {
  double value;
  int64_t index;
};

__device__ __forceinline__ bool Beats(const Best& a, const Best& b) {
  return a.index >= 0 &&
         (b.index < 0 || a.value > b.value || (a.value == b.value && a.index < b.index));
}

// The block's best; every thread gets it. `scratch`: kBlockThreads / 32 entries.
template <int kBlockThreads = kThreads>
__device__ Best BlockBest(Best best, Best* scratch) {
  constexpr int kWarps = kBlockThreads / 32;
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

template <int kBlockThreads = kThreads>
__device__ double BlockSum(double value, double* scratch) {
  constexpr int kWarps = kBlockThreads / 32;
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
  __shared__ Best best_scratch[kThreads / 32];
  __shared__ double sum_scratch[kThreads / 32];
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

// A row's slice: its best logit, its sums of exp(logit / T - max / T) shifted by its own
// maximum (T = 1, and the temperature's), and its Gumbel-max winner.
struct SlicePartial {
  Best max;
  double sum;
  double sum_at_temperature;
  Best sampled;
};
static_assert(sizeof(SlicePartial) == kLmHeadSlicePartialBytes);

// Few rows (a verify step's tree): each row in `gridDim.x` slices of at most kSliceThreads *
// kLmHeadSliceValues logits, one block each, so that the double exps of a row spread over many
// multiprocessors (one block per row left 16 of 132 busy: 15.5 us for 16 rows, 9.8 in slices;
// bench/NOTES.md, steps 132-133); the last slice of a row to arrive combines the row's partials in
// slice order. A thread's logits are loaded at once, before any compare.
__global__ void __launch_bounds__(kSliceThreads)
    LmHeadSliceKernel(LmHeadSummaryParams p, SlicePartial* partials, uint32_t* arrivals) {
  __shared__ Best best_scratch[kSliceThreads / 32];
  __shared__ double sum_scratch[kSliceThreads / 32];
  __shared__ SlicePartial row_parts[kLmHeadMaxSlices];
  __shared__ bool last;
  const int64_t r = blockIdx.y;
  const int32_t slices = gridDim.x, slice = blockIdx.x;
  const float* logits = p.logits + r * p.vocab_shard;
  const int64_t chunk = (p.vocab_shard + slices - 1) / slices;
  const int64_t begin = slice * chunk, end = min(p.vocab_shard, begin + chunk);

  float x[kLmHeadSliceValues];
#pragma unroll
  for (int i = 0; i < kLmHeadSliceValues; ++i) {
    const int64_t v = begin + threadIdx.x + i * kSliceThreads;
    x[i] = v < end ? logits[v] : 0.0f;
  }
  Best max{-DBL_MAX, -1};
#pragma unroll
  for (int i = 0; i < kLmHeadSliceValues; ++i) {
    const int64_t v = begin + threadIdx.x + i * kSliceThreads;
    const Best candidate{static_cast<double>(x[i]), v};
    if (v < end && Beats(candidate, max)) max = candidate;
  }
  SlicePartial part;
  part.max = BlockBest<kSliceThreads>(max, best_scratch);
  // The slice's sums shifted by its maximum, as LogSumExp does for a whole row.
  const double slice_max = part.max.value;
  auto sum_at = [&](double divisor) {
    double sum = 0.0;
    if (!isfinite(slice_max)) return sum;
#pragma unroll
    for (int i = 0; i < kLmHeadSliceValues; ++i) {
      const int64_t v = begin + threadIdx.x + i * kSliceThreads;
      if (v < end) sum += exp(static_cast<double>(x[i]) / divisor - slice_max / divisor);
    }
    return BlockSum<kSliceThreads>(sum, sum_scratch);
  };
  part.sum = sum_at(1.0);
  part.sum_at_temperature = 0.0;
  part.sampled = Best{-DBL_MAX, -1};
  if (p.temperature > 0.0f) {
    const int64_t position = p.positions[r];
    const double temperature = p.temperature;
    // Every thread starts from the slice's argmax's score, so that the skipping rule bites.
    Best sampled{GumbelMaxScore(static_cast<float>(slice_max), p.temperature, p.seed, position,
                                static_cast<int32_t>(p.vocab_begin + part.max.index)),
                 part.max.index};
#pragma unroll
    for (int i = 0; i < kLmHeadSliceValues; ++i) {
      const int64_t v = begin + threadIdx.x + i * kSliceThreads;
      if (v >= end || static_cast<double>(x[i]) / temperature + kGumbelNoiseBound < sampled.value) {
        continue;
      }
      const Best candidate{GumbelMaxScore(x[i], p.temperature, p.seed, position,
                                          static_cast<int32_t>(p.vocab_begin + v)),
                           v};
      if (Beats(candidate, sampled)) sampled = candidate;
    }
    part.sampled = BlockBest<kSliceThreads>(sampled, best_scratch);
    part.sum_at_temperature = sum_at(temperature);
  }

  // Arrive; the last slice of the row combines (the partials through the L2, acquire-release).
  if (threadIdx.x == 0) {
    partials[r * slices + slice] = part;
    uint32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(arrivals + r)
                 : "memory");
    last = before == static_cast<uint32_t>(slices - 1);
    if (last) arrivals[r] = 0;  // for the next launch: every slice has arrived
  }
  __syncthreads();
  if (!last) return;
  if (threadIdx.x < slices) {
    const SlicePartial* source = partials + r * slices + threadIdx.x;
    SlicePartial loaded;
    auto index = [](const int64_t* at) {
      return static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(at)));
    };
    loaded.max = Best{__ldcg(&source->max.value), index(&source->max.index)};
    loaded.sum = __ldcg(&source->sum);
    loaded.sum_at_temperature = __ldcg(&source->sum_at_temperature);
    loaded.sampled = Best{__ldcg(&source->sampled.value), index(&source->sampled.index)};
    row_parts[threadIdx.x] = loaded;
  }
  __syncthreads();
  // The row's best and winner, then each slice's term of the shifted sums on a thread of its
  // own (a double exp each), added by thread 0 in slice order.
  Best row_max = row_parts[0].max, row_sampled = row_parts[0].sampled;
  for (int32_t s = 1; s < slices; ++s) {
    if (Beats(row_parts[s].max, row_max)) row_max = row_parts[s].max;
    if (Beats(row_parts[s].sampled, row_sampled)) row_sampled = row_parts[s].sampled;
  }
  const float max_logit = static_cast<float>(row_max.value);
  __shared__ double terms[2][kLmHeadMaxSlices];
  if (threadIdx.x < slices) {
    const SlicePartial& mine = row_parts[threadIdx.x];
    const bool counts = isfinite(mine.max.value) && isfinite(max_logit);
    terms[0][threadIdx.x] = counts ? mine.sum * exp(mine.max.value - double{max_logit}) : 0.0;
    if (p.temperature > 0.0f) {
      const double t = p.temperature;
      terms[1][threadIdx.x] =
          counts ? mine.sum_at_temperature * exp(mine.max.value / t - double{max_logit} / t) : 0.0;
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  NodeSummary summary;
  summary.max_logit = max_logit;
  summary.argmax = static_cast<int32_t>(p.vocab_begin + row_max.index);
  auto log_sum_exp = [&](int which, double divisor) {
    if (!isfinite(max_logit)) return max_logit;
    double sum = 0.0;
    for (int32_t s = 0; s < slices; ++s) sum += terms[which][s];
    return static_cast<float>(static_cast<double>(max_logit) / divisor + log(sum));
  };
  summary.log_sum_exp = log_sum_exp(0, 1.0);
  if (p.temperature > 0.0f) {
    summary.sampled_token = static_cast<int32_t>(p.vocab_begin + row_sampled.index);
    summary.sampled_logit = logits[row_sampled.index];
    summary.sampled_score = row_sampled.value;
    summary.log_sum_exp_at_temperature = log_sum_exp(1, p.temperature);
  }
  p.out[r] = summary;
}

absl::Status CheckSummary(const LmHeadSummaryParams& p) {
  if (p.vocab_shard <= 0 || p.rows < 0 || p.rows > 0x7fffffff || p.vocab_begin < 0 ||
      p.vocab_begin + p.vocab_shard - 1 > 0x7fffffff || !isfinite(p.temperature) ||
      p.temperature < 0.0f || p.num_candidates < 0 || p.num_candidates > kMaxSummaryCandidates) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::LmHeadSummary: rows=", p.rows, " vocab_shard=", p.vocab_shard, " vocab_begin=",
        p.vocab_begin, " temperature=", p.temperature, " candidates=", p.num_candidates));
  }
  if (p.rows > 0 && (p.logits == nullptr || p.out == nullptr ||
                     (p.temperature > 0.0f && p.positions == nullptr) ||
                     (p.num_candidates > 0 && p.candidates == nullptr))) {
    return absl::InvalidArgumentError(
        "cuda::LmHeadSummary: logits and out (positions with a temperature, candidates when "
        "requested) must be non-null");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LmHeadSummary(const LmHeadSummaryParams& p, cudaStream_t stream) {
  TV_RETURN_IF_ERROR(CheckSummary(p));
  if (p.rows == 0) return absl::OkStatus();
  LmHeadSummaryKernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "LmHeadSummaryKernel launch");
}

absl::StatusOr<LmHeadSummaryScratch> AllocateLmHeadSummaryScratch(int64_t rows) {
  if (rows <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::AllocateLmHeadSummaryScratch: rows must be positive, got ", rows));
  }
  int device = 0;
  LmHeadSummaryScratch scratch;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&scratch.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&scratch.partials, rows * kLmHeadMaxSlices * kLmHeadSlicePartialBytes));
  if (const cudaError_t e = cudaMalloc(&scratch.arrivals, rows * sizeof(uint32_t));
      e != cudaSuccess) {
    cudaFree(scratch.partials);
    return CudaStatus(e, "cudaMalloc(arrivals)");
  }
  if (const cudaError_t e = cudaMemset(scratch.arrivals, 0, rows * sizeof(uint32_t));
      e != cudaSuccess) {
    FreeLmHeadSummaryScratch(scratch);
    return CudaStatus(e, "cudaMemset(arrivals)");
  }
  scratch.rows = rows;
  return scratch;
}

void FreeLmHeadSummaryScratch(LmHeadSummaryScratch& scratch) {
  cudaFree(scratch.partials);
  cudaFree(scratch.arrivals);
  scratch = LmHeadSummaryScratch();
}

absl::Status LmHeadSummary(const LmHeadSummaryParams& p, const LmHeadSummaryScratch& scratch,
                           cudaStream_t stream) {
  TV_RETURN_IF_ERROR(CheckSummary(p));
  if (p.rows == 0) return absl::OkStatus();
  // Slices enough for the multiprocessors (and for every logit to fit a thread's registers);
  // rows that need more than kLmHeadMaxSlices, candidates, or more rows than the scratch holds
  // take the row-per-block kernel.
  constexpr int64_t kSliceLogits = int64_t{kSliceThreads} * kLmHeadSliceValues;
  const int64_t needed = (p.vocab_shard + kSliceLogits - 1) / kSliceLogits;
  // (At least a block's threads of logits a slice.)
  const int64_t wanted = std::min((int64_t{scratch.multiprocessors} + p.rows - 1) / p.rows,
                                  std::max<int64_t>(1, p.vocab_shard / kSliceThreads));
  const int64_t slices = std::max(needed, std::min<int64_t>(wanted, kLmHeadMaxSlices));
  if (p.num_candidates > 0 || p.rows > scratch.rows || p.rows > 65535 ||
      slices > kLmHeadMaxSlices || scratch.partials == nullptr) {
    return LmHeadSummary(p, stream);
  }
  LmHeadSliceKernel<<<dim3(static_cast<unsigned>(slices), static_cast<unsigned>(p.rows)),
                      kSliceThreads, 0, stream>>>(p, static_cast<SlicePartial*>(scratch.partials),
                                                  scratch.arrivals);
  return CudaStatus(cudaGetLastError(), "LmHeadSliceKernel launch");
}

}  // namespace treeverify::kernels::cuda
