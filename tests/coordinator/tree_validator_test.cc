#include "treeverify/coordinator/tree_validator.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace treeverify::coordinator {
namespace {

using ::testing::HasSubstr;

const TreeLimits kLimits{.max_draft_nodes = 255, .vocab_size = 1000, .max_context_length = 4096};

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(status.message(), HasSubstr(text));
}

TEST(ValidateDraftTreeTest, AcceptsWellFormedTrees) {
  EXPECT_TRUE(ValidateDraftTree({}, {}, kLimits, 10).ok());
  // Two branches under the pending token, a chain under the first.
  EXPECT_TRUE(ValidateDraftTree({5, 6, 7, 8, 999}, {-1, -1, 0, 2, 1}, kLimits, 10).ok());
  // Token ids at both ends of the vocabulary.
  EXPECT_TRUE(ValidateDraftTree({0, 999}, {-1, 0}, kLimits, 0).ok());
  // Exactly the node limit.
  std::vector<int32_t> tokens(255, 1), parents(255, -1);
  EXPECT_TRUE(ValidateDraftTree(tokens, parents, kLimits, 0).ok());
}

TEST(ValidateDraftTreeTest, LengthMismatch) {
  ExpectError(ValidateDraftTree({1, 2, 3}, {-1, 0}, kLimits, 0), absl::StatusCode::kInvalidArgument,
              "tree.token_ids has 3 entries but tree.parents has 2");
}

TEST(ValidateDraftTreeTest, TooManyNodes) {
  std::vector<int32_t> tokens(300, 1), parents(300, -1);
  ExpectError(ValidateDraftTree(tokens, parents, kLimits, 0), absl::StatusCode::kInvalidArgument,
              "tree has 300 draft nodes; the limit is 255");
  std::vector<int32_t> one_over(256, 1), one_over_parents(256, -1);
  ExpectError(ValidateDraftTree(one_over, one_over_parents, kLimits, 0),
              absl::StatusCode::kInvalidArgument, "tree has 256 draft nodes");
}

TEST(ValidateDraftTreeTest, ParentNotEarlier) {
  ExpectError(ValidateDraftTree({1, 2, 3, 4, 5}, {-1, 0, 1, 2, 7}, kLimits, 0),
              absl::StatusCode::kInvalidArgument,
              "parents[4] = 7: a parent must be -1 (the pending token) or an earlier node (0..3)");
  // A node cannot be its own parent.
  ExpectError(ValidateDraftTree({1, 2}, {-1, 1}, kLimits, 0), absl::StatusCode::kInvalidArgument,
              "parents[1] = 1: a parent must be -1 (the pending token) or an earlier node (0..0)");
  // Node 0 can only hang under the pending token.
  ExpectError(ValidateDraftTree({1}, {0}, kLimits, 0), absl::StatusCode::kInvalidArgument,
              "parents[0] = 0: a parent must be -1");
  ExpectError(ValidateDraftTree({1, 2}, {-1, -2}, kLimits, 0), absl::StatusCode::kInvalidArgument,
              "parents[1] = -2");
}

TEST(ValidateDraftTreeTest, TokenOutsideVocabulary) {
  ExpectError(ValidateDraftTree({1, 1000}, {-1, 0}, kLimits, 0), absl::StatusCode::kInvalidArgument,
              "token_ids[1] = 1000 is outside the vocabulary [0, 1000)");
  ExpectError(ValidateDraftTree({1, 2, -5}, {-1, 0, 0}, kLimits, 0),
              absl::StatusCode::kInvalidArgument, "token_ids[2] = -5 is outside the vocabulary");
}

TEST(ValidateDraftTreeTest, MalformedTreeIsReportedBeforeTheContext) {
  // Both malformed and too long for the context: the malformation is the error.
  ExpectError(ValidateDraftTree({1, 5000}, {-1, 0}, kLimits, 4095),
              absl::StatusCode::kInvalidArgument, "token_ids[1] = 5000");
}

TEST(ValidateDraftTreeTest, ContextBoundary) {
  // committed + 1 (pending) + nodes rows; 4096 allowed.
  const std::vector<int32_t> tokens{1, 2, 3, 4};
  const std::vector<int32_t> parents{-1, 0, 0, 2};
  EXPECT_TRUE(ValidateDraftTree(tokens, parents, kLimits, 4096 - 1 - 4).ok());
  ExpectError(ValidateDraftTree(tokens, parents, kLimits, 4096 - 1 - 4 + 1),
              absl::StatusCode::kOutOfRange,
              "the step needs 4097 context rows (4092 committed + 1 pending + 4 draft nodes) but "
              "max_context_length is 4096; send at most 3 draft nodes");

  // An empty tree needs only the pending token's row.
  EXPECT_TRUE(ValidateDraftTree({}, {}, kLimits, 4095).ok());
  ExpectError(ValidateDraftTree({}, {}, kLimits, 4096), absl::StatusCode::kOutOfRange,
              "the session's context is full");
}

TEST(ValidatePromptTest, AcceptsAPromptThatLeavesARow) {
  EXPECT_TRUE(ValidatePrompt({0, 999, 5}, kLimits).ok());
  std::vector<int32_t> longest(4095, 7);
  EXPECT_TRUE(ValidatePrompt(longest, kLimits).ok());
}

TEST(ValidatePromptTest, Empty) {
  ExpectError(ValidatePrompt({}, kLimits), absl::StatusCode::kInvalidArgument,
              "prompt_token_ids is empty");
}

TEST(ValidatePromptTest, TokenOutsideVocabulary) {
  ExpectError(ValidatePrompt({1, 2, 3, 1000}, kLimits), absl::StatusCode::kInvalidArgument,
              "prompt_token_ids[3] = 1000 is outside the vocabulary [0, 1000)");
  ExpectError(ValidatePrompt({-1}, kLimits), absl::StatusCode::kInvalidArgument,
              "prompt_token_ids[0] = -1");
}

TEST(ValidatePromptTest, NoRowForTheFirstPendingToken) {
  std::vector<int32_t> full(4096, 7);
  ExpectError(ValidatePrompt(full, kLimits), absl::StatusCode::kOutOfRange,
              "prompt has 4096 tokens; max_context_length is 4096");
  std::vector<int32_t> longer(5000, 7);
  ExpectError(ValidatePrompt(longer, kLimits), absl::StatusCode::kOutOfRange,
              "at most 4095 prompt tokens fit");
}

}  // namespace
}  // namespace treeverify::coordinator
