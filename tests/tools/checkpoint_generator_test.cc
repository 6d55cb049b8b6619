#include "treeverify/tools/checkpoint_generator.h"

#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "treeverify/worker/model_config.h"
#include "treeverify/worker/safetensors.h"

namespace treeverify::tools {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using worker::Checkpoint;
using worker::ModelConfig;
using Shapes = std::map<std::string, std::vector<int64_t>>;

// Every checkpoint of this process goes under one root, removed when the tests end.
const std::string& TestRoot() {
  static const std::string* root =
      new std::string(absl::StrCat(testing::TempDir(), "/checkpoint_generator_test_", getpid()));
  return *root;
}

class RemoveTestRoot : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code error;
    fs::remove_all(TestRoot(), error);
  }
};
const ::testing::Environment* const kRemoveTestRoot =
    ::testing::AddGlobalTestEnvironment(new RemoveTestRoot);

// A fresh directory, unique per test and call (not created: WriteCheckpoint creates it).
std::string NewDir(const std::string& label) {
  static int counter = 0;
  std::string name = absl::StrCat(::testing::UnitTest::GetInstance()->current_test_info()->name(),
                                  "_", label, "_", counter++);
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') c = '_';
  }
  const std::string dir = absl::StrCat(TestRoot(), "/", name);
  fs::remove_all(dir);
  return dir;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

CheckpointSpec Preset(const std::string& name) {
  absl::StatusOr<CheckpointSpec> spec = PresetSpec(name);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : CheckpointSpec{};
}

ModelConfig LoadConfig(const std::string& dir) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromFile(dir + "/config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

std::unique_ptr<Checkpoint> OpenCheckpoint(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  return checkpoint.ok() ? std::move(*checkpoint) : nullptr;
}

std::vector<float> ReadTensor(const Checkpoint& checkpoint, const std::string& name,
                              const std::vector<int64_t>& shape) {
  absl::StatusOr<std::vector<float>> values = checkpoint.Read(name, shape);
  EXPECT_TRUE(values.ok()) << name << ": " << values.status();
  return values.ok() ? *values : std::vector<float>{};
}

// The official tensor names and shapes, written out from the config independently of the
// generator's code.
Shapes ExpectedTensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t nh = c.num_attention_heads;
  Shapes shapes;
  shapes["model.embed_tokens.weight"] = {c.vocab_size, h};
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    shapes[p + "input_layernorm.weight"] = {h};
    shapes[p + "post_attention_layernorm.weight"] = {h};
    if (c.q_lora_rank.has_value()) {
      shapes[p + "self_attn.q_a_proj.weight"] = {*c.q_lora_rank, h};
      shapes[p + "self_attn.q_a_layernorm.weight"] = {*c.q_lora_rank};
      shapes[p + "self_attn.q_b_proj.weight"] = {nh * (c.qk_nope_head_dim + c.qk_rope_head_dim),
                                                 *c.q_lora_rank};
    } else {
      shapes[p + "self_attn.q_proj.weight"] = {nh * (c.qk_nope_head_dim + c.qk_rope_head_dim), h};
    }
    shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = {c.kv_lora_rank + c.qk_rope_head_dim, h};
    shapes[p + "self_attn.kv_a_layernorm.weight"] = {c.kv_lora_rank};
    shapes[p + "self_attn.kv_b_proj.weight"] = {nh * (c.qk_nope_head_dim + c.v_head_dim),
                                                c.kv_lora_rank};
    shapes[p + "self_attn.o_proj.weight"] = {h, nh * c.v_head_dim};
    const bool moe =
        c.n_routed_experts > 0 && l >= c.first_k_dense_replace && l % c.moe_layer_freq == 0;
    if (!moe) {
      shapes[p + "mlp.gate_proj.weight"] = {c.intermediate_size, h};
      shapes[p + "mlp.up_proj.weight"] = {c.intermediate_size, h};
      shapes[p + "mlp.down_proj.weight"] = {h, c.intermediate_size};
      continue;
    }
    shapes[p + "mlp.gate.weight"] = {c.n_routed_experts, h};
    if (c.topk_method == kernels::MoeTopkMethod::kNoauxTc) {
      shapes[p + "mlp.gate.e_score_correction_bias"] = {c.n_routed_experts};
    }
    const int64_t im = c.moe_intermediate_size;
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      const std::string ep = absl::StrCat(p, "mlp.experts.", e, ".");
      shapes[ep + "gate_proj.weight"] = {im, h};
      shapes[ep + "up_proj.weight"] = {im, h};
      shapes[ep + "down_proj.weight"] = {h, im};
    }
    if (c.n_shared_experts > 0) {
      const int64_t is = im * c.n_shared_experts;
      shapes[p + "mlp.shared_experts.gate_proj.weight"] = {is, h};
      shapes[p + "mlp.shared_experts.up_proj.weight"] = {is, h};
      shapes[p + "mlp.shared_experts.down_proj.weight"] = {h, is};
    }
  }
  shapes["model.norm.weight"] = {h};
  if (!c.tie_word_embeddings) shapes["lm_head.weight"] = {c.vocab_size, h};
  return shapes;
}

