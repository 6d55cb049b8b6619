#include "treeverify/coordinator/token_selector.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "treeverify/coordinator/summary_reducer.h"
#include "treeverify/kernels/philox.h"
#include "treeverify/kernels/status.h"

namespace treeverify::coordinator {
namespace {

using kernels::Candidate;
using kernels::NodeSummary;

// Candidate order, as the ranks list them: larger logit first, then smaller id.
bool Better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.token_id < b.token_id);
}

bool UsesTopP(const SamplingParams& params) { return params.top_p > 0.0f && params.top_p < 1.0f; }

bool Restricted(const SamplingParams& params) { return params.top_k > 0 || UsesTopP(params); }

absl::Status ValidateParams(const SamplingParams& params) {
  if (!std::isfinite(params.temperature) || params.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and >= 0, got ", params.temperature));
  }
  if (params.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", params.top_k));
  }
  if (!(params.top_p >= 0.0f && params.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in [0, 1], got ", params.top_p));
  }
  return absl::OkStatus();
}

// log sum_r exp(values[r]) in double, in rank order; -inf when every value is -inf.
double LogSumExp(const std::vector<double>& values) {
  double max_value = -std::numeric_limits<double>::infinity();
  for (double v : values) max_value = std::max(max_value, v);
  if (!std::isfinite(max_value)) return max_value;
  double sum = 0.0;
  for (double v : values) sum += std::exp(v - max_value);
  return max_value + std::log(sum);
}

// The merged candidates of all ranks, best first, and how many of them are known to be the true
// top tokens of the whole vocabulary. A rank whose list is padded sent its whole shard; a rank
// whose list is full may hold more tokens, each worse than its last candidate, so merged entries
// below the best of those last candidates may be missing tokens ahead of them.
struct MergedCandidates {
  std::vector<Candidate> sorted;
  size_t exact = 0;
};

absl::StatusOr<MergedCandidates> MergeCandidates(absl::Span<const ShardNode> shards,
                                                 int32_t top_k) {
  MergedCandidates merged;
  std::optional<Candidate> cutoff;
  for (size_t r = 0; r < shards.size(); ++r) {
    const absl::Span<const Candidate> list = shards[r].candidates;
    if (list.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", r, " sent no candidates; top-k / top-p need CandidatesPerShard per node"));
    }
    const bool whole_shard = list.back().token_id < 0;
    if (!whole_shard) {
      if (top_k > static_cast<int64_t>(list.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("top_k ", top_k, " exceeds the ", list.size(), " candidates of rank ", r,
                         ", which may hold more tokens; top_k is served exactly up to ",
                         kMaxCandidatesPerShard));
      }
      if (!cutoff || Better(list.back(), *cutoff)) cutoff = list.back();
    }
    for (const Candidate& c : list) {
      if (c.token_id >= 0) merged.sorted.push_back(c);
    }
  }
  std::sort(merged.sorted.begin(), merged.sorted.end(), Better);
  merged.exact = merged.sorted.size();
  if (cutoff) {
    merged.exact = std::partition_point(merged.sorted.begin(), merged.sorted.end(),
                                        [&](const Candidate& c) { return !Better(*cutoff, c); }) -
                   merged.sorted.begin();
  }
  return merged;
}

}  // namespace

int32_t CandidatesPerShard(const SamplingParams& params) {
  if (params.temperature <= 0.0f || !Restricted(params)) return 0;
  if (params.top_k > 0) return std::min(params.top_k, kMaxCandidatesPerShard);
  return kMaxCandidatesPerShard;
}

absl::StatusOr<SelectedToken> SelectToken(absl::Span<const ShardNode> shards,
                                          const SamplingParams& params, int64_t position) {
  TV_RETURN_IF_ERROR(ValidateParams(params));
  if (shards.empty()) return absl::InvalidArgumentError("SelectToken needs at least one shard");
  std::vector<NodeSummary> summaries;
  summaries.reserve(shards.size());
  for (size_t r = 0; r < shards.size(); ++r) {
    if (shards[r].summary == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r, "'s summary is null"));
    }
    summaries.push_back(*shards[r].summary);
  }
  const NodeSummary full = ReduceSummaries(summaries);
  if (params.temperature == 0.0f) {
    return SelectedToken{.token = full.argmax, .logprob = full.max_logit - full.log_sum_exp};
  }
  for (size_t r = 0; r < summaries.size(); ++r) {
    if (summaries[r].sampled_token < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", r, " sent no sampled token: it ran without the session's temperature"));
    }
  }

  if (!Restricted(params)) {
    // Each rank's winner is the Gumbel-max over its shard; the max over ranks is the max over the
    // whole vocabulary.
    const NodeSummary* winner = &summaries[0];
    for (const NodeSummary& s : summaries) {
      if (s.sampled_score > winner->sampled_score ||
          (s.sampled_score == winner->sampled_score && s.sampled_token < winner->sampled_token)) {
        winner = &s;
      }
    }
    return SelectedToken{.token = winner->sampled_token,
                         .logprob = winner->sampled_logit - full.log_sum_exp};
  }

  TV_ASSIGN_OR_RETURN(MergedCandidates merged, MergeCandidates(shards, params.top_k));
  if (params.top_k > static_cast<int64_t>(merged.sorted.size())) {
    return absl::InvalidArgumentError(absl::StrCat("top_k ", params.top_k, " is larger than the ",
                                                   merged.sorted.size(),
                                                   " candidates of the whole vocabulary"));
  }
  if (merged.sorted.empty()) return absl::InvalidArgumentError("the ranks sent no candidates");
  // top_k <= every full rank list, so the first top_k merged entries are exact.
  size_t kept = params.top_k > 0 ? static_cast<size_t>(params.top_k) : merged.exact;
  if (UsesTopP(params)) {
    std::vector<double> shard_lse;
    for (const NodeSummary& s : summaries) shard_lse.push_back(s.log_sum_exp_at_temperature);
    const double lse_at_temperature = LogSumExp(shard_lse);
    const double temperature = params.temperature;
    double cumulative = 0.0;
    for (size_t i = 0; i < kept; ++i) {
      cumulative +=
          std::exp(static_cast<double>(merged.sorted[i].logit) / temperature - lse_at_temperature);
      if (cumulative >= params.top_p) {
        kept = i + 1;
        break;
      }
    }
  }
  const Candidate* winner = nullptr;
  double best_score = 0.0;
  for (size_t i = 0; i < kept; ++i) {
    const Candidate& c = merged.sorted[i];
    const double score =
        kernels::GumbelMaxScore(c.logit, params.temperature, params.seed, position, c.token_id);
    if (winner == nullptr || score > best_score ||
        (score == best_score && c.token_id < winner->token_id)) {
      winner = &c;
      best_score = score;
    }
  }
  return SelectedToken{.token = winner->token_id, .logprob = winner->logit - full.log_sum_exp};
}

}  // namespace treeverify::coordinator
