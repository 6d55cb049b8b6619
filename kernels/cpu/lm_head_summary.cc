// CPU summary of one vocabulary shard's logits per row: max, argmax and log-sum-exp; with a
// temperature the Gumbel-max sampling winner and the log-sum-exp at that temperature; on request
// the row's top-K candidates.
//
// The exponentials are summed in double in column order and the sampling scores come from the
// shared GumbelMaxScore, so a row's summary depends only on its logits, its position and the
// seed. Roofline: reads 4 * vocab_shard bytes per row and does one exp per logit (two with a
// temperature); at DeepSeek's 129280-column vocabulary the exps dominate. Sampling would add a
// Philox block and two logs per column, but only columns whose logit / T could still beat the
// best score (within kGumbelNoiseBound) draw noise: with peaked distributions almost none do.
#include "treeverify/kernels/lm_head_summary.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "treeverify/kernels/philox.h"

namespace treeverify::kernels::cpu {
namespace {

// log sum_v exp(logits[v] / divisor), shifted by the maximum, summed in double in column order.
// +-inf maxima (all masked, or an infinite logit) give themselves.
float LogSumExp(const float* logits, int64_t n, float max_logit, double divisor) {
  if (!std::isfinite(max_logit)) return max_logit;
  const double shift = static_cast<double>(max_logit) / divisor;
  double sum = 0.0;
  for (int64_t v = 0; v < n; ++v) sum += std::exp(static_cast<double>(logits[v]) / divisor - shift);
  return static_cast<float>(shift + std::log(sum));
}

// Candidate order: larger logit first, then smaller id.
bool Better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.token_id < b.token_id);
}

// The k best columns of one row into out[0..k), best first, padded with (-1, -inf). `heap` is
// scratch space.
void TopCandidates(const float* logits, int64_t n, int32_t vocab_begin, int32_t k,
                   std::vector<Candidate>& heap, Candidate* out) {
  heap.clear();
  // With Better as the heap's "less", the front is the worst candidate kept so far.
  for (int64_t v = 0; v < n; ++v) {
    const Candidate c{static_cast<int32_t>(vocab_begin + v), logits[v]};
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), Better);
    } else if (Better(c, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), Better);
      heap.back() = c;
      std::push_heap(heap.begin(), heap.end(), Better);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), Better);
  std::copy(heap.begin(), heap.end(), out);
  std::fill(out + heap.size(), out + k, Candidate{-1, -std::numeric_limits<float>::infinity()});
}

}  // namespace

absl::Status LmHeadSummary(const LmHeadSummaryParams& params) {
  const int64_t vocab_shard = params.vocab_shard;
  if (vocab_shard <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LmHeadSummary: vocab_shard must be > 0, got ", vocab_shard));
  }
  if (params.rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LmHeadSummary: rows must be >= 0, got ", params.rows));
  }
  if (params.vocab_begin < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LmHeadSummary: vocab_begin must be >= 0, got ", params.vocab_begin));
  }
  if (params.vocab_begin + vocab_shard - 1 > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("LmHeadSummary: vocab_begin + vocab_shard must fit int32 token ids, got ",
                     params.vocab_begin, " + ", vocab_shard));
  }
  if (!std::isfinite(params.temperature) || params.temperature < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LmHeadSummary: temperature must be finite and >= 0, got ", params.temperature));
  }
  if (params.num_candidates < 0 || params.num_candidates > kMaxSummaryCandidates) {
    return absl::InvalidArgumentError(absl::StrCat("LmHeadSummary: num_candidates must be in 0..",
                                                   kMaxSummaryCandidates, ", got ",
                                                   params.num_candidates));
  }
  if (params.rows == 0) return absl::OkStatus();
  if (params.logits == nullptr) return absl::InvalidArgumentError("LmHeadSummary: logits is null");
  if (params.out == nullptr) return absl::InvalidArgumentError("LmHeadSummary: out is null");
  const bool sampling = params.temperature > 0.0f;
  if (sampling && params.positions == nullptr) {
    return absl::InvalidArgumentError(
        "LmHeadSummary: positions is null but temperature > 0 needs them");
  }
  if (params.num_candidates > 0 && params.candidates == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("LmHeadSummary: candidates is null but ",
                                                   params.num_candidates, " are requested"));
  }

  const int64_t rows = params.rows;
  const double temperature = params.temperature;
  const int32_t k = params.num_candidates;
  const bool parallel = rows > 1 && rows * vocab_shard >= (int64_t{1} << 14);
#pragma omp parallel if (parallel)
  {
    std::vector<Candidate> heap;
    if (k > 0) heap.reserve(k);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* logits = params.logits + r * vocab_shard;
      // Strictly greater keeps the smallest column among equal maxima.
      float max_logit = logits[0];
      int64_t argmax = 0;
      for (int64_t v = 1; v < vocab_shard; ++v) {
        if (logits[v] > max_logit) {
          max_logit = logits[v];
          argmax = v;
        }
      }
      NodeSummary summary;
      summary.max_logit = max_logit;
      summary.argmax = static_cast<int32_t>(params.vocab_begin + argmax);
      summary.log_sum_exp = LogSumExp(logits, vocab_shard, max_logit, 1.0);

      if (sampling) {
        const int64_t position = params.positions[r];
        // Columns in increasing order with a strictly greater score: the smallest id wins ties.
        // A column that cannot reach the best score even with the largest noise is skipped; its
        // score would lose the comparison anyway, so the winner is unchanged.
        int64_t best = 0;
        double best_score = GumbelMaxScore(logits[0], params.temperature, params.seed, position,
                                           params.vocab_begin);
        for (int64_t v = 1; v < vocab_shard; ++v) {
          if (static_cast<double>(logits[v]) / temperature + kGumbelNoiseBound < best_score) {
            continue;
          }
          const double score = GumbelMaxScore(logits[v], params.temperature, params.seed, position,
                                              static_cast<int32_t>(params.vocab_begin + v));
          if (score > best_score) {
            best_score = score;
            best = v;
          }
        }
        summary.sampled_token = static_cast<int32_t>(params.vocab_begin + best);
        summary.sampled_logit = logits[best];
        summary.sampled_score = best_score;
        summary.log_sum_exp_at_temperature = LogSumExp(logits, vocab_shard, max_logit, temperature);
      }
      params.out[r] = summary;
      if (k > 0) {
        TopCandidates(logits, vocab_shard, params.vocab_begin, k, heap,
                      params.candidates + r * int64_t{k});
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
