#include "treeverify/tools/checkpoint_generator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/model_config.h"

namespace treeverify::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kConfigFile[] = "config.json";
constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

// The generator holds a shard's values in memory as fp32; this catches a spec with real model
// sizes before it allocates tens of gigabytes.
constexpr int64_t kMaxTotalElements = int64_t{4} << 30;

// How a tensor's values are drawn. Scales keep activations of order 1 through the random model
// and make its choices (routing, next token) decisive rather than near ties.
enum class Init {
  kProjection,  // N(0, 1/fan_in): nn.Linear [out, in], fan_in = in
  kNorm,        // 1 + 0.1 N(0, 1)
  kRouter,      // N(0, (2/sqrt(H))^2)
  kBias,        // N(0, 0.05^2): e_score_correction_bias
  kEmbedding,   // N(0, 1)
  kLmHead,      // N(0, (lm_head_scale/sqrt(H))^2)
};

struct PlannedTensor {
  std::string name;
  std::vector<int64_t> shape;
  Init init = Init::kProjection;
};

// ---------------------------------------------------------------------------------------------
// Platform-independent random numbers. std::mt19937_64 is fully specified by the standard, but
// the distributions are not, so the normal deviates come from our own Box-Muller transform.

uint64_t Fnv1a64(absl::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Values depend only on (seed, name): adding a tensor leaves the others unchanged.
std::vector<float> NormalValues(uint64_t seed, const std::string& name, int64_t count, double mean,
                                double stddev) {
  std::mt19937_64 engine(SplitMix64(SplitMix64(seed) ^ Fnv1a64(name)));
  // 53 random bits mapped to (0, 1], so log() never sees 0.
  auto uniform = [&engine] { return (static_cast<double>(engine() >> 11) + 1.0) * 0x1.0p-53; };
  constexpr double kTwoPi = 6.283185307179586476925;
  std::vector<float> values(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform()));
    const double angle = kTwoPi * uniform();
    values[i] = static_cast<float>(mean + stddev * radius * std::cos(angle));
    if (i + 1 < count) values[i + 1] = static_cast<float>(mean + stddev * radius * std::sin(angle));
  }
  return values;
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

const char* TorchDTypeName(worker::DType dtype) {
  switch (dtype) {
    case worker::DType::kF32:
      return "float32";
    case worker::DType::kF16:
      return "float16";
    case worker::DType::kBF16:
      return "bfloat16";
    case worker::DType::kI32:
      return "int32";
    case worker::DType::kI64:
      return "int64";
    case worker::DType::kF8E4M3:
      return "float8_e4m3fn";
  }
  return "bfloat16";
}

