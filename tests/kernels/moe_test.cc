// Tests of the CPU MoE routing (against hand-built cases and a brute-force reference of
// transformers' routers) and expert computation (against a naive double-precision reference).
#include "treeverify/kernels/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace treeverify::kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::vector<float> RandomFloats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

void ExpectInvalid(const absl::Status& status, const std::string& needle) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(needle));
}

// The logit whose sigmoid is p.
float Logit(double p) { return static_cast<float>(std::log(p / (1.0 - p))); }

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed Route(MoeRoutingParams params, const std::vector<float>& logits) {
  Routed routed{std::vector<int32_t>(params.tokens * params.top_k, -1),
                std::vector<float>(params.tokens * params.top_k, -1.0f)};
  params.router_logits = logits.data();
  params.topk_ids = routed.ids.data();
  params.topk_weights = routed.weights.data();
  const absl::Status status = cpu::MoeRouting(params);
  EXPECT_TRUE(status.ok()) << status;
  return routed;
}

MoeRoutingParams V3Router(int32_t num_experts, int32_t top_k, int32_t num_groups,
                          int32_t topk_groups, const float* bias) {
  return {.correction_bias = bias,
          .tokens = 1,
          .num_experts = num_experts,
          .top_k = top_k,
          .num_groups = num_groups,
          .topk_groups = topk_groups,
          .scoring = MoeScoring::kSigmoid,
          .method = MoeTopkMethod::kNoauxTc,
          .normalize = true,
          .routed_scaling_factor = 2.5f};
}

// ---------------------------------------------------------------------------------------------
// Routing: hand-built cases

TEST(MoeRoutingTest, NoauxTcGroupRestrictionDropsTheGloballyBestExpert) {
  // Four groups of two. Group 0 holds the best expert (0.95) but a poor partner; groups 1 and 2
  // have the best top-2 sums (1.2 and 1.1) and are kept.
  const std::vector<double> probs = {0.95, 0.05, 0.6, 0.6, 0.55, 0.56, 0.1, 0.1};
  std::vector<float> logits;
  for (double p : probs) logits.push_back(Logit(p));
  const std::vector<float> zero_bias(8, 0.0f);
  const Routed grouped = Route(V3Router(8, 2, 4, 2, zero_bias.data()), logits);
  EXPECT_THAT(grouped.ids, ElementsAre(2, 3));
  EXPECT_NEAR(grouped.weights[0], 1.25f, 1e-6);  // 0.6 / 1.2 * 2.5
  EXPECT_NEAR(grouped.weights[1], 1.25f, 1e-6);

  // Without the restriction (all groups kept) the best expert wins.
  const Routed ungrouped = Route(V3Router(8, 2, 4, 4, zero_bias.data()), logits);
  EXPECT_THAT(ungrouped.ids, ElementsAre(0, 2));
  EXPECT_NEAR(ungrouped.weights[0], 0.95 / 1.55 * 2.5, 1e-6);
  EXPECT_NEAR(ungrouped.weights[1], 0.6 / 1.55 * 2.5, 1e-6);
}

TEST(MoeRoutingTest, NoauxTcBiasPicksButScoresWeigh) {
  std::mt19937 rng(11);
  SCOPED_TRACE("seed=11");
  const std::vector<float> logits = RandomFloats(rng, 8, -1.0f, 1.0f);
  std::vector<float> bias(8, 0.0f);
  bias[6] = 10.0f;  // forces expert 6 and its group (3)
  bias[7] = 9.0f;
  const Routed routed = Route(V3Router(8, 2, 4, 1, bias.data()), logits);
  EXPECT_THAT(routed.ids, ElementsAre(6, 7));
  const double s6 = 1.0 / (1.0 + std::exp(-double{logits[6]}));
  const double s7 = 1.0 / (1.0 + std::exp(-double{logits[7]}));
  EXPECT_NEAR(routed.weights[0], s6 / (s6 + s7) * 2.5, 1e-6);
  EXPECT_NEAR(routed.weights[1], s7 / (s6 + s7) * 2.5, 1e-6);
}

