#include "treeverify/worker/model_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numbers>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

using Json = nlohmann::json;

constexpr double kDefaultRopeTheta = 10000.0;  // transformers' PreTrainedConfig.default_theta
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

// A short rendering of a JSON value for error messages.
std::string Render(const Json& value) {
  // Containers are named, not dumped: dump() recurses, and a hostile file can nest deeply.
  if (value.is_array()) return absl::StrCat("an array of ", value.size());
  if (value.is_object()) return absl::StrCat("an object of ", value.size(), " keys");
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > 60) text = absl::StrCat(text.substr(0, 57), "...");
  return text;
}

// Reads typed fields of one JSON object. Absent and null read as "not given" (std::nullopt);
// present with the wrong type or out of range is an error naming the field. `prefix` names the
// object inside config.json ("" for the top level, "rope_scaling." for a nested one).
class FieldReader {
 public:
  FieldReader(const Json& object, std::string source, std::string prefix)
      : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

  absl::Status Error(absl::string_view key, absl::string_view message) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": field \"", prefix_, key, "\" ", message));
  }

  bool Present(absl::string_view key) const { return Find(key) != nullptr; }
  bool Contains(absl::string_view key) const { return object_.contains(std::string(key)); }

  // An integer >= min (min 1: "positive", min 0: "non-negative") and <= max.
  absl::StatusOr<std::optional<int64_t>> Int(absl::string_view key, int64_t min,
                                             int64_t max = kMaxInt32) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    const bool in_range =
        value->is_number_integer() &&
        (value->is_number_unsigned() ? value->get<uint64_t>() <= static_cast<uint64_t>(max)
                                     : value->get<int64_t>() <= max) &&
        value->get<int64_t>() >= min;
    if (!in_range) {
      const char* kind = min == 1   ? "a positive integer"
                         : min == 0 ? "a non-negative integer"
                                    : "an integer";
      // The upper bound is only worth saying when it is what the value broke.
      const std::string bound = value->is_number_integer() && value->get<int64_t>() >= min
                                    ? absl::StrCat(" at most ", max)
                                    : "";
      return Error(key, absl::StrCat("must be ", kind, bound, ", got ", Render(*value)));
    }
    return value->get<int64_t>();
  }

  absl::StatusOr<int64_t> RequiredInt(absl::string_view key, int64_t min) const {
    TV_ASSIGN_OR_RETURN(std::optional<int64_t> value, Int(key, min));
    if (!value.has_value()) return Missing(key);
    return *value;
  }

  // A finite number; `positive` also refuses zero and negative values.
  absl::StatusOr<std::optional<double>> Number(absl::string_view key, bool positive) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_number() || (positive && value->get<double>() <= 0.0)) {
      return Error(key, absl::StrCat("must be ", positive ? "a positive number" : "a number",
                                     ", got ", Render(*value)));
    }
    return value->get<double>();
  }

  absl::StatusOr<std::optional<bool>> Bool(absl::string_view key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_boolean()) {
      return Error(key, absl::StrCat("must be true or false, got ", Render(*value)));
    }
    return value->get<bool>();
  }

  absl::StatusOr<std::optional<std::string>> String(absl::string_view key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_string()) {
      return Error(key, absl::StrCat("must be a string, got ", Render(*value)));
    }
    return value->get<std::string>();
  }

  absl::Status Missing(absl::string_view key) const { return Error(key, "is missing (required)"); }

  // The raw value, or nullptr when absent or null.
  const Json* Find(absl::string_view key) const {
    auto it = object_.find(std::string(key));
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  const std::string& source() const { return source_; }

 private:
  const Json& object_;
  std::string source_;
  std::string prefix_;
};

// RoPE as one of `rope_scaling` / `rope_parameters` describes it.
struct RopeSpec {
  double theta = kDefaultRopeTheta;
  std::optional<YarnScaling> yarn;
  bool operator==(const RopeSpec&) const = default;
};

