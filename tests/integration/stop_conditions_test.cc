// Stop conditions through the service (the checkpoint's EOS, stop token ids, max new tokens, the
// max context): each ends the session with its finish_reason, the stop token emitted and nothing
// after it, and a later Verify is FAILED_PRECONDITION. Hidden states returned for requested
// layers equal the in-process model's, after the wire's bf16 rounding.
//
// The tiny-v3 preset's EOS is token 1, which its greedy continuations never reached in a search
// (30 random prompts x 40 tokens, none emitted it). So the EOS test writes the same checkpoint
// with another eos_token_id, a token known to come up: the generator draws every tensor from
// (seed, tensor name) only, so the weights are unchanged, which the test checks too.
#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "test_support.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/drafters.h"

namespace treeverify::integration {
namespace {

using coordinator::FinishReason;
using testing::HasSubstr;
using tools::GenerateResult;

constexpr int kMaxContext = 48;

// Runs a session with `drafter` until it finishes (at most max_steps Verify calls) and leaves it
// open. The tokens are CreateSession's pending token followed by every emitted token.
struct OpenRun {
  coordinator::SessionId session_id;
  std::vector<int32_t> tokens;
  FinishReason finish_reason = FinishReason::kNone;
  std::vector<coordinator::VerifyOutput> steps;
};

absl::StatusOr<OpenRun> RunUntilFinished(coordinator::VerifierApi& api,
                                         const std::vector<int32_t>& prompt,
                                         const coordinator::StoppingCriteria& stopping,
                                         tools::Drafter& drafter,
                                         const std::vector<int32_t>& hidden_layers = {},
                                         int max_steps = 64) {
  absl::StatusOr<coordinator::CreateSessionOutput> created =
      api.CreateSession({.prompt_token_ids = prompt, .stopping = stopping});
  if (!created.ok()) return created.status();
  OpenRun run{.session_id = created->session_id,
              .tokens = {created->pending_token_id},
              .finish_reason = created->finish_reason};
  for (int step = 0; step < max_steps && run.finish_reason == FinishReason::kNone; ++step) {
    tools::DraftTree tree = drafter.Propose(Concat(prompt, run.tokens), 8);
    absl::StatusOr<coordinator::VerifyOutput> out =
        api.Verify({.session_id = run.session_id,
                    .draft_token_ids = tree.token_ids,
                    .draft_parents = tree.parents,
                    .hidden_state_layers = hidden_layers});
    if (!out.ok()) return out.status();
    run.tokens.insert(run.tokens.end(), out->emitted_token_ids.begin(),
                      out->emitted_token_ids.end());
    run.finish_reason = out->finish_reason;
    run.steps.push_back(*std::move(out));
  }
  return run;
}

std::unique_ptr<tools::Drafter> MakeDrafter(const std::string& name, int64_t vocab,
                                            const std::vector<int32_t>& oracle) {
  auto drafter = tools::MakeDrafter(
      name, {.vocab_size = vocab, .seed = 3, .oracle = oracle, .oracle_acceptance = 1.0});
  EXPECT_TRUE(drafter.ok()) << drafter.status();
  return drafter.ok() ? *std::move(drafter) : nullptr;
}

// A later Verify on a finished session is FAILED_PRECONDITION saying so; closing still works.
void ExpectFinished(coordinator::VerifierApi& api, const coordinator::SessionId& id) {
  absl::StatusOr<coordinator::VerifyOutput> after = api.Verify({.session_id = id});
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition) << after.status();
  EXPECT_THAT(std::string(after.status().message()), HasSubstr("finished"));
  EXPECT_TRUE(api.CloseSession(id).ok());
}

TEST_F(ReplicaTest, StopConditionsEndTheSessionAsDocumented) {
  // The target's greedy continuation, in process at the replica's TP degree.
  const std::vector<int32_t> prompt = {17, 42, 99, 17, 42, 99, 250};
  auto model = tools::LocalModel::Create(TinyModelDir(), {.world_size = 2});
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->config().vocab_size;
  absl::StatusOr<tools::Generation> reference = (*model)->GenerateGreedy(1, prompt, 16);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_TRUE((*model)->Release(1).ok());
  const std::vector<int32_t>& tokens = reference->tokens;
  std::cout << "reference continuation " << testing::PrintToString(tokens) << "\n";
  // The checkpoint's EOS: the first token from index 4 on that did not come up before it.
  size_t eos_at = 4;
  while (eos_at < tokens.size() && std::find(tokens.begin(), tokens.begin() + eos_at,
                                             tokens[eos_at]) != tokens.begin() + eos_at) {
    ++eos_at;
  }
  ASSERT_LT(eos_at, tokens.size()) << "no fresh token to make the EOS";
  const int32_t eos = tokens[eos_at];
  absl::StatusOr<tools::CheckpointSpec> spec = tools::PresetSpec("tiny-v3");
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->eos_token_id = {eos};
  const std::string eos_model = ScratchDir() + "/tiny-v3-eos";
  ASSERT_TRUE(tools::WriteCheckpoint(eos_model, *spec).ok());

  Replica* replica =
      StartReplica({.world_size = 2,
                    .model_dir = eos_model,
                    .coordinator_flags = {"--max-context", std::to_string(kMaxContext)}});
  ASSERT_NE(replica, nullptr);
  coordinator::VerifierApi& api = replica->client();
  absl::StatusOr<coordinator::ModelInfo> info = api.GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->eos_token_ids, std::vector<int32_t>{eos});
  EXPECT_EQ(info->max_context_length, kMaxContext);
  const std::vector<int32_t> oracle = Concat(prompt, tokens);