std::vector<float> GenerateValues(const CheckpointSpec& spec, const PlannedTensor& tensor) {
  const int64_t count = NumElements(tensor.shape);
  const double inv_sqrt_hidden = 1.0 / std::sqrt(static_cast<double>(spec.hidden_size));
  switch (tensor.init) {
    case Init::kProjection:
      return NormalValues(spec.seed, tensor.name, count, 0.0,
                          1.0 / std::sqrt(static_cast<double>(tensor.shape.back())));
    case Init::kNorm:
      return NormalValues(spec.seed, tensor.name, count, 1.0, 0.1);
    case Init::kRouter:
      return NormalValues(spec.seed, tensor.name, count, 0.0, 2.0 * inv_sqrt_hidden);
    case Init::kBias:
      return NormalValues(spec.seed, tensor.name, count, 0.0, 0.05);
    case Init::kEmbedding:
      return NormalValues(spec.seed, tensor.name, count, 0.0, 1.0);
    case Init::kLmHead:
      return NormalValues(spec.seed, tensor.name, count, 0.0, spec.lm_head_scale * inv_sqrt_hidden);
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// config.json

bool IsMoeLayer(const CheckpointSpec& spec, int64_t layer) {
  return spec.n_routed_experts > 0 && layer >= spec.first_k_dense_replace &&
         spec.moe_layer_freq > 0 && layer % spec.moe_layer_freq == 0;
}

json YarnFields(const YarnSpec& yarn) {
  json fields = {
      {"factor", yarn.factor},
      {"original_max_position_embeddings", yarn.original_max_position_embeddings},
      {"beta_fast", yarn.beta_fast},
      {"beta_slow", yarn.beta_slow},
  };
  if (yarn.mscale != 0.0) fields["mscale"] = yarn.mscale;
  if (yarn.mscale_all_dim != 0.0) fields["mscale_all_dim"] = yarn.mscale_all_dim;
  return fields;
}

absl::StatusOr<std::string> ConfigJson(const CheckpointSpec& spec) {
  const bool is_v2 = spec.architecture == "DeepseekV2ForCausalLM";
  if (is_v2 && !spec.rope_interleave) {
    return absl::InvalidArgumentError(
        "rope_interleave = false is not expressible for DeepseekV2ForCausalLM (always "
        "interleaved)");
  }
  json config = {
      {"architectures", json::array({spec.architecture})},
      {"model_type", spec.model_type},
      {"vocab_size", spec.vocab_size},
      {"hidden_size", spec.hidden_size},
      {"intermediate_size", spec.intermediate_size},
      {"moe_intermediate_size", spec.moe_intermediate_size},
      {"num_hidden_layers", spec.num_hidden_layers},
      {"num_attention_heads", spec.num_attention_heads},
      {"num_key_value_heads", spec.num_attention_heads},
      {"max_position_embeddings", spec.max_position_embeddings},
      {"kv_lora_rank", spec.kv_lora_rank},
      {"qk_nope_head_dim", spec.qk_nope_head_dim},
      {"qk_rope_head_dim", spec.qk_rope_head_dim},
      {"v_head_dim", spec.v_head_dim},
      {"n_routed_experts", spec.n_routed_experts},
      {"num_experts_per_tok", spec.num_experts_per_tok},
      {"n_shared_experts", spec.n_shared_experts},
      {"n_group", spec.n_group},
      {"topk_group", spec.topk_group},
      {"topk_method", spec.topk_method},
      {"scoring_func", spec.scoring_func},
      {"norm_topk_prob", spec.norm_topk_prob},
      {"routed_scaling_factor", spec.routed_scaling_factor},
      {"first_k_dense_replace", spec.first_k_dense_replace},
      {"moe_layer_freq", spec.moe_layer_freq},
      {"rms_norm_eps", spec.rms_norm_eps},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"tie_word_embeddings", spec.tie_word_embeddings},
      {"bos_token_id", 0},
      {"torch_dtype", TorchDTypeName(spec.weight_dtype)},
      {"use_cache", true},
  };
  config["q_lora_rank"] = spec.q_lora_rank.has_value() ? json(*spec.q_lora_rank) : json(nullptr);
  using Method = worker::WeightQuantization::Method;
  if (spec.quantization.method == Method::kFp8Block) {
    config["quantization_config"] = {
        {"activation_scheme", "dynamic"},
        {"fmt", "e4m3"},
        {"quant_method", "fp8"},
        {"weight_block_size", {spec.quantization.block_rows, spec.quantization.block_cols}}};
  } else if (spec.quantization.method == Method::kInt4Group) {
    config["quantization_config"] = {{"config_groups",
                                      {{"group_0",
                                        {{"input_activations", nullptr},
                                         {"output_activations", nullptr},
                                         {"targets", {"Linear"}},
                                         {"weights",
                                          {{"actorder", nullptr},
                                           {"block_structure", nullptr},
                                           {"dynamic", false},
                                           {"group_size", spec.quantization.group_size},
                                           {"num_bits", 4},
                                           {"observer", "minmax"},
                                           {"observer_kwargs", json::object()},
                                           {"strategy", "group"},
                                           {"symmetric", true},
                                           {"type", "int"}}}}}}},
                                     {"format", "pack-quantized"},
                                     {"ignore",
                                      {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"}},
                                     {"kv_cache_scheme", nullptr},
                                     {"quant_method", "compressed-tensors"},
                                     {"quantization_status", "compressed"}};
  }
  if (spec.eos_token_id.size() == 1) {
    config["eos_token_id"] = spec.eos_token_id[0];
  } else if (!spec.eos_token_id.empty()) {
    config["eos_token_id"] = spec.eos_token_id;
  }
  if (!is_v2) config["rope_interleave"] = spec.rope_interleave;

  switch (spec.rope_style) {
    case RopeStyle::kRopeScaling:
      config["rope_theta"] = spec.rope_theta;
      if (spec.yarn.has_value()) {
        json scaling = YarnFields(*spec.yarn);
        scaling["type"] = "yarn";  // the official checkpoints' key (transformers < 4.45)
        config["rope_scaling"] = std::move(scaling);
      } else {
        config["rope_scaling"] = nullptr;
      }
      break;
    case RopeStyle::kRopeParameters: {
      json parameters = spec.yarn.has_value() ? YarnFields(*spec.yarn) : json::object();
      parameters["rope_type"] = spec.yarn.has_value() ? "yarn" : "default";
      parameters["rope_theta"] = spec.rope_theta;
      config["rope_parameters"] = std::move(parameters);
      break;
    }
  }
  return config.dump(2) + "\n";
}

// ---------------------------------------------------------------------------------------------
// Tensors

std::vector<PlannedTensor> PlanTensors(const CheckpointSpec& spec) {
  const int64_t hidden = spec.hidden_size;
  const int64_t heads = spec.num_attention_heads;
  const int64_t qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim;
  std::vector<PlannedTensor> tensors;
  auto add = [&tensors](std::string name, std::vector<int64_t> shape, Init init) {
    tensors.push_back({std::move(name), std::move(shape), init});
  };
  auto add_mlp = [&add, hidden](const std::string& prefix, int64_t intermediate) {
    add(prefix + ".gate_proj.weight", {intermediate, hidden}, Init::kProjection);
    add(prefix + ".up_proj.weight", {intermediate, hidden}, Init::kProjection);
    add(prefix + ".down_proj.weight", {hidden, intermediate}, Init::kProjection);
  };

  add("model.embed_tokens.weight", {spec.vocab_size, hidden}, Init::kEmbedding);
  for (int64_t layer = 0; layer < spec.num_hidden_layers; ++layer) {
    const std::string prefix = absl::StrFormat("model.layers.%d", layer);
    add(prefix + ".input_layernorm.weight", {hidden}, Init::kNorm);
    add(prefix + ".post_attention_layernorm.weight", {hidden}, Init::kNorm);

    const std::string attn = prefix + ".self_attn";
    if (spec.q_lora_rank.has_value()) {
      const int64_t q_lora = *spec.q_lora_rank;
      add(attn + ".q_a_proj.weight", {q_lora, hidden}, Init::kProjection);
      add(attn + ".q_a_layernorm.weight", {q_lora}, Init::kNorm);
      add(attn + ".q_b_proj.weight", {heads * qk_head, q_lora}, Init::kProjection);
    } else {
      add(attn + ".q_proj.weight", {heads * qk_head, hidden}, Init::kProjection);
    }
    add(attn + ".kv_a_proj_with_mqa.weight", {spec.kv_lora_rank + spec.qk_rope_head_dim, hidden},
        Init::kProjection);
    add(attn + ".kv_a_layernorm.weight", {spec.kv_lora_rank}, Init::kNorm);
    add(attn + ".kv_b_proj.weight",
        {heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank}, Init::kProjection);
    add(attn + ".o_proj.weight", {hidden, heads * spec.v_head_dim}, Init::kProjection);

    const std::string mlp = prefix + ".mlp";
    if (!IsMoeLayer(spec, layer)) {
      add_mlp(mlp, spec.intermediate_size);
      continue;
    }
    add(mlp + ".gate.weight", {spec.n_routed_experts, hidden}, Init::kRouter);
    if (spec.topk_method == "noaux_tc") {
      add(mlp + ".gate.e_score_correction_bias", {spec.n_routed_experts}, Init::kBias);
    }
    for (int64_t expert = 0; expert < spec.n_routed_experts; ++expert) {
      add_mlp(absl::StrFormat("%s.experts.%d", mlp, expert), spec.moe_intermediate_size);
    }
    if (spec.n_shared_experts > 0) {
      add_mlp(mlp + ".shared_experts", spec.moe_intermediate_size * spec.n_shared_experts);
    }
  }
  add("model.norm.weight", {hidden}, Init::kNorm);
  if (!spec.tie_word_embeddings) add("lm_head.weight", {spec.vocab_size, hidden}, Init::kLmHead);
  return tensors;
}

// Splits the tensors, in order, into num_shards contiguous runs of about total/num_shards bytes
// each, none empty. Returns each tensor's shard.
std::vector<int> AssignShards(const std::vector<int64_t>& bytes, int num_shards) {
  int64_t total = 0;
  for (int64_t size : bytes) total += size;
  std::vector<int> shard_of(bytes.size());
  const int64_t count = static_cast<int64_t>(bytes.size());
  int shard = 0;
  int64_t cumulative = 0;  // bytes in shards [0, shard]
  int64_t in_shard = 0;    // tensors in the current shard
  for (int64_t i = 0; i < count; ++i) {
    const int shards_after = num_shards - 1 - shard;
    const bool share_reached = cumulative * num_shards >= total * (shard + 1);
    const bool must_leave_rest = count - i == shards_after;
    if (in_shard > 0 && shards_after > 0 && (share_reached || must_leave_rest)) {
      ++shard;
      in_shard = 0;
    }
    shard_of[i] = shard;
    cumulative += bytes[i];
    ++in_shard;
  }
  return shard_of;
}

std::string ShardFileName(int shard, int num_shards) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", shard + 1, num_shards);
}

absl::Status ValidateSpec(const CheckpointSpec& spec, const std::vector<PlannedTensor>& tensors) {
  if (spec.num_shards < 1 || spec.num_shards > 99999) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_shards must be in [1, 99999], got %d", spec.num_shards));
  }
  if (!(spec.lm_head_scale > 0.0f) || !std::isfinite(spec.lm_head_scale)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("lm_head_scale must be positive and finite, got %f", spec.lm_head_scale));
  }
  int64_t total_elements = 0;
  for (const PlannedTensor& tensor : tensors) {
    for (int64_t dim : tensor.shape) {
      // Each factor is bounded, so the products below cannot overflow.
      if (dim <= 0 || dim > (int64_t{1} << 31)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s would have shape [%s]; every dimension must be in [1, 2^31]: check the spec's "
            "sizes",
            tensor.name, absl::StrJoin(tensor.shape, ", ")));
      }
    }
    const int64_t elements = NumElements(tensor.shape);
    if (elements > kMaxTotalElements || total_elements + elements > kMaxTotalElements) {
      return absl::InvalidArgumentError(
          absl::StrFormat("the spec needs more than %d parameters; this generator is for small "
                          "models (it holds a shard in memory as fp32)",
                          kMaxTotalElements));
    }
    total_elements += elements;
  }
  if (spec.num_shards > static_cast<int64_t>(tensors.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_shards = %d but the checkpoint has only %d tensors", spec.num_shards, tensors.size()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Files

bool IsGeneratorFile(const std::string& file_name) {
  if (file_name == kConfigFile || file_name == kSingleFile || file_name == kIndexFile) return true;
  // model-NNNNN-of-NNNNN.safetensors
  constexpr absl::string_view kShardPattern = "model-#####-of-#####.safetensors";
  if (file_name.size() != kShardPattern.size()) return false;
  for (size_t i = 0; i < file_name.size(); ++i) {
    const char expected = kShardPattern[i];
    const char actual = file_name[i];
    if (expected == '#' ? (actual < '0' || actual > '9') : actual != expected) return false;
  }
  return true;
}

// Creates dir, or empties it of a previous checkpoint; refuses a directory holding anything else.
absl::Status PrepareDirectory(const std::string& dir) {
  std::error_code error;
  const fs::file_status status = fs::status(dir, error);
  if (fs::exists(status)) {
    if (!fs::is_directory(status)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s exists and is not a directory", dir));
    }
    std::vector<fs::path> previous_files;
    for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
      const std::string file_name = it->path().filename().string();
      if (!IsGeneratorFile(file_name) || !it->is_regular_file()) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s holds %s, which the checkpoint generator did not write; refusing to write a "
            "checkpoint there (use an empty or new directory)",
            dir, file_name));
      }
      previous_files.push_back(it->path());
    }
    if (error) {
      return absl::InternalError(absl::StrFormat("listing %s: %s", dir, error.message()));
    }
    for (const fs::path& file : previous_files) {
      if (!fs::remove(file, error) && error) {
        return absl::InternalError(
            absl::StrFormat("removing %s: %s", file.string(), error.message()));
      }
    }
    return absl::OkStatus();
  }
  fs::create_directories(dir, error);
  if (error) {
    return absl::InternalError(absl::StrFormat("creating %s: %s", dir, error.message()));
  }
  return absl::OkStatus();
}

