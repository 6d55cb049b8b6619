#include "treeverify/worker/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <string>
#include <vector>

namespace treeverify::worker {
namespace {

using ::testing::HasSubstr;

// deepseek-ai/DeepSeek-V3 config.json as released.
constexpr char kDeepseekV3[] = R"json({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})json";

// The RoPE block of kDeepseekV3, and the same in the transformers >= 5 form.
constexpr char kV3RopeScaling[] = R"json("rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,)json";
constexpr char kV3RopeParameters[] = R"json("rope_parameters": {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0
  },)json";

// deepseek-ai/DeepSeek-V2-Lite config.json as released.
constexpr char kDeepseekV2Lite[] = R"json({
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
})json";

// moonshotai/Kimi-K2-Instruct config.json (quantization_config left out).
constexpr char kKimiK2[] = R"json({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 163584,
  "eos_token_id": 163585,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 131072,
  "model_type": "kimi_k2",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 384,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 64,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 64,
  "num_nextn_predict_layers": 0,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 50000.0,
  "routed_scaling_factor": 2.827,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 163840
})json";

// A small V3 config for the RoPE arithmetic: 32 rope dims, so the YaRN ramp (dims 5..12 with
// these betas) falls inside the 16 frequencies.
constexpr char kSmallYarn[] = R"json({
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "deepseek_v3",
  "vocab_size": 1000,
  "hidden_size": 256,
  "intermediate_size": 512,
  "moe_intermediate_size": 64,
  "num_hidden_layers": 4,
  "num_attention_heads": 8,
  "max_position_embeddings": 163840,
  "q_lora_rank": 96,
  "kv_lora_rank": 64,
  "qk_nope_head_dim": 48,
  "qk_rope_head_dim": 32,
  "v_head_dim": 48,
  "n_routed_experts": 16,
  "num_experts_per_tok": 4,
  "n_shared_experts": 1,
  "n_group": 4,
  "topk_group": 2,
  "first_k_dense_replace": 1,
  "rope_theta": 10000,
  "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
})json";

// `json` with the one occurrence of `from` replaced by `to`; fails the test if it is absent.
std::string With(std::string json, const std::string& from, const std::string& to) {
  const size_t at = json.find(from);
  if (at == std::string::npos) {
    ADD_FAILURE() << "test config does not contain: " << from;
    return json;
  }
  return json.replace(at, from.size(), to);
}

ModelConfig ParseOk(const std::string& json) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(json);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

// Expects InvalidArgument with a message naming `field`.
void ExpectRefused(const std::string& json, const std::string& field) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(json);
  ASSERT_FALSE(config.ok()) << "accepted a config that should name " << field;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
  EXPECT_THAT(std::string(config.status().message()), HasSubstr(field));
}

double YarnGetMscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// YaRN inverse frequencies re-derived in double from the YaRN paper's definitions.
std::vector<double> ReferenceYarnInvFreq(int dim, double theta, double factor, double original,
                                         double beta_fast, double beta_slow, bool truncate) {
  auto correction_dim = [&](double rotations) {
    return dim * std::log(original / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(theta));
  };
  double low = correction_dim(beta_fast);
  double high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  std::vector<double> inv_freq;
  for (int i = 0; i < dim / 2; ++i) {
    const double extrapolated = std::pow(theta, -2.0 * i / dim);
    const double interpolated = extrapolated / factor;
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    inv_freq.push_back(interpolated * ramp + extrapolated * (1.0 - ramp));
  }
  return inv_freq;
}

void ExpectRelativelyNear(const std::vector<float>& actual, const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-6 * std::abs(expected[i])) << "frequency " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Real checkpoints