  // Same weights: ignoring EOS, the service continues exactly as the in-process model.
  {
    auto none = MakeDrafter("none", vocab, oracle);
    absl::StatusOr<OpenRun> run =
        RunUntilFinished(api, prompt, {.max_new_tokens = 16, .ignore_eos = true}, *none);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->tokens, tokens);
    EXPECT_EQ(run->finish_reason, FinishReason::kMaxNewTokens);
    ExpectFinished(api, run->session_id);
  }

  const std::vector<int32_t> up_to_eos(tokens.begin(), tokens.begin() + eos_at + 1);
  for (const std::string drafter_name : {"none", "noisy-oracle"}) {
    SCOPED_TRACE("drafter " + drafter_name);
    // EOS from the checkpoint: emitted, then the session ends (a whole accepted chain past it is
    // cut there).
    auto drafter = MakeDrafter(drafter_name, vocab, oracle);
    absl::StatusOr<OpenRun> run = RunUntilFinished(api, prompt, {.max_new_tokens = 16}, *drafter);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->tokens, up_to_eos);
    EXPECT_EQ(run->finish_reason, FinishReason::kEos);
    ExpectFinished(api, run->session_id);

    // A stop token: the first token's first occurrence ends the session.
    const int32_t stop = tokens[2];
    const size_t stop_at = std::find(tokens.begin(), tokens.end(), stop) - tokens.begin();
    drafter = MakeDrafter(drafter_name, vocab, oracle);
    run = RunUntilFinished(api, prompt,
                           {.max_new_tokens = 16, .stop_token_ids = {stop}, .ignore_eos = true},
                           *drafter);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->tokens, std::vector<int32_t>(tokens.begin(), tokens.begin() + stop_at + 1));
    EXPECT_EQ(run->finish_reason, FinishReason::kStopToken);
    ExpectFinished(api, run->session_id);

    // Max new tokens: exactly that many, counting CreateSession's token, also when a step
    // accepts a longer chain.
    drafter = MakeDrafter(drafter_name, vocab, oracle);
    run = RunUntilFinished(api, prompt, {.max_new_tokens = 5, .ignore_eos = true}, *drafter);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->tokens, std::vector<int32_t>(tokens.begin(), tokens.begin() + 5));
    EXPECT_EQ(run->finish_reason, FinishReason::kMaxNewTokens);
    ExpectFinished(api, run->session_id);
  }

  // EOS as the very first token: CreateSession already reports the finish.
  {
    const std::vector<int32_t> before_eos =
        Concat(prompt, std::vector<int32_t>(tokens.begin(), tokens.begin() + eos_at));
    absl::StatusOr<coordinator::CreateSessionOutput> created =
        api.CreateSession({.prompt_token_ids = before_eos});
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->pending_token_id, eos);
    EXPECT_EQ(created->finish_reason, FinishReason::kEos);
    ExpectFinished(api, created->session_id);
  }

  // The max context: plain decoding runs until no further token fits.
  {
    auto none = MakeDrafter("none", vocab, oracle);
    absl::StatusOr<OpenRun> run =
        RunUntilFinished(api, prompt, {.ignore_eos = true}, *none, {}, /*max_steps=*/kMaxContext);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->finish_reason, FinishReason::kMaxContext);
    ASSERT_FALSE(run->steps.empty());
    EXPECT_EQ(run->steps.back().context_length, kMaxContext);
    // Every position holds a committed token, plus the last emitted (pending) token.
    EXPECT_EQ(prompt.size() + run->tokens.size(), static_cast<size_t>(kMaxContext) + 1);
    EXPECT_EQ(std::vector<int32_t>(run->tokens.begin(), run->tokens.begin() + 16), tokens);
    ExpectFinished(api, run->session_id);
  }
  const absl::Status freed = replica->WaitForAllKvPagesFree(absl::Seconds(10));
  EXPECT_TRUE(freed.ok()) << freed;
}