// Parses one RoPE dictionary (`field` is "rope_scaling" or "rope_parameters"), following
// transformers' standardize_rope_params and _compute_yarn_parameters.
absl::StatusOr<RopeSpec> ParseRopeDict(const FieldReader& root, absl::string_view field,
                                       std::optional<double> top_level_theta,
                                       int64_t max_position_embeddings) {
  const Json& dict = *root.Find(field);
  if (!dict.is_object()) {
    return root.Error(field, absl::StrCat("must be an object or null, got ", Render(dict)));
  }
  const FieldReader reader(dict, root.source(), absl::StrCat(field, "."));

  TV_ASSIGN_OR_RETURN(std::optional<std::string> rope_type, reader.String("rope_type"));
  TV_ASSIGN_OR_RETURN(std::optional<std::string> legacy_type, reader.String("type"));
  if (rope_type && legacy_type && *rope_type != *legacy_type) {
    return reader.Error(
        "type",
        absl::StrCat("\"", *legacy_type, "\" disagrees with \"rope_type\" \"", *rope_type, "\""));
  }
  const std::string type = rope_type ? *rope_type : legacy_type.value_or("default");
  const absl::string_view type_key = rope_type ? "rope_type" : "type";

  RopeSpec spec;
  TV_ASSIGN_OR_RETURN(std::optional<double> theta, reader.Number("rope_theta", true));
  if (theta && top_level_theta && *theta != *top_level_theta) {
    return reader.Error("rope_theta", absl::StrCat(*theta,
                                                   " disagrees with the top-level "
                                                   "\"rope_theta\" ",
                                                   *top_level_theta));
  }
  spec.theta = theta.value_or(top_level_theta.value_or(kDefaultRopeTheta));

  TV_ASSIGN_OR_RETURN(std::optional<double> partial_rotary_factor,
                      reader.Number("partial_rotary_factor", true));
  if (partial_rotary_factor && *partial_rotary_factor != 1.0) {
    return reader.Error("partial_rotary_factor", "must be 1 (partial rotary is not supported)");
  }

  if (type == "default") return spec;
  if (type != "yarn") {
    return reader.Error(type_key,
                        absl::StrCat("\"", type, "\" is not supported (supported: default, yarn)"));
  }

  YarnScaling& yarn = spec.yarn.emplace();
  TV_ASSIGN_OR_RETURN(
      std::optional<int64_t> original,
      reader.Int("original_max_position_embeddings", 1, std::numeric_limits<int64_t>::max()));
  // transformers fills an absent original length with max_position_embeddings.
  yarn.original_max_position_embeddings = original.value_or(max_position_embeddings);

  TV_ASSIGN_OR_RETURN(std::optional<double> factor, reader.Number("factor", true));
  // DeepSeek's convention when factor is absent: the ratio of the two context lengths.
  yarn.factor = factor.value_or(static_cast<double>(max_position_embeddings) /
                                static_cast<double>(yarn.original_max_position_embeddings));
  if (yarn.factor < 1.0) {
    return reader.Error("factor", absl::StrCat("must be at least 1, got ", yarn.factor));
  }

  // transformers reads these as `value or default`, so 0 also means the default.
  TV_ASSIGN_OR_RETURN(std::optional<double> beta_fast, reader.Number("beta_fast", false));
  TV_ASSIGN_OR_RETURN(std::optional<double> beta_slow, reader.Number("beta_slow", false));
  if (beta_fast && *beta_fast < 0) return reader.Error("beta_fast", "must not be negative");
  if (beta_slow && *beta_slow < 0) return reader.Error("beta_slow", "must not be negative");
  yarn.beta_fast = beta_fast.value_or(0.0) != 0.0 ? *beta_fast : 32.0;
  yarn.beta_slow = beta_slow.value_or(0.0) != 0.0 ? *beta_slow : 1.0;

  TV_ASSIGN_OR_RETURN(std::optional<double> mscale, reader.Number("mscale", false));
  TV_ASSIGN_OR_RETURN(std::optional<double> mscale_all_dim, reader.Number("mscale_all_dim", false));
  yarn.mscale = mscale.value_or(0.0);
  yarn.mscale_all_dim = mscale_all_dim.value_or(0.0);
  TV_ASSIGN_OR_RETURN(yarn.attention_factor, reader.Number("attention_factor", true));
  TV_ASSIGN_OR_RETURN(std::optional<bool> truncate, reader.Bool("truncate"));
  yarn.truncate = truncate.value_or(true);
  return spec;
}

