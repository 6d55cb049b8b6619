#include "treeverify/coordinator/tree_validator.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace treeverify::coordinator {

namespace {

std::string OutsideVocabulary(absl::string_view field, size_t index, int32_t token,
                              int64_t vocab_size) {
  return absl::StrCat(field, "[", index, "] = ", token, " is outside the vocabulary [0, ",
                      vocab_size, ")");
}

}  // namespace

absl::Status ValidateDraftTree(absl::Span<const int32_t> token_ids,
                               absl::Span<const int32_t> parents, const TreeLimits& limits,
                               int64_t committed_length) {
  if (token_ids.size() != parents.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree.token_ids has ", token_ids.size(), " entries but tree.parents has ",
                     parents.size(), "; every draft node needs one token id and one parent"));
  }
  const int64_t nodes = static_cast<int64_t>(token_ids.size());
  if (nodes > limits.max_draft_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree has ", nodes, " draft nodes; the limit is ", limits.max_draft_nodes));
  }
  for (int64_t i = 0; i < nodes; ++i) {
    const int32_t parent = parents[i];
    if (parent < -1 || parent >= i) {
      const std::string earlier =
          i == 0 ? std::string("none before node 0") : absl::StrCat("0..", i - 1);
      return absl::InvalidArgumentError(absl::StrCat(
          "parents[", i, "] = ", parent,
          ": a parent must be -1 (the pending token) or an earlier node (", earlier, ")"));
    }
    if (token_ids[i] < 0 || token_ids[i] >= limits.vocab_size) {
      return absl::InvalidArgumentError(
          OutsideVocabulary("token_ids", i, token_ids[i], limits.vocab_size));
    }
  }
  const int64_t rows = committed_length + 1 + nodes;
  if (rows > limits.max_context_length) {
    const int64_t room = limits.max_context_length - committed_length - 1;
    return absl::OutOfRangeError(absl::StrCat(
        "the step needs ", rows, " context rows (", committed_length, " committed + 1 pending + ",
        nodes, " draft nodes) but max_context_length is ", limits.max_context_length,
        room >= 0 ? absl::StrCat("; send at most ", room, " draft nodes")
                  : std::string("; the session's context is full")));
  }
  return absl::OkStatus();
}

absl::Status ValidatePrompt(absl::Span<const int32_t> prompt, const TreeLimits& limits) {
  if (prompt.empty()) {
    return absl::InvalidArgumentError(
        "prompt_token_ids is empty; a prompt needs at least one token");
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= limits.vocab_size) {
      return absl::InvalidArgumentError(
          OutsideVocabulary("prompt_token_ids", i, prompt[i], limits.vocab_size));
    }
  }
  const int64_t length = static_cast<int64_t>(prompt.size());
  if (length >= limits.max_context_length) {
    return absl::OutOfRangeError(absl::StrCat(
        "prompt has ", length, " tokens; max_context_length is ", limits.max_context_length,
        " and one row is needed for the first generated token, so at most ",
        limits.max_context_length - 1, " prompt tokens fit"));
  }
  return absl::OkStatus();
}

}  // namespace treeverify::coordinator