TEST(MoeRoutingTest, GroupLimitedGreedyMasksDroppedGroups) {
  // Softmax over 8 experts in 4 groups; one group kept. The runner-up (expert 2, logit 4.9) sits
  // in group 1, which loses to group 0 (max 5.0): top-2 must come from group 0 alone.
  const std::vector<float> logits = {5.0f, 1.0f, 4.9f, 0.5f, 2.0f, 2.0f, 0.0f, -1.0f};
  MoeRoutingParams params{.tokens = 1,
                          .num_experts = 8,
                          .top_k = 2,
                          .num_groups = 4,
                          .topk_groups = 1,
                          .scoring = MoeScoring::kSoftmax,
                          .method = MoeTopkMethod::kGroupLimitedGreedy,
                          .normalize = false,
                          .routed_scaling_factor = 16.0f};
  double sum = 0.0;
  for (float l : logits) sum += std::exp(double{l} - 5.0);
  auto softmax = [&](int e) { return std::exp(double{logits[e]} - 5.0) / sum; };

  const Routed grouped = Route(params, logits);
  EXPECT_THAT(grouped.ids, ElementsAre(0, 1));
  EXPECT_NEAR(grouped.weights[0], softmax(0) * 16.0, 1e-5);
  EXPECT_NEAR(grouped.weights[1], softmax(1) * 16.0, 1e-5);

  // Plain greedy ignores groups.
  params.method = MoeTopkMethod::kGreedy;
  const Routed greedy = Route(params, logits);
  EXPECT_THAT(greedy.ids, ElementsAre(0, 2));
  EXPECT_NEAR(greedy.weights[1], softmax(2) * 16.0, 1e-5);

  // With normalization the weights sum to the scaling factor.
  params.normalize = true;
  const Routed normalized = Route(params, logits);
  EXPECT_NEAR(normalized.weights[0], softmax(0) / (softmax(0) + softmax(2)) * 16.0, 1e-5);
  EXPECT_NEAR(normalized.weights[0] + normalized.weights[1], 16.0, 1e-5);
}

TEST(MoeRoutingTest, GroupLimitedGreedyPicksZeroWeightExpertsWhenKeptGroupsRunOut) {
  // transformers masks dropped groups with 0.0; if a kept expert's probability underflows to 0
  // it ties with the masked ones, and the lower id wins.
  const std::vector<float> logits = {0.0f, -200.0f, 3.0f, 2.0f};
  const Routed routed = Route({.tokens = 1,
                               .num_experts = 4,
                               .top_k = 2,
                               .num_groups = 2,
                               .topk_groups = 1,
                               .scoring = MoeScoring::kSoftmax,
                               .method = MoeTopkMethod::kGroupLimitedGreedy,
                               .normalize = false},
                              logits);
  EXPECT_THAT(routed.ids, ElementsAre(2, 3));
  const Routed low = Route({.tokens = 1,
                            .num_experts = 4,
                            .top_k = 2,
                            .num_groups = 2,
                            .topk_groups = 1,
                            .scoring = MoeScoring::kSoftmax,
                            .method = MoeTopkMethod::kGroupLimitedGreedy,
                            .normalize = false},
                           {3.0f, -200.0f, 0.0f, 2.0f});
  // Group 0 kept; expert 1's probability is exactly 0 in fp32, tying with masked experts 2, 3.
  EXPECT_THAT(low.ids, ElementsAre(0, 1));
  EXPECT_EQ(low.weights[1], 0.0f);
}

TEST(MoeRoutingTest, TokensPastTheRoutedCountGetNoExpert) {
  const std::vector<float> bias(8, 0.0f);
  MoeRoutingParams params = V3Router(8, 2, 4, 2, bias.data());
  params.tokens = 3;
  std::vector<float> logits(3 * 8);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.1f * static_cast<float>(i % 7);
  const Routed all = Route(params, logits);
  const int32_t routed = 1;
  params.routed_tokens = &routed;
  const Routed first = Route(params, logits);
  EXPECT_EQ(std::vector<int32_t>(first.ids.begin(), first.ids.begin() + 2),
            std::vector<int32_t>(all.ids.begin(), all.ids.begin() + 2));
  EXPECT_EQ(std::vector<int32_t>(first.ids.begin() + 2, first.ids.end()),
            std::vector<int32_t>(4, -1));
  EXPECT_EQ(std::vector<float>(first.weights.begin() + 2, first.weights.end()),
            std::vector<float>(4, 0.0f));
  EXPECT_NE(all.ids[2], -1);
}

