// Token selection from the ranks' shard summaries: greedy, Gumbel-max sampling and top-k / top-p,
// with the ranks' side computed by the real CPU kernel. The chosen token must not depend on how
// the vocabulary is split over ranks.
#include "treeverify/coordinator/token_selector.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/lm_head_summary.h"

namespace treeverify::coordinator {
namespace {

using kernels::Candidate;
using kernels::NodeSummary;
using ::testing::HasSubstr;

// One rank's kernel output for the same logits at every position.
struct RankOutput {
  std::vector<NodeSummary> summaries;  // [positions]
  std::vector<Candidate> candidates;   // [positions, k]
  int32_t k = 0;
};

// Runs the LM-head summary of each shard [bounds[r], bounds[r + 1]) of `logits` at every position.
std::vector<RankOutput> RunRanks(const std::vector<float>& logits,
                                 const std::vector<int64_t>& bounds,
                                 const std::vector<int64_t>& positions, float temperature,
                                 uint64_t seed, int32_t k) {
  std::vector<RankOutput> ranks(bounds.size() - 1);
  const int64_t rows = static_cast<int64_t>(positions.size());
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    const int64_t width = bounds[r + 1] - bounds[r];
    std::vector<float> shard(rows * width);
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(logits.begin() + bounds[r], width, shard.begin() + i * width);
    }
    RankOutput& out = ranks[r];
    out.k = k;
    out.summaries.resize(rows);
    out.candidates.resize(rows * k);
    const absl::Status status =
        kernels::cpu::LmHeadSummary({.logits = shard.data(),
                                     .out = out.summaries.data(),
                                     .rows = rows,
                                     .vocab_shard = width,
                                     .vocab_begin = static_cast<int32_t>(bounds[r]),
                                     .temperature = temperature,
                                     .seed = seed,
                                     .positions = positions.data(),
                                     .num_candidates = k,
                                     .candidates = out.candidates.data()});
    EXPECT_TRUE(status.ok()) << status;
  }
  return ranks;
}

std::vector<ShardNode> NodeOf(const std::vector<RankOutput>& ranks, size_t i) {
  std::vector<ShardNode> shards;
  for (const RankOutput& rank : ranks) {
    shards.push_back(
        {&rank.summaries[i], absl::MakeConstSpan(rank.candidates).subspan(i * rank.k, rank.k)});
  }
  return shards;
}

SelectedToken Select(const std::vector<RankOutput>& ranks, size_t i, const SamplingParams& params,
                     int64_t position) {
  absl::StatusOr<SelectedToken> selected = SelectToken(NodeOf(ranks, i), params, position);
  EXPECT_TRUE(selected.ok()) << selected.status();
  return selected.value_or(SelectedToken{});
}

// world - 1 random cut points in 1..vocab-1.
std::vector<int64_t> RandomSplit(int64_t vocab, int world, std::mt19937& rng) {
  std::set<int64_t> cuts;
  while (static_cast<int>(cuts.size()) < world - 1) {
    cuts.insert(std::uniform_int_distribution<int64_t>(1, vocab - 1)(rng));
  }
  std::vector<int64_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(vocab);
  return bounds;
}

std::vector<float> RandomLogits(int64_t vocab, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> logits(vocab);
  for (float& l : logits) l = normal(rng);
  return logits;
}

std::vector<int64_t> Positions(int64_t first, int64_t count) {
  std::vector<int64_t> positions(count);
  for (int64_t i = 0; i < count; ++i) positions[i] = first + i;
  return positions;
}

double FullLogSumExp(const std::vector<float>& logits, double temperature) {
  double max_scaled = -std::numeric_limits<double>::infinity();
  for (float l : logits) max_scaled = std::max(max_scaled, l / temperature);
  double sum = 0.0;
  for (float l : logits) sum += std::exp(l / temperature - max_scaled);
  return max_scaled + std::log(sum);
}