// Names of every tensor stored in the checkpoint's safetensors files.
std::set<std::string> StoredNames(const std::string& dir) {
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    absl::StatusOr<std::unique_ptr<worker::SafetensorsFile>> file =
        worker::SafetensorsFile::Open(entry.path().string());
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) continue;
    for (const auto& [name, info] : (*file)->tensors()) {
      EXPECT_TRUE(names.insert(name).second) << name << " stored twice";
    }
  }
  return names;
}

double StdDev(const std::vector<float>& values) {
  double sum = 0, sum_sq = 0;
  for (float v : values) {
    sum += v;
    sum_sq += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(values.size());
  const double mean = sum / n;
  return std::sqrt(sum_sq / n - mean * mean);
}

// Every expected tensor is found with its shape, and nothing else is stored.
void ExpectOfficialTensors(const std::string& dir) {
  const ModelConfig config = LoadConfig(dir);
  const Shapes expected = ExpectedTensors(config);
  std::unique_ptr<Checkpoint> checkpoint = OpenCheckpoint(dir);
  ASSERT_NE(checkpoint, nullptr);
  for (const auto& [name, shape] : expected) {
    ASSERT_TRUE(checkpoint->Has(name)) << name;
    absl::StatusOr<worker::TensorInfo> info = checkpoint->Info(name);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->shape, shape) << name;
  }
  std::set<std::string> expected_names;
  for (const auto& [name, shape] : expected) expected_names.insert(name);
  EXPECT_EQ(StoredNames(dir), expected_names);
}

TEST(PresetSpecTest, DemoHasTheDocumentedShape) {
  const std::string dir = NewDir("demo");
  ASSERT_TRUE(WriteCheckpoint(dir, Preset("demo")).ok());
  const ModelConfig c = LoadConfig(dir);
  EXPECT_EQ(c.architecture, worker::Architecture::kDeepseekV3);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 1024);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.q_lora_rank, 96);
  EXPECT_EQ(c.kv_lora_rank, 64);
  EXPECT_EQ(c.qk_nope_head_dim, 32);
  EXPECT_EQ(c.qk_rope_head_dim, 16);
  EXPECT_EQ(c.v_head_dim, 32);
  EXPECT_EQ(c.n_routed_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.topk_method, kernels::MoeTopkMethod::kNoauxTc);
  EXPECT_EQ(c.scoring_func, kernels::MoeScoring::kSigmoid);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_FALSE(c.tie_word_embeddings);
  ASSERT_TRUE(c.yarn.has_value());
  EXPECT_DOUBLE_EQ(c.yarn->factor, 4.0);
  EXPECT_EQ(c.yarn->original_max_position_embeddings, 256);
  EXPECT_DOUBLE_EQ(c.yarn->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.yarn->mscale_all_dim, 1.0);
}

