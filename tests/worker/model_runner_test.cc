// The forward pass of the CPU backend: trees equal chains bit for bit, batch invariance, tensor
// parallelism, KV commit/release and per-sequence failure isolation. Models are tiny random
// checkpoints written by the generator in the real format.
#include "treeverify/worker/model_runner.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/local_model.h"

namespace treeverify::worker {
namespace {

using kernels::NodeSummary;
using tools::LocalModel;
using tools::LocalModelOptions;
using tools::LocalSegmentResult;

// Writes each preset once per test binary.
std::string ModelDir(const std::string& preset) {
  static std::map<std::string, std::string>* dirs = new std::map<std::string, std::string>;
  auto it = dirs->find(preset);
  if (it != dirs->end()) return it->second;
  const std::string dir =
      testing::TempDir() + "/model_runner_test_" + preset + "_" + std::to_string(::getpid());
  auto spec = tools::PresetSpec(preset);
  EXPECT_TRUE(spec.ok()) << spec.status();
  const absl::Status written = tools::WriteCheckpoint(dir, *spec);
  EXPECT_TRUE(written.ok()) << written;
  return (*dirs)[preset] = dir;
}

std::unique_ptr<LocalModel> MakeModel(const std::string& preset, LocalModelOptions options = {}) {
  auto model = LocalModel::Create(ModelDir(preset), options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

std::vector<int32_t> RandomTokens(int n, int vocab, std::mt19937& rng) {
  std::vector<int32_t> tokens(n);
  for (int32_t& t : tokens) t = std::uniform_int_distribution<int32_t>(0, vocab - 1)(rng);
  return tokens;
}

// Random tree shapes: uniform parents (bushy) or mostly deep (long paths).
std::vector<int32_t> RandomParents(int nodes, bool deep, std::mt19937& rng) {
  std::vector<int32_t> parents(nodes);
  for (int i = 0; i < nodes; ++i) {
    if (i == 0) {
      parents[i] = -1;
    } else if (deep) {
      parents[i] = std::max(0, i - 1 - std::uniform_int_distribution<int>(0, 2)(rng));
    } else {
      parents[i] = std::uniform_int_distribution<int>(0, i - 1)(rng);
    }
  }
  return parents;
}

LocalSegmentResult ForwardOne(LocalModel& model, SegmentInput segment, bool logits = false) {
  ForwardRequest request;
  request.return_logits = logits;
  request.segments.push_back(std::move(segment));
  auto results = model.Forward(request);
  EXPECT_TRUE(results.ok()) << results.status();
  return results.ok() ? (*results)[0] : LocalSegmentResult{results.status()};
}

// Commits `tokens` into a sequence one token per forward (the autoregressive way).
void PrefillTokenByToken(LocalModel& model, uint64_t id, const std::vector<int32_t>& tokens) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    SegmentInput s{.sequence_id = id, .token_ids = {tokens[i]}, .parents = {-1}};
    if (i > 0) s.commit_nodes = std::vector<int32_t>{0};
    ASSERT_TRUE(ForwardOne(model, s).status.ok());
  }
  SegmentInput commit{.sequence_id = id, .commit_nodes = std::vector<int32_t>{0}};
  commit.expected_committed_length = static_cast<int64_t>(tokens.size());
  ASSERT_TRUE(ForwardOne(model, commit).status.ok());
}

void ExpectBitIdentical(const NodeSummary& a, const NodeSummary& b, const std::string& what) {
  EXPECT_EQ(a.argmax, b.argmax) << what;
  EXPECT_EQ(a.max_logit, b.max_logit) << what;
  EXPECT_EQ(a.log_sum_exp, b.log_sum_exp) << what;
}

class TreeEqualsChainTest : public testing::TestWithParam<std::tuple<std::string, bool>> {};

// Every node of a random tree (up to 255 draft nodes under the root) has exactly the summary of
// a plain causal forward over prefix + its path, with the prefix computed differently (one chunk
// vs token by token) and the pages split at different places.
TEST_P(TreeEqualsChainTest, EveryNodeMatchesTheChainOfItsPath) {
  const auto [preset, deep] = GetParam();
  const unsigned seed = 99 + (deep ? 1 : 0);
  SCOPED_TRACE(testing::Message() << "preset " << preset << " seed " << seed);
  std::mt19937 rng(seed);
  LocalModelOptions options;
  options.kv_page_size = 16;
  auto model = MakeModel(preset, options);
  ASSERT_NE(model, nullptr);
  const int vocab = static_cast<int>(model->config().vocab_size);

  for (int trial = 0; trial < 2; ++trial) {
    const int prefix_length = std::uniform_int_distribution<int>(1, 70)(rng);
    const int nodes = trial == 0 ? 256 : std::uniform_int_distribution<int>(2, 60)(rng);
    const std::vector<int32_t> prefix = RandomTokens(prefix_length, vocab, rng);
    const std::vector<int32_t> tokens = RandomTokens(nodes, vocab, rng);
    const std::vector<int32_t> parents = RandomParents(nodes, deep, rng);
    const uint64_t tree_id = 100 + trial * 2;
    const uint64_t chain_id = tree_id + 1;

    ASSERT_TRUE(model->Prefill(tree_id, prefix).ok());
    PrefillTokenByToken(*model, chain_id, prefix);
    const LocalSegmentResult tree =
        ForwardOne(*model, {.sequence_id = tree_id, .token_ids = tokens, .parents = parents});
    ASSERT_TRUE(tree.status.ok()) << tree.status;
    ASSERT_EQ(tree.committed_length, prefix_length);

    for (int node = 0; node < nodes; ++node) {
      std::vector<int32_t> path;
      for (int32_t a = node; a >= 0; a = parents[a]) path.insert(path.begin(), tokens[a]);
      // An uncommitted segment is replaced by the next one, so the chain sequence keeps its
      // prefix and takes one path after another.
      const LocalSegmentResult chain = ForwardOne(
          *model, {.sequence_id = chain_id,
                   .token_ids = path,
                   .parents = SegmentTree::ChainParents(static_cast<int32_t>(path.size()))});
      ASSERT_TRUE(chain.status.ok()) << chain.status;
      ExpectBitIdentical(tree.summaries[node], chain.summaries.back(),
                         "trial " + std::to_string(trial) + " node " + std::to_string(node));
      if (HasFailure()) return;
    }
    ASSERT_TRUE(model->Release(tree_id).ok());
    ASSERT_TRUE(model->Release(chain_id).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, TreeEqualsChainTest,
                         testing::Combine(testing::Values("tiny-v3", "tiny-v2-lite"),
                                          testing::Bool()));

// The same node computed alone or in a batch with other sequences gives the same bits.
TEST(ModelRunnerTest, SummariesAreBatchInvariant) {
  const unsigned seed = 5;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  auto model = MakeModel("tiny-v3");
  ASSERT_NE(model, nullptr);
  const int vocab = static_cast<int>(model->config().vocab_size);
  const std::vector<int32_t> prefix = RandomTokens(37, vocab, rng);
  const std::vector<int32_t> tokens = RandomTokens(23, vocab, rng);
  const std::vector<int32_t> parents = RandomParents(23, false, rng);
  ASSERT_TRUE(model->Prefill(1, prefix).ok());
  ASSERT_TRUE(model->Prefill(2, prefix).ok());
  ASSERT_TRUE(model->Prefill(3, RandomTokens(91, vocab, rng)).ok());
  const LocalSegmentResult alone =
      ForwardOne(*model, {.sequence_id = 1, .token_ids = tokens, .parents = parents});
  ASSERT_TRUE(alone.status.ok());

  ForwardRequest batch;
  batch.segments.push_back({.sequence_id = 3,
                            .token_ids = RandomTokens(40, vocab, rng),
                            .parents = RandomParents(40, true, rng)});
  batch.segments.push_back({.sequence_id = 2, .token_ids = tokens, .parents = parents});
  batch.segments.push_back(
      {.sequence_id = 4, .token_ids = RandomTokens(3, vocab, rng), .parents = {-1, 0, 0}});
  auto together = model->Forward(batch);
  ASSERT_TRUE(together.ok()) << together.status();
  for (const LocalSegmentResult& r : *together) ASSERT_TRUE(r.status.ok()) << r.status;
  for (size_t n = 0; n < tokens.size(); ++n) {
    ExpectBitIdentical(alone.summaries[n], (*together)[1].summaries[n],
                       "node " + std::to_string(n));
  }
}

// Full-vocabulary logits of W = 1 for a prompt and a tree, to compare other layouts against.
struct Reference {
  std::vector<float> prefill_logits;
  std::vector<float> tree_logits;
  std::vector<NodeSummary> tree_summaries;
};

Reference RunReference(LocalModel& model, const std::vector<int32_t>& prompt,
                       const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents) {
  Reference ref;
  const LocalSegmentResult prefill =
      ForwardOne(model,
                 {.sequence_id = 1,
                  .token_ids = prompt,
                  .parents = SegmentTree::ChainParents(static_cast<int32_t>(prompt.size()))},
                 /*logits=*/true);
  EXPECT_TRUE(prefill.status.ok()) << prefill.status;
  std::vector<int32_t> all(prompt.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
  const LocalSegmentResult tree = ForwardOne(
      model, {.sequence_id = 1, .commit_nodes = all, .token_ids = tokens, .parents = parents},
      /*logits=*/true);
  EXPECT_TRUE(tree.status.ok()) << tree.status;
  ref.prefill_logits = prefill.logits;
  ref.tree_logits = tree.logits;
  ref.tree_summaries = tree.summaries;
  return ref;
}

void ExpectClose(const Reference& expected, const Reference& actual, int64_t vocab,
                 const std::string& what) {
  ASSERT_EQ(expected.tree_logits.size(), actual.tree_logits.size()) << what;
  for (const auto& [e, a] : {std::pair{&expected.prefill_logits, &actual.prefill_logits},
                             std::pair{&expected.tree_logits, &actual.tree_logits}}) {
    ASSERT_EQ(e->size(), a->size());
    for (size_t i = 0; i < e->size(); ++i) {
      ASSERT_NEAR((*e)[i], (*a)[i], 1e-4) << what << " logit " << i % vocab << " row " << i / vocab;
    }
  }
  for (size_t n = 0; n < expected.tree_summaries.size(); ++n) {
    const NodeSummary& e = expected.tree_summaries[n];
    const NodeSummary& a = actual.tree_summaries[n];
    EXPECT_NEAR(e.max_logit, a.max_logit, 1e-4) << what << " node " << n;
    EXPECT_NEAR(e.log_sum_exp, a.log_sum_exp, 1e-4) << what << " node " << n;
    // Argmax must agree unless the top two logits are within the tolerance.
    std::vector<float> row(expected.tree_logits.begin() + n * vocab,
                           expected.tree_logits.begin() + (n + 1) * vocab);
    std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
    if (row[0] - row[1] > 1e-4) {
      EXPECT_EQ(e.argmax, a.argmax) << what << " node " << n;
    }
  }
}

class TensorParallelTest : public testing::TestWithParam<std::string> {};

TEST_P(TensorParallelTest, RanksAndShardingModesAgree) {
  const std::string preset = GetParam();
  const unsigned seed = 31;
  SCOPED_TRACE(testing::Message() << "preset " << preset << " seed " << seed);
  std::mt19937 rng(seed);
  auto base = MakeModel(preset);
  ASSERT_NE(base, nullptr);
  const int vocab = static_cast<int>(base->config().vocab_size);
  const std::vector<int32_t> prompt = RandomTokens(29, vocab, rng);
  const std::vector<int32_t> tokens = RandomTokens(17, vocab, rng);
  const std::vector<int32_t> parents = RandomParents(17, false, rng);
  const Reference expected = RunReference(*base, prompt, tokens, parents);
  for (int world : {2, 4}) {
    for (ExpertSharding sharding : {ExpertSharding::kSplitInside, ExpertSharding::kWholeExperts}) {
      LocalModelOptions options;
      options.world_size = world;
      options.expert_sharding = sharding;
      auto model = MakeModel(preset, options);
      ASSERT_NE(model, nullptr);
      const std::string what = "W=" + std::to_string(world) +
                               (sharding == ExpertSharding::kSplitInside ? " split" : " whole");
      ExpectClose(expected, RunReference(*model, prompt, tokens, parents), vocab, what);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, TensorParallelTest,
                         testing::Values("tiny-v3", "tiny-kimi", "tiny-v2-lite"));

// After an accepted path is committed, the next forward equals a fresh forward over the
// committed tokens; releasing every sequence returns every page.
TEST(ModelRunnerTest, CommitEqualsFreshForwardAndReleaseFreesAll) {
  const unsigned seed = 8;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  LocalModelOptions options;
  options.world_size = 2;
  options.kv_page_size = 8;
  auto model = MakeModel("tiny-v3", options);
  ASSERT_NE(model, nullptr);
  const int vocab = static_cast<int>(model->config().vocab_size);
  const std::vector<int32_t> prefix = RandomTokens(21, vocab, rng);
  // Tree: 0 -> {1, 2}; 2 -> {3, 4}; 4 -> {5}; 1 -> {6}. Accept the path 0, 2, 4, 5.
  const std::vector<int32_t> parents = {-1, 0, 0, 2, 2, 4, 1};
  const std::vector<int32_t> tokens = RandomTokens(7, vocab, rng);
  const std::vector<int32_t> accepted = {0, 2, 4, 5};
  const int32_t next_token = 77;

  ASSERT_TRUE(model->Prefill(1, prefix).ok());
  ASSERT_TRUE(
      ForwardOne(*model, {.sequence_id = 1, .token_ids = tokens, .parents = parents}).status.ok());
  SegmentInput next{
      .sequence_id = 1, .commit_nodes = accepted, .token_ids = {next_token}, .parents = {-1}};
  next.expected_committed_length = 21 + 4;
  const LocalSegmentResult after_commit = ForwardOne(*model, next);
  ASSERT_TRUE(after_commit.status.ok()) << after_commit.status;
  EXPECT_EQ(after_commit.committed_length, 25);

  std::vector<int32_t> committed = prefix;
  for (int32_t node : accepted) committed.push_back(tokens[node]);
  ASSERT_TRUE(model->Prefill(2, committed).ok());
  const LocalSegmentResult fresh =
      ForwardOne(*model, {.sequence_id = 2, .token_ids = {next_token}, .parents = {-1}});
  ASSERT_TRUE(fresh.status.ok());
  ExpectBitIdentical(after_commit.summaries[0], fresh.summaries[0], "after commit");

  // A wrong expectation of the committed length fails that sequence and changes nothing.
  SegmentInput stale{.sequence_id = 1, .token_ids = {3}, .parents = {-1}};
  stale.expected_committed_length = 24;
  EXPECT_EQ(ForwardOne(*model, stale).status.code(), absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE(model->Release(1).ok());
  ASSERT_TRUE(model->Release(2).ok());
  for (int r = 0; r < model->world_size(); ++r) {
    EXPECT_EQ(model->rank(r).kv_cache().free_pages(), options.kv_pages) << "rank " << r;
  }
  EXPECT_EQ(model->Release(1).code(), absl::StatusCode::kNotFound);
}

// A sequence that does not fit in the cache, or sends a bad tree, fails alone.
TEST(ModelRunnerTest, BadOrOversizedSequencesFailAlone) {
  const unsigned seed = 13;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  LocalModelOptions options;
  options.kv_page_size = 16;
  options.kv_pages = 6;  // 96 rows in all
  auto model = MakeModel("tiny-v3", options);
  ASSERT_NE(model, nullptr);
  const int vocab = static_cast<int>(model->config().vocab_size);
  const std::vector<int32_t> tokens = RandomTokens(9, vocab, rng);
  const std::vector<int32_t> parents = RandomParents(9, false, rng);
  const LocalSegmentResult alone =
      ForwardOne(*model, {.sequence_id = 1, .token_ids = tokens, .parents = parents});
  ASSERT_TRUE(alone.status.ok());
  ASSERT_TRUE(model->Release(1).ok());

  ForwardRequest request;
  request.segments.push_back({.sequence_id = 10,
                              .token_ids = RandomTokens(100, vocab, rng),
                              .parents = SegmentTree::ChainParents(100)});
  request.segments.push_back({.sequence_id = 2, .token_ids = tokens, .parents = parents});
  request.segments.push_back({.sequence_id = 11, .token_ids = {1, vocab}, .parents = {-1, 0}});
  request.segments.push_back({.sequence_id = 12, .token_ids = {1, 2}, .parents = {-1, 1}});
  auto results = model->Forward(request);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[0].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*results)[2].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string((*results)[2].status.message()), testing::HasSubstr("vocabulary"));
  EXPECT_EQ((*results)[3].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string((*results)[3].status.message()), testing::HasSubstr("parents[1]"));
  ASSERT_TRUE((*results)[1].status.ok()) << (*results)[1].status;
  for (size_t n = 0; n < tokens.size(); ++n) {
    ExpectBitIdentical(alone.summaries[n], (*results)[1].summaries[n], "node " + std::to_string(n));
  }
  // Only sequence 2 holds pages now.
  EXPECT_EQ(model->rank(0).kv_cache().used_pages(), 1);
}

}  // namespace
}  // namespace treeverify::worker

namespace treeverify::worker {
namespace {

// A checkpoint whose tensors do not fit its config.json is refused at load, naming the tensor.
TEST(ModelRunnerLoadTest, TensorShapesMustMatchTheConfig) {
  auto spec = tools::PresetSpec("tiny-v3");
  ASSERT_TRUE(spec.ok());
  const std::string dir = testing::TempDir() + "/model_runner_shape_" + std::to_string(::getpid());
  ASSERT_TRUE(tools::WriteCheckpoint(dir, *spec).ok());
  // Same weights, but a config that claims a wider latent cache.
  std::ifstream in(dir + "/config.json");
  std::string config((std::istreambuf_iterator<char>(in)), {});
  const std::string field = "\"kv_lora_rank\": 32";
  ASSERT_NE(config.find(field), std::string::npos) << config;
  config.replace(config.find(field), field.size(), "\"kv_lora_rank\": 48");
  std::ofstream(dir + "/config.json") << config;

  SoloCommunicator solo;
  auto runner = ModelRunner::Create(dir, {}, &solo);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(runner.status().message()),
              testing::AllOf(testing::HasSubstr("kv_a_proj_with_mqa.weight"),
                             testing::HasSubstr("expected [56, 64]")));

  // Tensor parallelism that cannot split the heads is refused, naming the dimension.
  tools::LocalModelOptions options;
  options.world_size = 8;  // tiny-v3 has 4 heads
  auto model = LocalModel::Create(ModelDir("tiny-v3"), options);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(std::string(model.status().message()), testing::HasSubstr("num_attention_heads"));
}

}  // namespace
}  // namespace treeverify::worker
