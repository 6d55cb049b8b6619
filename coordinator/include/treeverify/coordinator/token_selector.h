// Picks the target model's token for one tree node from the ranks' vocabulary-shard summaries:
// greedy (temperature 0), exact Gumbel-max sampling, or sampling restricted by top-k / top-p.
//
// The token sampled at absolute position p is argmax_v (logit_v / T + GumbelNoise(seed, p, v))
// over the allowed tokens (kernels/philox.h). Unrestricted, each rank already took that max over
// its shard and the selector only compares the shard winners; restricted, it merges the ranks'
// top candidates, cuts them to top-k and the top-p nucleus, and draws the same noise the ranks
// would have drawn. So the result does not depend on the number of ranks, and top-k = vocab
// equals unrestricted sampling exactly.
//
//   SamplingParams params{.temperature = 0.7f, .seed = session_seed, .top_p = 0.9f};
//   // Ranks run with SegmentSampling{.candidates = CandidatesPerShard(params)}.
//   std::vector<ShardNode> shards = {{&rank0[i], rank0_candidates_of_i},
//                                    {&rank1[i], rank1_candidates_of_i}};
//   TV_ASSIGN_OR_RETURN(SelectedToken t, SelectToken(shards, params, node_position + 1));
//
// top-p is exact when its nucleus lies inside the prefix of the merged candidates known to be the
// true top tokens of the whole vocabulary (at least the K = CandidatesPerShard candidates of one
// rank); beyond that the nucleus is truncated to that prefix.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "treeverify/kernels/lm_head_summary.h"

namespace treeverify::coordinator {

// The most candidates a rank sends per node for top-k / top-p.
inline constexpr int32_t kMaxCandidatesPerShard = 64;

struct SamplingParams {
  float temperature = 0;  // 0: greedy
  uint64_t seed = 0;
  int32_t top_k = 0;  // 0: no top-k
  float top_p = 0;    // 0 or 1: no top-p
};

// One rank's view of one node.
struct ShardNode {
  const kernels::NodeSummary* summary;
  absl::Span<const kernels::Candidate> candidates;  // [CandidatesPerShard(params)]
};

struct SelectedToken {
  int32_t token = -1;
  float logprob = 0;  // logprob at temperature 1
};

// shards[r] is rank r's summary (and candidates) of the same node; `position` is the absolute
// position of the token being chosen (the node's position + 1). INVALID_ARGUMENT for bad
// params, missing sampled fields or candidates, or a top_k the candidates cannot serve exactly
// (larger than the merged candidates, or than the list of a rank that may hold more tokens).
absl::StatusOr<SelectedToken> SelectToken(absl::Span<const ShardNode> shards,
                                          const SamplingParams& params, int64_t position);

// What the ranks must send per node: 0 unless sampling is restricted by top_k or top_p; then
// top_k (64 for top-p alone), at most kMaxCandidatesPerShard.
int32_t CandidatesPerShard(const SamplingParams& params);

}  // namespace treeverify::coordinator