TEST(PresetSpecTest, TinyV3HasTheDocumentedShape) {
  const std::string dir = NewDir("tiny-v3");
  ASSERT_TRUE(WriteCheckpoint(dir, Preset("tiny-v3")).ok());
  const ModelConfig c = LoadConfig(dir);
  EXPECT_EQ(c.architecture, worker::Architecture::kDeepseekV3);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.moe_intermediate_size, 32);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.max_position_embeddings, 1024);
  EXPECT_EQ(c.q_lora_rank, 48);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.qk_nope_head_dim, 16);
  EXPECT_EQ(c.qk_rope_head_dim, 8);
  EXPECT_EQ(c.v_head_dim, 16);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.topk_method, kernels::MoeTopkMethod::kNoauxTc);
  EXPECT_EQ(c.scoring_func, kernels::MoeScoring::kSigmoid);
  ASSERT_TRUE(c.yarn.has_value());
  EXPECT_DOUBLE_EQ(c.yarn->factor, 4.0);
  EXPECT_EQ(c.yarn->original_max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(c.yarn->mscale, 0.707);
  EXPECT_DOUBLE_EQ(c.yarn->mscale_all_dim, 1.0);
}

TEST(PresetSpecTest, TinyKimiIsKimiK2WithOneGroupAndRopeParameters) {
  const CheckpointSpec spec = Preset("tiny-kimi");
  EXPECT_EQ(spec.rope_style, RopeStyle::kRopeParameters);
  const std::string dir = NewDir("tiny-kimi");
  ASSERT_TRUE(WriteCheckpoint(dir, spec).ok());
  const nlohmann::json raw = nlohmann::json::parse(ReadFile(dir + "/config.json"));
  EXPECT_TRUE(raw.contains("rope_parameters"));
  EXPECT_FALSE(raw.contains("rope_scaling"));
  const ModelConfig c = LoadConfig(dir);
  EXPECT_EQ(c.architecture, worker::Architecture::kDeepseekV3);
  EXPECT_EQ(c.model_type, "kimi_k2");
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.n_routed_experts, 12);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.topk_method, kernels::MoeTopkMethod::kNoauxTc);
  EXPECT_EQ(c.scoring_func, kernels::MoeScoring::kSigmoid);
  ASSERT_TRUE(c.yarn.has_value());
  EXPECT_DOUBLE_EQ(c.yarn->factor, 4.0);
  EXPECT_EQ(c.yarn->original_max_position_embeddings, 64);
}

TEST(PresetSpecTest, TinyV2LiteHasNoQLoraSoftmaxGreedyAndPlainRope) {
  const std::string dir = NewDir("tiny-v2-lite");
  ASSERT_TRUE(WriteCheckpoint(dir, Preset("tiny-v2-lite")).ok());
  const ModelConfig c = LoadConfig(dir);
  EXPECT_EQ(c.architecture, worker::Architecture::kDeepseekV2);
  EXPECT_EQ(c.model_type, "deepseek_v2");
  EXPECT_FALSE(c.q_lora_rank.has_value());
  EXPECT_EQ(c.topk_method, kernels::MoeTopkMethod::kGreedy);
  EXPECT_EQ(c.scoring_func, kernels::MoeScoring::kSoftmax);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_FALSE(c.yarn.has_value());
}

TEST(PresetSpecTest, UnknownPresetListsTheKnownOnes) {
  absl::StatusOr<CheckpointSpec> spec = PresetSpec("huge");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* name : {"demo", "tiny-v3", "tiny-kimi", "tiny-v2-lite"}) {
    EXPECT_THAT(spec.status().message(), HasSubstr(name));
  }
}

class EveryPresetTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryPresetTest, StoresEveryOfficialTensorWithItsShape) {
  const std::string dir = NewDir(GetParam());
  ASSERT_TRUE(WriteCheckpoint(dir, Preset(GetParam())).ok());
  ExpectOfficialTensors(dir);
}

