// The CPU backend against Hugging Face transformers: fixtures in tests/golden/ were made by
// tools/make_golden_fixtures.py (see tests/golden/README.md) from tiny random DeepSeek-V3,
// Kimi-K2 and DeepSeek-V2-Lite checkpoints. By teacher forcing (the reference's own tokens are
// fed), the log-softmax at every position must be within 2e-3 of the reference, and the argmax
// must agree wherever the reference's top-1/top-2 margin exceeds that tolerance. Greedy decoding
// from the prompt must reproduce the reference continuation.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "golden_fixture.h"
#include "gtest/gtest.h"
#include "treeverify/tools/local_model.h"

namespace treeverify::worker {
namespace {

constexpr double kTolerance = 2e-3;

class GoldenTest : public testing::TestWithParam<GoldenParam> {};

TEST_P(GoldenTest, MatchesTransformersByTeacherForcing) {
  const auto [model_name, world_size] = GetParam();
  const std::string dir = GoldenDir(model_name);
  tools::LocalModelOptions options;
  options.world_size = world_size;
  options.kv_page_size = 16;
  auto model = tools::LocalModel::Create(dir, options);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->config().vocab_size;
  const std::vector<GoldenPrompt> prompts = LoadGolden(dir, vocab);
  ASSERT_EQ(prompts.size(), 2u);

  for (size_t p = 0; p < prompts.size(); ++p) {
    const GoldenPrompt& golden = prompts[p];
    const int32_t length = static_cast<int32_t>(golden.tokens.size());
    auto results = (*model)->Forward(TeacherForcedRequest(golden, 100 + p));
    ASSERT_TRUE(results.ok()) << results.status();
    const tools::LocalSegmentResult& result = (*results)[0];
    ASSERT_TRUE(result.status.ok()) << result.status;

    double worst = 0.0;
    int compared_argmax = 0;
    for (int32_t t = 0; t < length; ++t) {
      const float* logits = result.logits.data() + int64_t{t} * vocab;
      const float* expected = golden.log_softmax.data() + int64_t{t} * vocab;
      double max_logit = logits[0];
      for (int64_t v = 1; v < vocab; ++v) max_logit = std::max<double>(max_logit, logits[v]);
      double sum = 0.0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(logits[v] - max_logit);
      const double lse = max_logit + std::log(sum);
      int64_t argmax = 0, ref_argmax = 0;
      float ref_top1 = -INFINITY, ref_top2 = -INFINITY;
      for (int64_t v = 0; v < vocab; ++v) {
        const double diff = std::abs((logits[v] - lse) - expected[v]);
        worst = std::max(worst, diff);
        ASSERT_LE(diff, kTolerance) << "prompt " << p << " position " << t << " token " << v;
        if (logits[v] > logits[argmax]) argmax = v;
        if (expected[v] > ref_top1) {
          ref_top2 = ref_top1;
          ref_top1 = expected[v];
          ref_argmax = v;
        } else if (expected[v] > ref_top2) {
          ref_top2 = expected[v];
        }
      }
      if (ref_top1 - ref_top2 > kTolerance) {
        ++compared_argmax;
        EXPECT_EQ(argmax, ref_argmax) << "prompt " << p << " position " << t;
      }
      // The reduced summary agrees with the full logits.
      EXPECT_EQ(result.summaries[t].argmax, argmax);
    }
    std::cout << model_name << " tp=" << world_size << " prompt " << p << ": " << length
              << " positions, max |log-softmax diff| = " << worst << ", argmax compared at "
              << compared_argmax << "\n";
  }
}

TEST_P(GoldenTest, GreedyDecodingReproducesTheContinuation) {
  const auto [model_name, world_size] = GetParam();
  const std::string dir = GoldenDir(model_name);
  tools::LocalModelOptions options;
  options.world_size = world_size;
  options.kv_page_size = 16;
  options.prefill_chunk = 5;  // several chunks, so chunked prefill is exercised too
  auto model = tools::LocalModel::Create(dir, options);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<GoldenPrompt> prompts = LoadGolden(dir, (*model)->config().vocab_size);
  for (size_t p = 0; p < prompts.size(); ++p) {
    const GoldenPrompt& golden = prompts[p];
    const std::vector<int32_t> prompt(golden.tokens.begin(),
                                      golden.tokens.begin() + golden.prompt_length);
    const std::vector<int32_t> continuation(golden.tokens.begin() + golden.prompt_length,
                                            golden.tokens.end());
    auto generation =
        (*model)->GenerateGreedy(200 + p, prompt, static_cast<int>(continuation.size()));
    ASSERT_TRUE(generation.ok()) << generation.status();
    EXPECT_EQ(generation->tokens, continuation) << "prompt " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, EveryGoldenFixtureAtTp1And2(), GoldenParamName);

}  // namespace
}  // namespace treeverify::worker
