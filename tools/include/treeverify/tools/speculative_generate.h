// The drafting loop: create a session, then one Verify per step with the drafter's tree, until
// the session finishes. Runs against any VerifierApi: the in-process engine or a server.
//
//   TV_ASSIGN_OR_RETURN(GenerateResult r, SpeculativeGenerate(api, prompt, options, *drafter));
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/coordinator/verifier_api.h"
#include "treeverify/tools/drafters.h"

namespace treeverify::tools {

struct GenerateOptions {
  coordinator::SamplingParams sampling;
  coordinator::StoppingCriteria stopping;  // set max_new_tokens: the loop runs until a stop
  int tree_nodes = 8;                      // draft nodes per step
  bool return_logprobs = true;
};

struct GenerateResult {
  std::vector<int32_t> tokens;             // every emitted token, the first pending token included
  std::vector<float> logprobs;             // of `tokens`, when requested
  int64_t steps = 0;                       // Verify calls
  std::vector<int32_t> accepted_per_step;  // accepted draft tokens of each step
  double seconds = 0;                      // wall time from CreateSession to the last reply
  coordinator::FinishReason finish_reason = coordinator::FinishReason::kNone;

  double tokens_per_second() const { return seconds > 0 ? tokens.size() / seconds : 0; }
  double mean_accepted_per_step() const;
};

absl::StatusOr<GenerateResult> SpeculativeGenerate(coordinator::VerifierApi& api,
                                                   const std::vector<int32_t>& prompt,
                                                   const GenerateOptions& options,
                                                   Drafter& drafter);

}  // namespace treeverify::tools
