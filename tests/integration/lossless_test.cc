// Lossless speculative decoding through the real processes: for every drafter, the tokens a
// replica emits equal plain decoding (empty trees) on the same replica, token for token, greedy
// at TP 1, 2 and 4 and with seeded sampling (also top-k / top-p) at TP 2. Across TP degrees the
// numbers differ in the last bits, so plain continuations are compared by teacher forcing with
// the margin rule of DESIGN.md against an in-process TP 1 model.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "test_support.h"
#include "treeverify/tools/drafters.h"

namespace treeverify::integration {
namespace {

using coordinator::SamplingParams;
using tools::GenerateResult;

constexpr int kNewTokens = 16;
// The margin rule's tolerance: token identity is required where the reference's top-1/top-2
// log-prob margin exceeds it; log-probs must agree within it everywhere.
constexpr float kMarginTolerance = 1e-3f;

int64_t VocabSize(Replica& replica) {
  absl::StatusOr<coordinator::ModelInfo> info = replica.client().GetModelInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->vocab_size : 0;
}

std::string Describe(const SamplingParams& s) {
  return absl::StrCat("temperature ", s.temperature, " seed ", s.seed, " top_k ", s.top_k,
                      " top_p ", s.top_p);
}

// Every drafter against plain decoding on one replica, for every prompt. Returns the plain runs.
std::vector<GenerateResult> ExpectEveryDrafterLossless(
    Replica& replica, const std::vector<std::vector<int32_t>>& prompts,
    const SamplingParams& sampling) {
  const int64_t vocab = VocabSize(replica);
  std::vector<GenerateResult> plain_runs;
  std::map<std::string, int64_t> accepted;
  for (size_t p = 0; p < prompts.size(); ++p) {
    SCOPED_TRACE(testing::Message() << "prompt " << p << " " << testing::PrintToString(prompts[p])
                                    << " sampling " << Describe(sampling));
    absl::StatusOr<GenerateResult> plain = Generate(
        replica.client(), vocab, prompts[p], {.sampling = sampling, .max_new_tokens = kNewTokens});
    EXPECT_TRUE(plain.ok()) << plain.status();
    if (!plain.ok()) return plain_runs;
    EXPECT_EQ(plain->tokens.size(), static_cast<size_t>(kNewTokens));
    EXPECT_EQ(plain->finish_reason, coordinator::FinishReason::kMaxNewTokens);
    plain_runs.push_back(*plain);
    for (const std::string& drafter : tools::DrafterNames()) {
      if (drafter == "none") continue;
      absl::StatusOr<GenerateResult> speculative =
          Generate(replica.client(), vocab, prompts[p],
                   {.drafter = drafter,
                    .oracle = Concat(prompts[p], plain->tokens),
                    .oracle_acceptance = 0.8,
                    .sampling = sampling,
                    .max_new_tokens = kNewTokens});
      EXPECT_TRUE(speculative.ok()) << drafter << ": " << speculative.status();
      if (!speculative.ok()) continue;
      EXPECT_EQ(speculative->tokens, plain->tokens) << "drafter " << drafter;
      // The CPU backend is batch invariant: a token's log-prob does not depend on the tree.
      EXPECT_EQ(speculative->logprobs, plain->logprobs) << "drafter " << drafter;
      accepted[drafter] += std::accumulate(speculative->accepted_per_step.begin(),
                                           speculative->accepted_per_step.end(), int64_t{0});
      if (drafter == "noisy-oracle") {
        EXPECT_LT(speculative->steps, plain->steps) << "the oracle's trees were not accepted";
      }
    }
  }
  std::cout << "TP " << replica.world_size() << " sampling " << Describe(sampling)
            << ": accepted draft tokens over " << prompts.size() << " prompts:";
  for (const auto& [drafter, count] : accepted) std::cout << " " << drafter << "=" << count;
  std::cout << "\n";
  EXPECT_GT(accepted["noisy-oracle"], 0);
  return plain_runs;
}

// Greedy, 20 prompts, every drafter, at one TP degree.
class GreedyLosslessTest : public ReplicaTest {
 protected:
  void ExpectLosslessAt(int world_size, int prompt_count) {
    Replica* replica = StartReplica({.world_size = world_size});
    ASSERT_NE(replica, nullptr);
    const unsigned seed = 1000 + world_size;
    std::cout << "TP " << world_size << ": prompt seed " << seed << "\n";
    const auto prompts = RepetitivePrompts(prompt_count, VocabSize(*replica), seed);
    ExpectEveryDrafterLossless(*replica, prompts, {});
    // Every session was closed: every rank has all its KV pages back.
    const absl::Status freed = replica->WaitForAllKvPagesFree(absl::Seconds(10));
    EXPECT_TRUE(freed.ok()) << freed;
  }
};

TEST_F(GreedyLosslessTest, EveryDrafterEqualsPlainDecodingAtTp1) { ExpectLosslessAt(1, 20); }
TEST_F(GreedyLosslessTest, EveryDrafterEqualsPlainDecodingAtTp2) { ExpectLosslessAt(2, 20); }
// TP 4 is the slowest (five processes share the two cores of the CI machines, and every
// all-reduce crosses four processes): about 45 s for the 20 prompts the issue asks for.
TEST_F(GreedyLosslessTest, EveryDrafterEqualsPlainDecodingAtTp4) { ExpectLosslessAt(4, 20); }

// Teacher forcing with the margin rule: `reference` (TP 1's plain continuation of `prompt`)
// against plain decoding on `replica`. Where the replica's token differs, TP 1's own top-1/top-2
// margin at that position must be within the tolerance (a near tie); decoding then restarts on
// the replica from the reference's prefix (the reference's token fed in), so one tie does not
// derail the rest. Log-probs must agree within the tolerance wherever the tokens agree.
// Raises *max_difference to the largest log-prob difference seen.
void ExpectAgreesByTeacherForcing(Replica& replica, tools::LocalModel& tp1,
                                  const std::vector<int32_t>& prompt,
                                  const GenerateResult& reference, float* max_difference) {
  const int64_t vocab = tp1.config().vocab_size;
  absl::StatusOr<tools::LocalSegmentResult> forced =
      ForwardChain(tp1, Concat(prompt, reference.tokens), /*return_logits=*/true, {});
  ASSERT_TRUE(forced.ok()) << forced.status();
  size_t position = 0;  // index into reference.tokens where the replica's run starts
  int restarts = 0;
  while (position < reference.tokens.size()) {
    std::vector<int32_t> context = prompt;
    context.insert(context.end(), reference.tokens.begin(), reference.tokens.begin() + position);
    absl::StatusOr<GenerateResult> run =
        Generate(replica.client(), vocab, context,
                 {.max_new_tokens = static_cast<int>(reference.tokens.size() - position)});
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_EQ(run->tokens.size(), reference.tokens.size() - position);
    size_t k = 0;
    for (; k < run->tokens.size(); ++k) {
      const size_t at = position + k;
      if (run->tokens[k] != reference.tokens[at]) break;
      EXPECT_NEAR(run->logprobs[k], reference.logprobs[at], kMarginTolerance)
          << "log-prob of token " << at;
      *max_difference =
          std::max(*max_difference, std::abs(run->logprobs[k] - reference.logprobs[at]));
    }
    if (k == run->tokens.size()) return;
    const size_t at = position + k;
    // Row prompt.size() - 1 + at of the forced forward predicts reference.tokens[at].
    const float margin = TopTwoMargin(
        forced->logits.data() + (prompt.size() - 1 + at) * static_cast<size_t>(vocab), vocab);
    EXPECT_LT(margin, kMarginTolerance)
        << "TP " << replica.world_size() << " emits " << run->tokens[k] << " at token " << at
        << " where TP 1 emits " << reference.tokens[at] << " with a top-1/top-2 margin of "
        << margin << " (only a near tie may differ)";
    if (margin >= kMarginTolerance) return;
    ++restarts;
    position = at + 1;
  }
  std::cout << "teacher forcing restarted " << restarts << " time(s) at near ties\n";
}

// Prompt counts: 20 at TP 1 and 2, and 8 at TP 4 (as in the lossless test at TP 4: five
// processes share two cores there and every step costs about 3x a TP 2 step).
TEST_F(ReplicaTest, GreedyAgreesAcrossTensorParallelDegreesByTeacherForcing) {
  const unsigned seed = 2024;
  std::cout << "prompt seed " << seed << "\n";
  auto model = tools::LocalModel::Create(TinyModelDir(), {.world_size = 1});
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->config().vocab_size;
  const auto prompts = RepetitivePrompts(20, vocab, seed);

  std::vector<GenerateResult> reference;
  {
    Replica* tp1 = StartReplica({.world_size = 1});
    ASSERT_NE(tp1, nullptr);
    for (const auto& prompt : prompts) {
      absl::StatusOr<GenerateResult> run =
          Generate(tp1->client(), vocab, prompt, {.max_new_tokens = kNewTokens});
      ASSERT_TRUE(run.ok()) << run.status();
      reference.push_back(*run);
    }
    tp1->Stop();  // one replica at a time: they share the cores
  }
  for (const auto& [world_size, count] : {std::pair{2, 20}, std::pair{4, 20}}) {
    Replica* replica = StartReplica({.world_size = world_size});
    ASSERT_NE(replica, nullptr);
    float max_difference = 0;
    for (int p = 0; p < count; ++p) {
      SCOPED_TRACE(testing::Message() << "TP " << world_size << " prompt " << p << " "
                                      << testing::PrintToString(prompts[p]));
      ExpectAgreesByTeacherForcing(*replica, **model, prompts[p], reference[p], &max_difference);
    }
    std::cout << "TP " << world_size << " vs TP 1 over " << count
              << " prompts: largest log-prob difference " << max_difference << "\n";
    replica->Stop();
  }
}

// Seeded sampling at TP 2: every drafter emits exactly plain sampling's tokens, also with top-k
// and top-p; top_k = 1 is greedy; other seeds give other tokens.
TEST_F(ReplicaTest, SamplingEveryDrafterEqualsPlainSampling) {
  Replica* replica = StartReplica({.world_size = 2});
  ASSERT_NE(replica, nullptr);
  const int64_t vocab = VocabSize(*replica);
  const unsigned seed = 3003;
  std::cout << "prompt seed " << seed << "\n";
  const auto prompts = RepetitivePrompts(6, vocab, seed);
  for (const SamplingParams& sampling :
       {SamplingParams{.temperature = 0.8f, .seed = 42},
        SamplingParams{.temperature = 0.8f, .seed = 42, .top_k = 20, .top_p = 0.9f},
        SamplingParams{.temperature = 0.8f, .seed = 7, .top_k = 3},
        SamplingParams{.temperature = 0.8f, .seed = 7, .top_p = 0.5f}}) {
    ExpectEveryDrafterLossless(*replica, prompts, sampling);
  }

  // Seeds matter: with another seed most continuations differ somewhere.
  int differ = 0;
  for (const auto& prompt : prompts) {
    absl::StatusOr<GenerateResult> a =
        Generate(replica->client(), vocab, prompt,
                 {.sampling = {.temperature = 0.8f, .seed = 42}, .max_new_tokens = 2 * kNewTokens});
    absl::StatusOr<GenerateResult> b =
        Generate(replica->client(), vocab, prompt,
                 {.sampling = {.temperature = 0.8f, .seed = 43}, .max_new_tokens = 2 * kNewTokens});
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
    differ += a->tokens != b->tokens;
  }
  std::cout << "seeds 42 and 43 differ on " << differ << " of " << prompts.size() << " prompts\n";
  EXPECT_GE(differ, static_cast<int>(prompts.size()) / 2);

  // top_k = 1 leaves only the argmax: greedy decoding, whatever the temperature and seed.
  for (const auto& prompt : prompts) {
    absl::StatusOr<GenerateResult> greedy =
        Generate(replica->client(), vocab, prompt, {.max_new_tokens = kNewTokens});
    for (const std::string drafter : {"none", "ngram"}) {
      absl::StatusOr<GenerateResult> top1 =
          Generate(replica->client(), vocab, prompt,
                   {.drafter = drafter,
                    .sampling = {.temperature = 2.0f, .seed = 9, .top_k = 1},
                    .max_new_tokens = kNewTokens});
      ASSERT_TRUE(greedy.ok() && top1.ok()) << greedy.status() << " " << top1.status();
      EXPECT_EQ(top1->tokens, greedy->tokens) << "drafter " << drafter;
    }
  }
}

// top-k and top-p restrict what is sampled: at a high temperature, unrestricted sampling leaves
// the top 3 tokens somewhere, while every token sampled with top_k = 3 is among the top 3 and
// every token sampled with top_p = 0.5 inside the nucleus, by the in-process model's logits.
TEST_F(ReplicaTest, TopKAndTopPRestrictTheSampledTokens) {
  Replica* replica = StartReplica({.world_size = 2});
  ASSERT_NE(replica, nullptr);
  auto model = tools::LocalModel::Create(TinyModelDir(), {.world_size = 2});
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->config().vocab_size;
  const unsigned seed = 4004;
  std::cout << "prompt seed " << seed << "\n";
  const auto prompts = RepetitivePrompts(4, vocab, seed);
  constexpr float kTemperature = 3.0f;
  constexpr int kTopK = 3;
  constexpr float kTopP = 0.5f;
  int64_t outside_top_k_unrestricted = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    SCOPED_TRACE(testing::Message() << "prompt " << p);
    for (const SamplingParams& sampling :
         {SamplingParams{.temperature = kTemperature, .seed = 11},
          SamplingParams{.temperature = kTemperature, .seed = 11, .top_k = kTopK},
          SamplingParams{.temperature = kTemperature, .seed = 11, .top_p = kTopP}}) {
      absl::StatusOr<GenerateResult> run =
          Generate(replica->client(), vocab, prompts[p],
                   {.drafter = "ngram", .sampling = sampling, .max_new_tokens = kNewTokens});
      ASSERT_TRUE(run.ok()) << run.status();
      absl::StatusOr<tools::LocalSegmentResult> forced =
          ForwardChain(**model, Concat(prompts[p], run->tokens), /*return_logits=*/true, {});
      ASSERT_TRUE(forced.ok()) << forced.status();
      for (size_t k = 0; k < run->tokens.size(); ++k) {
        const float* logits =
            forced->logits.data() + (prompts[p].size() - 1 + k) * static_cast<size_t>(vocab);
        const int32_t token = run->tokens[k];
        const int64_t rank = RankOf(logits, vocab, token);
        if (sampling.top_k == 0 && sampling.top_p == 0) {
          outside_top_k_unrestricted += rank >= kTopK;
        } else if (sampling.top_k > 0) {
          EXPECT_LT(rank, kTopK) << "token " << k << " = " << token;
        } else {
          // Probability mass (at the temperature) of the tokens ranked above this one: below
          // top_p, or the token would be outside the nucleus.
          const float max_logit = *std::max_element(logits, logits + vocab);
          double total = 0;
          double above = 0;
          for (int64_t v = 0; v < vocab; ++v) {
            const double weight = std::exp((logits[v] - max_logit) / kTemperature);
            total += weight;
            if (v != token && logits[v] >= logits[token]) above += weight;
          }
          EXPECT_LT(above / total, kTopP + 1e-4) << "token " << k << " = " << token;
        }
      }
    }
  }
  std::cout << "unrestricted sampling at T " << kTemperature << " picked "
            << outside_top_k_unrestricted << " token(s) outside the top " << kTopK << "\n";
  EXPECT_GT(outside_top_k_unrestricted, 0) << "the restriction checks above would prove nothing";
}

// CreateSession prefills long prompts in chunks: a prompt several chunks long gives the same
// first token and continuation (ngram drafts included) as an in-process model at the same TP
// degree that prefills in chunks of another size.
TEST_F(ReplicaTest, LongPromptsArePrefilledLosslessly) {
  Replica* replica = StartReplica({.world_size = 2});
  ASSERT_NE(replica, nullptr);
  auto model = tools::LocalModel::Create(TinyModelDir(), {.world_size = 2, .prefill_chunk = 100});
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->config().vocab_size;
  const unsigned seed = 5005;
  std::cout << "prompt seed " << seed << "\n";
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(700);
  for (size_t i = 0; i < prompt.size(); ++i) {
    // Repeats of earlier stretches, so that ngram finds something to propose.
    prompt[i] = i >= 50 && i % 3 == 0 ? prompt[i - 50]
                                      : std::uniform_int_distribution<int32_t>(2, 511)(rng);
  }
  absl::StatusOr<tools::Generation> reference = (*model)->GenerateGreedy(1, prompt, 12);
  ASSERT_TRUE(reference.ok()) << reference.status();
  for (const std::string drafter : {"none", "ngram"}) {
    absl::StatusOr<GenerateResult> run =
        Generate(replica->client(), vocab, prompt, {.drafter = drafter, .max_new_tokens = 12});
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->tokens, reference->tokens) << "drafter " << drafter;
    EXPECT_EQ(run->logprobs, reference->logprobs) << "drafter " << drafter;
  }
}

}  // namespace
}  // namespace treeverify::integration
