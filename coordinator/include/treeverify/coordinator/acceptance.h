// Acceptance: which draft nodes of a verified tree the target agrees with, which tokens the step
// emits, and where the session stops.
//
// The ranks run a *segment* per sequence: segment node 0 is the session's pending token, segment
// node i + 1 is draft node i. For every segment node s the reduced summaries give the target's
// token after it (argmax, or the seeded Gumbel-max sample), target_tokens[s].
//
//   Acceptance a = AcceptLongestPath(tree.token_ids, tree.parents, target_tokens);
//   StopDecision stop = ApplyStopping(a.emitted_tokens, session.emitted_tokens, session.stopping,
//                                     eos_token_ids, context_length_after, max_context_length);
//   // emit a.emitted_tokens[0, stop.emit_count); commit a.commit_nodes at the next forward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "treeverify/coordinator/session_manager.h"

namespace treeverify::coordinator {

// Segment parents of a draft tree: the pending token (segment node 0) is the root (-1); a draft
// node with parent -1 hangs under it (0); parent p becomes p + 1.
std::vector<int32_t> SegmentParents(absl::Span<const int32_t> draft_parents);

struct Acceptance {
  // Accepted draft node indices, root to leaf (ascending, since parents precede children).
  std::vector<int32_t> accepted_draft_nodes;
  // Segment node indices whose KV to keep: 0 (the old pending token), then accepted + 1.
  std::vector<int32_t> commit_nodes;
  // The accepted draft tokens, then the new pending token.
  std::vector<int32_t> emitted_tokens;
  // The target's token after the last accepted node.
  int32_t new_pending_token = -1;
};

// Walks from the root: at segment node s the target's token is t = target_tokens[s]; if a child
// of s carries t, move to it (the lowest draft index among equal siblings), else stop. The new
// pending token is t at the node where the walk stops. This is exactly autoregressive decoding
// of the target along the accepted path, whatever the tree's shape.
//
// Requires a tree that passed ValidateDraftTree and target_tokens.size() ==
// draft_tokens.size() + 1.
Acceptance AcceptLongestPath(absl::Span<const int32_t> draft_tokens,
                             absl::Span<const int32_t> draft_parents,
                             absl::Span<const int32_t> target_tokens);

struct StopDecision {
  // How many of the candidate tokens to emit (a prefix).
  size_t emit_count = 0;
  // kNone: the session may continue.
  FinishReason reason = FinishReason::kNone;
};

// Decides where a step's candidate tokens (`emitted`, in order) stop. Scanning the k-th token
// (1-based), the session finishes after it, with that token emitted, when it
//   1. is an end-of-sequence token (unless stopping.ignore_eos)           -> kEos,
//   2. is in stopping.stop_token_ids                                       -> kStopToken,
//   3. brings already_emitted + k to stopping.max_new_tokens (when > 0)   -> kMaxNewTokens;
// checked in that order, so at one token EOS wins over a stop token, which wins over the
// max_new_tokens limit. Otherwise all tokens are emitted, and if context_length_after (the
// committed tokens after this step) leaves no row for the new pending token
// (context_length_after >= max_context_length) the reason is kMaxContext.
//
// already_emitted counts CreateSession's pending token; for CreateSession itself pass the one
// pending token with already_emitted 0 and context_length_after the prompt length.
StopDecision ApplyStopping(absl::Span<const int32_t> emitted, int64_t already_emitted,
                           const StoppingCriteria& stopping,
                           absl::Span<const int32_t> eos_token_ids, int64_t context_length_after,
                           int64_t max_context_length);

}  // namespace treeverify::coordinator
