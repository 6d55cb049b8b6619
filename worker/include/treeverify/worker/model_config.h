// The model's hyper-parameters, read from a Hugging Face config.json of a DeepseekV3ForCausalLM,
// DeepseekV2ForCausalLM or Kimi-K2 checkpoint.
//
// YaRN may be given the official way (`rope_scaling` + top-level `rope_theta`) or the
// transformers >= 5 way (`rope_parameters`, which also holds rope_theta); both parse to the same
// ModelConfig. Unknown architectures and unsupported options are refused with a message naming
// the field.
//
//   TV_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::FromFile(dir + "/config.json"));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "treeverify/kernels/moe.h"
#include "treeverify/worker/weight_quantization.h"

namespace treeverify::worker {

// transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps.
inline constexpr float kLatentNormEps = 1e-6f;

enum class Architecture { kDeepseekV2, kDeepseekV3 };

struct YarnScaling {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;                     // 0 = absent
  double mscale_all_dim = 0.0;             // 0 = absent
  std::optional<double> attention_factor;  // explicit override, rarely given
  bool truncate = true;
  bool operator==(const YarnScaling&) const = default;
};

struct ModelConfig {
  Architecture architecture = Architecture::kDeepseekV3;
  std::string model_type;  // "deepseek_v3", "deepseek_v2", "kimi_k2"
  // How the linear layers' weights are stored (quantization_config; none: as their dtype says).
  WeightQuantization quantization;

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // one routed expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t max_position_embeddings = 0;

  // Multi-head latent attention.
  std::optional<int64_t> q_lora_rank;  // null in DeepSeek-V2-Lite: q_proj instead
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // Mixture of experts.
  int64_t n_routed_experts = 0;  // 0: every layer dense
  int64_t num_experts_per_tok = 0;
  int64_t n_shared_experts = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  kernels::MoeTopkMethod topk_method = kernels::MoeTopkMethod::kGreedy;
  kernels::MoeScoring scoring_func = kernels::MoeScoring::kSoftmax;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;

  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<YarnScaling> yarn;  // absent: plain RoPE
  bool rope_interleave = true;      // V2 is always interleaved
  bool tie_word_embeddings = false;

  std::vector<int32_t> eos_token_ids;  // from eos_token_id (int or list); may be empty

  // Parses and validates; errors name the offending field.
  static absl::StatusOr<ModelConfig> FromJson(absl::string_view json_text);
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);

  // Derived quantities.
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t kv_row_dim() const { return kv_lora_rank + qk_rope_head_dim; }  // one latent cache row
  // DeepSeek's rule: layer l is MoE when experts exist, l >= first_k_dense_replace and
  // l % moe_layer_freq == 0.
  bool is_moe_layer(int64_t layer) const;
  // Softmax scale qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.
  double softmax_scale() const;
  // Rotary inverse frequencies [qk_rope_head_dim / 2] and the cos/sin attention factor,
  // computed as transformers does (fp32 results).
  std::vector<float> rope_inv_freq() const;
  double rope_attention_factor() const;

  bool operator==(const ModelConfig&) const = default;
};

}  // namespace treeverify::worker
