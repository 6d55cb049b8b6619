#include "treeverify/coordinator/acceptance.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace treeverify::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(SegmentParentsTest, ShiftsDraftParentsUnderThePendingToken) {
  EXPECT_THAT(SegmentParents({}), ElementsAre(-1));
  EXPECT_THAT(SegmentParents({-1, -1, 0, 2, 1}), ElementsAre(-1, 0, 0, 1, 3, 2));
}

TEST(AcceptLongestPathTest, EmptyTreeEmitsJustTheRootTarget) {
  const Acceptance a = AcceptLongestPath({}, {}, {42});
  EXPECT_THAT(a.accepted_draft_nodes, IsEmpty());
  EXPECT_THAT(a.commit_nodes, ElementsAre(0));
  EXPECT_THAT(a.emitted_tokens, ElementsAre(42));
  EXPECT_EQ(a.new_pending_token, 42);
}

TEST(AcceptLongestPathTest, FullChainAccepted) {
  // Chain 10 -> 11 -> 12; the target agrees at every node and adds 13.
  const Acceptance a = AcceptLongestPath({10, 11, 12}, {-1, 0, 1}, {10, 11, 12, 13});
  EXPECT_THAT(a.accepted_draft_nodes, ElementsAre(0, 1, 2));
  EXPECT_THAT(a.commit_nodes, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(a.emitted_tokens, ElementsAre(10, 11, 12, 13));
  EXPECT_EQ(a.new_pending_token, 13);
}

TEST(AcceptLongestPathTest, ChainCutHalfway) {
  const Acceptance a = AcceptLongestPath({10, 11, 12}, {-1, 0, 1}, {10, 99, 12, 13});
  EXPECT_THAT(a.accepted_draft_nodes, ElementsAre(0));
  EXPECT_THAT(a.commit_nodes, ElementsAre(0, 1));
  EXPECT_THAT(a.emitted_tokens, ElementsAre(10, 99));
  EXPECT_EQ(a.new_pending_token, 99);
}

TEST(AcceptLongestPathTest, BranchChosenByTheTarget) {
  // Pending token has children 0 (token 5) and 1 (token 6); node 0 has child 2 (7), node 1 has
  // children 3 (8) and 4 (9). The target says 6 after the root, 9 after node 1, 1 after node 4.
  const std::vector<int32_t> tokens{5, 6, 7, 8, 9};
  const std::vector<int32_t> parents{-1, -1, 0, 1, 1};
  // The target after each segment node: root 6, node 0 7, node 1 9, node 2 0, node 3 0, node 4 1.
  const std::vector<int32_t> targets{6, 7, 9, 0, 0, 1};
  const Acceptance a = AcceptLongestPath(tokens, parents, targets);
  EXPECT_THAT(a.accepted_draft_nodes, ElementsAre(1, 4));
  EXPECT_THAT(a.commit_nodes, ElementsAre(0, 2, 5));
  EXPECT_THAT(a.emitted_tokens, ElementsAre(6, 9, 1));
  EXPECT_EQ(a.new_pending_token, 1);
}

TEST(AcceptLongestPathTest, DuplicateSiblingsTakeTheLowestIndex) {
  // Nodes 1 and 2 both carry 5 under the root. Node 3 (under node 2) matches the target after
  // node 2, but the walk takes node 1, which has no children, and stops there.
  const std::vector<int32_t> tokens{4, 5, 5, 6};
  const std::vector<int32_t> parents{-1, -1, -1, 2};
  const std::vector<int32_t> targets{5, 0, 8, 6, 0};
  const Acceptance a = AcceptLongestPath(tokens, parents, targets);
  EXPECT_THAT(a.accepted_draft_nodes, ElementsAre(1));
  EXPECT_THAT(a.emitted_tokens, ElementsAre(5, 8));
  EXPECT_EQ(a.new_pending_token, 8);
}

TEST(AcceptLongestPathTest, RejectionAtTheFirstLevel) {
  const Acceptance a = AcceptLongestPath({5, 6, 7}, {-1, -1, 0}, {9, 7, 7, 7});
  EXPECT_THAT(a.accepted_draft_nodes, IsEmpty());
  EXPECT_THAT(a.commit_nodes, ElementsAre(0));
  EXPECT_THAT(a.emitted_tokens, ElementsAre(9));
  EXPECT_EQ(a.new_pending_token, 9);
}

TEST(AcceptLongestPathTest, AGrandchildMatchingTheRootTargetIsNotAChild) {
  // Node 1 carries the root's target but hangs under node 0, which is rejected.
  const Acceptance a = AcceptLongestPath({5, 6}, {-1, 0}, {6, 6, 6});
  EXPECT_THAT(a.accepted_draft_nodes, IsEmpty());
  EXPECT_THAT(a.emitted_tokens, ElementsAre(6));
}

// Brute force: every root-to-node path whose every node carries the target's token after its
// parent is consistent; the longest one is accepted. Trees here have distinct sibling tokens,
// so at most one consistent path exists per depth.
Acceptance Reference(const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents,
                     const std::vector<int32_t>& targets) {
  std::vector<int32_t> best;
  for (int32_t node = 0; node < static_cast<int32_t>(tokens.size()); ++node) {
    std::vector<int32_t> path;
    for (int32_t n = node; n >= 0; n = parents[n]) path.push_back(n);
    std::reverse(path.begin(), path.end());
    bool consistent = true;
    for (int32_t n : path) consistent = consistent && tokens[n] == targets[parents[n] + 1];
    if (consistent && path.size() > best.size()) best = path;
  }
  Acceptance a;
  a.accepted_draft_nodes = best;
  a.commit_nodes.push_back(0);
  for (int32_t n : best) {
    a.commit_nodes.push_back(n + 1);
    a.emitted_tokens.push_back(tokens[n]);
  }
  a.new_pending_token = targets[best.empty() ? 0 : best.back() + 1];
  a.emitted_tokens.push_back(a.new_pending_token);
  return a;
}

TEST(AcceptLongestPathTest, MatchesBruteForceOnRandomTrees) {
  const unsigned seed = 20260417;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 2000; ++trial) {
    const int nodes = std::vector<int>{0, 1, 3, 7, 19, 64, 255}[trial % 7];
    const int vocab = 2 + static_cast<int>(rng() % 7);
    std::vector<int32_t> tokens, parents;
    std::vector<std::vector<int32_t>> children_tokens(nodes + 1);  // by segment node
    while (static_cast<int>(tokens.size()) < nodes) {
      const int32_t i = static_cast<int32_t>(tokens.size());
      const int32_t parent = static_cast<int32_t>(rng() % (i + 1)) - 1;
      std::vector<int32_t>& used = children_tokens[parent + 1];
      if (static_cast<int>(used.size()) == vocab) continue;  // every token taken: re-draw
      int32_t token;
      do {
        token = static_cast<int32_t>(rng() % vocab);
      } while (std::find(used.begin(), used.end(), token) != used.end());
      used.push_back(token);
      tokens.push_back(token);
      parents.push_back(parent);
    }
    // Mostly agree with some child, so that paths run deep.
    std::vector<int32_t> targets(nodes + 1);
    for (int s = 0; s <= nodes; ++s) {
      const std::vector<int32_t>& kids = children_tokens[s];
      targets[s] = !kids.empty() && rng() % 10 < 8 ? kids[rng() % kids.size()]
                                                   : static_cast<int32_t>(rng() % vocab);
    }
    const Acceptance got = AcceptLongestPath(tokens, parents, targets);
    const Acceptance want = Reference(tokens, parents, targets);
    ASSERT_EQ(got.accepted_draft_nodes, want.accepted_draft_nodes) << "trial " << trial;
    ASSERT_EQ(got.commit_nodes, want.commit_nodes) << "trial " << trial;
    ASSERT_EQ(got.emitted_tokens, want.emitted_tokens) << "trial " << trial;
    ASSERT_EQ(got.new_pending_token, want.new_pending_token) << "trial " << trial;
    ASSERT_TRUE(std::is_sorted(got.commit_nodes.begin(), got.commit_nodes.end()));
  }
}