// rope_theta and YaRN from the official form (`rope_theta` + `rope_scaling`) or the
// transformers >= 5 form (`rope_parameters`). When both dictionaries are given they must agree.
absl::Status ParseRope(const FieldReader& root, ModelConfig& config) {
  TV_ASSIGN_OR_RETURN(std::optional<double> top_level_theta, root.Number("rope_theta", true));
  std::optional<RopeSpec> from_scaling;
  std::optional<RopeSpec> from_parameters;
  if (root.Present("rope_scaling")) {
    TV_ASSIGN_OR_RETURN(from_scaling, ParseRopeDict(root, "rope_scaling", top_level_theta,
                                                    config.max_position_embeddings));
  }
  if (root.Present("rope_parameters")) {
    TV_ASSIGN_OR_RETURN(from_parameters, ParseRopeDict(root, "rope_parameters", top_level_theta,
                                                       config.max_position_embeddings));
  }
  if (from_scaling && from_parameters && *from_scaling != *from_parameters) {
    return root.Error("rope_parameters", "disagrees with \"rope_scaling\"; give only one");
  }
  RopeSpec spec;
  spec.theta = top_level_theta.value_or(kDefaultRopeTheta);
  if (from_scaling) spec = *from_scaling;
  if (from_parameters) spec = *from_parameters;
  config.rope_theta = spec.theta;
  config.yarn = spec.yarn;
  return absl::OkStatus();
}

absl::StatusOr<Architecture> ParseArchitecture(const FieldReader& root, ModelConfig& config) {
  std::optional<Architecture> architecture;
  if (const Json* architectures = root.Find("architectures")) {
    if (!architectures->is_array() || architectures->empty() || !(*architectures)[0].is_string()) {
      return root.Error("architectures", absl::StrCat("must be a list of architecture names, got ",
                                                      Render(*architectures)));
    }
    const std::string name = (*architectures)[0].get<std::string>();
    if (name == "DeepseekV3ForCausalLM") {
      architecture = Architecture::kDeepseekV3;
    } else if (name == "DeepseekV2ForCausalLM") {
      architecture = Architecture::kDeepseekV2;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(root.source(), ": architecture \"", name,
                       "\" is not supported (supported: DeepseekV3ForCausalLM, "
                       "DeepseekV2ForCausalLM)"));
    }
  }

  TV_ASSIGN_OR_RETURN(std::optional<std::string> model_type, root.String("model_type"));
  if (!architecture.has_value()) {
    if (!model_type.has_value()) return root.Missing("architectures");
    if (*model_type == "deepseek_v3" || *model_type == "kimi_k2") {
      architecture = Architecture::kDeepseekV3;
    } else if (*model_type == "deepseek_v2") {
      architecture = Architecture::kDeepseekV2;
    } else {
      return root.Error("model_type",
                        absl::StrCat("\"", *model_type,
                                     "\" is not supported (supported: deepseek_v3, kimi_k2, "
                                     "deepseek_v2)"));
    }
  }

  const bool v3 = *architecture == Architecture::kDeepseekV3;
  if (!model_type.has_value()) {
    model_type = v3 ? "deepseek_v3" : "deepseek_v2";
  } else if (v3 ? (*model_type != "deepseek_v3" && *model_type != "kimi_k2")
                : *model_type != "deepseek_v2") {
    return root.Error("model_type",
                      absl::StrCat("\"", *model_type, "\" does not match architecture ",
                                   v3 ? "DeepseekV3ForCausalLM (expected deepseek_v3 or kimi_k2)"
                                      : "DeepseekV2ForCausalLM (expected deepseek_v2)"));
  }
  config.model_type = *model_type;
  return *architecture;
}

absl::StatusOr<kernels::MoeTopkMethod> ParseTopkMethod(const FieldReader& root,
                                                       kernels::MoeTopkMethod fallback) {
  TV_ASSIGN_OR_RETURN(std::optional<std::string> name, root.String("topk_method"));
  if (!name.has_value()) return fallback;
  if (*name == "noaux_tc") return kernels::MoeTopkMethod::kNoauxTc;
  if (*name == "greedy") return kernels::MoeTopkMethod::kGreedy;
  if (*name == "group_limited_greedy") return kernels::MoeTopkMethod::kGroupLimitedGreedy;
  return root.Error("topk_method", absl::StrCat("\"", *name,
                                                "\" is not supported (supported: noaux_tc, greedy, "
                                                "group_limited_greedy)"));
}

