#include "treeverify/coordinator/acceptance.h"

#include <algorithm>
#include <cassert>

namespace treeverify::coordinator {

std::vector<int32_t> SegmentParents(absl::Span<const int32_t> draft_parents) {
  std::vector<int32_t> segment(draft_parents.size() + 1);
  segment[0] = -1;
  for (size_t i = 0; i < draft_parents.size(); ++i) segment[i + 1] = draft_parents[i] + 1;
  return segment;
}

Acceptance AcceptLongestPath(absl::Span<const int32_t> draft_tokens,
                             absl::Span<const int32_t> draft_parents,
                             absl::Span<const int32_t> target_tokens) {
  assert(draft_parents.size() == draft_tokens.size());
  assert(target_tokens.size() == draft_tokens.size() + 1);
  const int32_t nodes = static_cast<int32_t>(draft_tokens.size());
  Acceptance result;
  result.commit_nodes.push_back(0);
  int32_t segment_node = 0;
  while (true) {
    const int32_t target = target_tokens[segment_node];
    // Draft node j hangs under segment node s when draft_parents[j] == s - 1; such j are > s - 1.
    int32_t next = -1;
    for (int32_t j = segment_node; j < nodes; ++j) {
      if (draft_parents[j] == segment_node - 1 && draft_tokens[j] == target) {
        next = j;
        break;
      }
    }
    if (next < 0) {
      result.new_pending_token = target;
      break;
    }
    result.accepted_draft_nodes.push_back(next);
    result.commit_nodes.push_back(next + 1);
    result.emitted_tokens.push_back(target);
    segment_node = next + 1;
  }
  result.emitted_tokens.push_back(result.new_pending_token);
  return result;
}

StopDecision ApplyStopping(absl::Span<const int32_t> emitted, int64_t already_emitted,
                           const StoppingCriteria& stopping,
                           absl::Span<const int32_t> eos_token_ids, int64_t context_length_after,
                           int64_t max_context_length) {
  auto contains = [](absl::Span<const int32_t> set, int32_t token) {
    return std::find(set.begin(), set.end(), token) != set.end();
  };
  for (size_t k = 1; k <= emitted.size(); ++k) {
    const int32_t token = emitted[k - 1];
    if (!stopping.ignore_eos && contains(eos_token_ids, token)) {
      return {k, FinishReason::kEos};
    }
    if (contains(stopping.stop_token_ids, token)) return {k, FinishReason::kStopToken};
    // >= rather than ==: a caller that already passed the limit still stops at once.
    if (stopping.max_new_tokens > 0 &&
        already_emitted + static_cast<int64_t>(k) >= stopping.max_new_tokens) {
      return {k, FinishReason::kMaxNewTokens};
    }
  }
  if (context_length_after >= max_context_length) {
    return {emitted.size(), FinishReason::kMaxContext};
  }
  return {emitted.size(), FinishReason::kNone};
}

}  // namespace treeverify::coordinator
