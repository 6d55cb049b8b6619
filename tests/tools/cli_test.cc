// treeverify-cli as a user runs it: make-checkpoint, then generate --json, whose tokens must be
// the in-process model's greedy continuation.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "treeverify/tools/local_model.h"

namespace treeverify::tools {
namespace {

std::string RunCommand(const std::string& command) {
  std::string output;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return output;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
  EXPECT_EQ(::pclose(pipe), 0) << command << "\n" << output;
  return output;
}

TEST(CliTest, GenerateJsonIsTheGreedyContinuation) {
  const std::string dir = testing::TempDir() + "/cli_test_" + std::to_string(::getpid());
  RunCommand(std::string(TREEVERIFY_CLI) + " make-checkpoint --out " + dir +
             " --preset tiny-v3 --seed 3");
  for (int tp : {1, 2}) {
    const std::string output = RunCommand(
        std::string(TREEVERIFY_CLI) + " generate --model " + dir +
        " --prompt-ids 4,8,15,16,23,42 --max-new-tokens 12 --json --tp " + std::to_string(tp));
    const nlohmann::json json = nlohmann::json::parse(output);
    const std::vector<int32_t> tokens = json.at("tokens").get<std::vector<int32_t>>();
    const std::vector<float> logprobs = json.at("logprobs").get<std::vector<float>>();

    auto model = LocalModel::Create(dir, {.world_size = tp});
    ASSERT_TRUE(model.ok()) << model.status();
    auto expected = (*model)->GenerateGreedy(1, {4, 8, 15, 16, 23, 42}, 12);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(tokens, expected->tokens) << "tp " << tp;
    ASSERT_EQ(logprobs.size(), expected->logprobs.size());
    for (size_t i = 0; i < logprobs.size(); ++i) {
      EXPECT_NEAR(logprobs[i], expected->logprobs[i], 1e-6) << "token " << i;
      EXPECT_LE(logprobs[i], 0.0f);
    }
  }
}

TEST(CliTest, BadFlagsFailWithAMessage) {
  FILE* pipe =
      ::popen((std::string(TREEVERIFY_CLI) + " generate --model /nonexistent --prompt-ids 1,x 2>&1")
                  .c_str(),
              "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
  EXPECT_NE(::pclose(pipe), 0);
  EXPECT_NE(output.find("'x' is not an integer"), std::string::npos) << output;
}

}  // namespace
}  // namespace treeverify::tools