absl::StatusOr<kernels::MoeScoring> ParseScoring(const FieldReader& root,
                                                 kernels::MoeScoring fallback) {
  TV_ASSIGN_OR_RETURN(std::optional<std::string> name, root.String("scoring_func"));
  if (!name.has_value()) return fallback;
  if (*name == "sigmoid") return kernels::MoeScoring::kSigmoid;
  if (*name == "softmax") return kernels::MoeScoring::kSoftmax;
  return root.Error("scoring_func",
                    absl::StrCat("\"", *name, "\" is not supported (supported: sigmoid, softmax)"));
}

// The mixture-of-experts fields. Absent optional fields take transformers' defaults for the
// architecture (DeepseekV3Config / DeepseekV2Config; V3's router is always sigmoid + noaux_tc
// there, V2's always softmax).
absl::Status ParseMoe(const FieldReader& root, ModelConfig& config) {
  const bool v3 = config.architecture == Architecture::kDeepseekV3;
  TV_ASSIGN_OR_RETURN(std::optional<int64_t> n_routed_experts, root.Int("n_routed_experts", 0));
  config.n_routed_experts = n_routed_experts.value_or(0);

  TV_ASSIGN_OR_RETURN(std::optional<int64_t> num_experts_per_tok,
                      root.Int("num_experts_per_tok", 1));
  TV_ASSIGN_OR_RETURN(std::optional<int64_t> moe_intermediate_size,
                      root.Int("moe_intermediate_size", 1));
  // An explicit null means no shared experts, as in DeepSeek's own modeling code.
  TV_ASSIGN_OR_RETURN(std::optional<int64_t> n_shared_experts, root.Int("n_shared_experts", 0));
  TV_ASSIGN_OR_RETURN(std::optional<int64_t> n_group, root.Int("n_group", 1));
  TV_ASSIGN_OR_RETURN(std::optional<int64_t> topk_group, root.Int("topk_group", 1));
  TV_ASSIGN_OR_RETURN(config.topk_method,
                      ParseTopkMethod(root, v3 ? kernels::MoeTopkMethod::kNoauxTc
                                               : kernels::MoeTopkMethod::kGreedy));
  TV_ASSIGN_OR_RETURN(config.scoring_func, ParseScoring(root, v3 ? kernels::MoeScoring::kSigmoid
                                                                 : kernels::MoeScoring::kSoftmax));
  TV_ASSIGN_OR_RETURN(std::optional<bool> norm_topk_prob, root.Bool("norm_topk_prob"));
  TV_ASSIGN_OR_RETURN(std::optional<double> routed_scaling_factor,
                      root.Number("routed_scaling_factor", true));
  TV_ASSIGN_OR_RETURN(std::optional<int64_t> first_k_dense_replace,
                      root.Int("first_k_dense_replace", 0));
  TV_ASSIGN_OR_RETURN(std::optional<int64_t> moe_layer_freq, root.Int("moe_layer_freq", 1));

  config.num_experts_per_tok = num_experts_per_tok.value_or(v3 ? 8 : 0);
  config.moe_intermediate_size = moe_intermediate_size.value_or(0);
  const int64_t default_shared_experts = root.Contains("n_shared_experts") ? 0 : (v3 ? 1 : 2);
  config.n_shared_experts = n_shared_experts.value_or(default_shared_experts);
  config.n_group = n_group.value_or(v3 ? 8 : 1);
  config.topk_group = topk_group.value_or(v3 ? 4 : 1);
  config.norm_topk_prob = norm_topk_prob.value_or(v3);
  config.routed_scaling_factor = routed_scaling_factor.value_or(v3 ? 2.5 : 1.0);
  config.first_k_dense_replace = first_k_dense_replace.value_or(v3 ? 3 : 0);
  config.moe_layer_freq = moe_layer_freq.value_or(1);

  if (config.n_routed_experts == 0) return absl::OkStatus();  // dense: the rest is unused

  if (config.num_experts_per_tok == 0) return root.Missing("num_experts_per_tok");
  if (config.moe_intermediate_size == 0) return root.Missing("moe_intermediate_size");
  if (config.num_experts_per_tok > config.n_routed_experts) {
    return root.Error(
        "num_experts_per_tok",
        absl::StrCat("(", config.num_experts_per_tok, ") must not exceed \"n_routed_experts\" (",
                     config.n_routed_experts, ")"));
  }
  if (config.n_routed_experts % config.n_group != 0) {
    return root.Error("n_group",
                      absl::StrCat("(", config.n_group, ") must divide \"n_routed_experts\" (",
                                   config.n_routed_experts, ")"));
  }
  if (config.topk_group > config.n_group) {
    return root.Error("topk_group",
                      absl::StrCat("(", config.topk_group, ") must not exceed \"n_group\" (",
                                   config.n_group, ")"));
  }
  const int64_t experts_per_group = config.n_routed_experts / config.n_group;
  if (config.topk_method != kernels::MoeTopkMethod::kGreedy &&
      config.num_experts_per_tok > config.topk_group * experts_per_group) {
    return root.Error("num_experts_per_tok",
                      absl::StrCat("(", config.num_experts_per_tok, ") exceeds the ",
                                   config.topk_group * experts_per_group,
                                   " experts of the \"topk_group\" groups a token may use"));
  }
  // noaux_tc ranks a group by the sum of its two best experts.
  // noaux_tc ranks groups by their two best experts (transformers' topk(2)), so every group
  // needs two, with one group too; the MoE kernel refuses the rest.
  if (config.topk_method == kernels::MoeTopkMethod::kNoauxTc && experts_per_group < 2) {
    return root.Error("n_group", absl::StrCat("(", config.n_group,
                                              ") leaves fewer than 2 experts per group, which "
                                              "noaux_tc needs"));
  }
  return absl::OkStatus();
}