absl::Status WriteTextFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrFormat("writing %s failed", path.string()));
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> PresetNames() { return {"demo", "tiny-v3", "tiny-kimi", "tiny-v2-lite"}; }

absl::StatusOr<CheckpointSpec> PresetSpec(absl::string_view name) {
  // tiny-v3 is the base of the three tiny presets.
  CheckpointSpec tiny;
  tiny.architecture = "DeepseekV3ForCausalLM";
  tiny.model_type = "deepseek_v3";
  tiny.vocab_size = 512;
  tiny.hidden_size = 64;
  tiny.intermediate_size = 128;
  tiny.moe_intermediate_size = 32;
  tiny.num_hidden_layers = 3;
  tiny.num_attention_heads = 4;
  tiny.max_position_embeddings = 1024;
  tiny.q_lora_rank = 48;
  tiny.kv_lora_rank = 32;
  tiny.qk_nope_head_dim = 16;
  tiny.qk_rope_head_dim = 8;
  tiny.v_head_dim = 16;
  tiny.n_routed_experts = 8;
  tiny.num_experts_per_tok = 2;
  tiny.n_shared_experts = 1;
  tiny.n_group = 4;
  tiny.topk_group = 2;
  tiny.topk_method = "noaux_tc";
  tiny.scoring_func = "sigmoid";
  tiny.norm_topk_prob = true;
  tiny.routed_scaling_factor = 2.5;
  tiny.first_k_dense_replace = 1;
  tiny.moe_layer_freq = 1;
  tiny.rms_norm_eps = 1e-6;
  tiny.rope_theta = 10000.0;
  tiny.yarn = YarnSpec{.factor = 4.0,
                       .original_max_position_embeddings = 64,
                       .beta_fast = 32.0,
                       .beta_slow = 1.0,
                       .mscale = 0.707,
                       .mscale_all_dim = 1.0};

  if (name == "tiny-v3") return tiny;

  if (name == "tiny-kimi") {
    CheckpointSpec kimi = tiny;
    kimi.model_type = "kimi_k2";
    kimi.n_routed_experts = 12;
    kimi.num_experts_per_tok = 3;
    kimi.n_group = 1;
    kimi.topk_group = 1;
    kimi.routed_scaling_factor = 2.827;  // Kimi-K2's
    kimi.rope_style = RopeStyle::kRopeParameters;
    return kimi;
  }

  if (name == "tiny-v2-lite") {
    CheckpointSpec v2 = tiny;
    v2.architecture = "DeepseekV2ForCausalLM";
    v2.model_type = "deepseek_v2";
    v2.q_lora_rank = std::nullopt;
    v2.n_group = 1;
    v2.topk_group = 1;
    v2.topk_method = "greedy";
    v2.scoring_func = "softmax";
    v2.norm_topk_prob = false;
    v2.routed_scaling_factor = 1.0;
    v2.n_shared_experts = 2;
    v2.yarn = std::nullopt;
    return v2;
  }

  if (name == "demo") {
    CheckpointSpec demo = tiny;
    demo.vocab_size = 1024;
    demo.hidden_size = 128;
    demo.intermediate_size = 256;
    demo.moe_intermediate_size = 64;
    demo.num_hidden_layers = 4;
    demo.num_attention_heads = 8;
    demo.max_position_embeddings = 4096;
    demo.q_lora_rank = 96;
    demo.kv_lora_rank = 64;
    demo.qk_nope_head_dim = 32;
    demo.qk_rope_head_dim = 16;
    demo.v_head_dim = 32;
    demo.n_routed_experts = 16;
    demo.num_experts_per_tok = 4;
    demo.n_shared_experts = 1;
    demo.n_group = 4;
    demo.topk_group = 2;
    demo.yarn = YarnSpec{.factor = 4.0,
                         .original_max_position_embeddings = 256,
                         .beta_fast = 32.0,
                         .beta_slow = 1.0,
                         .mscale = 1.0,
                         .mscale_all_dim = 1.0};
    return demo;
  }

  return absl::InvalidArgumentError(
      absl::StrFormat("unknown checkpoint preset \"%s\"; known presets: %s", name,
                      absl::StrJoin(PresetNames(), ", ")));
}