TEST_P(EveryPresetTest, RopeScalingAndRopeParametersParseEqual) {
  CheckpointSpec spec = Preset(GetParam());
  spec.rope_style = RopeStyle::kRopeScaling;
  const std::string scaling_dir = NewDir("scaling");
  ASSERT_TRUE(WriteCheckpoint(scaling_dir, spec).ok());
  spec.rope_style = RopeStyle::kRopeParameters;
  const std::string parameters_dir = NewDir("parameters");
  ASSERT_TRUE(WriteCheckpoint(parameters_dir, spec).ok());

  const nlohmann::json scaling = nlohmann::json::parse(ReadFile(scaling_dir + "/config.json"));
  const nlohmann::json parameters =
      nlohmann::json::parse(ReadFile(parameters_dir + "/config.json"));
  EXPECT_TRUE(scaling.contains("rope_scaling"));
  EXPECT_TRUE(scaling.contains("rope_theta"));
  EXPECT_FALSE(scaling.contains("rope_parameters"));
  EXPECT_TRUE(parameters.contains("rope_parameters"));
  EXPECT_FALSE(parameters.contains("rope_scaling"));
  EXPECT_FALSE(parameters.contains("rope_theta"));

  EXPECT_TRUE(LoadConfig(scaling_dir) == LoadConfig(parameters_dir));
}