TEST(MoeRoutingTest, TiesPreferLowerExpertIds) {
  const std::vector<float> equal(12, 0.25f);
  const Routed softmax = Route({.tokens = 1,
                                .num_experts = 12,
                                .top_k = 3,
                                .scoring = MoeScoring::kSoftmax,
                                .method = MoeTopkMethod::kGreedy,
                                .normalize = false},
                               equal);
  EXPECT_THAT(softmax.ids, ElementsAre(0, 1, 2));
  for (float w : softmax.weights) EXPECT_NEAR(w, 1.0 / 12.0, 1e-7);

  // Equal groups too: the lowest groups, then the lowest experts in them.
  const std::vector<float> zero_bias(12, 0.0f);
  const Routed noaux = Route(V3Router(12, 4, 4, 2, zero_bias.data()), equal);
  EXPECT_THAT(noaux.ids, ElementsAre(0, 1, 2, 3));
  for (float w : noaux.weights) EXPECT_NEAR(w, 2.5 / 4, 1e-6);

  // A tie between a kept expert and a better one elsewhere: ids come out ascending anyway.
  std::vector<float> logits = {0.0f, 0.0f, 1.0f, 0.0f, 2.0f, 2.0f};
  const Routed ordered = Route({.tokens = 1,
                                .num_experts = 6,
                                .top_k = 3,
                                .scoring = MoeScoring::kSoftmax,
                                .method = MoeTopkMethod::kGreedy,
                                .normalize = true},
                               logits);
  EXPECT_THAT(ordered.ids, ElementsAre(2, 4, 5));
  EXPECT_EQ(ordered.weights[1], ordered.weights[2]);
  EXPECT_LT(ordered.weights[0], ordered.weights[1]);
}

// ---------------------------------------------------------------------------------------------
// Routing: brute force

// transformers' routers written out with full sorts: scores, choice, group scores, a sort of the
// groups, masking, a sort of the experts.
Routed BruteForceRoute(const MoeRoutingParams& p, const std::vector<float>& logits,
                       const std::vector<float>& bias) {
  Routed routed;
  const int32_t num_experts = p.num_experts;
  const int32_t group_size = num_experts / p.num_groups;
  // Sorts indices by value, descending, ties to the lower index.
  auto ranked = [](const std::vector<float>& values) {
    std::vector<int32_t> order(values.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return values[a] > values[b]; });
    return order;
  };
  for (int64_t t = 0; t < p.tokens; ++t) {
    const float* row = &logits[t * num_experts];
    std::vector<float> scores(num_experts);
    if (p.scoring == MoeScoring::kSigmoid) {
      for (int32_t e = 0; e < num_experts; ++e) {
        scores[e] = static_cast<float>(1.0 / (1.0 + std::exp(-double{row[e]})));
      }
    } else {
      const double max_logit = *std::max_element(row, row + num_experts);
      double sum = 0.0;
      for (int32_t e = 0; e < num_experts; ++e) sum += std::exp(row[e] - max_logit);
      for (int32_t e = 0; e < num_experts; ++e) {
        scores[e] = static_cast<float>(std::exp(row[e] - max_logit) / sum);
      }
    }
    std::vector<float> choice = scores;
    if (p.method == MoeTopkMethod::kNoauxTc) {
      for (int32_t e = 0; e < num_experts; ++e) choice[e] = scores[e] + bias[e];
    }
    if (p.method != MoeTopkMethod::kGreedy) {
      std::vector<float> group_scores(p.num_groups);
      for (int32_t g = 0; g < p.num_groups; ++g) {
        std::vector<float> group(choice.begin() + g * group_size,
                                 choice.begin() + (g + 1) * group_size);
        std::sort(group.begin(), group.end(), std::greater<float>());
        group_scores[g] = p.method == MoeTopkMethod::kNoauxTc ? group[0] + group[1] : group[0];
      }
      const std::vector<int32_t> group_order = ranked(group_scores);
      std::vector<bool> kept(p.num_groups, false);
      for (int32_t i = 0; i < p.topk_groups; ++i) kept[group_order[i]] = true;
      for (int32_t e = 0; e < num_experts; ++e) {
        if (!kept[e / group_size]) {
          choice[e] =
              p.method == MoeTopkMethod::kNoauxTc ? -std::numeric_limits<float>::infinity() : 0.0f;
        }
      }
    }
    std::vector<int32_t> selected = ranked(choice);
    selected.resize(p.top_k);
    std::sort(selected.begin(), selected.end());
    double sum = 0.0;
    std::vector<double> weights;
    for (int32_t id : selected) {
      weights.push_back(p.method == MoeTopkMethod::kNoauxTc ? scores[id] : choice[id]);
      sum += weights.back();
    }
    for (size_t j = 0; j < selected.size(); ++j) {
      routed.ids.push_back(selected[j]);
      routed.weights.push_back(static_cast<float>((p.normalize ? weights[j] / sum : weights[j]) *
                                                  p.routed_scaling_factor));
    }
  }
  return routed;
}