// config.json's `quantization_config` (weight_quantization.h): DeepSeek-V3's fp8 blocks, or
// compressed-tensors pack-quantized int4 groups (Kimi-K2-Thinking).
absl::StatusOr<WeightQuantization> ParseWeightQuantization(const Json& config,
                                                           const std::string& source) {
  auto error = [&](const std::string& message) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": quantization_config ", message));
  };
  if (!config.is_object()) return error("must be an object");
  const std::string method = config.value("quant_method", "");
  WeightQuantization q;
  if (method == "fp8") {
    q.method = WeightQuantization::Method::kFp8Block;
    if (config.contains("fmt") && config["fmt"] != "e4m3") {
      return error(absl::StrCat("fmt ", config["fmt"].dump(), ": only e4m3 is supported"));
    }
    const Json& block = config.contains("weight_block_size") ? config["weight_block_size"]
                                                             : Json::array({128, 128});
    if (!block.is_array() || block.size() != 2 || !block[0].is_number_integer() ||
        !block[1].is_number_integer() || block[0].get<int64_t>() < 1 ||
        block[1].get<int64_t>() < 1) {
      return error(
          absl::StrCat("weight_block_size ", block.dump(), " must be two positive integers"));
    }
    q.block_rows = block[0].get<int64_t>();
    q.block_cols = block[1].get<int64_t>();
    return q;
  }
  if (method == "compressed-tensors") {
    if (config.value("format", "") != "pack-quantized") {
      return error(absl::StrCat("format ", config.value("format", Json()).dump(),
                                ": only pack-quantized (int4 groups) is supported"));
    }
    const Json& groups = config.contains("config_groups") ? config["config_groups"] : Json();
    if (!groups.is_object() || groups.size() != 1) {
      return error("config_groups must hold one group (the experts' int4 weights)");
    }
    const Json& weights =
        groups.begin()->contains("weights") ? (*groups.begin())["weights"] : Json();
    const bool int4_groups =
        weights.is_object() && weights.value("num_bits", 0) == 4 &&
        weights.value("type", "") == "int" && weights.value("symmetric", false) &&
        weights.value("strategy", "") == "group" && weights.value("group_size", 0) > 0;
    if (!int4_groups) {
      return error(absl::StrCat("weights ", weights.dump(),
                                ": only 4-bit symmetric int in groups is supported"));
    }
    q.method = WeightQuantization::Method::kInt4Group;
    q.group_size = weights["group_size"].get<int64_t>();
    if (q.group_size % 8 != 0) {
      return error(absl::StrCat("group_size ", q.group_size,
                                " must be a multiple of 8 (the "
                                "int4 values one int32 packs)"));
    }
    return q;
  }
  return error(
      absl::StrCat("quant_method \"", method,
                   "\" is not supported (fp8, or compressed-tensors pack-quantized int4)"));
}