// The hidden states of the requested layers for each step's committed rows (the previous pending
// token and the accepted drafts) equal an in-process forward of the same tokens at the same TP
// degree, bit for bit once rounded to bf16 as the wire carries them.
TEST_F(ReplicaTest, HiddenStatesEqualTheInProcessModel) {
  constexpr int kWorldSize = 2;
  Replica* replica = StartReplica({.world_size = kWorldSize});
  ASSERT_NE(replica, nullptr);
  auto model = tools::LocalModel::Create(TinyModelDir(), {.world_size = kWorldSize});
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->config().vocab_size;
  const int64_t hidden = (*model)->config().hidden_size;
  const int32_t layers = static_cast<int32_t>((*model)->config().num_hidden_layers);
  const std::vector<int32_t> requested = {layers, 0, 1};  // any order, as requested

  const std::vector<int32_t> prompt = {300, 301, 5, 300, 301, 5, 77, 12};
  absl::StatusOr<tools::Generation> reference = (*model)->GenerateGreedy(1, prompt, 24);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_TRUE((*model)->Release(1).ok());
  // Acceptance 0.8: steps commit rows of different counts.
  auto drafter = tools::MakeDrafter("noisy-oracle", {.vocab_size = vocab,
                                                     .seed = 21,
                                                     .oracle = Concat(prompt, reference->tokens),
                                                     .oracle_acceptance = 0.8});
  ASSERT_TRUE(drafter.ok());
  absl::StatusOr<OpenRun> run = RunUntilFinished(
      replica->client(), prompt, {.max_new_tokens = 24, .ignore_eos = true}, **drafter, requested);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->tokens, reference->tokens);
  EXPECT_TRUE(replica->client().CloseSession(run->session_id).ok());

  // Rows in commit order: the step's committed tokens are its emitted tokens shifted by one
  // (the old pending token first).
  std::vector<std::vector<float>> rows_by_layer(requested.size());
  int64_t rows = 0;
  int64_t max_rows_in_a_step = 0;
  for (const coordinator::VerifyOutput& step : run->steps) {
    ASSERT_EQ(step.hidden_states.size(), requested.size());
    for (size_t l = 0; l < requested.size(); ++l) {
      const coordinator::HiddenStateRows& got = step.hidden_states[l];
      EXPECT_EQ(got.layer, requested[l]);
      EXPECT_EQ(got.hidden_size, hidden);
      EXPECT_EQ(got.rows, static_cast<int64_t>(step.emitted_token_ids.size()));
      ASSERT_EQ(got.values.size(), static_cast<size_t>(got.rows * hidden));
      rows_by_layer[l].insert(rows_by_layer[l].end(), got.values.begin(), got.values.end());
    }
    rows += step.hidden_states[0].rows;
    max_rows_in_a_step = std::max(max_rows_in_a_step, step.hidden_states[0].rows);
  }
  EXPECT_GT(max_rows_in_a_step, 1) << "no step accepted a draft: the test covers less";
  const std::vector<int32_t> committed =
      Concat(prompt, std::vector<int32_t>(run->tokens.begin(), run->tokens.begin() + rows));
  absl::StatusOr<tools::LocalSegmentResult> forced =
      ForwardChain(**model, committed, /*return_logits=*/false, requested);
  ASSERT_TRUE(forced.ok()) << forced.status();
  ASSERT_EQ(forced->hidden_states.size(), requested.size());
  for (size_t l = 0; l < requested.size(); ++l) {
    ASSERT_EQ(forced->hidden_states[l].layer, requested[l]);
    const float* expected = forced->hidden_states[l].values.data() + prompt.size() * hidden;
    int64_t mismatches = 0;
    for (int64_t i = 0; i < rows * hidden; ++i) {
      if (rows_by_layer[l][i] != RoundToBf16(expected[i])) {
        if (++mismatches <= 5) {
          ADD_FAILURE() << "layer " << requested[l] << " row " << i / hidden << " column "
                        << i % hidden << ": service " << rows_by_layer[l][i] << ", in-process "
                        << expected[i] << " (bf16 " << RoundToBf16(expected[i]) << ")";
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << "layer " << requested[l];
  }
}

}  // namespace
}  // namespace treeverify::integration