struct RouterConfig {
  const char* name;
  MoeScoring scoring;
  MoeTopkMethod method;
  int32_t num_experts, top_k, num_groups, topk_groups;
  bool normalize;
  float scaling;
};

constexpr RouterConfig kRouterConfigs[] = {
    // DeepSeek-V3 / Kimi-K2 style (scaled down), V2 and V2-Lite style, and odd shapes.
    {"v3_noaux_tc", MoeScoring::kSigmoid, MoeTopkMethod::kNoauxTc, 64, 8, 8, 4, true, 2.5f},
    {"k2_noaux_tc_one_group", MoeScoring::kSigmoid, MoeTopkMethod::kNoauxTc, 19, 7, 1, 1, true,
     2.827f},
    {"noaux_tc_odd", MoeScoring::kSigmoid, MoeTopkMethod::kNoauxTc, 21, 3, 7, 3, false, 1.0f},
    {"v2_group_limited", MoeScoring::kSoftmax, MoeTopkMethod::kGroupLimitedGreedy, 40, 6, 8, 3,
     false, 16.0f},
    {"group_limited_odd", MoeScoring::kSoftmax, MoeTopkMethod::kGroupLimitedGreedy, 21, 2, 7, 1,
     true, 1.0f},
    {"v2_lite_greedy", MoeScoring::kSoftmax, MoeTopkMethod::kGreedy, 64, 6, 1, 1, false, 1.0f},
    {"greedy_odd_normalized", MoeScoring::kSoftmax, MoeTopkMethod::kGreedy, 19, 7, 1, 1, true,
     1.5f},
};

TEST(MoeRoutingTest, MatchesBruteForceOnRandomLogits) {
  for (const RouterConfig& config : kRouterConfigs) {
    for (int64_t tokens : {1, 3, 7, 19, 733}) {
      const uint32_t seed = static_cast<uint32_t>(100 + tokens * 13 + config.num_experts);
      SCOPED_TRACE(absl::StrCat("seed=", seed, " config=", config.name, " tokens=", tokens));
      std::mt19937 rng(seed);
      const std::vector<float> logits = RandomFloats(rng, tokens * config.num_experts, -4.0f, 4.0f);
      const std::vector<float> bias = RandomFloats(rng, config.num_experts, -0.1f, 0.1f);
      const MoeRoutingParams params{
          .correction_bias = config.method == MoeTopkMethod::kNoauxTc ? bias.data() : nullptr,
          .tokens = tokens,
          .num_experts = config.num_experts,
          .top_k = config.top_k,
          .num_groups = config.num_groups,
          .topk_groups = config.topk_groups,
          .scoring = config.scoring,
          .method = config.method,
          .normalize = config.normalize,
          .routed_scaling_factor = config.scaling};
      const Routed routed = Route(params, logits);
      const Routed expected = BruteForceRoute(params, logits, bias);
      ASSERT_THAT(routed.ids, ElementsAreArray(expected.ids));
      for (size_t i = 0; i < routed.weights.size(); ++i) {
        ASSERT_NEAR(routed.weights[i], expected.weights[i], 1e-6 * config.scaling) << "entry " << i;
      }
    }
  }
}

TEST(MoeRoutingTest, BatchInvariant) {
  for (const RouterConfig& config : kRouterConfigs) {
    const int64_t tokens = 733;
    const uint32_t seed = static_cast<uint32_t>(200 + config.num_experts);
    SCOPED_TRACE(absl::StrCat("seed=", seed, " config=", config.name));
    std::mt19937 rng(seed);
    const std::vector<float> logits = RandomFloats(rng, tokens * config.num_experts, -4.0f, 4.0f);
    const std::vector<float> bias = RandomFloats(rng, config.num_experts, -0.1f, 0.1f);
    MoeRoutingParams params{.correction_bias = bias.data(),
                            .tokens = tokens,
                            .num_experts = config.num_experts,
                            .top_k = config.top_k,
                            .num_groups = config.num_groups,
                            .topk_groups = config.topk_groups,
                            .scoring = config.scoring,
                            .method = config.method,
                            .normalize = config.normalize,
                            .routed_scaling_factor = config.scaling};
    const Routed batched = Route(params, logits);
    params.tokens = 1;
    for (int64_t t = 0; t < tokens; ++t) {
      const std::vector<float> row(logits.begin() + t * config.num_experts,
                                   logits.begin() + (t + 1) * config.num_experts);
      const Routed alone = Route(params, row);
      ASSERT_EQ(0, std::memcmp(alone.ids.data(), &batched.ids[t * config.top_k],
                               config.top_k * sizeof(int32_t)))
          << "token " << t;
      ASSERT_EQ(0, std::memcmp(alone.weights.data(), &batched.weights[t * config.top_k],
                               config.top_k * sizeof(float)))
          << "token " << t;
    }
  }
}

