// Per-node summary of one vocabulary shard's logits: max logit, its token id, and the
// log-sum-exp. Summaries of all shards reduce exactly to the full distribution's (max over
// shards; log-sum-exp of log-sum-exps), so ranks never ship full logits.
//
// With a temperature T > 0 the summary also holds the shard's Gumbel-max sampling winner
// (philox.h): the token maximizing logit / T + GumbelNoise(seed, position, token). The winner
// over all shards is the shard winner with the largest score, an exact sample of the full
// softmax(logits / T). For top-k / top-p the shard also lists its K largest logits, which the
// coordinator merges.
//
//   LmHeadSummaryParams params{.logits = logits, .out = summaries, .rows = nodes,
//                              .vocab_shard = shard_size, .vocab_begin = shard_begin,
//                              .temperature = 0.8f, .seed = seed, .positions = positions};
//   TV_RETURN_IF_ERROR(cpu::LmHeadSummary(params));
#pragma once

#include <cstdint>
#include <limits>

#include "absl/status/status.h"

namespace treeverify::kernels {

// The most candidates a shard may list per row.
inline constexpr int32_t kMaxSummaryCandidates = 1024;

struct NodeSummary {
  float max_logit = 0.0f;
  int32_t argmax = -1;  // global token id; the smallest id among equal maxima
  float log_sum_exp = 0.0f;
  // Sampling (temperature > 0; otherwise these keep their defaults).
  int32_t sampled_token = -1;  // global id maximizing logit / T + noise; smallest id on ties
  float sampled_logit = 0.0f;  // its logit
  double sampled_score = -std::numeric_limits<double>::infinity();  // its logit / T + noise
  float log_sum_exp_at_temperature = 0.0f;  // log sum_v exp(logit_v / T) over the shard
};

struct Candidate {
  int32_t token_id;  // global id; -1 pads a list longer than the shard
  float logit;       // -inf for padding
};

struct LmHeadSummaryParams {
  const float* logits = nullptr;  // [rows, vocab_shard]
  NodeSummary* out = nullptr;     // [rows]
  int64_t rows = 0;
  int64_t vocab_shard = 0;
  int32_t vocab_begin = 0;  // global id of the shard's first column

  // Sampling: 0 = greedy only (no sampled fields); > 0 fills the sampled fields.
  float temperature = 0.0f;
  uint64_t seed = 0;
  const int64_t* positions = nullptr;  // [rows] absolute position of the token each row predicts

  // Top-K candidates (0 = none): the shard's largest logits, descending, ties by smaller id.
  int32_t num_candidates = 0;
  Candidate* candidates = nullptr;  // [rows, num_candidates]
};

namespace cpu {
absl::Status LmHeadSummary(const LmHeadSummaryParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
