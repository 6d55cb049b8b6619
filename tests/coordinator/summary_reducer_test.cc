#include "treeverify/coordinator/summary_reducer.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "treeverify/kernels/lm_head_summary.h"

namespace treeverify::coordinator {
namespace {

using kernels::NodeSummary;

// Summary of a full logit vector, computed directly in double.
NodeSummary Direct(const std::vector<float>& logits) {
  NodeSummary s{logits[0], 0, 0.0f};
  for (size_t v = 1; v < logits.size(); ++v) {
    if (logits[v] > s.max_logit) s = {logits[v], static_cast<int32_t>(v), 0.0f};
  }
  double sum = 0.0;
  for (float l : logits) sum += std::exp(double{l} - s.max_logit);
  s.log_sum_exp = static_cast<float>(s.max_logit + std::log(sum));
  return s;
}

TEST(SummaryReducerTest, ShardsReduceToTheFullDistribution) {
  const unsigned seed = 20261129;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> logit(0.0f, 6.0f);
  for (int world : {1, 2, 3, 4, 7}) {
    const int vocab = 733;
    std::vector<float> logits(vocab);
    for (float& l : logits) l = logit(rng);
    std::vector<NodeSummary> shards;
    for (int r = 0; r < world; ++r) {
      const int begin = vocab * r / world;
      const int end = vocab * (r + 1) / world;
      std::vector<float> slice(logits.begin() + begin, logits.begin() + end);
      NodeSummary s = Direct(slice);
      s.argmax += begin;
      shards.push_back(s);
    }
    const NodeSummary expected = Direct(logits);
    const NodeSummary reduced = ReduceSummaries(shards);
    EXPECT_EQ(reduced.argmax, expected.argmax) << "world " << world;
    EXPECT_EQ(reduced.max_logit, expected.max_logit) << "world " << world;
    EXPECT_NEAR(reduced.log_sum_exp, expected.log_sum_exp, 1e-5) << "world " << world;
  }
}

TEST(SummaryReducerTest, TiesGoToTheSmallestTokenId) {
  const NodeSummary reduced = ReduceSummaries({{3.0f, 900, 4.0f}, {3.0f, 12, 4.0f}});
  EXPECT_EQ(reduced.argmax, 12);
  EXPECT_NEAR(reduced.log_sum_exp, 4.0f + std::log(2.0f), 1e-6);
}

TEST(SummaryReducerTest, EmptyInputHasNoArgmax) { EXPECT_EQ(ReduceSummaries({}).argmax, -1); }

}  // namespace
}  // namespace treeverify::coordinator