TEST(ModelConfigTest, ParsesDeepseekV3) {
  const ModelConfig config = ParseOk(kDeepseekV3);
  EXPECT_EQ(config.architecture, Architecture::kDeepseekV3);
  EXPECT_EQ(config.model_type, "deepseek_v3");
  EXPECT_EQ(config.vocab_size, 129280);
  EXPECT_EQ(config.hidden_size, 7168);
  EXPECT_EQ(config.intermediate_size, 18432);
  EXPECT_EQ(config.moe_intermediate_size, 2048);
  EXPECT_EQ(config.num_hidden_layers, 61);
  EXPECT_EQ(config.num_attention_heads, 128);
  EXPECT_EQ(config.max_position_embeddings, 163840);
  EXPECT_EQ(config.q_lora_rank, 1536);
  EXPECT_EQ(config.kv_lora_rank, 512);
  EXPECT_EQ(config.qk_nope_head_dim, 128);
  EXPECT_EQ(config.qk_rope_head_dim, 64);
  EXPECT_EQ(config.v_head_dim, 128);
  EXPECT_EQ(config.qk_head_dim(), 192);
  EXPECT_EQ(config.kv_row_dim(), 576);
  EXPECT_EQ(config.n_routed_experts, 256);
  EXPECT_EQ(config.num_experts_per_tok, 8);
  EXPECT_EQ(config.n_shared_experts, 1);
  EXPECT_EQ(config.n_group, 8);
  EXPECT_EQ(config.topk_group, 4);
  EXPECT_EQ(config.topk_method, kernels::MoeTopkMethod::kNoauxTc);
  EXPECT_EQ(config.scoring_func, kernels::MoeScoring::kSigmoid);
  EXPECT_TRUE(config.norm_topk_prob);
  EXPECT_DOUBLE_EQ(config.routed_scaling_factor, 2.5);
  EXPECT_EQ(config.first_k_dense_replace, 3);
  EXPECT_EQ(config.moe_layer_freq, 1);
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(config.rope_theta, 10000.0);
  ASSERT_TRUE(config.yarn.has_value());
  EXPECT_DOUBLE_EQ(config.yarn->factor, 40.0);
  EXPECT_EQ(config.yarn->original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(config.yarn->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(config.yarn->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(config.yarn->mscale, 1.0);
  EXPECT_DOUBLE_EQ(config.yarn->mscale_all_dim, 1.0);
  EXPECT_FALSE(config.yarn->attention_factor.has_value());
  EXPECT_TRUE(config.yarn->truncate);
  EXPECT_TRUE(config.rope_interleave);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_EQ(config.eos_token_ids, std::vector<int32_t>{1});

  EXPECT_FALSE(config.is_moe_layer(0));
  EXPECT_FALSE(config.is_moe_layer(2));
  EXPECT_TRUE(config.is_moe_layer(3));
  EXPECT_TRUE(config.is_moe_layer(60));
}

TEST(ModelConfigTest, DeepseekV3SoftmaxScaleAndAttentionFactor) {
  const ModelConfig config = ParseOk(kDeepseekV3);
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(config.softmax_scale(), mscale * mscale / std::sqrt(192.0), 1e-15);
  EXPECT_NEAR(config.softmax_scale(), 0.1352337788608801, 1e-12);  // Python, by hand
  // mscale == mscale_all_dim: the cos/sin factor cancels to 1.
  EXPECT_DOUBLE_EQ(config.rope_attention_factor(), 1.0);
}

TEST(ModelConfigTest, RopeParametersFormParsesEqual) {
  const std::string transformers5 = With(kDeepseekV3, kV3RopeScaling, kV3RopeParameters);
  ASSERT_EQ(transformers5.find("rope_scaling"), std::string::npos);
  const ModelConfig official = ParseOk(kDeepseekV3);
  const ModelConfig converted = ParseOk(transformers5);
  EXPECT_TRUE(official == converted);
  EXPECT_EQ(official.rope_inv_freq(), converted.rope_inv_freq());
}

TEST(ModelConfigTest, BothRopeFormsAcceptedWhenTheyAgree) {
  const std::string both =
      With(kDeepseekV3, kV3RopeScaling, std::string(kV3RopeScaling) + "\n  " + kV3RopeParameters);
  EXPECT_TRUE(ParseOk(both) == ParseOk(kDeepseekV3));
}

TEST(ModelConfigTest, RopeFormsThatDisagreeAreRefused) {
  const std::string both = With(kDeepseekV3, kV3RopeScaling,
                                std::string(kV3RopeScaling) + "\n  " +
                                    With(kV3RopeParameters, "\"factor\": 40.0", "\"factor\": 4.0"));
  ExpectRefused(both, "rope_parameters");
}

TEST(ModelConfigTest, YarnFactorDefaultsToContextRatio) {
  // 163840 / 4096 = 40, the explicit factor.
  const std::string without_factor = With(kDeepseekV3, "\"factor\": 40,\n", "");
  EXPECT_TRUE(ParseOk(without_factor) == ParseOk(kDeepseekV3));
}

TEST(ModelConfigTest, RopeTypeKeyIsAcceptedInRopeScaling) {
  const std::string rope_type = With(kDeepseekV3, "\"type\": \"yarn\"", "\"rope_type\": \"yarn\"");
  EXPECT_TRUE(ParseOk(rope_type) == ParseOk(kDeepseekV3));
}

TEST(ModelConfigTest, ParsesDeepseekV2Lite) {
  const ModelConfig config = ParseOk(kDeepseekV2Lite);
  EXPECT_EQ(config.architecture, Architecture::kDeepseekV2);
  EXPECT_EQ(config.model_type, "deepseek_v2");
  EXPECT_EQ(config.vocab_size, 102400);
  EXPECT_EQ(config.hidden_size, 2048);
  EXPECT_EQ(config.num_attention_heads, 16);
  EXPECT_EQ(config.num_hidden_layers, 27);
  EXPECT_FALSE(config.q_lora_rank.has_value());
  EXPECT_EQ(config.kv_lora_rank, 512);
  EXPECT_EQ(config.n_routed_experts, 64);
  EXPECT_EQ(config.num_experts_per_tok, 6);
  EXPECT_EQ(config.n_shared_experts, 2);
  EXPECT_EQ(config.n_group, 1);
  EXPECT_EQ(config.topk_group, 1);
  EXPECT_EQ(config.topk_method, kernels::MoeTopkMethod::kGreedy);
  EXPECT_EQ(config.scoring_func, kernels::MoeScoring::kSoftmax);
  EXPECT_FALSE(config.norm_topk_prob);
  EXPECT_DOUBLE_EQ(config.routed_scaling_factor, 1.0);
  EXPECT_EQ(config.first_k_dense_replace, 1);
  EXPECT_TRUE(config.rope_interleave);
  EXPECT_EQ(config.eos_token_ids, std::vector<int32_t>{100001});
  ASSERT_TRUE(config.yarn.has_value());
  EXPECT_DOUBLE_EQ(config.yarn->mscale_all_dim, 0.707);
  EXPECT_FALSE(config.is_moe_layer(0));
  EXPECT_TRUE(config.is_moe_layer(1));
  const double mscale = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(config.softmax_scale(), mscale * mscale / std::sqrt(192.0), 1e-15);
  EXPECT_NEAR(config.softmax_scale(), 0.1147213867929261, 1e-12);
}

TEST(ModelConfigTest, ParsesKimiK2) {
  const ModelConfig config = ParseOk(kKimiK2);
  EXPECT_EQ(config.architecture, Architecture::kDeepseekV3);
  EXPECT_EQ(config.model_type, "kimi_k2");
  EXPECT_EQ(config.vocab_size, 163840);
  EXPECT_EQ(config.num_attention_heads, 64);
  EXPECT_EQ(config.q_lora_rank, 1536);
  EXPECT_EQ(config.n_routed_experts, 384);
  EXPECT_EQ(config.num_experts_per_tok, 8);
  EXPECT_EQ(config.n_group, 1);
  EXPECT_EQ(config.topk_group, 1);
  EXPECT_DOUBLE_EQ(config.routed_scaling_factor, 2.827);
  EXPECT_DOUBLE_EQ(config.rope_theta, 50000.0);
  ASSERT_TRUE(config.yarn.has_value());
  EXPECT_DOUBLE_EQ(config.yarn->factor, 32.0);
  EXPECT_EQ(config.yarn->original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(config.yarn->beta_fast, 1.0);
  EXPECT_EQ(config.eos_token_ids, std::vector<int32_t>{163585});
  EXPECT_FALSE(config.is_moe_layer(0));
  EXPECT_TRUE(config.is_moe_layer(1));
  const double mscale = 0.1 * std::log(32.0) + 1.0;
  EXPECT_NEAR(config.softmax_scale(), mscale * mscale / std::sqrt(192.0), 1e-15);
  ExpectRelativelyNear(config.rope_inv_freq(),
                       ReferenceYarnInvFreq(64, 50000.0, 32.0, 4096.0, 1.0, 1.0, true));
}

// quantization_config: DeepSeek-V3's fp8 blocks and Kimi-K2-Thinking's int4 groups (as their
// config.json files publish them), and what is refused.
TEST(ModelConfigTest, ParsesQuantizationConfigs) {
  EXPECT_EQ(ParseOk(kKimiK2).quantization.method, WeightQuantization::Method::kNone);
  const ModelConfig fp8 =
      ParseOk(With(kKimiK2, R"("vocab_size": 163840)",
                   R"("vocab_size": 163840, "quantization_config": {"activation_scheme": "dynamic",
         "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})"));
  EXPECT_EQ(fp8.quantization, (WeightQuantization{.method = WeightQuantization::Method::kFp8Block,
                                                  .block_rows = 128,
                                                  .block_cols = 128}));
  const ModelConfig int4 =
      ParseOk(With(kKimiK2, R"("vocab_size": 163840)",
                   R"("vocab_size": 163840, "quantization_config": {"config_groups": {"group_0": {
         "input_activations": null, "output_activations": null, "targets": ["Linear"],
         "weights": {"actorder": null, "block_structure": null, "dynamic": false,
         "group_size": 32, "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
         "strategy": "group", "symmetric": true, "type": "int"}}},
         "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*"],
         "kv_cache_scheme": null, "quant_method": "compressed-tensors",
         "quantization_status": "compressed"})"));
  EXPECT_EQ(int4.quantization.method, WeightQuantization::Method::kInt4Group);
  EXPECT_EQ(int4.quantization.group_size, 32);
  const std::string kimi = kKimiK2;
  auto quantized = [&](const std::string& quantization) {
    return With(kimi, R"("vocab_size": 163840)",
                R"("vocab_size": 163840, "quantization_config": )" + quantization);
  };
  ExpectRefused(quantized(R"({"quant_method": "awq"})"), "quant_method \"awq\" is not supported");
  ExpectRefused(quantized(R"({"quant_method": "fp8", "fmt": "e5m2"})"), "only e4m3");
  ExpectRefused(quantized(R"({"quant_method": "fp8", "weight_block_size": [128]})"),
                "weight_block_size");
  ExpectRefused(quantized(R"({"quant_method": "compressed-tensors", "format": "float-quantized"})"),
                "only pack-quantized");
  ExpectRefused(quantized(R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "symmetric": true,
      "strategy": "group", "group_size": 32}}}})"),
                "only 4-bit symmetric int");
}

