// Per-node summary of one vocabulary shard's logits: max logit, its token id, and the
// log-sum-exp. Summaries of all shards reduce exactly to the full distribution's (max over
// shards; log-sum-exp of log-sum-exps), so ranks never ship full logits.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

struct NodeSummary {
  float max_logit = 0.0f;
  int32_t argmax = -1;  // global token id; the smallest id among equal maxima
  float log_sum_exp = 0.0f;
};

struct LmHeadSummaryParams {
  const float* logits = nullptr;  // [rows, vocab_shard]
  NodeSummary* out = nullptr;     // [rows]
  int64_t rows = 0;
  int64_t vocab_shard = 0;
  int32_t vocab_begin = 0;  // global id of the shard's first column
};

namespace cpu {
absl::Status LmHeadSummary(const LmHeadSummaryParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
