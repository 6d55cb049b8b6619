// How one model is split over W tensor-parallel ranks (DESIGN.md, "The model"): attention
// heads, dense-MLP columns, expert columns or whole experts, shared-expert columns and the
// vocabulary, each as a balanced range of the whole.
//
//   TV_ASSIGN_OR_RETURN(ShardingPlan plan, ShardingPlan::Make(config, rank, world_size,
//                                                             ExpertSharding::kSplitInside));
//   plan.heads.begin ... plan.heads.end are this rank's heads.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "treeverify/worker/model_config.h"

namespace treeverify::worker {

// Shard [begin, end) of `total` items for `rank` of `world_size`, balanced (sizes differ by at
// most one). Used for heads, intermediate columns, experts and the vocabulary.
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
ShardRange Shard(int64_t total, int world_size, int rank);

enum class ExpertSharding {
  kSplitInside,   // every rank holds 1/W of every expert: balanced bytes at small batch
  kWholeExperts,  // expert parallel: rank r holds experts [r*E/W, (r+1)*E/W)
};

struct ShardingPlan {
  int rank = 0;
  int world_size = 1;
  ExpertSharding expert_sharding = ExpertSharding::kSplitInside;

  ShardRange heads;
  ShardRange vocab;
  ShardRange dense_intermediate;
  ShardRange expert_intermediate;  // columns of each held expert
  ShardRange shared_intermediate;  // columns of the shared experts' MLP
  ShardRange experts;              // experts held

  // Every range must be non-empty where the model has that part; errors name the dimension.
  static absl::StatusOr<ShardingPlan> Make(const ModelConfig& config, int rank, int world_size,
                                           ExpertSharding expert_sharding);
};

}  // namespace treeverify::worker