// ---------------------------------------------------------------------------------------------
// Defaults and derived values

TEST(ModelConfigTest, AbsentRouterFieldsTakeTransformersDefaults) {
  std::string v3 = kDeepseekV3;
  v3 = With(v3, "\"topk_method\": \"noaux_tc\",", "");
  v3 = With(v3, "\"scoring_func\": \"sigmoid\",", "");
  v3 = With(v3, "\"norm_topk_prob\": true,", "");
  const ModelConfig v3_config = ParseOk(v3);
  EXPECT_EQ(v3_config.topk_method, kernels::MoeTopkMethod::kNoauxTc);
  EXPECT_EQ(v3_config.scoring_func, kernels::MoeScoring::kSigmoid);
  EXPECT_TRUE(v3_config.norm_topk_prob);

  std::string v2 = kDeepseekV2Lite;
  v2 = With(v2, "\"topk_method\": \"greedy\",", "");
  v2 = With(v2, "\"scoring_func\": \"softmax\",", "");
  v2 = With(v2, "\"norm_topk_prob\": false,", "");
  const ModelConfig v2_config = ParseOk(v2);
  EXPECT_EQ(v2_config.topk_method, kernels::MoeTopkMethod::kGreedy);
  EXPECT_EQ(v2_config.scoring_func, kernels::MoeScoring::kSoftmax);
  EXPECT_FALSE(v2_config.norm_topk_prob);
}

