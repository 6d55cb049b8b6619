// The margin rule (DESIGN.md, Numerics) for the GPU backend, whose bf16 weights and activations
// round differently from the fp32 CPU backend and from transformers in fp32: a row of logits
// agrees with its reference when the log-probs of likely tokens are within kLogProbTolerance, the
// tail's within kTailRelativeTolerance relative, and its argmax is the reference's wherever the
// reference's top-1/top-2 margin exceeds twice the tolerance.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace treeverify::worker {

// The margin rule's tolerance on log-probabilities that matter (tokens the reference gives at
// least e^-10), set from measured errors of bf16 weights and activations against fp32: on the H200
// (2026-11-30) the largest differences over 157 rows per model were 0.15-0.19 nats, and 1.4-1.6 %
// relative for rarer tokens, whose large negative log-probs round in proportion to their size.
// Tree and chain on the GPU agreed exactly. The bounds leave 1.5-2x room.
constexpr double kLogProbTolerance = 0.3;
constexpr double kLikelyLogProb = -10.0;
constexpr double kTailRelativeTolerance = 0.03;

// Log-softmax of one row, in double.
inline std::vector<double> LogSoftmax(const float* logits, int64_t vocab) {
  const double max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(logits[v] - max_logit);
  const double lse = max_logit + std::log(sum);
  std::vector<double> out(vocab);
  for (int64_t v = 0; v < vocab; ++v) out[v] = logits[v] - lse;
  return out;
}

struct Agreement {
  double worst = 0.0;       // largest |log-softmax difference| where the reference's is >= -10
  double worst_tail = 0.0;  // largest relative difference below that
  int rows = 0;
  int argmax_compared = 0;
  std::vector<std::string> disagreeing;  // rows outside the bounds, with the first reason
};

// The margin rule on [rows, vocab] logits, GPU against a reference (logits or log-probs): a row
// agrees when its likely tokens' log-probs are within kLogProbTolerance, the rest within
// kTailRelativeTolerance, and its argmax is the reference's wherever the reference's top-1/top-2
// margin exceeds twice the tolerance.
inline void CompareRows(const std::vector<float>& gpu, const std::vector<float>& reference,
                        int64_t vocab, const std::string& what, Agreement& agreement) {
  ASSERT_EQ(gpu.size(), reference.size()) << what;
  const int64_t rows = static_cast<int64_t>(reference.size()) / vocab;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> expected = LogSoftmax(reference.data() + r * vocab, vocab);
    const std::vector<double> actual = LogSoftmax(gpu.data() + r * vocab, vocab);
    std::string reason;
    for (int64_t v = 0; v < vocab; ++v) {
      const double diff = std::abs(actual[v] - expected[v]);
      const bool likely = expected[v] >= kLikelyLogProb;
      const double measure = likely ? diff : diff / std::abs(expected[v]);
      double& worst = likely ? agreement.worst : agreement.worst_tail;
      worst = std::max(worst, measure);
      if (reason.empty() && measure > (likely ? kLogProbTolerance : kTailRelativeTolerance)) {
        reason = "token " + std::to_string(v) + ": log-prob " + std::to_string(actual[v]) +
                 ", reference " + std::to_string(expected[v]);
      }
    }
    std::vector<double> sorted = expected;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] > 2 * kLogProbTolerance) {
      ++agreement.argmax_compared;
      const auto argmax = std::max_element(actual.begin(), actual.end()) - actual.begin();
      const auto expected_argmax =
          std::max_element(expected.begin(), expected.end()) - expected.begin();
      if (reason.empty() && argmax != expected_argmax) {
        reason =
            "argmax " + std::to_string(argmax) + ", reference " + std::to_string(expected_argmax);
      }
    }
    if (!reason.empty()) {
      agreement.disagreeing.push_back(what + ", row " + std::to_string(r) + ": " + reason);
    }
    ++agreement.rows;
  }
}

}  // namespace treeverify::worker
