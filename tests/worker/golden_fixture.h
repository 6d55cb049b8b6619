// The Hugging Face golden fixtures of tests/golden/ (see its README.md): per model, two prompts
// with their greedy continuations and transformers' fp32 log-softmax at every position.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "treeverify/worker/model_runner.h"
#include "treeverify/worker/safetensors.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::worker {

// Under the source tree, or under $TREEVERIFY_SOURCE_DIR where a bundle of the tests was copied
// to another machine (scripts/gpu-check.sh).
inline std::string GoldenDir(const std::string& model_name) {
  const char* moved = std::getenv("TREEVERIFY_SOURCE_DIR");
  const std::string root = moved != nullptr && moved[0] != '\0' ? moved : TREEVERIFY_SOURCE_DIR;
  return root + "/tests/golden/" + model_name;
}

struct GoldenPrompt {
  int prompt_length = 0;
  std::vector<int32_t> tokens;     // prompt + reference continuation
  std::vector<float> log_softmax;  // [tokens, vocab]
};

inline std::vector<GoldenPrompt> LoadGolden(const std::string& dir, int64_t vocab) {
  std::ifstream json_file(dir + "/reference.json");
  std::stringstream text;
  text << json_file.rdbuf();
  const nlohmann::json reference = nlohmann::json::parse(text.str());
  auto file = SafetensorsFile::Open(dir + "/reference.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  std::vector<GoldenPrompt> prompts;
  if (!file.ok()) return prompts;
  for (size_t p = 0; p < reference["prompts"].size(); ++p) {
    GoldenPrompt prompt;
    prompt.prompt_length = reference["prompts"][p]["prompt_length"].get<int>();
    prompt.tokens = reference["prompts"][p]["tokens"].get<std::vector<int32_t>>();
    const std::string name = "prompt" + std::to_string(p) + ".log_softmax";
    const TensorInfo& info = (*file)->tensors().at(name);
    EXPECT_EQ(info.dtype, DType::kF32);
    EXPECT_EQ(info.shape,
              (std::vector<int64_t>{static_cast<int64_t>(prompt.tokens.size()), vocab}));
    auto data = (*file)->Data(name);
    EXPECT_TRUE(data.ok());
    prompt.log_softmax.resize(prompt.tokens.size() * vocab);
    std::memcpy(prompt.log_softmax.data(), *data, prompt.log_softmax.size() * sizeof(float));
    prompts.push_back(std::move(prompt));
  }
  return prompts;
}

// The whole prompt and its continuation as one chain with logits returned: the request that
// teacher-forces the reference's tokens.
inline ForwardRequest TeacherForcedRequest(const GoldenPrompt& golden, uint64_t sequence_id) {
  ForwardRequest request;
  request.return_logits = true;
  request.segments.push_back(
      {.sequence_id = sequence_id,
       .token_ids = golden.tokens,
       .parents = SegmentTree::ChainParents(static_cast<int32_t>(golden.tokens.size()))});
  return request;
}

// The parameters of a test over every fixture at TP 1 and 2, and their names ("kimi_k2_tiny_tp2").
using GoldenParam = std::tuple<std::string, int>;
inline auto EveryGoldenFixtureAtTp1And2() {
  return testing::Combine(
      testing::Values("deepseek_v3_tiny", "kimi_k2_tiny", "deepseek_v2_lite_tiny"),
      testing::Values(1, 2));
}
inline std::string GoldenParamName(const testing::TestParamInfo<GoldenParam>& info) {
  return std::get<0>(info.param) + "_tp" + std::to_string(std::get<1>(info.param));
}

}  // namespace treeverify::worker
