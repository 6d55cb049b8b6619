#include "treeverify/coordinator/summary_reducer.h"

#include <cmath>
#include <limits>

namespace treeverify::coordinator {

kernels::NodeSummary ReduceSummaries(absl::Span<const kernels::NodeSummary> shards) {
  kernels::NodeSummary full;
  if (shards.empty()) return full;
  full = shards[0];
  // Only the greedy fields reduce here; sampling winners go through SelectToken.
  full.sampled_token = -1;
  full.sampled_logit = 0.0f;
  full.sampled_score = -std::numeric_limits<double>::infinity();
  full.log_sum_exp_at_temperature = 0.0f;
  for (size_t r = 1; r < shards.size(); ++r) {
    const kernels::NodeSummary& s = shards[r];
    if (s.max_logit > full.max_logit || (s.max_logit == full.max_logit && s.argmax < full.argmax)) {
      full.max_logit = s.max_logit;
      full.argmax = s.argmax;
    }
  }
  // log(sum_r exp(lse_r)) = m + log(sum_r exp(lse_r - m)), m = max_r lse_r; in double, rank order.
  double max_lse = shards[0].log_sum_exp;
  for (const kernels::NodeSummary& s : shards) max_lse = std::max<double>(max_lse, s.log_sum_exp);
  double sum = 0.0;
  for (const kernels::NodeSummary& s : shards) sum += std::exp(s.log_sum_exp - max_lse);
  full.log_sum_exp = static_cast<float>(max_lse + std::log(sum));
  return full;
}

}  // namespace treeverify::coordinator
