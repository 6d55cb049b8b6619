// CPU summary of one vocabulary shard's logits per row: max, argmax and log-sum-exp.
//
// The exponentials are summed in double in column order, so a row's summary depends only on its
// logits. Roofline: reads 4 * vocab_shard bytes per row and does one exp per logit; at DeepSeek's
// 129280-column vocabulary the exps dominate.
#include "treeverify/kernels/lm_head_summary.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::kernels::cpu {

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
  if (params.rows == 0) return absl::OkStatus();
  if (params.logits == nullptr) return absl::InvalidArgumentError("LmHeadSummary: logits is null");
  if (params.out == nullptr) return absl::InvalidArgumentError("LmHeadSummary: out is null");

  const int64_t rows = params.rows;
  const bool parallel = rows > 1 && rows * vocab_shard >= (int64_t{1} << 14);
#pragma omp parallel for schedule(static) if (parallel)
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
    float log_sum_exp = max_logit;  // +-inf (all masked, or an infinite logit) stays as is
    if (std::isfinite(max_logit)) {
      const double shift = max_logit;
      double sum = 0.0;
      for (int64_t v = 0; v < vocab_shard; ++v)
        sum += std::exp(static_cast<double>(logits[v]) - shift);
      log_sum_exp = static_cast<float>(shift + std::log(sum));
    }
    NodeSummary& summary = params.out[r];
    summary.max_logit = max_logit;
    summary.argmax = static_cast<int32_t>(params.vocab_begin + argmax);
    summary.log_sum_exp = log_sum_exp;
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