absl::Status ParseEos(const FieldReader& root, ModelConfig& config) {
  const Json* eos = root.Find("eos_token_id");
  if (eos == nullptr) return absl::OkStatus();
  const Json list = eos->is_array() ? *eos : Json::array({*eos});
  for (const Json& id : list) {
    // Non-negative integers parse as unsigned.
    if (!id.is_number_unsigned() ||
        id.get<uint64_t>() >= static_cast<uint64_t>(config.vocab_size)) {
      return root.Error("eos_token_id",
                        absl::StrCat("must be a token id below vocab_size (", config.vocab_size,
                                     ") or a list of them, got ", Render(*eos)));
    }
    config.eos_token_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> Parse(absl::string_view text, const std::string& source) {
  Json json;
  try {
    json = Json::parse(text.begin(), text.end());
  } catch (const Json::exception& error) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON: ", error.what()));
  }
  if (!json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": must be a JSON object, got ", Render(json)));
  }
  const FieldReader root(json, source, "");
  ModelConfig config;
  TV_ASSIGN_OR_RETURN(config.architecture, ParseArchitecture(root, config));
  if (const Json* quantization = root.Find("quantization_config"); quantization != nullptr) {
    TV_ASSIGN_OR_RETURN(config.quantization, ParseWeightQuantization(*quantization, source));
  }
  const bool v3 = config.architecture == Architecture::kDeepseekV3;

  TV_ASSIGN_OR_RETURN(config.vocab_size, root.RequiredInt("vocab_size", 1));
  TV_ASSIGN_OR_RETURN(config.hidden_size, root.RequiredInt("hidden_size", 1));
  TV_ASSIGN_OR_RETURN(config.intermediate_size, root.RequiredInt("intermediate_size", 1));
  TV_ASSIGN_OR_RETURN(config.num_hidden_layers, root.RequiredInt("num_hidden_layers", 1));
  TV_ASSIGN_OR_RETURN(config.num_attention_heads, root.RequiredInt("num_attention_heads", 1));
  TV_ASSIGN_OR_RETURN(config.max_position_embeddings,
                      root.RequiredInt("max_position_embeddings", 1));

  // q_lora_rank must be spelled out: null selects the plain q_proj of V2-Lite, and transformers'
  // silent default (1536) would load the wrong attention.
  if (!root.Contains("q_lora_rank")) {
    return root.Error("q_lora_rank", "is missing (required; null for no query compression)");
  }
  TV_ASSIGN_OR_RETURN(config.q_lora_rank, root.Int("q_lora_rank", 1));
  TV_ASSIGN_OR_RETURN(config.kv_lora_rank, root.RequiredInt("kv_lora_rank", 1));
  TV_ASSIGN_OR_RETURN(config.qk_nope_head_dim, root.RequiredInt("qk_nope_head_dim", 1));
  TV_ASSIGN_OR_RETURN(config.qk_rope_head_dim, root.RequiredInt("qk_rope_head_dim", 1));
  TV_ASSIGN_OR_RETURN(config.v_head_dim, root.RequiredInt("v_head_dim", 1));
  if (config.qk_rope_head_dim % 2 != 0) {
    return root.Error("qk_rope_head_dim",
                      absl::StrCat("must be even (rotary pairs), got ", config.qk_rope_head_dim));
  }

  TV_RETURN_IF_ERROR(ParseMoe(root, config));

  TV_ASSIGN_OR_RETURN(std::optional<double> rms_norm_eps, root.Number("rms_norm_eps", true));
  config.rms_norm_eps = rms_norm_eps.value_or(1e-6);
  TV_RETURN_IF_ERROR(ParseRope(root, config));

  TV_ASSIGN_OR_RETURN(std::optional<bool> rope_interleave, root.Bool("rope_interleave"));
  if (!v3 && rope_interleave == false) {
    return root.Error("rope_interleave",
                      "must be true for DeepseekV2ForCausalLM (always "
                      "interleaved)");
  }
  config.rope_interleave = rope_interleave.value_or(true);
  TV_ASSIGN_OR_RETURN(std::optional<bool> tie_word_embeddings, root.Bool("tie_word_embeddings"));
  config.tie_word_embeddings = tie_word_embeddings.value_or(false);
  TV_RETURN_IF_ERROR(ParseEos(root, config));

  TV_ASSIGN_OR_RETURN(std::optional<bool> attention_bias, root.Bool("attention_bias"));
  if (attention_bias == true) {
    return root.Error("attention_bias", "must be false (attention biases are not supported)");
  }
  TV_ASSIGN_OR_RETURN(std::optional<std::string> hidden_act, root.String("hidden_act"));
  if (hidden_act.has_value() && *hidden_act != "silu") {
    return root.Error("hidden_act",
                      absl::StrCat("\"", *hidden_act, "\" is not supported (supported: silu)"));
  }
  return config;
}