TEST(MoeRoutingTest, RejectsInvalidParams) {
  std::vector<float> logits(16, 0.5f), bias(8, 0.0f), weights(8);
  std::vector<int32_t> ids(8);
  const MoeRoutingParams good{.router_logits = logits.data(),
                              .correction_bias = bias.data(),
                              .topk_ids = ids.data(),
                              .topk_weights = weights.data(),
                              .tokens = 2,
                              .num_experts = 8,
                              .top_k = 4,
                              .num_groups = 4,
                              .topk_groups = 2};
  EXPECT_TRUE(cpu::MoeRouting(good).ok());
  MoeRoutingParams p = good;
  p.num_experts = 0;
  ExpectInvalid(cpu::MoeRouting(p), "num_experts");
  p = good;
  p.num_groups = 3;
  ExpectInvalid(cpu::MoeRouting(p), "num_groups");
  p = good;
  p.top_k = 9;
  ExpectInvalid(cpu::MoeRouting(p), "top_k");
  p = good;
  p.top_k = 0;
  ExpectInvalid(cpu::MoeRouting(p), "top_k");
  p = good;
  p.topk_groups = 5;
  ExpectInvalid(cpu::MoeRouting(p), "topk_groups");
  p = good;
  p.topk_groups = 1;  // 1 group of 2 experts cannot hold top_k = 4
  ExpectInvalid(cpu::MoeRouting(p), "top_k must be <= topk_groups * (num_experts / num_groups)");
  p = good;
  p.correction_bias = nullptr;
  ExpectInvalid(cpu::MoeRouting(p), "correction_bias");
  p = good;
  p.num_groups = 8;
  p.topk_groups = 4;  // groups of one expert: transformers' topk(2) per group is undefined
  ExpectInvalid(cpu::MoeRouting(p), "num_experts / num_groups >= 2");
  p = good;
  p.tokens = -1;
  ExpectInvalid(cpu::MoeRouting(p), "tokens");
  p = good;
  p.router_logits = nullptr;
  ExpectInvalid(cpu::MoeRouting(p), "router_logits");
  p = good;
  p.topk_ids = nullptr;
  ExpectInvalid(cpu::MoeRouting(p), "topk_ids");
  p = good;
  p.topk_weights = nullptr;
  ExpectInvalid(cpu::MoeRouting(p), "topk_weights");
  // Softmax routers need no bias.
  p = good;
  p.correction_bias = nullptr;
  p.scoring = MoeScoring::kSoftmax;
  p.method = MoeTopkMethod::kGroupLimitedGreedy;
  EXPECT_TRUE(cpu::MoeRouting(p).ok());
}

// ---------------------------------------------------------------------------------------------
// Experts

struct Experts {
  int32_t num_experts;
  int64_t hidden;
  int64_t intermediate;
  std::vector<std::vector<float>> gate, up, down;  // [expert] -> nn.Linear weights

  static Experts Random(std::mt19937& rng, int32_t num_experts, int64_t hidden,
                        int64_t intermediate) {
    Experts experts{num_experts, hidden, intermediate, {}, {}, {}};
    const float gate_scale = 2.0f / std::sqrt(static_cast<float>(hidden));
    const float down_scale = 2.0f / std::sqrt(static_cast<float>(intermediate));
    for (int32_t e = 0; e < num_experts; ++e) {
      experts.gate.push_back(RandomFloats(rng, intermediate * hidden, -gate_scale, gate_scale));
      experts.up.push_back(RandomFloats(rng, intermediate * hidden, -gate_scale, gate_scale));
      experts.down.push_back(RandomFloats(rng, hidden * intermediate, -down_scale, down_scale));
    }
    return experts;
  }

  std::vector<const float*> Pointers(const std::vector<std::vector<float>>& weights, int32_t first,
                                     int32_t count) const {
    std::vector<const float*> pointers;
    for (int32_t e = first; e < first + count; ++e) pointers.push_back(weights[e].data());
    return pointers;
  }
};

