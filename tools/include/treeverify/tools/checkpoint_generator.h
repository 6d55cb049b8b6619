// Random DeepSeek-V3 / Kimi-K2 / DeepSeek-V2 checkpoints in the real Hugging Face format, for the
// demo and for tests.
//
// The generator writes config.json and safetensors weights with the official tensor names and
// shapes, so everything that loads a real checkpoint loads these too. Values are drawn from a
// generator that gives the same numbers on every platform, and each tensor depends only on
// (seed, tensor name): adding a layer or an expert leaves every other tensor unchanged. The spec
// is validated by parsing the config it would write with worker::ModelConfig::FromJson first, so
// the generator never writes a config our loader refuses.
//
//   TV_ASSIGN_OR_RETURN(CheckpointSpec spec, PresetSpec("tiny-v3"));
//   spec.seed = 7;
//   spec.num_shards = 2;
//   TV_RETURN_IF_ERROR(WriteCheckpoint("/tmp/tiny-v3", spec));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "treeverify/worker/safetensors.h"
#include "treeverify/worker/weight_quantization.h"

namespace treeverify::tools {

// YaRN rope scaling, as the config's `rope_scaling` (or `rope_parameters`) holds it.
struct YarnSpec {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;          // 0: omitted from the config
  double mscale_all_dim = 1.0;  // 0: omitted from the config
};

// How the config states rope_theta and YaRN.
enum class RopeStyle {
  kRopeScaling,     // official checkpoints: "rope_scaling" (null without YaRN) + top-level
                    // "rope_theta"
  kRopeParameters,  // transformers >= 5: "rope_parameters" holding rope_type and rope_theta
};

struct CheckpointSpec {
  // config.json fields, named as there.
  std::string architecture = "DeepseekV3ForCausalLM";  // or "DeepseekV2ForCausalLM"
  std::string model_type = "deepseek_v3";              // or "kimi_k2", "deepseek_v2"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // one routed expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t max_position_embeddings = 0;
  std::optional<int64_t> q_lora_rank;  // nullopt: q_proj instead of q_a_proj/q_b_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;  // 0: every layer dense
  int64_t num_experts_per_tok = 0;
  int64_t n_shared_experts = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  std::string topk_method = "noaux_tc";  // or "greedy", "group_limited_greedy"
  std::string scoring_func = "sigmoid";  // or "softmax"
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<YarnSpec> yarn;  // nullopt: plain RoPE
  bool rope_interleave = true;   // written for V3-style configs only; V2 is always interleaved
  bool tie_word_embeddings = false;
  std::vector<int32_t> eos_token_id = {1};  // written as an int when one, a list when several

  // Generator knobs.
  uint64_t seed = 0;
  // Multiplies the LM head's std (1/sqrt(hidden_size)), so that logits have std of about
  // lm_head_scale: output distributions are peaked and top-1/top-2 margins large, as in a
  // trained model, instead of the near-uniform distributions of a plain random init.
  float lm_head_scale = 8.0f;
  RopeStyle rope_style = RopeStyle::kRopeScaling;
  // Every tensor is stored in this dtype, e_score_correction_bias included (official checkpoints
  // keep that one in f32; WriteSafetensors writes one dtype per file).
  worker::DType weight_dtype = worker::DType::kBF16;
  // Linear weights in a published quantized layout (quantized_weights.h), as their releases
  // quantize them: FP8 blocks for every layer's projections (DeepSeek-V3), INT4 groups for the
  // routed experts only (Kimi-K2-Thinking); config.json says so in quantization_config. The
  // values are the float ones above, quantized (block or group scales from their max magnitude).
  worker::WeightQuantization quantization;
  // 1: model.safetensors. N > 1: model-0000i-of-0000N.safetensors + model.safetensors.index.json,
  // the tensors in name order split into N contiguous runs of about equal bytes (so a layer's
  // tensors are mostly in one shard, as in official checkpoints).
  int num_shards = 1;
};

// The named preset: "demo", "tiny-v3", "tiny-kimi" or "tiny-v2-lite". See docs/tiny-models.md.
absl::StatusOr<CheckpointSpec> PresetSpec(absl::string_view name);

// The names PresetSpec knows, in the order documented.
std::vector<std::string> PresetNames();

// Writes config.json and the weights into `dir`, created if missing. `dir` must be empty or hold
// only files a previous WriteCheckpoint wrote (those are replaced), so a real model directory
// (tokenizer, generation config, ...) is never overwritten.
absl::Status WriteCheckpoint(const std::string& dir, const CheckpointSpec& spec);

// The CLI's `make-checkpoint` subcommand: the preset with the given seed and shard count.
absl::Status RunMakeCheckpoint(const std::string& out_dir, const std::string& preset, uint64_t seed,
                               int num_shards);

}  // namespace treeverify::tools