INSTANTIATE_TEST_SUITE_P(Presets, EveryPresetTest,
                         ::testing::Values("demo", "tiny-v3", "tiny-kimi", "tiny-v2-lite"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

TEST(WriteCheckpointTest, SameSeedGivesIdenticalBytesAndOtherSeedsDiffer) {
  CheckpointSpec spec = Preset("tiny-v3");
  spec.seed = 1234;
  const std::string first = NewDir("first");
  const std::string second = NewDir("second");
  const std::string other = NewDir("other");
  ASSERT_TRUE(WriteCheckpoint(first, spec).ok());
  ASSERT_TRUE(WriteCheckpoint(second, spec).ok());
  spec.seed = 1235;
  ASSERT_TRUE(WriteCheckpoint(other, spec).ok());

  for (const char* file : {"config.json", "model.safetensors"}) {
    const std::string bytes = ReadFile(fs::path(first) / file);
    ASSERT_FALSE(bytes.empty()) << file;
    EXPECT_TRUE(bytes == ReadFile(fs::path(second) / file)) << file << " differs for one seed";
  }
  EXPECT_TRUE(ReadFile(fs::path(first) / "config.json") ==
              ReadFile(fs::path(other) / "config.json"));
  EXPECT_FALSE(ReadFile(fs::path(first) / "model.safetensors") ==
               ReadFile(fs::path(other) / "model.safetensors"));

  // Not only somewhere: every tensor changes with the seed.
  std::unique_ptr<Checkpoint> a = OpenCheckpoint(first);
  std::unique_ptr<Checkpoint> b = OpenCheckpoint(other);
  ASSERT_TRUE(a && b);
  for (const auto& [name, shape] : ExpectedTensors(LoadConfig(first))) {
    EXPECT_NE(ReadTensor(*a, name, shape), ReadTensor(*b, name, shape)) << name;
  }
}

TEST(WriteCheckpointTest, TensorsDependOnlyOnSeedAndName) {
  CheckpointSpec spec = Preset("tiny-v3");
  spec.seed = 99;
  spec.weight_dtype = worker::DType::kF32;
  const std::string small_dir = NewDir("three_layers");
  ASSERT_TRUE(WriteCheckpoint(small_dir, spec).ok());
  spec.num_hidden_layers += 1;
  spec.n_routed_experts += 4;  // 12 experts, still divisible into 4 groups
  const std::string large_dir = NewDir("four_layers");
  ASSERT_TRUE(WriteCheckpoint(large_dir, spec).ok());

  std::unique_ptr<Checkpoint> small = OpenCheckpoint(small_dir);
  std::unique_ptr<Checkpoint> large = OpenCheckpoint(large_dir);
  ASSERT_TRUE(small && large);
  int compared = 0;
  for (const auto& [name, shape] : ExpectedTensors(LoadConfig(small_dir))) {
    // The router's and bias's shapes grow with the expert count; everything else must be equal.
    if (name.find(".mlp.gate.") != std::string::npos) continue;
    EXPECT_EQ(ReadTensor(*small, name, shape), ReadTensor(*large, name, shape)) << name;
    ++compared;
  }
  EXPECT_GT(compared, 50);
  EXPECT_TRUE(large->Has("model.layers.3.mlp.experts.11.down_proj.weight"));
}

TEST(WriteCheckpointTest, ShardedCheckpointReadsLikeTheSingleFile) {
  CheckpointSpec spec = Preset("tiny-v3");
  spec.seed = 7;
  const std::string single_dir = NewDir("single");
  ASSERT_TRUE(WriteCheckpoint(single_dir, spec).ok());
  spec.num_shards = 3;
  const std::string sharded_dir = NewDir("sharded");
  ASSERT_TRUE(WriteCheckpoint(sharded_dir, spec).ok());

  EXPECT_FALSE(fs::exists(fs::path(sharded_dir) / "model.safetensors"));
  const nlohmann::json index =
      nlohmann::json::parse(ReadFile(fs::path(sharded_dir) / "model.safetensors.index.json"));
  const std::vector<std::string> shard_files = {"model-00001-of-00003.safetensors",
                                                "model-00002-of-00003.safetensors",
                                                "model-00003-of-00003.safetensors"};
  std::map<std::string, int> tensors_per_shard;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    tensors_per_shard[file.get<std::string>()]++;
  }
  for (const std::string& file : shard_files) {
    EXPECT_TRUE(fs::exists(fs::path(sharded_dir) / file)) << file;
    EXPECT_GT(tensors_per_shard[file], 0) << file;
  }
  EXPECT_EQ(tensors_per_shard.size(), shard_files.size());

  const Shapes expected = ExpectedTensors(LoadConfig(single_dir));
  EXPECT_EQ(index.at("weight_map").size(), expected.size());
  int64_t total_bytes = 0;
  for (const auto& [name, shape] : expected) {
    int64_t elements = 1;
    for (int64_t dim : shape) elements *= dim;
    total_bytes += elements * 2;  // bf16
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<int64_t>(), total_bytes);

  ExpectOfficialTensors(sharded_dir);
  std::unique_ptr<Checkpoint> single = OpenCheckpoint(single_dir);
  std::unique_ptr<Checkpoint> sharded = OpenCheckpoint(sharded_dir);
  ASSERT_TRUE(single && sharded);
  for (const auto& [name, shape] : expected) {
    EXPECT_EQ(ReadTensor(*single, name, shape), ReadTensor(*sharded, name, shape)) << name;
  }
}

TEST(WriteCheckpointTest, LmHeadStdIsScaleOverSqrtHidden) {
  for (float scale : {8.0f, 3.0f}) {
    CheckpointSpec spec = Preset("tiny-v3");
    spec.seed = 21;
    spec.lm_head_scale = scale;
    const std::string dir = NewDir("lm_head");
    ASSERT_TRUE(WriteCheckpoint(dir, spec).ok());
    std::unique_ptr<Checkpoint> checkpoint = OpenCheckpoint(dir);
    ASSERT_NE(checkpoint, nullptr);
    const double expected = scale / std::sqrt(static_cast<double>(spec.hidden_size));
    const double measured =
        StdDev(ReadTensor(*checkpoint, "lm_head.weight", {spec.vocab_size, spec.hidden_size}));
    EXPECT_NEAR(measured, expected, 0.1 * expected) << "lm_head_scale " << scale;
    // The other scales, loosely: embedding std 1, projections 1/sqrt(fan_in).
    EXPECT_NEAR(StdDev(ReadTensor(*checkpoint, "model.embed_tokens.weight",
                                  {spec.vocab_size, spec.hidden_size})),
                1.0, 0.1);
    const int64_t kv_rows = spec.kv_lora_rank + spec.qk_rope_head_dim;
    EXPECT_NEAR(StdDev(ReadTensor(*checkpoint, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                  {kv_rows, spec.hidden_size})),
                1.0 / std::sqrt(static_cast<double>(spec.hidden_size)), 0.02);
  }
}

TEST(WriteCheckpointTest, TiedEmbeddingsOmitLmHead) {
  CheckpointSpec spec = Preset("tiny-v3");
  spec.tie_word_embeddings = true;
  const std::string dir = NewDir("tied");
  ASSERT_TRUE(WriteCheckpoint(dir, spec).ok());
  EXPECT_TRUE(LoadConfig(dir).tie_word_embeddings);
  std::unique_ptr<Checkpoint> checkpoint = OpenCheckpoint(dir);
  ASSERT_NE(checkpoint, nullptr);
  EXPECT_FALSE(checkpoint->Has("lm_head.weight"));
  EXPECT_TRUE(checkpoint->Has("model.embed_tokens.weight"));
  ExpectOfficialTensors(dir);
}

TEST(WriteCheckpointTest, StoresTheRequestedDType) {
  for (worker::DType dtype : {worker::DType::kF32, worker::DType::kF16, worker::DType::kBF16}) {
    CheckpointSpec spec = Preset("tiny-v3");
    spec.weight_dtype = dtype;
    const std::string dir = NewDir("dtype");
    ASSERT_TRUE(WriteCheckpoint(dir, spec).ok());
    std::unique_ptr<Checkpoint> checkpoint = OpenCheckpoint(dir);
    ASSERT_NE(checkpoint, nullptr);
    for (const char* name : {"model.layers.1.mlp.experts.0.up_proj.weight",
                             "model.layers.1.mlp.gate.e_score_correction_bias"}) {
      absl::StatusOr<worker::TensorInfo> info = checkpoint->Info(name);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->dtype, dtype) << name;
    }
  }
}