struct RoutedTokens {
  int64_t tokens;
  int32_t top_k;
  std::vector<float> x;
  std::vector<int32_t> ids;  // ascending per token, distinct
  std::vector<float> weights;
};

RoutedTokens RandomTokens(std::mt19937& rng, int64_t tokens, int32_t top_k, int32_t num_experts,
                          int64_t hidden) {
  RoutedTokens routed{tokens, top_k, RandomFloats(rng, tokens * hidden, -2.0f, 2.0f), {}, {}};
  std::vector<int32_t> all(num_experts);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> chosen(all.begin(), all.begin() + top_k);
    std::sort(chosen.begin(), chosen.end());
    routed.ids.insert(routed.ids.end(), chosen.begin(), chosen.end());
  }
  routed.weights = RandomFloats(rng, tokens * top_k, 0.05f, 1.5f);
  return routed;
}

// Runs MoeExperts on the local experts [first, first + count) of `experts`.
std::vector<float> RunExperts(const Experts& experts, const RoutedTokens& routed, int32_t first,
                              int32_t count) {
  const std::vector<const float*> gate = experts.Pointers(experts.gate, first, count);
  const std::vector<const float*> up = experts.Pointers(experts.up, first, count);
  const std::vector<const float*> down = experts.Pointers(experts.down, first, count);
  // Garbage in out: the kernel must overwrite it.
  std::vector<float> out(routed.tokens * experts.hidden, std::numeric_limits<float>::quiet_NaN());
  const absl::Status status = cpu::MoeExperts({.x = routed.x.data(),
                                               .topk_ids = routed.ids.data(),
                                               .topk_weights = routed.weights.data(),
                                               .gate_proj = gate.data(),
                                               .up_proj = up.data(),
                                               .down_proj = down.data(),
                                               .out = out.data(),
                                               .tokens = routed.tokens,
                                               .top_k = routed.top_k,
                                               .hidden = experts.hidden,
                                               .intermediate = experts.intermediate,
                                               .first_expert = first,
                                               .num_local_experts = count});
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

// Naive double-precision MoE: value and sum of absolute terms (the scale of its rounding error).
struct Reference {
  std::vector<double> value, magnitude;
};

Reference NaiveExperts(const Experts& experts, const RoutedTokens& routed) {
  const int64_t hidden = experts.hidden, intermediate = experts.intermediate;
  Reference ref{std::vector<double>(routed.tokens * hidden, 0.0),
                std::vector<double>(routed.tokens * hidden, 0.0)};
  std::vector<double> act(intermediate);
  for (int64_t t = 0; t < routed.tokens; ++t) {
    const float* x = &routed.x[t * hidden];
    for (int32_t j = 0; j < routed.top_k; ++j) {
      const int32_t e = routed.ids[t * routed.top_k + j];
      const double weight = routed.weights[t * routed.top_k + j];
      for (int64_t i = 0; i < intermediate; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t h = 0; h < hidden; ++h) {
          g += double{experts.gate[e][i * hidden + h]} * x[h];
          u += double{experts.up[e][i * hidden + h]} * x[h];
        }
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t h = 0; h < hidden; ++h) {
        double y = 0.0, magnitude = 0.0;
        for (int64_t i = 0; i < intermediate; ++i) {
          y += experts.down[e][h * intermediate + i] * act[i];
          magnitude += std::abs(experts.down[e][h * intermediate + i] * act[i]);
        }
        ref.value[t * hidden + h] += weight * y;
        ref.magnitude[t * hidden + h] += weight * magnitude;
      }
    }
  }
  return ref;
}

struct ExpertShape {
  int64_t tokens;
  int32_t num_experts, top_k;
  int64_t hidden, intermediate;
};

constexpr ExpertShape kExpertShapes[] = {
    {1, 1, 1, 1, 1},   {3, 4, 2, 7, 3},     {7, 8, 3, 19, 7},
    {19, 8, 8, 3, 19}, {733, 16, 3, 19, 7}, {19, 6, 2, 733, 19},
};

TEST(MoeExpertsTest, MatchesNaiveReference) {
  for (const ExpertShape& shape : kExpertShapes) {
    const uint32_t seed = static_cast<uint32_t>(300 + shape.tokens * 7 + shape.hidden);
    SCOPED_TRACE(absl::StrCat("seed=", seed, " tokens=", shape.tokens,
                              " experts=", shape.num_experts, " top_k=", shape.top_k,
                              " hidden=", shape.hidden, " intermediate=", shape.intermediate));
    std::mt19937 rng(seed);
    const Experts experts =
        Experts::Random(rng, shape.num_experts, shape.hidden, shape.intermediate);
    const RoutedTokens routed =
        RandomTokens(rng, shape.tokens, shape.top_k, shape.num_experts, shape.hidden);
    const std::vector<float> out = RunExperts(experts, routed, 0, shape.num_experts);
    const Reference ref = NaiveExperts(experts, routed);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], ref.value[i], 1e-5 * ref.magnitude[i] + 1e-30) << "element " << i;
    }
  }
}