// Whether the spec's format stores this tensor quantized, as the releases do: FP8 every layer's
// projections, INT4 the routed experts' only.
bool Quantized(const CheckpointSpec& spec, const PlannedTensor& tensor) {
  using Method = worker::WeightQuantization::Method;
  const std::string& name = tensor.name;
  const bool projection =
      tensor.shape.size() == 2 && absl::StartsWith(name, "model.layers.") &&
      absl::EndsWith(name, ".weight") &&
      (absl::StrContains(name, "_proj.") || absl::StrContains(name, "kv_a_proj_with_mqa."));
  if (spec.quantization.method == Method::kFp8Block) return projection;
  if (spec.quantization.method == Method::kInt4Group) {
    return projection && absl::StrContains(name, ".mlp.experts.");
  }
  return false;
}

template <typename T>
std::string AsBytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// A tensor as it is stored: plain, or the parts of its quantized layout.
std::vector<worker::TensorToWrite> Encode(const CheckpointSpec& spec, const PlannedTensor& tensor,
                                          std::vector<float> values) {
  if (!Quantized(spec, tensor)) return {{tensor.name, tensor.shape, std::move(values)}};
  const int64_t out = tensor.shape[0], in = tensor.shape[1];
  const std::string prefix = tensor.name.substr(0, tensor.name.size() - std::strlen(".weight"));
  using Method = worker::WeightQuantization::Method;
  if (spec.quantization.method == Method::kFp8Block) {
    // Each block's scale maps its largest magnitude to e4m3's largest finite value (448).
    const int64_t br = spec.quantization.block_rows, bc = spec.quantization.block_cols;
    const int64_t block_rows = (out + br - 1) / br, block_cols = (in + bc - 1) / bc;
    std::vector<float> scales(block_rows * block_cols, 0.f);
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t c = 0; c < in; ++c) {
        float& s = scales[(r / br) * block_cols + c / bc];
        s = std::max(s, std::fabs(values[r * in + c]));
      }
    }
    for (float& s : scales) s = s > 0.f ? s / 448.f : 1.f;
    std::vector<uint8_t> codes(out * in);
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t c = 0; c < in; ++c) {
        codes[r * in + c] =
            worker::FloatToFp8E4M3(values[r * in + c] / scales[(r / br) * block_cols + c / bc]);
      }
    }
    return {
        {tensor.name, tensor.shape, {}, worker::DType::kF8E4M3, AsBytes(codes)},
        {tensor.name + "_scale_inv", {block_rows, block_cols}, scales, worker::DType::kF32, ""}};
  }
  // INT4: each group's scale (bf16) maps its largest magnitude to 7; values round to [-8, 7].
  const int64_t group = spec.quantization.group_size;
  const int64_t groups = (in + group - 1) / group, words = (in + 7) / 8;
  std::vector<float> scales(out * groups);
  std::vector<int32_t> packed(out * words, 0);
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float largest = 0.f;
      for (int64_t c = g * group; c < std::min(in, (g + 1) * group); ++c) {
        largest = std::max(largest, std::fabs(values[r * in + c]));
      }
      const float scale =
          worker::Bf16ToFloat(worker::FloatToBf16(largest > 0.f ? largest / 7.f : 1.f));
      scales[r * groups + g] = scale;
      for (int64_t c = g * group; c < std::min(in, (g + 1) * group); ++c) {
        const int q =
            static_cast<int>(std::clamp(std::nearbyint(values[r * in + c] / scale), -8.0f, 7.0f));
        uint32_t word = static_cast<uint32_t>(packed[r * words + c / 8]);
        word |= static_cast<uint32_t>(q + 8) << (4 * (c % 8));
        packed[r * words + c / 8] = static_cast<int32_t>(word);
      }
    }
  }
  return {{prefix + ".weight_packed", {out, words}, {}, worker::DType::kI32, AsBytes(packed)},
          {prefix + ".weight_scale", {out, groups}, scales, worker::DType::kBF16, ""},
          {prefix + ".weight_shape",
           {2},
           {},
           worker::DType::kI64,
           AsBytes(std::vector<int64_t>{out, in})}};
}