TEST(ModelConfigTest, AbsentRopeInterleaveIsTrueAndFalseIsKeptForV3) {
  EXPECT_TRUE(ParseOk(kDeepseekV3).rope_interleave);
  const std::string not_interleaved = With(kDeepseekV3, "\"rope_theta\": 10000,",
                                           "\"rope_theta\": 10000,\n\"rope_interleave\": false,");
  EXPECT_FALSE(ParseOk(not_interleaved).rope_interleave);
}

TEST(ModelConfigTest, NullExpertsMeanDenseModel) {
  const ModelConfig config =
      ParseOk(With(kDeepseekV3, "\"n_routed_experts\": 256", "\"n_routed_experts\": null"));
  EXPECT_EQ(config.n_routed_experts, 0);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    EXPECT_FALSE(config.is_moe_layer(layer)) << layer;
  }
}

TEST(ModelConfigTest, MoeLayerFrequency) {
  const ModelConfig config =
      ParseOk(With(kDeepseekV3, "\"moe_layer_freq\": 1", "\"moe_layer_freq\": 2"));
  EXPECT_FALSE(config.is_moe_layer(2));
  EXPECT_FALSE(config.is_moe_layer(3));  // past the dense prefix, but odd
  EXPECT_TRUE(config.is_moe_layer(4));
  EXPECT_FALSE(config.is_moe_layer(5));
}

