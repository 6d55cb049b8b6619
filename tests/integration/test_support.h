// What the integration tests share: a gtest fixture that owns the replicas a test starts (their
// logs printed if the test failed, every process killed in TearDown), prompts, the drafting loop
// against a replica, and in-process reference computations (tools::LocalModel) to hold the
// service's answers against.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "replica.h"
#include "treeverify/coordinator/verifier_api.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/tools/speculative_generate.h"

namespace treeverify::integration {

class ReplicaTest : public testing::Test {
 protected:
  // Starts a replica owned by the fixture; nullptr (with a test failure carrying the processes'
  // stderr) if it does not come up. Use as: ASSERT_NE(replica = StartReplica(...), nullptr).
  Replica* StartReplica(const ReplicaOptions& options);
  // Prints every replica's logs if the test failed, then kills and reaps every process.
  void TearDown() override;

  std::vector<std::unique_ptr<Replica>> replicas_;
};

// `count` prompts of 2..6 random tokens in [2, vocab) repeated 1..4 times, so that the ngram
// drafter finds matches (tokens 0 and 1, BOS and EOS of the test models, are left out).
std::vector<std::vector<int32_t>> RepetitivePrompts(int count, int64_t vocab_size, unsigned seed);

struct GenerateSpec {
  std::string drafter = "none";
  std::vector<int32_t> oracle;  // noisy-oracle: prompt + the plain run's tokens
  double oracle_acceptance = 0.8;
  coordinator::SamplingParams sampling;
  int max_new_tokens = 16;
  bool ignore_eos = true;
  int tree_nodes = 12;
  uint64_t drafter_seed = 5;
};

// tools::SpeculativeGenerate against `api` with the named drafter (max_new_tokens tokens, the
// first pending token included).
absl::StatusOr<tools::GenerateResult> Generate(coordinator::VerifierApi& api, int64_t vocab_size,
                                               const std::vector<int32_t>& prompt,
                                               const GenerateSpec& spec);

// The prompt followed by a run's tokens: what the noisy-oracle drafter needs.
std::vector<int32_t> Concat(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

// One forward of `tokens` as a chain (a fresh sequence, released afterwards) on an in-process
// model: per position, the reduced summary, and the full logits / hidden states if asked.
absl::StatusOr<tools::LocalSegmentResult> ForwardChain(tools::LocalModel& model,
                                                       const std::vector<int32_t>& tokens,
                                                       bool return_logits,
                                                       const std::vector<int32_t>& hidden_layers);

// Top-1 minus top-2 of one row of logits (the log-prob margin: log-softmax shifts both alike).
float TopTwoMargin(const float* logits, int64_t vocab_size);
// Rank of `token` in a row of logits (0: the largest; ties count against the token).
int64_t RankOf(const float* logits, int64_t vocab_size, int32_t token);

// A float rounded to bfloat16 (nearest even) and back: what the wire carries for hidden states.
float RoundToBf16(float value);

}  // namespace treeverify::integration