// Bytes a tensor takes as stored (for balancing shards).
int64_t StoredBytes(const CheckpointSpec& spec, const PlannedTensor& tensor) {
  const int64_t count = NumElements(tensor.shape);
  if (!Quantized(spec, tensor))
    return count * static_cast<int64_t>(worker::DTypeSize(spec.weight_dtype));
  return spec.quantization.method == worker::WeightQuantization::Method::kFp8Block ? count
                                                                                   : count / 2;
}

absl::Status WriteCheckpoint(const std::string& dir, const CheckpointSpec& spec) {
  // Everything is checked before anything is written.
  TV_ASSIGN_OR_RETURN(std::string config_text, ConfigJson(spec));
  absl::StatusOr<worker::ModelConfig> parsed = worker::ModelConfig::FromJson(config_text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the spec's config.json would be refused by ModelConfig: %s", parsed.status().message()));
  }
  const std::vector<PlannedTensor> tensors = PlanTensors(spec);
  TV_RETURN_IF_ERROR(ValidateSpec(spec, tensors));
  TV_RETURN_IF_ERROR(PrepareDirectory(dir));

  const fs::path root(dir);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (spec.num_shards == 1) {
    std::vector<worker::TensorToWrite> to_write;
    to_write.reserve(tensors.size());
    for (const PlannedTensor& tensor : tensors) {
      for (worker::TensorToWrite& part : Encode(spec, tensor, GenerateValues(spec, tensor))) {
        to_write.push_back(std::move(part));
      }
    }
    TV_RETURN_IF_ERROR(worker::WriteSafetensors((root / kSingleFile).string(), to_write,
                                                spec.weight_dtype, metadata));
  } else {
    std::vector<int64_t> bytes;
    bytes.reserve(tensors.size());
    int64_t total_bytes = 0;
    for (const PlannedTensor& tensor : tensors) {
      bytes.push_back(StoredBytes(spec, tensor));
      total_bytes += bytes.back();
    }
    const std::vector<int> shard_of = AssignShards(bytes, spec.num_shards);
    json weight_map = json::object();
    // One shard in memory at a time.
    for (int shard = 0; shard < spec.num_shards; ++shard) {
      const std::string file_name = ShardFileName(shard, spec.num_shards);
      std::vector<worker::TensorToWrite> to_write;
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (shard_of[i] != shard) continue;
        for (worker::TensorToWrite& part :
             Encode(spec, tensors[i], GenerateValues(spec, tensors[i]))) {
          weight_map[part.name] = file_name;
          to_write.push_back(std::move(part));
        }
      }
      TV_RETURN_IF_ERROR(worker::WriteSafetensors((root / file_name).string(), to_write,
                                                  spec.weight_dtype, metadata));
    }
    const json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    TV_RETURN_IF_ERROR(WriteTextFile(root / kIndexFile, index.dump(2) + "\n"));
  }
  // config.json last: a directory without one is visibly an interrupted write.
  return WriteTextFile(root / kConfigFile, config_text);
}

absl::Status RunMakeCheckpoint(const std::string& out_dir, const std::string& preset, uint64_t seed,
                               int num_shards) {
  TV_ASSIGN_OR_RETURN(CheckpointSpec spec, PresetSpec(preset));
  spec.seed = seed;
  spec.num_shards = num_shards;
  return WriteCheckpoint(out_dir, spec);
}

}  // namespace treeverify::tools