TEST(ModelConfigTest, EosTokenIdListAndAbsent) {
  EXPECT_EQ(
      ParseOk(With(kDeepseekV3, "\"eos_token_id\": 1", "\"eos_token_id\": [1, 7]")).eos_token_ids,
      (std::vector<int32_t>{1, 7}));
  EXPECT_TRUE(ParseOk(With(kDeepseekV3, "\"eos_token_id\": 1,", "")).eos_token_ids.empty());
}

TEST(ModelConfigTest, PlainRopeWhenScalingIsNull) {
  const std::string plain =
      With(kDeepseekV3, kV3RopeScaling, "\"rope_scaling\": null,\n  \"rope_theta\": 10000,");
  const ModelConfig config = ParseOk(plain);
  EXPECT_FALSE(config.yarn.has_value());
  EXPECT_NEAR(config.softmax_scale(), 1.0 / std::sqrt(192.0), 1e-15);
  EXPECT_DOUBLE_EQ(config.rope_attention_factor(), 1.0);
  const std::vector<float> inv_freq = config.rope_inv_freq();
  ASSERT_EQ(inv_freq.size(), 32u);
  std::vector<double> expected;
  for (int i = 0; i < 32; ++i) expected.push_back(std::pow(10000.0, -2.0 * i / 64));
  ExpectRelativelyNear(inv_freq, expected);
}

TEST(ModelConfigTest, DefaultRopeParametersMeanPlainRope) {
  const std::string default_rope = With(kDeepseekV3, kV3RopeScaling,
                                        R"("rope_parameters": {"rope_type": "default", )"
                                        R"("rope_theta": 20000.0},)");
  const std::string plain =
      With(kDeepseekV3, kV3RopeScaling, "\"rope_scaling\": null,\n\"rope_theta\": 20000,");
  const ModelConfig config = ParseOk(default_rope);
  EXPECT_FALSE(config.yarn.has_value());
  EXPECT_DOUBLE_EQ(config.rope_theta, 20000.0);
  EXPECT_TRUE(config == ParseOk(plain));
}

TEST(ModelConfigTest, YarnInverseFrequenciesMatchIndependentDerivation) {
  const ModelConfig config = ParseOk(kSmallYarn);
  const std::vector<float> inv_freq = config.rope_inv_freq();
  const std::vector<double> expected =
      ReferenceYarnInvFreq(32, 10000.0, 40.0, 4096.0, 32.0, 1.0, /*truncate=*/true);
  ExpectRelativelyNear(inv_freq, expected);
  // The ramp must really blend: the first frequency is extrapolated, the last interpolated.
  EXPECT_NEAR(inv_freq[0], 1.0, 1e-7);
  EXPECT_NEAR(inv_freq[15], std::pow(10000.0, -30.0 / 32) / 40.0, 1e-6 * inv_freq[15]);
}

TEST(ModelConfigTest, YarnWithoutTruncation) {
  const ModelConfig config = ParseOk(With(kSmallYarn, "\"mscale_all_dim\": 1.0}",
                                          "\"mscale_all_dim\": 1.0, \"truncate\": false}"));
  ASSERT_TRUE(config.yarn.has_value());
  EXPECT_FALSE(config.yarn->truncate);
  ExpectRelativelyNear(config.rope_inv_freq(),
                       ReferenceYarnInvFreq(32, 10000.0, 40.0, 4096.0, 32.0, 1.0, false));
}