// Token ids sorted by logit descending, ties by smaller id.
std::vector<int32_t> RankedTokens(const std::vector<float>& logits) {
  std::vector<int32_t> ids(logits.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  return ids;
}

// The smallest prefix of RankedTokens whose probability at `temperature` reaches top_p.
std::set<int32_t> Nucleus(const std::vector<float>& logits, float temperature, float top_p) {
  const double lse = FullLogSumExp(logits, temperature);
  std::set<int32_t> nucleus;
  double cumulative = 0.0;
  for (int32_t id : RankedTokens(logits)) {
    nucleus.insert(id);
    cumulative += std::exp(logits[id] / double{temperature} - lse);
    if (cumulative >= top_p) break;
  }
  return nucleus;
}

TEST(TokenSelectorTest, GreedyIsTheReducedArgmax) {
  const unsigned seed = 11;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const std::vector<float> logits = RandomLogits(733, 3.0f, rng);
  const std::vector<RankOutput> ranks =
      RunRanks(logits, RandomSplit(733, 3, rng), Positions(5, 1), 0.0f, 0, 0);
  const SelectedToken t = Select(ranks, 0, {}, 6);
  const int32_t argmax = RankedTokens(logits)[0];
  EXPECT_EQ(t.token, argmax);
  EXPECT_NEAR(t.logprob, logits[argmax] - FullLogSumExp(logits, 1.0), 1e-5);
}

// Splitting the vocabulary over 1..4 ranks never changes the chosen token: unrestricted sampling,
// top-k, top-p, both, and greedy.
TEST(TokenSelectorTest, ShardSplitDoesNotChangeTheToken) {
  const std::vector<SamplingParams> all_params = {
      {.temperature = 0.8f, .seed = 42},
      {.temperature = 1.3f, .seed = 7, .top_k = 5},
      {.temperature = 0.8f, .seed = 42, .top_p = 0.9f},
      {.temperature = 2.0f, .seed = 3, .top_k = 10, .top_p = 0.5f},
      {.temperature = 0.0f},
  };
  for (int64_t vocab : {50, 733}) {
    for (size_t p = 0; p < all_params.size(); ++p) {
      const SamplingParams& params = all_params[p];
      const unsigned seed = static_cast<unsigned>(100 + vocab + p);
      SCOPED_TRACE(absl::StrCat("seed=", seed, " vocab=", vocab, " params #", p));
      std::mt19937 rng(seed);
      const std::vector<float> logits = RandomLogits(vocab, 2.0f, rng);
      const std::vector<int64_t> positions = Positions(1000, 200);
      // Every rank lists its whole shard, so top-p is exact for any split.
      const int32_t k = static_cast<int32_t>(vocab);
      const std::vector<RankOutput> one =
          RunRanks(logits, {0, vocab}, positions, params.temperature, params.seed, k);
      std::vector<int32_t> expected(positions.size());
      for (size_t i = 0; i < positions.size(); ++i) {
        expected[i] = Select(one, i, params, positions[i]).token;
      }
      for (int world = 2; world <= 4; ++world) {
        const std::vector<int64_t> bounds = RandomSplit(vocab, world, rng);
        const std::vector<RankOutput> ranks =
            RunRanks(logits, bounds, positions, params.temperature, params.seed, k);
        for (size_t i = 0; i < positions.size(); ++i) {
          ASSERT_EQ(Select(ranks, i, params, positions[i]).token, expected[i])
              << "world " << world << " position " << positions[i];
        }
      }
      if (params.temperature > 0.0f) {
        EXPECT_GT(std::set<int32_t>(expected.begin(), expected.end()).size(), 1u)
            << "sampling should not always pick one token";
      }
    }
  }
}

// With the candidates a real deployment sends (CandidatesPerShard), top-k and a nucleus smaller
// than one rank's list are still exact for any split.
TEST(TokenSelectorTest, ShardSplitWithDeployedCandidateCounts) {
  const unsigned seed = 21;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 733;
  const std::vector<float> logits = RandomLogits(vocab, 4.0f, rng);
  const std::vector<int64_t> positions = Positions(7, 300);
  for (const SamplingParams& params :
       {SamplingParams{.temperature = 1.0f, .seed = 5, .top_k = 7},
        SamplingParams{.temperature = 0.7f, .seed = 6, .top_p = 0.95f}}) {
    if (params.top_p > 0.0f) {
      ASSERT_LT(Nucleus(logits, params.temperature, params.top_p).size(), 64u)
          << "the nucleus must fit one rank's list for this test";
    }
    const int32_t k = CandidatesPerShard(params);
    const std::vector<RankOutput> one =
        RunRanks(logits, {0, vocab}, positions, params.temperature, params.seed, k);
    for (int world = 2; world <= 4; ++world) {
      const std::vector<RankOutput> ranks = RunRanks(logits, RandomSplit(vocab, world, rng),
                                                     positions, params.temperature, params.seed, k);
      for (size_t i = 0; i < positions.size(); ++i) {
        ASSERT_EQ(Select(ranks, i, params, positions[i]).token,
                  Select(one, i, params, positions[i]).token)
            << "top_k " << params.top_k << " top_p " << params.top_p << " world " << world
            << " position " << positions[i];
      }
    }
  }
}

// The coordinator draws the same noise as the ranks, so top-k = vocab (merged on the
// coordinator) equals unrestricted sampling (maxed on the ranks) exactly, log-prob included.
TEST(TokenSelectorTest, TopKOfTheWholeVocabularyEqualsUnrestrictedSampling) {
  const unsigned seed = 31;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 97;
  const std::vector<float> logits = RandomLogits(vocab, 1.5f, rng);
  const std::vector<int64_t> positions = Positions(0, 1000);
  const SamplingParams unrestricted{.temperature = 0.9f, .seed = 0xDEADBEEFCAFEull};
  SamplingParams top_all = unrestricted;
  top_all.top_k = static_cast<int32_t>(vocab);
  const double lse = FullLogSumExp(logits, 1.0);
  for (int world = 1; world <= 4; ++world) {
    const std::vector<RankOutput> ranks =
        RunRanks(logits, RandomSplit(vocab, world, rng), positions, unrestricted.temperature,
                 unrestricted.seed, static_cast<int32_t>(vocab));
    for (size_t i = 0; i < positions.size(); ++i) {
      const SelectedToken a = Select(ranks, i, unrestricted, positions[i]);
      const SelectedToken b = Select(ranks, i, top_all, positions[i]);
      ASSERT_EQ(a.token, b.token) << "world " << world << " position " << positions[i];
      ASSERT_EQ(a.logprob, b.logprob) << "world " << world << " position " << positions[i];
      ASSERT_NEAR(a.logprob, logits[a.token] - lse, 1e-5);
    }
  }
}

TEST(TokenSelectorTest, TopKOneIsGreedy) {
  const unsigned seed = 41;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 211;
  const std::vector<float> logits = RandomLogits(vocab, 1.0f, rng);
  const std::vector<int64_t> positions = Positions(50, 500);
  const SamplingParams params{.temperature = 5.0f, .seed = 1, .top_k = 1};
  const std::vector<RankOutput> ranks =
      RunRanks(logits, RandomSplit(vocab, 3, rng), positions, params.temperature, params.seed,
               CandidatesPerShard(params));
  const int32_t argmax = RankedTokens(logits)[0];
  for (size_t i = 0; i < positions.size(); ++i) {
    ASSERT_EQ(Select(ranks, i, params, positions[i]).token, argmax) << "position " << positions[i];
    ASSERT_EQ(Select(ranks, i, {}, positions[i]).token, argmax);
  }
}

// A token outside the top-p nucleus is never chosen, though unrestricted sampling picks such
// tokens; several nucleus tokens are.
TEST(TokenSelectorTest, TopPNeverLeavesTheNucleus) {
  const unsigned seed = 51;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 50;
  const std::vector<float> logits = RandomLogits(vocab, 1.5f, rng);
  const SamplingParams params{.temperature = 1.0f, .seed = 77, .top_p = 0.6f};
  const std::set<int32_t> nucleus = Nucleus(logits, params.temperature, params.top_p);
  ASSERT_GT(nucleus.size(), 1u);
  ASSERT_LT(nucleus.size(), 20u);
  const std::vector<int64_t> positions = Positions(300, 2000);
  const std::vector<RankOutput> ranks =
      RunRanks(logits, RandomSplit(vocab, 2, rng), positions, params.temperature, params.seed,
               CandidatesPerShard(params));
  SamplingParams unrestricted = params;
  unrestricted.top_p = 0.0f;
  std::set<int32_t> chosen;
  int outside_unrestricted = 0;
  for (size_t i = 0; i < positions.size(); ++i) {
    const int32_t token = Select(ranks, i, params, positions[i]).token;
    ASSERT_TRUE(nucleus.count(token)) << "token " << token << " at position " << positions[i];
    chosen.insert(token);
    outside_unrestricted += !nucleus.count(Select(ranks, i, unrestricted, positions[i]).token);
  }
  EXPECT_GT(outside_unrestricted, 100);
  EXPECT_EQ(chosen, nucleus);
}

// A nucleus wider than the candidates is cut to the merged prefix known to be the true top tokens:
// never a token that some rank did not list while it held better ones.
TEST(TokenSelectorTest, TopPBeyondTheCandidatesIsTruncatedToTheExactPrefix) {
  const unsigned seed = 61;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 733;
  const std::vector<float> logits = RandomLogits(vocab, 0.1f, rng);  // flat: a huge nucleus
  const SamplingParams params{.temperature = 1.0f, .seed = 9, .top_p = 0.99f};
  const int32_t k = 8;
  const std::vector<int64_t> bounds = {0, 300, vocab};
  const std::vector<int64_t> positions = Positions(0, 2000);
  const std::vector<RankOutput> ranks =
      RunRanks(logits, bounds, positions, params.temperature, params.seed, k);
  // The better of the two ranks' last candidates bounds the exact prefix.
  const std::vector<int32_t> ranked = RankedTokens(logits);
  std::vector<int32_t> global_rank(vocab);
  for (int64_t i = 0; i < vocab; ++i) global_rank[ranked[i]] = static_cast<int32_t>(i);
  const int32_t cutoff_rank = std::min(global_rank[ranks[0].candidates[k - 1].token_id],
                                       global_rank[ranks[1].candidates[k - 1].token_id]);
  ASSERT_GE(cutoff_rank, k - 1);
  std::set<int32_t> chosen;
  for (size_t i = 0; i < positions.size(); ++i) {
    const int32_t token = Select(ranks, i, params, positions[i]).token;
    ASSERT_LE(global_rank[token], cutoff_rank) << "position " << positions[i];
    chosen.insert(token);
  }
  EXPECT_EQ(static_cast<int32_t>(chosen.size()), cutoff_rank + 1);
}

TEST(TokenSelectorTest, RejectsWhatItCannotServe) {
  const unsigned seed = 71;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 40;
  const std::vector<float> logits = RandomLogits(vocab, 1.0f, rng);
  const std::vector<int64_t> positions = {12};
  const std::vector<int64_t> bounds = {0, 20, vocab};
  auto code = [&](const std::vector<RankOutput>& ranks, const SamplingParams& params) {
    return SelectToken(NodeOf(ranks, 0), params, 13).status();
  };
  auto expect_invalid = [](const absl::Status& status, const std::string& needle) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(needle));
  };
  const std::vector<RankOutput> complete = RunRanks(logits, bounds, positions, 1.0f, 1, 64);
  const std::vector<RankOutput> eight = RunRanks(logits, bounds, positions, 1.0f, 1, 8);
  const std::vector<RankOutput> greedy = RunRanks(logits, bounds, positions, 0.0f, 1, 0);
  const std::vector<RankOutput> none = RunRanks(logits, bounds, positions, 1.0f, 1, 0);

  EXPECT_TRUE(code(complete, {.temperature = 1.0f, .top_k = 40}).ok());
  expect_invalid(code(complete, {.temperature = 1.0f, .top_k = 41}), "top_k 41");
  EXPECT_TRUE(code(eight, {.temperature = 1.0f, .top_k = 8}).ok());
  expect_invalid(code(eight, {.temperature = 1.0f, .top_k = 9}), "may hold more tokens");
  expect_invalid(code(none, {.temperature = 1.0f, .top_p = 0.5f}), "no candidates");
  expect_invalid(code(greedy, {.temperature = 1.0f}), "no sampled token");
  EXPECT_TRUE(code(greedy, {}).ok());
  expect_invalid(code(complete, {.temperature = -1.0f}), "temperature");
  expect_invalid(code(complete, {.temperature = std::numeric_limits<float>::quiet_NaN()}),
                 "temperature");
  expect_invalid(code(complete, {.temperature = 1.0f, .top_k = -1}), "top_k");
  expect_invalid(code(complete, {.temperature = 1.0f, .top_p = 1.5f}), "top_p");
  expect_invalid(SelectToken({}, {}, 0).status(), "at least one shard");
  const ShardNode null_summary{nullptr, {}};
  expect_invalid(SelectToken({&null_summary, 1}, {}, 0).status(), "null");
}

TEST(TokenSelectorTest, CandidatesPerShard) {
  EXPECT_EQ(CandidatesPerShard({}), 0);
  EXPECT_EQ(CandidatesPerShard({.top_k = 5}), 0) << "greedy needs no candidates";
  EXPECT_EQ(CandidatesPerShard({.temperature = 1.0f}), 0);
  EXPECT_EQ(CandidatesPerShard({.temperature = 1.0f, .top_p = 1.0f}), 0);
  EXPECT_EQ(CandidatesPerShard({.temperature = 1.0f, .top_k = 5}), 5);
  EXPECT_EQ(CandidatesPerShard({.temperature = 1.0f, .top_k = 500}), kMaxCandidatesPerShard);
  EXPECT_EQ(CandidatesPerShard({.temperature = 1.0f, .top_p = 0.9f}), kMaxCandidatesPerShard);
  EXPECT_EQ(CandidatesPerShard({.temperature = 1.0f, .top_k = 10, .top_p = 0.9f}), 10);
}

}  // namespace
}  // namespace treeverify::coordinator