// --- ApplyStopping ---

const std::vector<int32_t> kEos{2};
constexpr int64_t kMaxContext = 100;

void ExpectStop(const StopDecision& got, size_t emit_count, FinishReason reason) {
  EXPECT_EQ(got.emit_count, emit_count);
  EXPECT_EQ(got.reason, reason);
}

TEST(ApplyStoppingTest, NoStopEmitsEverything) {
  ExpectStop(ApplyStopping({5, 6, 7}, 4, {}, kEos, 50, kMaxContext), 3, FinishReason::kNone);
}

TEST(ApplyStoppingTest, EosStopsAfterIt) {
  ExpectStop(ApplyStopping({5, 2, 7}, 4, {}, kEos, 50, kMaxContext), 2, FinishReason::kEos);
}

TEST(ApplyStoppingTest, IgnoreEos) {
  const StoppingCriteria stopping{.ignore_eos = true};
  ExpectStop(ApplyStopping({5, 2, 7}, 4, stopping, kEos, 50, kMaxContext), 3, FinishReason::kNone);
  // A stop token still stops.
  const StoppingCriteria with_stop{.stop_token_ids = {7}, .ignore_eos = true};
  ExpectStop(ApplyStopping({5, 2, 7}, 4, with_stop, kEos, 50, kMaxContext), 3,
             FinishReason::kStopToken);
}

