// The golden fixtures (tests/golden/, made by Hugging Face transformers) through the full service
// at TP 2: the greedy continuation of each reference prompt equals the reference's, token for
// token, with plain decoding and with drafts. The fixtures' top-1/top-2 margins are at least 0.1
// at every position, far above the numerical differences between backends, so the margin rule
// demands exact equality here.
#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "test_support.h"
#include "treeverify/tools/drafters.h"

namespace treeverify::integration {
namespace {

struct GoldenPrompt {
  std::vector<int32_t> prompt;
  std::vector<int32_t> continuation;
};

std::vector<GoldenPrompt> ReadReference(const std::string& dir) {
  std::ifstream in(dir + "/reference.json");
  EXPECT_TRUE(in.good()) << "cannot read " << dir << "/reference.json";
  if (!in.good()) return {};
  const nlohmann::json reference = nlohmann::json::parse(in);
  std::vector<GoldenPrompt> prompts;
  for (const nlohmann::json& p : reference.at("prompts")) {
    const auto tokens = p.at("tokens").get<std::vector<int32_t>>();
    const size_t length = p.at("prompt_length").get<size_t>();
    EXPECT_FALSE(p.at("continuation_contains_eos").get<bool>());
    prompts.push_back(
        {.prompt = std::vector<int32_t>(tokens.begin(), tokens.begin() + length),
         .continuation = std::vector<int32_t>(tokens.begin() + length, tokens.end())});
  }
  return prompts;
}

class GoldenServiceTest : public ReplicaTest {
 protected:
  void ExpectReferenceContinuations(const std::string& fixture) {
    const std::string dir = GoldenModelDir(fixture);
    const std::vector<GoldenPrompt> prompts = ReadReference(dir);
    ASSERT_EQ(prompts.size(), 2u);
    Replica* replica = StartReplica({.world_size = 2, .model_dir = dir});
    ASSERT_NE(replica, nullptr);
    absl::StatusOr<coordinator::ModelInfo> info = replica->client().GetModelInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    for (size_t p = 0; p < prompts.size(); ++p) {
      const GoldenPrompt& golden = prompts[p];
      for (const std::string drafter : {"none", "ngram", "noisy-oracle"}) {
        SCOPED_TRACE(testing::Message() << fixture << " prompt " << p << " drafter " << drafter);
        // EOS is honoured (not ignored): the reference continuation has none, so the session
        // must run to max_new_tokens.
        absl::StatusOr<tools::GenerateResult> run =
            Generate(replica->client(), info->vocab_size, golden.prompt,
                     {.drafter = drafter,
                      .oracle = Concat(golden.prompt, golden.continuation),
                      .max_new_tokens = static_cast<int>(golden.continuation.size()),
                      .ignore_eos = false});
        ASSERT_TRUE(run.ok()) << run.status();
        EXPECT_EQ(run->tokens, golden.continuation);
        EXPECT_EQ(run->finish_reason, coordinator::FinishReason::kMaxNewTokens);
      }
    }
  }
};

TEST_F(GoldenServiceTest, DeepseekV3TinyGivesTheReferenceContinuation) {
  ExpectReferenceContinuations("deepseek_v3_tiny");
}
TEST_F(GoldenServiceTest, KimiK2TinyGivesTheReferenceContinuation) {
  ExpectReferenceContinuations("kimi_k2_tiny");
}
TEST_F(GoldenServiceTest, DeepseekV2LiteTinyGivesTheReferenceContinuation) {
  ExpectReferenceContinuations("deepseek_v2_lite_tiny");
}

}  // namespace
}  // namespace treeverify::integration