TEST(WriteCheckpointTest, RefusesSpecsTheLoaderWouldRefuseAndWritesNothing) {
  CheckpointSpec spec = Preset("tiny-v3");
  spec.architecture = "LlamaForCausalLM";
  const std::string dir = NewDir("refused");
  absl::Status status = WriteCheckpoint(dir, spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_FALSE(fs::exists(dir));

  for (int num_shards : {0, -1, 1000000}) {
    spec = Preset("tiny-v3");
    spec.num_shards = num_shards;
    status = WriteCheckpoint(dir, spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << num_shards << ": " << status;
    EXPECT_FALSE(fs::exists(dir));
  }

  spec = Preset("tiny-v3");
  spec.lm_head_scale = 0.0f;
  EXPECT_EQ(WriteCheckpoint(dir, spec).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir));
}

TEST(WriteCheckpointTest, ReplacesItsOwnOutputButNotOtherFiles) {
  CheckpointSpec spec = Preset("tiny-v3");
  spec.num_shards = 2;
  const std::string dir = NewDir("rewrite");
  ASSERT_TRUE(WriteCheckpoint(dir, spec).ok());
  spec.num_shards = 1;
  ASSERT_TRUE(WriteCheckpoint(dir, spec).ok());
  // The previous shards and index are gone, so the directory is one unambiguous checkpoint.
  std::set<std::string> files;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    files.insert(entry.path().filename().string());
  }
  EXPECT_EQ(files, (std::set<std::string>{"config.json", "model.safetensors"}));
  ExpectOfficialTensors(dir);

  const std::string model_dir = NewDir("real_model");
  fs::create_directories(model_dir);
  std::ofstream(fs::path(model_dir) / "tokenizer.json") << "{}";
  const absl::Status status = WriteCheckpoint(model_dir, spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("tokenizer.json"));
  EXPECT_FALSE(fs::exists(fs::path(model_dir) / "config.json"));
}

TEST(RunMakeCheckpointTest, WritesThePresetWithSeedAndShards) {
  const std::string dir = NewDir("make");
  ASSERT_TRUE(RunMakeCheckpoint(dir, "demo", 5, 2).ok());
  EXPECT_EQ(LoadConfig(dir).hidden_size, 128);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model-00002-of-00002.safetensors"));
  ExpectOfficialTensors(dir);

  CheckpointSpec spec = Preset("demo");
  spec.seed = 5;
  const std::string direct_dir = NewDir("direct");
  ASSERT_TRUE(WriteCheckpoint(direct_dir, spec).ok());
  std::unique_ptr<Checkpoint> made = OpenCheckpoint(dir);
  std::unique_ptr<Checkpoint> direct = OpenCheckpoint(direct_dir);
  ASSERT_TRUE(made && direct);
  const std::vector<int64_t> shape = {1024, 128};
  EXPECT_EQ(ReadTensor(*made, "lm_head.weight", shape),
            ReadTensor(*direct, "lm_head.weight", shape));

  EXPECT_EQ(RunMakeCheckpoint(NewDir("bad"), "nope", 5, 1).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace treeverify::tools
