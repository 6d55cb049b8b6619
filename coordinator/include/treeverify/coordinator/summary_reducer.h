// Reduces the ranks' per-node vocabulary-shard summaries to the summary of the full
// distribution: the max logit and its token over all shards (the smallest token id on ties), and
// the log-sum-exp of the shards' log-sum-exps. Exact up to rounding, in rank order. The sampling
// fields are left empty: sampled tokens are chosen by SelectToken (token_selector.h).
//
//   kernels::NodeSummary full = ReduceSummaries({rank0[i], rank1[i]});
//   float logprob_of_argmax = full.max_logit - full.log_sum_exp;
#pragma once

#include "absl/types/span.h"
#include "treeverify/kernels/lm_head_summary.h"

namespace treeverify::coordinator {

// shards[r] is rank r's summary of the same node. An empty span gives an empty summary
// (argmax -1).
kernels::NodeSummary ReduceSummaries(absl::Span<const kernels::NodeSummary> shards);

}  // namespace treeverify::coordinator