TEST(MoeExpertsTest, ExpertParallelHalvesSumToTheFullResult) {
  for (const ExpertShape& shape : kExpertShapes) {
    if (shape.num_experts < 2) continue;
    const uint32_t seed = static_cast<uint32_t>(400 + shape.tokens * 7 + shape.hidden);
    SCOPED_TRACE(absl::StrCat("seed=", seed, " tokens=", shape.tokens));
    std::mt19937 rng(seed);
    const Experts experts =
        Experts::Random(rng, shape.num_experts, shape.hidden, shape.intermediate);
    const RoutedTokens routed =
        RandomTokens(rng, shape.tokens, shape.top_k, shape.num_experts, shape.hidden);
    const int32_t half = shape.num_experts / 2;
    const std::vector<float> full = RunExperts(experts, routed, 0, shape.num_experts);
    const std::vector<float> low = RunExperts(experts, routed, 0, half);
    const std::vector<float> high = RunExperts(experts, routed, half, shape.num_experts - half);
    const Reference ref = NaiveExperts(experts, routed);
    for (size_t i = 0; i < full.size(); ++i) {
      ASSERT_NEAR(double{low[i]} + high[i], full[i], 1e-6 * ref.magnitude[i] + 1e-30)
          << "element " << i;
    }
  }
}

TEST(MoeExpertsTest, TensorParallelSlicesSumToTheFullResult) {
  // Each rank holds every expert with half of the intermediate columns.
  const uint32_t seed = 450;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int32_t num_experts = 6;
  const int64_t hidden = 19, intermediate = 14;
  const Experts experts = Experts::Random(rng, num_experts, hidden, intermediate);
  const RoutedTokens routed = RandomTokens(rng, 7, 3, num_experts, hidden);
  const std::vector<float> full = RunExperts(experts, routed, 0, num_experts);
  std::vector<double> summed(full.size(), 0.0);
  for (int rank = 0; rank < 2; ++rank) {
    const int64_t columns = intermediate / 2;
    Experts slice{num_experts, hidden, columns, {}, {}, {}};
    for (int32_t e = 0; e < num_experts; ++e) {
      const auto rows_begin = experts.gate[e].begin() + rank * columns * hidden;
      slice.gate.emplace_back(rows_begin, rows_begin + columns * hidden);
      const auto up_begin = experts.up[e].begin() + rank * columns * hidden;
      slice.up.emplace_back(up_begin, up_begin + columns * hidden);
      std::vector<float> down(hidden * columns);
      for (int64_t h = 0; h < hidden; ++h) {
        for (int64_t i = 0; i < columns; ++i) {
          down[h * columns + i] = experts.down[e][h * intermediate + rank * columns + i];
        }
      }
      slice.down.push_back(std::move(down));
    }
    const std::vector<float> partial = RunExperts(slice, routed, 0, num_experts);
    for (size_t i = 0; i < partial.size(); ++i) summed[i] += partial[i];
  }
  const Reference ref = NaiveExperts(experts, routed);
  for (size_t i = 0; i < full.size(); ++i) {
    ASSERT_NEAR(summed[i], full[i], 1e-6 * ref.magnitude[i] + 1e-30) << "element " << i;
  }
}

TEST(MoeExpertsTest, TokensWithoutLocalExpertsGetZeros) {
  const uint32_t seed = 470;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const Experts experts = Experts::Random(rng, 8, 7, 3);
  RoutedTokens routed = RandomTokens(rng, 3, 2, 8, 7);
  routed.ids = {0, 1, 5, 6, 2, 7};  // token 0 only hits experts 0-1, token 1 only 5-6
  const std::vector<float> out = RunExperts(experts, routed, 2, 3);  // experts 2, 3, 4
  for (int64_t h = 0; h < 7; ++h) {
    EXPECT_EQ(out[h], 0.0f);
    EXPECT_EQ(out[7 + h], 0.0f);
  }
  bool any_nonzero = false;
  for (int64_t h = 0; h < 7; ++h) any_nonzero |= out[14 + h] != 0.0f;
  EXPECT_TRUE(any_nonzero);
}

