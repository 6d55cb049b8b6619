// One tensor-parallel rank's slice of a DeepSeek-V2/V3/Kimi-K2 checkpoint, as fp32 arrays.
//
// The sharding follows DESIGN.md: attention heads split (q_b_proj / q_proj and kv_b_proj rows,
// o_proj columns), dense MLP split (gate/up rows, down columns), routed experts split inside
// each expert (every rank holds 1/W of every expert's intermediate columns) or whole experts per
// rank, shared experts split inside, embedding and LM head split by vocabulary; router, norms and
// the q_a / kv_a projections replicated. A rank reads only its slice of each tensor.
//
//   TV_ASSIGN_OR_RETURN(auto weights, ModelWeights::Load(dir, config, plan));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/worker/model_config.h"
#include "treeverify/worker/quantized_weights.h"
#include "treeverify/worker/sharding_plan.h"

namespace treeverify::worker {

// Where the checkpoint stores a dense projection FP8 (DeepSeek-V3), its slice as stored sits
// beside its values (`fp8_*`), for the GPU's FP8 products; the values, dequantized from it, are
// the CPU backend's.
struct MlpWeights {
  int64_t intermediate = 0;    // this rank's columns (0: absent)
  std::vector<float> gate_up;  // [2 * intermediate, hidden]: gate rows, then up rows
  std::vector<float> down;     // [hidden, intermediate]
  // gate_up's only where gate's rows end on a block edge (then up's blocks stay whole).
  std::optional<Fp8Matrix> fp8_gate_up, fp8_down;
};

struct AttentionWeights {
  std::vector<float> q_a_proj;   // [q_lora_rank, hidden] (when q_lora_rank is set)
  std::vector<float> q_a_norm;   // [q_lora_rank]
  std::vector<float> q_proj;     // [local_heads * qk_head_dim, q_lora_rank or hidden]
  std::vector<float> kv_a_proj;  // [kv_lora_rank + qk_rope_head_dim, hidden]
  std::vector<float> kv_a_norm;  // [kv_lora_rank]
  std::vector<float> w_uk_t;     // [local_heads, kv_lora_rank, qk_nope_head_dim]: q_nope -> latent
  std::vector<float> w_uv;       // [local_heads, v_head_dim, kv_lora_rank]: latent -> value
  std::vector<float> o_proj;     // [hidden, local_heads * v_head_dim]
  // FP8 as stored (see MlpWeights); kv_b_proj's the rank's heads' rows [heads * (nope + v), lora].
  std::optional<Fp8Matrix> fp8_q_a_proj, fp8_q_proj, fp8_kv_a_proj, fp8_kv_b_proj, fp8_o_proj;
};

struct MoeWeights {
  std::vector<float> router;           // [n_routed_experts, hidden]
  std::vector<float> correction_bias;  // [n_routed_experts] (noaux_tc), else empty
  // Held experts, in expert order: [intermediate, hidden], [intermediate, hidden],
  // [hidden, intermediate] each.
  std::vector<std::vector<float>> gate_proj, up_proj, down_proj;
  std::vector<const float*> gate_ptrs, up_ptrs, down_ptrs;  // into the vectors above
  // Where the checkpoint stores every held expert INT4 (Kimi-K2-Thinking) or FP8 (DeepSeek-V3),
  // the same slices as stored, for the GPU's quantized expert stream (the vectors above hold
  // their dequantized values, the CPU backend's); empty otherwise.
  std::vector<Int4Matrix> int4_gate, int4_up, int4_down;
  std::vector<Fp8Matrix> fp8_gate, fp8_up, fp8_down;
  MlpWeights shared;  // intermediate 0 without shared
};

struct LayerWeights {
  std::vector<float> input_norm;  // [hidden]
  std::vector<float> post_norm;   // [hidden]
  AttentionWeights attention;
  bool is_moe = false;
  MlpWeights dense;  // when !is_moe
  MoeWeights moe;    // when is_moe
};

struct ModelWeights {
  ModelConfig config;
  ShardingPlan plan;
  std::vector<float> embedding;   // [vocab shard, hidden]
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab shard, hidden]
  std::vector<LayerWeights> layers;

  static absl::StatusOr<std::unique_ptr<ModelWeights>> Load(const std::string& dir,
                                                            const ModelConfig& config,
                                                            const ShardingPlan& plan);
};

}  // namespace treeverify::worker