TEST(ModelConfigTest, YarnAttentionFactor) {
  // No mscale fields: get_mscale(factor).
  const std::string bare = With(kSmallYarn, ", \"mscale\": 1.0, \"mscale_all_dim\": 1.0", "");
  EXPECT_NEAR(ParseOk(bare).rope_attention_factor(), YarnGetMscale(40.0, 1.0), 1e-15);
  EXPECT_NEAR(ParseOk(bare).softmax_scale(), 1.0 / std::sqrt(80.0), 1e-15);  // no mscale_all_dim
  // Different mscales: their ratio.
  const std::string ratio = With(kSmallYarn, "\"mscale\": 1.0", "\"mscale\": 0.5");
  EXPECT_NEAR(ParseOk(ratio).rope_attention_factor(),
              YarnGetMscale(40.0, 0.5) / YarnGetMscale(40.0, 1.0), 1e-15);
  // An explicit attention_factor wins.
  const std::string explicit_factor =
      With(kSmallYarn, "\"mscale\": 1.0", "\"mscale\": 1.0, \"attention_factor\": 0.75");
  EXPECT_DOUBLE_EQ(ParseOk(explicit_factor).rope_attention_factor(), 0.75);
}

TEST(ModelConfigTest, FromFileReadsAndNamesThePath) {
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) /
                                    ("model_config_test_from_file_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  std::ofstream(path) << kKimiK2;
  absl::StatusOr<ModelConfig> config = ModelConfig::FromFile(path);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(*config == ParseOk(kKimiK2));

  std::ofstream(path) << With(kKimiK2, "\"v_head_dim\": 128", "\"v_head_dim\": 0");
  config = ModelConfig::FromFile(path);
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("\"v_head_dim\""));

  EXPECT_EQ(ModelConfig::FromFile((dir / "absent.json").string()).status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Refused configs: one per way of being wrong.

TEST(ModelConfigRefusedTest, MissingField) {
  ExpectRefused(With(kDeepseekV3, "\"kv_lora_rank\": 512,", ""),
                "field \"kv_lora_rank\" is missing");
}

TEST(ModelConfigRefusedTest, WrongType) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(
      With(kDeepseekV3, "\"kv_lora_rank\": 512", "\"kv_lora_rank\": \"abc\""));
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(config.status().message(),
            "config.json: field \"kv_lora_rank\" must be a positive integer, got \"abc\"");
}

TEST(ModelConfigRefusedTest, FractionalInteger) {
  ExpectRefused(With(kDeepseekV3, "\"hidden_size\": 7168", "\"hidden_size\": 7168.5"),
                "\"hidden_size\"");
}

TEST(ModelConfigRefusedTest, NegativeDimension) {
  ExpectRefused(With(kDeepseekV3, "\"qk_nope_head_dim\": 128", "\"qk_nope_head_dim\": -128"),
                "\"qk_nope_head_dim\" must be a positive integer");
}

TEST(ModelConfigRefusedTest, ZeroDimension) {
  ExpectRefused(With(kDeepseekV3, "\"num_attention_heads\": 128", "\"num_attention_heads\": 0"),
                "\"num_attention_heads\"");
}

TEST(ModelConfigRefusedTest, OddRopeHeadDim) {
  ExpectRefused(With(kDeepseekV3, "\"qk_rope_head_dim\": 64", "\"qk_rope_head_dim\": 63"),
                "\"qk_rope_head_dim\" must be even");
}

TEST(ModelConfigRefusedTest, UnknownArchitecture) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(
      With(kDeepseekV3, "\"DeepseekV3ForCausalLM\"]", "\"LlamaForCausalLM\"]"));
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(config.status().message(),
            "config.json: architecture \"LlamaForCausalLM\" is not supported (supported: "
            "DeepseekV3ForCausalLM, DeepseekV2ForCausalLM)");
}

TEST(ModelConfigRefusedTest, ModelTypeDoesNotMatchArchitecture) {
  ExpectRefused(With(kDeepseekV2Lite, "\"deepseek_v2\"", "\"kimi_k2\""), "\"model_type\"");
}

