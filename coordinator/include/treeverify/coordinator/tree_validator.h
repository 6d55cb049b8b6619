// Checks a client's draft tree and prompt before anything reaches the ranks, so that a malformed
// request fails alone with a message its sender can act on and never touches another session.
//
//   TreeLimits limits{.max_draft_nodes = 255, .vocab_size = 129280, .max_context_length = 8192};
//   TV_RETURN_IF_ERROR(ValidateDraftTree(tree.token_ids, tree.parents, limits,
//                                        session.committed_tokens.size()));
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace treeverify::coordinator {

struct TreeLimits {
  int32_t max_draft_nodes = 255;
  // Token ids must be in [0, vocab_size).
  int64_t vocab_size = 0;
  // Cache rows a session may hold: committed tokens + pending token + draft nodes.
  int64_t max_context_length = 0;
};

// A draft tree hangs under the session's pending token: parents[i] is -1 (the pending token) or
// an earlier node. The step puts the pending token at position committed_length and every draft
// node after it, so it needs committed_length + 1 + token_ids.size() cache rows.
//
// INVALID_ARGUMENT for a malformed tree (length mismatch, too many nodes, a parent that is not -1
// or an earlier node, a token outside the vocabulary), checked in that order; OUT_OF_RANGE when
// a well-formed tree does not fit in max_context_length. An empty tree is valid.
absl::Status ValidateDraftTree(absl::Span<const int32_t> token_ids,
                               absl::Span<const int32_t> parents, const TreeLimits& limits,
                               int64_t committed_length);

// INVALID_ARGUMENT for an empty prompt or a token outside the vocabulary; OUT_OF_RANGE when the
// prompt leaves no row for the first pending token (prompt.size() >= max_context_length).
absl::Status ValidatePrompt(absl::Span<const int32_t> prompt, const TreeLimits& limits);

}  // namespace treeverify::coordinator
