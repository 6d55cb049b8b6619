#include "treeverify/tools/speculative_generate.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "treeverify/kernels/status.h"

namespace treeverify::tools {

double GenerateResult::mean_accepted_per_step() const {
  if (accepted_per_step.empty()) return 0;
  return std::accumulate(accepted_per_step.begin(), accepted_per_step.end(), 0.0) /
         static_cast<double>(accepted_per_step.size());
}

absl::StatusOr<GenerateResult> SpeculativeGenerate(coordinator::VerifierApi& api,
                                                   const std::vector<int32_t>& prompt,
                                                   const GenerateOptions& options,
                                                   Drafter& drafter) {
  TV_ASSIGN_OR_RETURN(coordinator::ModelInfo info, api.GetModelInfo());
  const auto start = std::chrono::steady_clock::now();
  GenerateResult result;
  TV_ASSIGN_OR_RETURN(coordinator::CreateSessionOutput session,
                      api.CreateSession({.prompt_token_ids = prompt,
                                         .sampling = options.sampling,
                                         .stopping = options.stopping,
                                         .return_logprobs = options.return_logprobs}));
  result.tokens.push_back(session.pending_token_id);
  if (options.return_logprobs) result.logprobs.push_back(session.pending_logprob);
  result.finish_reason = session.finish_reason;
  std::vector<int32_t> context = prompt;
  context.push_back(session.pending_token_id);
  while (result.finish_reason == coordinator::FinishReason::kNone) {
    // Near the end of the context a tree must shrink: the pending token and every draft node
    // need a row (a larger tree would be OUT_OF_RANGE).
    const int64_t room = info.max_context_length - static_cast<int64_t>(context.size());
    const int max_nodes = static_cast<int>(std::clamp<int64_t>(room, 0, options.tree_nodes));
    DraftTree tree = drafter.Propose(context, max_nodes);
    absl::StatusOr<coordinator::VerifyOutput> step =
        api.Verify({.session_id = session.session_id,
                    .draft_token_ids = std::move(tree.token_ids),
                    .draft_parents = std::move(tree.parents),
                    .return_logprobs = options.return_logprobs});
    if (!step.ok()) {
      (void)api.CloseSession(session.session_id);
      return step.status();
    }
    ++result.steps;
    result.accepted_per_step.push_back(static_cast<int32_t>(step->accepted_node_indices.size()));
    result.tokens.insert(result.tokens.end(), step->emitted_token_ids.begin(),
                         step->emitted_token_ids.end());
    result.logprobs.insert(result.logprobs.end(), step->logprobs.begin(), step->logprobs.end());
    context.insert(context.end(), step->emitted_token_ids.begin(), step->emitted_token_ids.end());
    result.finish_reason = step->finish_reason;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  TV_RETURN_IF_ERROR(api.CloseSession(session.session_id));
  return result;
}

}  // namespace treeverify::tools