TEST(ModelConfigRefusedTest, UnsupportedRopeScalingType) {
  ExpectRefused(With(kDeepseekV3, "\"type\": \"yarn\"", "\"type\": \"linear\""),
                "field \"rope_scaling.type\" \"linear\" is not supported");
}

TEST(ModelConfigRefusedTest, UnsupportedRopeParametersType) {
  const std::string dynamic = With(With(kDeepseekV3, kV3RopeScaling, kV3RopeParameters),
                                   "\"rope_type\": \"yarn\"", "\"rope_type\": \"dynamic\"");
  ExpectRefused(dynamic, "field \"rope_parameters.rope_type\" \"dynamic\" is not supported");
}

TEST(ModelConfigRefusedTest, YarnFactorBelowOne) {
  ExpectRefused(With(kDeepseekV3, "\"factor\": 40", "\"factor\": 0.5"), "\"rope_scaling.factor\"");
}

TEST(ModelConfigRefusedTest, AttentionBias) {
  ExpectRefused(With(kDeepseekV3, "\"attention_bias\": false", "\"attention_bias\": true"),
                "\"attention_bias\"");
}

TEST(ModelConfigRefusedTest, HiddenActNotSilu) {
  ExpectRefused(With(kDeepseekV3, "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""),
                "\"hidden_act\"");
}

TEST(ModelConfigRefusedTest, ExpertsNotDivisibleByGroups) {
  ExpectRefused(With(kDeepseekV3, "\"n_routed_experts\": 256", "\"n_routed_experts\": 252"),
                "\"n_group\"");
}

TEST(ModelConfigRefusedTest, TopkGroupExceedsGroups) {
  ExpectRefused(With(kDeepseekV3, "\"topk_group\": 4", "\"topk_group\": 9"), "\"topk_group\"");
}

TEST(ModelConfigRefusedTest, TopkExceedsExperts) {
  ExpectRefused(With(kDeepseekV3, "\"num_experts_per_tok\": 8", "\"num_experts_per_tok\": 300"),
                "\"num_experts_per_tok\"");
}

TEST(ModelConfigRefusedTest, TopkExceedsExpertsOfSelectedGroups) {
  // 4 of 8 groups of 32 experts leave 128 candidates.
  ExpectRefused(With(kDeepseekV3, "\"num_experts_per_tok\": 8", "\"num_experts_per_tok\": 129"),
                "\"num_experts_per_tok\"");
}

TEST(ModelConfigRefusedTest, UnknownTopkMethod) {
  ExpectRefused(With(kDeepseekV3, "\"noaux_tc\"", "\"aux_free\""), "\"topk_method\"");
}

TEST(ModelConfigRefusedTest, UnknownScoringFunc) {
  ExpectRefused(With(kDeepseekV3, "\"sigmoid\"", "\"tanh\""), "\"scoring_func\"");
}

TEST(ModelConfigRefusedTest, QLoraRankAbsent) {
  ExpectRefused(With(kDeepseekV2Lite, "\"q_lora_rank\": null,", ""), "\"q_lora_rank\"");
}

TEST(ModelConfigRefusedTest, EosOutsideVocabulary) {
  ExpectRefused(With(kDeepseekV3, "\"eos_token_id\": 1", "\"eos_token_id\": 129280"),
                "\"eos_token_id\"");
}

TEST(ModelConfigRefusedTest, V2NotInterleaved) {
  ExpectRefused(With(kDeepseekV2Lite, "\"rope_theta\": 10000,",
                     "\"rope_theta\": 10000,\n\"rope_interleave\": false,"),
                "\"rope_interleave\"");
}

TEST(ModelConfigRefusedTest, InvalidJson) {
  const std::string truncated = std::string(kDeepseekV3).substr(0, 200);
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(truncated);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("config.json: not valid JSON"));
}

// Deep nesting in a field: refused naming the field, never a stack overflow.
TEST(ModelConfigRefusedTest, DeeplyNestedField) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  ExpectRefused(With(kDeepseekV3, "\"kv_lora_rank\": 512", "\"kv_lora_rank\": " + deep),
                "\"kv_lora_rank\"");
}

TEST(ModelConfigRefusedTest, NotAnObject) {
  ExpectRefused("[1, 2, 3]", "config.json: must be a JSON object");
}

}  // namespace
}  // namespace treeverify::worker