// YaRN's magnitude correction, as DeepSeek and transformers define it.
double YarnGetMscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromJson(absl::string_view json_text) {
  return Parse(json_text, "config.json");
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  std::string text;
  char buffer[1 << 14];
  size_t read;
  while ((read = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, read);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return absl::InvalidArgumentError(absl::StrCat(path, ": read error"));
  return Parse(text, path);
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
}

double ModelConfig::softmax_scale() const {
  double scale = std::pow(static_cast<double>(qk_head_dim()), -0.5);
  if (yarn.has_value() && yarn->mscale_all_dim != 0.0) {
    const double mscale = YarnGetMscale(yarn->factor, yarn->mscale_all_dim);
    scale = scale * mscale * mscale;
  }
  return scale;
}

double ModelConfig::rope_attention_factor() const {
  if (!yarn.has_value()) return 1.0;
  if (yarn->attention_factor.has_value()) return *yarn->attention_factor;
  if (yarn->mscale != 0.0 && yarn->mscale_all_dim != 0.0) {
    return YarnGetMscale(yarn->factor, yarn->mscale) /
           YarnGetMscale(yarn->factor, yarn->mscale_all_dim);
  }
  return YarnGetMscale(yarn->factor, 1.0);
}

// Follows transformers' _compute_default_rope_parameters / _compute_yarn_parameters step by step
// in fp32, as torch evaluates them (scalars enter fp32 tensor ops as fp32); the correction range
// is Python double arithmetic.
std::vector<float> ModelConfig::rope_inv_freq() const {
  const int64_t dim = qk_rope_head_dim;
  const int64_t half = dim / 2;
  const float base = static_cast<float>(rope_theta);
  std::vector<float> pos_freqs(half);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    pos_freqs[i] = static_cast<float>(std::pow(static_cast<double>(base), exponent));
  }
  std::vector<float> inv_freq(half);
  if (!yarn.has_value()) {
    for (int64_t i = 0; i < half; ++i) inv_freq[i] = 1.0f / pos_freqs[i];
    return inv_freq;
  }

  auto correction_dim = [&](double num_rotations) {
    return (static_cast<double>(dim) *
            std::log(static_cast<double>(yarn->original_max_position_embeddings) /
                     (num_rotations * 2.0 * std::numbers::pi))) /
           (2.0 * std::log(rope_theta));
  };
  double low = correction_dim(yarn->beta_fast);
  double high = correction_dim(yarn->beta_slow);
  if (yarn->truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  const float ramp_low = static_cast<float>(low);
  const float ramp_width = static_cast<float>(high - low);

  const float factor = static_cast<float>(yarn->factor);
  for (int64_t i = 0; i < half; ++i) {
    const float extrapolation = 1.0f / pos_freqs[i];
    const float interpolation = 1.0f / (factor * pos_freqs[i]);
    const float ramp = std::clamp((static_cast<float>(i) - ramp_low) / ramp_width, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv_freq[i] =
        interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv_freq;
}

}  // namespace treeverify::worker
