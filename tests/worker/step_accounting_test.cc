// The bytes model of the step account, checked against the byte counts written out by hand for a
// small configuration, and the ratios built on it.
#include "treeverify/worker/step_accounting.h"

#include "gtest/gtest.h"

namespace treeverify::worker {
namespace {

ModelConfig SmallConfig() {
  ModelConfig c;
  c.vocab_size = 1000;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.q_lora_rank = 48;
  c.kv_lora_rank = 32;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 16;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.n_shared_experts = 1;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  return c;
}

TEST(StepAccountingTest, ModelsTheBytesEachPhaseMoves) {
  const ModelConfig c = SmallConfig();
  auto plan = ShardingPlan::Make(c, 0, 2, ExpertSharding::kSplitInside);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Two sequences: 100 + 5 and 40 + 3 keys; 8 rows; layers 1 and 2 (MoE) had 3 and 5 experts.
  const StepShape shape{
      .rows = 8, .keys = {105, 43}, .active_experts = {0, 3, 5}, .committed_moves = 2};
  StepAccount account;
  ModelStepBytes(c, *plan, shape, account);

  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kEmbed).modeled_bytes, 8 * 64 * 6.0);
  // Per layer, bf16: input norm 64, q_a 48x64, its norm 48, q_b (2 heads x 24) x 48, kv_a 40x64,
  // its norm 32, W_UK and W_UV 2 x 32 x (16 + 16), o_proj 64 x 2 x 16; KV: (148 + 8) rows x 40.
  const double attention_weights =
      64 + 48 * 64 + 48 + 2 * 24 * 48 + 40 * 64 + 32 + 2 * 32 * 32 + 64 * 2 * 16;
  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kAttention).modeled_bytes,
                   3 * (attention_weights * 2 + (148 + 8) * 40 * 2.0));
  // Layer 0 dense (48 of 96 columns); layers 1-2: norm, router 8 x 64, active x 3 x 64 x 16,
  // shared 3 x 64 x 16, plus the fp32 bias.
  const double dense = (64 + 3 * 64 * 48) * 2.0;
  auto moe = [](double active) {
    return (64 + 8 * 64 + active * 3 * 64 * 16 + 3 * 64 * 16) * 2.0 + 32;
  };
  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kMoe).modeled_bytes, dense + moe(3) + moe(5));
  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kLmHead).modeled_bytes, (64 + 500 * 64) * 2.0);
  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kKvCommit).modeled_bytes, 2 * 3 * 40 * 2 * 2.0);
  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kAllReduce).modeled_bytes, 0.0);
}

// FP8 projections (DeepSeek-V3's) count a byte a weight, the norms and the router still bf16, the
// experts at their own rate.
TEST(StepAccountingTest, Fp8ProjectionsCountTheirOwnBytes) {
  const ModelConfig c = SmallConfig();
  auto plan = ShardingPlan::Make(c, 0, 2, ExpertSharding::kSplitInside);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const StepShape shape{.rows = 8,
                        .keys = {105, 43},
                        .active_experts = {0, 3, 5},
                        .expert_weight_bytes = 1.0,
                        .projection_weight_bytes = 1.0};
  StepAccount account;
  ModelStepBytes(c, *plan, shape, account);
  const double norms = (64 + 48 + 32) * 2.0;
  const double projections = 48 * 64 + 2 * 24 * 48 + 40 * 64 + 2 * 32 * 32 + 64 * 2 * 16;
  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kAttention).modeled_bytes,
                   3 * (norms + projections + (148 + 8) * 40 * 2.0));
  const double dense = 64 * 2.0 + 3 * 64 * 48;
  auto moe = [](double active) {
    return (64 + 8 * 64) * 2.0 + active * 3 * 64 * 16 + 3 * 64 * 16 + 32;
  };
  EXPECT_DOUBLE_EQ(account.phase(StepPhase::kMoe).modeled_bytes, dense + moe(3) + moe(5));
}

TEST(StepAccountingTest, UtilizationIsBytesOverTimeOverTheCeiling) {
  StepAccount account;
  account.copy_bytes_per_second = 4e12;
  account.phase(StepPhase::kMoe) = {.seconds = 1e-3, .modeled_bytes = 2e9};
  account.phase(StepPhase::kAllReduce) = {.seconds = 1e-3, .modeled_bytes = 0.0};
  account.total_seconds = 2e-3;
  EXPECT_DOUBLE_EQ(account.Bandwidth(StepPhase::kMoe), 2e12);
  EXPECT_DOUBLE_EQ(account.Utilization(StepPhase::kMoe), 0.5);
  EXPECT_DOUBLE_EQ(account.Utilization(StepPhase::kEmbed), 0.0);  // no time: no figure
  EXPECT_DOUBLE_EQ(account.TotalUtilization(), 0.25);
  EXPECT_STREQ(StepPhaseName(StepPhase::kKvCommit), "kv_commit");
}

}  // namespace
}  // namespace treeverify::worker