TEST(ApplyStoppingTest, StopToken) {
  const StoppingCriteria stopping{.stop_token_ids = {9, 6}};
  ExpectStop(ApplyStopping({5, 6, 7}, 4, stopping, kEos, 50, kMaxContext), 2,
             FinishReason::kStopToken);
  ExpectStop(ApplyStopping({6}, 0, stopping, kEos, 50, kMaxContext), 1, FinishReason::kStopToken);
}

TEST(ApplyStoppingTest, MaxNewTokensReachedMidStepTruncates) {
  const StoppingCriteria stopping{.max_new_tokens = 6};
  // 4 emitted before; the 2nd candidate is the 6th token.
  ExpectStop(ApplyStopping({5, 6, 7, 8}, 4, stopping, kEos, 50, kMaxContext), 2,
             FinishReason::kMaxNewTokens);
  // Reached exactly at the last candidate.
  ExpectStop(ApplyStopping({5, 6}, 4, stopping, kEos, 50, kMaxContext), 2,
             FinishReason::kMaxNewTokens);
  // One short.
  ExpectStop(ApplyStopping({5}, 4, stopping, kEos, 50, kMaxContext), 1, FinishReason::kNone);
  // CreateSession's single pending token with a limit of 1.
  ExpectStop(ApplyStopping({5}, 0, {.max_new_tokens = 1}, kEos, 10, kMaxContext), 1,
             FinishReason::kMaxNewTokens);
}

TEST(ApplyStoppingTest, PrecedenceAtOneToken) {
  // Token 2 is EOS and a stop token and the max_new_tokens-th token: EOS wins.
  const StoppingCriteria all{.max_new_tokens = 2, .stop_token_ids = {2}};
  ExpectStop(ApplyStopping({5, 2, 7}, 0, all, kEos, 50, kMaxContext), 2, FinishReason::kEos);
  // Without EOS (ignored): the stop token wins over max_new_tokens.
  StoppingCriteria no_eos = all;
  no_eos.ignore_eos = true;
  ExpectStop(ApplyStopping({5, 2, 7}, 0, no_eos, kEos, 50, kMaxContext), 2,
             FinishReason::kStopToken);
  // An earlier token's reason wins over a later token's.
  const StoppingCriteria limit{.max_new_tokens = 1, .stop_token_ids = {5}};
  ExpectStop(ApplyStopping({7, 5}, 0, limit, kEos, 50, kMaxContext), 1,
             FinishReason::kMaxNewTokens);
  // A token stop at the context limit is reported as the token stop.
  ExpectStop(ApplyStopping({5, 2}, 0, {}, kEos, kMaxContext, kMaxContext), 2, FinishReason::kEos);
}

TEST(ApplyStoppingTest, MaxContext) {
  // 99 committed: the new pending token's row (99) still fits.
  ExpectStop(ApplyStopping({5, 6}, 0, {}, kEos, kMaxContext - 1, kMaxContext), 2,
             FinishReason::kNone);
  // 100 committed: no row left.
  ExpectStop(ApplyStopping({5, 6}, 0, {}, kEos, kMaxContext, kMaxContext), 2,
             FinishReason::kMaxContext);
  // Truncation by a stop token comes first.
  const StoppingCriteria stopping{.stop_token_ids = {5}};
  ExpectStop(ApplyStopping({5, 6}, 0, stopping, kEos, kMaxContext, kMaxContext), 1,
             FinishReason::kStopToken);
}

}  // namespace
}  // namespace treeverify::coordinator
