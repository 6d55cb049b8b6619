#include "treeverify/worker/sharding_plan.h"

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

absl::StatusOr<ShardRange> NonEmptyShard(int64_t total, int world_size, int rank,
                                         absl::string_view what) {
  ShardRange range = Shard(total, world_size, rank);
  if (range.size() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (", total, ") cannot be split over ",
                                                   world_size, " tensor-parallel ranks"));
  }
  return range;
}

}  // namespace

ShardRange Shard(int64_t total, int world_size, int rank) {
  return ShardRange{total * rank / world_size, total * (rank + 1) / world_size};
}

absl::StatusOr<ShardingPlan> ShardingPlan::Make(const ModelConfig& c, int rank, int world_size,
                                                ExpertSharding expert_sharding) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not within a world of ", world_size, " ranks"));
  }
  ShardingPlan plan;
  plan.rank = rank;
  plan.world_size = world_size;
  plan.expert_sharding = expert_sharding;
  TV_ASSIGN_OR_RETURN(
      plan.heads, NonEmptyShard(c.num_attention_heads, world_size, rank, "num_attention_heads"));
  TV_ASSIGN_OR_RETURN(plan.vocab, NonEmptyShard(c.vocab_size, world_size, rank, "vocab_size"));
  bool any_dense = false;
  bool any_moe = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    (c.is_moe_layer(l) ? any_moe : any_dense) = true;
  if (any_dense) {
    TV_ASSIGN_OR_RETURN(plan.dense_intermediate,
                        NonEmptyShard(c.intermediate_size, world_size, rank, "intermediate_size"));
  }
  if (any_moe) {
    if (expert_sharding == ExpertSharding::kSplitInside) {
      plan.experts = ShardRange{0, c.n_routed_experts};
      TV_ASSIGN_OR_RETURN(
          plan.expert_intermediate,
          NonEmptyShard(c.moe_intermediate_size, world_size, rank, "moe_intermediate_size"));
    } else {
      TV_ASSIGN_OR_RETURN(plan.experts,
                          NonEmptyShard(c.n_routed_experts, world_size, rank, "n_routed_experts"));
      plan.expert_intermediate = ShardRange{0, c.moe_intermediate_size};
    }
    if (c.n_shared_experts > 0) {
      TV_ASSIGN_OR_RETURN(plan.shared_intermediate,
                          NonEmptyShard(c.moe_intermediate_size * c.n_shared_experts, world_size,
                                        rank, "shared experts' intermediate size"));
    }
  }
  return plan;
}

}  // namespace treeverify::worker