TEST(MoeExpertsTest, BatchInvariant) {
  for (const ExpertShape& shape : kExpertShapes) {
    const uint32_t seed = static_cast<uint32_t>(500 + shape.tokens * 7 + shape.hidden);
    SCOPED_TRACE(absl::StrCat("seed=", seed, " tokens=", shape.tokens));
    std::mt19937 rng(seed);
    const Experts experts =
        Experts::Random(rng, shape.num_experts, shape.hidden, shape.intermediate);
    const RoutedTokens routed =
        RandomTokens(rng, shape.tokens, shape.top_k, shape.num_experts, shape.hidden);
    const std::vector<float> batched = RunExperts(experts, routed, 0, shape.num_experts);
    for (int64_t t = 0; t < shape.tokens; ++t) {
      const RoutedTokens one{1, shape.top_k,
                             std::vector<float>(routed.x.begin() + t * shape.hidden,
                                                routed.x.begin() + (t + 1) * shape.hidden),
                             std::vector<int32_t>(routed.ids.begin() + t * shape.top_k,
                                                  routed.ids.begin() + (t + 1) * shape.top_k),
                             std::vector<float>(routed.weights.begin() + t * shape.top_k,
                                                routed.weights.begin() + (t + 1) * shape.top_k)};
      const std::vector<float> alone = RunExperts(experts, one, 0, shape.num_experts);
      ASSERT_EQ(0,
                std::memcmp(alone.data(), &batched[t * shape.hidden], shape.hidden * sizeof(float)))
          << "token " << t;
    }
  }
}

TEST(MoeExpertsTest, RejectsInvalidParams) {
  std::mt19937 rng(600);
  const Experts experts = Experts::Random(rng, 2, 4, 3);
  const RoutedTokens routed = RandomTokens(rng, 2, 1, 2, 4);
  std::vector<const float*> gate = experts.Pointers(experts.gate, 0, 2);
  const std::vector<const float*> up = experts.Pointers(experts.up, 0, 2);
  const std::vector<const float*> down = experts.Pointers(experts.down, 0, 2);
  std::vector<float> out(8);
  const MoeExpertsParams good{.x = routed.x.data(),
                              .topk_ids = routed.ids.data(),
                              .topk_weights = routed.weights.data(),
                              .gate_proj = gate.data(),
                              .up_proj = up.data(),
                              .down_proj = down.data(),
                              .out = out.data(),
                              .tokens = 2,
                              .top_k = 1,
                              .hidden = 4,
                              .intermediate = 3,
                              .first_expert = 0,
                              .num_local_experts = 2};
  EXPECT_TRUE(cpu::MoeExperts(good).ok());
  MoeExpertsParams p = good;
  p.hidden = 0;
  ExpectInvalid(cpu::MoeExperts(p), "hidden must be > 0, got 0");
  p = good;
  p.intermediate = -1;
  ExpectInvalid(cpu::MoeExperts(p), "intermediate");
  p = good;
  p.top_k = 0;
  ExpectInvalid(cpu::MoeExperts(p), "top_k");
  p = good;
  p.first_expert = -1;
  ExpectInvalid(cpu::MoeExperts(p), "first_expert");
  p = good;
  p.num_local_experts = 0;
  ExpectInvalid(cpu::MoeExperts(p), "num_local_experts");
  p = good;
  p.tokens = -3;
  ExpectInvalid(cpu::MoeExperts(p), "tokens");
  p = good;
  p.x = nullptr;
  ExpectInvalid(cpu::MoeExperts(p), "x is null");
  p = good;
  p.topk_ids = nullptr;
  ExpectInvalid(cpu::MoeExperts(p), "topk_ids");
  p = good;
  p.topk_weights = nullptr;
  ExpectInvalid(cpu::MoeExperts(p), "topk_weights");
  p = good;
  p.out = nullptr;
  ExpectInvalid(cpu::MoeExperts(p), "out");
  p = good;
  p.gate_proj = nullptr;
  ExpectInvalid(cpu::MoeExperts(p), "gate_proj");
  p = good;
  p.up_proj = nullptr;
  ExpectInvalid(cpu::MoeExperts(p), "up_proj");
  p = good;
  p.down_proj = nullptr;
  ExpectInvalid(cpu::MoeExperts(p), "down_proj");
  gate[1] = nullptr;
  ExpectInvalid(cpu::MoeExperts(good), "local expert 1");
}

}  // namespace
}  // namespace treeverify::kernels
