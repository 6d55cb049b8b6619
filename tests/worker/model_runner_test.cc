// The forward pass of the CPU backend: trees equal chains bit for bit (summaries and sampled
// tokens), batch invariance, tensor parallelism, KV commit/release, per-sequence failure isolation
// and hidden-state capture. Models are tiny random checkpoints written by the generator in the
// real format.
#include "treeverify/worker/model_runner.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "treeverify/coordinator/token_selector.h"
#include "treeverify/kernels/gemm.h"
#include "treeverify/kernels/philox.h"
#include "treeverify/kernels/rms_norm.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/worker/model_weights.h"
#include "treeverify/worker/quantized_weights.h"
#include "treeverify/worker/safetensors.h"
#include "treeverify/worker/segment_tree.h"
#include "treeverify/worker/step_accounting.h"

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

// A chain longer than a tree (a long prefill chunk) enters the batch as pieces of at most
// kMaxSegmentRows rows: every row's summary, sampled winner, candidates, logits and hidden state
// are those of the same prompt in short chunks, and so is the first step after it. Trees stay
// bounded by the ancestor mask's width, chains by kMaxChainRows.
TEST(ModelRunnerTest, LongChainsRunAsPiecesAndMatchShortChunks) {
  const unsigned seed = 21;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  LocalModelOptions options;
  options.world_size = 2;
  options.kv_page_size = 16;
  auto model = MakeModel("tiny-v3", options);
  ASSERT_NE(model, nullptr);
  const int vocab = static_cast<int>(model->config().vocab_size);
  const int32_t length = 2 * kernels::kMaxSegmentRows + 77;  // three pieces, the last partial
  const std::vector<int32_t> prompt = RandomTokens(length, vocab, rng);
  const SegmentSampling sampling{.temperature = 0.8f, .seed = 5, .candidates = 3};
  const int32_t last_layer = static_cast<int32_t>(model->config().num_hidden_layers);

  SegmentInput whole{.sequence_id = 1,
                     .token_ids = prompt,
                     .parents = SegmentTree::ChainParents(length),
                     .sampling = sampling,
                     .hidden_state_layers = {last_layer}};
  const LocalSegmentResult one = ForwardOne(*model, whole, /*logits=*/true);
  ASSERT_TRUE(one.status.ok()) << one.status;

  LocalSegmentResult chunked;
  const std::vector<int32_t> bounds = {0, 300, 301, 556, length};
  for (size_t c = 0; c + 1 < bounds.size(); ++c) {
    const int32_t begin = bounds[c], end = bounds[c + 1];
    SegmentInput chunk{
        .sequence_id = 2,
        .token_ids = std::vector<int32_t>(prompt.begin() + begin, prompt.begin() + end),
        .parents = SegmentTree::ChainParents(end - begin),
        .sampling = sampling,
        .hidden_state_layers = {last_layer}};
    if (c > 0) chunk.commit_nodes = SegmentTree::AllNodes(begin - bounds[c - 1]);
    const LocalSegmentResult part = ForwardOne(*model, chunk, /*logits=*/true);
    ASSERT_TRUE(part.status.ok()) << part.status;
    chunked.summaries.insert(chunked.summaries.end(), part.summaries.begin(), part.summaries.end());
    chunked.logits.insert(chunked.logits.end(), part.logits.begin(), part.logits.end());
    chunked.shard_candidates.resize(part.shard_candidates.size());
    for (size_t r = 0; r < part.shard_candidates.size(); ++r) {
      chunked.shard_candidates[r].insert(chunked.shard_candidates[r].end(),
                                         part.shard_candidates[r].begin(),
                                         part.shard_candidates[r].end());
    }
    chunked.hidden_states.resize(1, {.layer = last_layer});
    chunked.hidden_states[0].values.insert(chunked.hidden_states[0].values.end(),
                                           part.hidden_states[0].values.begin(),
                                           part.hidden_states[0].values.end());
  }
  ASSERT_EQ(one.summaries.size(), static_cast<size_t>(length));
  ASSERT_EQ(chunked.summaries.size(), static_cast<size_t>(length));
  for (int32_t n = 0; n < length; ++n) {
    ExpectBitIdentical(one.summaries[n], chunked.summaries[n], "row " + std::to_string(n));
    EXPECT_EQ(one.summaries[n].sampled_token, chunked.summaries[n].sampled_token) << "row " << n;
  }
  EXPECT_EQ(one.logits, chunked.logits);
  EXPECT_EQ(one.shard_candidates.size(), chunked.shard_candidates.size());
  for (size_t r = 0; r < one.shard_candidates.size(); ++r) {
    ASSERT_EQ(one.shard_candidates[r].size(), static_cast<size_t>(length) * 3) << "rank " << r;
    for (size_t i = 0; i < one.shard_candidates[r].size(); ++i) {
      ASSERT_EQ(one.shard_candidates[r][i].token_id, chunked.shard_candidates[r][i].token_id) << i;
      ASSERT_EQ(one.shard_candidates[r][i].logit, chunked.shard_candidates[r][i].logit) << i;
    }
  }
  ASSERT_EQ(one.hidden_states.size(), 1u);
  EXPECT_EQ(one.hidden_states[0].values, chunked.hidden_states[0].values);

  // The next step (commit the whole chain, one tree) is the same on both.
  const std::vector<int32_t> tokens = RandomTokens(5, vocab, rng);
  const std::vector<int32_t> parents = {-1, 0, 0, 1, 2};
  SegmentInput after_one{.sequence_id = 1,
                         .commit_nodes = SegmentTree::AllNodes(length),
                         .token_ids = tokens,
                         .parents = parents};
  SegmentInput after_chunked = after_one;
  after_chunked.sequence_id = 2;
  after_chunked.commit_nodes = SegmentTree::AllNodes(length - 556);
  const LocalSegmentResult next_one = ForwardOne(*model, after_one);
  const LocalSegmentResult next_chunked = ForwardOne(*model, after_chunked);
  ASSERT_TRUE(next_one.status.ok()) << next_one.status;
  ASSERT_TRUE(next_chunked.status.ok()) << next_chunked.status;
  EXPECT_EQ(next_one.committed_length, length);
  for (size_t n = 0; n < tokens.size(); ++n) {
    ExpectBitIdentical(next_one.summaries[n], next_chunked.summaries[n],
                       "node " + std::to_string(n));
  }

  // Bounds: a tree wider than the mask, a chain longer than kMaxChainRows.
  std::vector<int32_t> wide_tree = SegmentTree::ChainParents(kernels::kMaxSegmentRows + 1);
  wide_tree.back() = 0;
  const LocalSegmentResult tree =
      ForwardOne(*model, {.sequence_id = 3,
                          .token_ids = RandomTokens(kernels::kMaxSegmentRows + 1, vocab, rng),
                          .parents = wide_tree});
  EXPECT_EQ(tree.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tree.status.message()), testing::HasSubstr("must be a chain"));
  const LocalSegmentResult too_long =
      ForwardOne(*model, {.sequence_id = 4,
                          .token_ids = std::vector<int32_t>(kMaxChainRows + 1, 1),
                          .parents = SegmentTree::ChainParents(kMaxChainRows + 1)});
  EXPECT_EQ(too_long.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_long.status.message()), testing::HasSubstr("at most"));
}

// A sequence that does not fit in the cache, or sends a bad tree, fails alone.
// The CPU backend keeps an account of every step: wall time in each phase (they add up), the
// bytes model with its fp32 weights and KV rows, the host's copy bandwidth, the active experts.
TEST(ModelRunnerTest, CpuStepsAreAccounted) {
  std::unique_ptr<LocalModel> model = MakeModel("tiny-kimi", {.world_size = 2});
  ASSERT_NE(model, nullptr);
  EXPECT_FALSE(model->rank(0).last_step_account().has_value());
  std::mt19937 rng(31);
  const int vocab = static_cast<int>(model->config().vocab_size);
  ForwardOne(*model, {.sequence_id = 1,
                      .token_ids = RandomTokens(12, vocab, rng),
                      .parents = SegmentTree::ChainParents(12)});
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    const std::optional<StepAccount> account = model->rank(r).last_step_account();
    ASSERT_TRUE(account.has_value());
    EXPECT_EQ(account->rows, 12);
    EXPECT_EQ(account->sequences, 1);
    EXPECT_GT(account->copy_bytes_per_second, 1e8);
    double sum = 0;
    for (const PhaseAccount& phase : account->phases) {
      EXPECT_GE(phase.seconds, 0);
      sum += phase.seconds;
    }
    EXPECT_DOUBLE_EQ(account->total_seconds, sum);
    for (StepPhase p : {StepPhase::kEmbed, StepPhase::kAttention, StepPhase::kMoe,
                        StepPhase::kAllReduce, StepPhase::kLmHead}) {
      EXPECT_GT(account->phase(p).seconds, 0) << StepPhaseName(p);
    }
    // The LM head's bytes: the final norm and this rank's vocabulary rows, fp32.
    const ModelConfig& c = model->config();
    const double vocab_shard = static_cast<double>(model->rank(r).plan().vocab.size());
    EXPECT_DOUBLE_EQ(account->phase(StepPhase::kLmHead).modeled_bytes,
                     (c.hidden_size + vocab_shard * c.hidden_size) * 4.0);
    // tiny-kimi: layer 0 dense, the MoE layers with at most 12 x 3 experts active (of 12).
    ASSERT_EQ(account->active_experts.size(), static_cast<size_t>(c.num_hidden_layers));
    EXPECT_EQ(account->active_experts[0], 0);
    for (size_t l = 1; l < account->active_experts.size(); ++l) {
      EXPECT_GT(account->active_experts[l], 0) << "layer " << l;
      EXPECT_LE(account->active_experts[l], model->rank(r).plan().experts.size());
    }
  }
}

// The same weights written dequantized, as F32 (every tensor of a quantized checkpoint read through
// WeightReader), beside a config without its quantization_config.
void WriteDequantized(const std::string& quantized_dir, const std::string& float_dir) {
  auto file = SafetensorsFile::Open(quantized_dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  auto checkpoint = Checkpoint::Open(quantized_dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto config = ModelConfig::FromFile(quantized_dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  const WeightReader reader(**checkpoint, config->quantization);
  std::vector<TensorToWrite> tensors;
  for (const auto& [name, info] : (*file)->tensors()) {
    std::string weight = name;
    std::vector<int64_t> shape = info.shape;
    const std::string packed = ".weight_packed";
    if (name.ends_with("_scale_inv") || name.ends_with(".weight_scale") ||
        name.ends_with(".weight_shape")) {
      continue;
    }
    if (name.ends_with(packed)) {
      weight = name.substr(0, name.size() - packed.size()) + ".weight";
      shape = {info.shape[0], info.shape[1] * 8};  // the test models' rows are whole words
    }
    auto values = reader.Read(weight, shape);
    ASSERT_TRUE(values.ok()) << weight << ": " << values.status();
    tensors.push_back({weight, shape, *values});
  }
  int quantized = 0;
  for (const auto& [name, info] : (*file)->tensors()) {
    quantized += name.ends_with("_scale_inv") || name.ends_with(".weight_packed") ? 1 : 0;
  }
  ASSERT_GT(quantized, 0) << "the generator wrote no quantized tensor";
  std::filesystem::create_directories(float_dir);
  ASSERT_TRUE(WriteSafetensors(float_dir + "/model.safetensors", tensors, DType::kF32).ok());
  std::ifstream in(quantized_dir + "/config.json");
  nlohmann::json json = nlohmann::json::parse(in);
  json.erase("quantization_config");
  std::ofstream(float_dir + "/config.json") << json.dump(2);
}

// A checkpoint in a published quantized layout (FP8 blocks for every projection, INT4 groups for
// the routed experts) runs as the float weights it stands for: its forward equals, bit for bit,
// the forward on those weights written out dequantized. A tensor-parallel split that cuts a
// quantization block is refused, naming it.
TEST(ModelRunnerTest, QuantizedCheckpointsRunAsTheirDequantizedWeights) {
  using Method = WeightQuantization::Method;
  for (Method method : {Method::kFp8Block, Method::kInt4Group}) {
    const std::string name = method == Method::kFp8Block ? "fp8" : "int4";
    SCOPED_TRACE(name);
    auto spec = tools::PresetSpec("tiny-kimi");
    ASSERT_TRUE(spec.ok());
    spec->quantization.method = method;
    const std::string base =
        testing::TempDir() + "/model_runner_test_quantized_" + std::to_string(::getpid());
    const std::string quantized_dir = base + "_" + name, float_dir = base + "_" + name + "_f32";
    ASSERT_TRUE(tools::WriteCheckpoint(quantized_dir, *spec).ok());
    WriteDequantized(quantized_dir, float_dir);
    auto quantized = LocalModel::Create(quantized_dir, {});
    ASSERT_TRUE(quantized.ok()) << quantized.status();
    auto dequantized = LocalModel::Create(float_dir, {});
    ASSERT_TRUE(dequantized.ok()) << dequantized.status();
    EXPECT_EQ((*quantized)->config().quantization.method, method);
    std::mt19937 rng(41);
    const std::vector<int32_t> tokens =
        RandomTokens(12, static_cast<int>((*quantized)->config().vocab_size), rng);
    const SegmentInput segment{
        .sequence_id = 1, .token_ids = tokens, .parents = SegmentTree::ChainParents(12)};
    const LocalSegmentResult a = ForwardOne(**quantized, segment, /*logits=*/true);
    const LocalSegmentResult b = ForwardOne(**dequantized, segment, /*logits=*/true);
    ASSERT_TRUE(a.status.ok()) << a.status;
    ASSERT_FALSE(a.logits.empty());
    EXPECT_EQ(a.logits, b.logits);
    if (method == Method::kFp8Block) {
      // tiny-kimi's dimensions are under one 128 x 128 block: two ranks would cut them.
      auto split = LocalModel::Create(quantized_dir, {.world_size = 2});
      ASSERT_FALSE(split.ok());
      EXPECT_THAT(std::string(split.status().message()),
                  testing::HasSubstr("cuts a quantization block"));
    }
    std::filesystem::remove_all(quantized_dir);
    std::filesystem::remove_all(float_dir);
  }
}

// An FP8 checkpoint's dense projections load as stored beside their values (for the GPU's FP8
// products), and the stored slices stand for exactly those values; gate and up stack into one
// FP8 matrix where gate's rows end on a block edge (tiny-kimi's dense 128), not otherwise (its
// shared expert's 32).
TEST(ModelRunnerTest, Fp8ProjectionsLoadAsStoredBesideTheirValues) {
  auto spec = tools::PresetSpec("tiny-kimi");
  ASSERT_TRUE(spec.ok());
  spec->quantization.method = WeightQuantization::Method::kFp8Block;
  const std::string dir =
      testing::TempDir() + "/model_runner_test_fp8_projections_" + std::to_string(::getpid());
  ASSERT_TRUE(tools::WriteCheckpoint(dir, *spec).ok());
  auto config = ModelConfig::FromFile(dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  auto plan = ShardingPlan::Make(*config, 0, 1, ExpertSharding::kSplitInside);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto weights = ModelWeights::Load(dir, *config, *plan);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto expect_stored = [](const std::optional<Fp8Matrix>& stored, const std::vector<float>& values,
                          const char* name) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(stored.has_value());
    EXPECT_EQ(stored->rows * stored->cols, static_cast<int64_t>(values.size()));
    EXPECT_EQ(Dequantized(*stored), values);
  };
  for (const LayerWeights& layer : (*weights)->layers) {
    const AttentionWeights& a = layer.attention;
    expect_stored(a.fp8_q_a_proj, a.q_a_proj, "q_a_proj");
    expect_stored(a.fp8_q_proj, a.q_proj, "q_b_proj");
    expect_stored(a.fp8_kv_a_proj, a.kv_a_proj, "kv_a_proj");
    expect_stored(a.fp8_o_proj, a.o_proj, "o_proj");
    ASSERT_TRUE(a.fp8_kv_b_proj.has_value());
    EXPECT_EQ(a.fp8_kv_b_proj->cols, config->kv_lora_rank);
    const MlpWeights& mlp = layer.is_moe ? layer.moe.shared : layer.dense;
    expect_stored(mlp.fp8_down, mlp.down, "down_proj");
    if (layer.is_moe) {
      EXPECT_FALSE(mlp.fp8_gate_up.has_value());  // 32 gate rows: up's would start mid-block
    } else {
      expect_stored(mlp.fp8_gate_up, mlp.gate_up, "gate_proj over up_proj");
    }
  }
  std::filesystem::remove_all(dir);
}

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

// ---------------------------------------------------------------------------------------------
// Sampling and hidden states

std::vector<int32_t> Depths(const std::vector<int32_t>& parents) {
  std::vector<int32_t> depth(parents.size());
  for (size_t i = 0; i < parents.size(); ++i) depth[i] = parents[i] < 0 ? 0 : depth[parents[i]] + 1;
  return depth;
}

std::vector<coordinator::ShardNode> ShardsOf(const LocalSegmentResult& result, size_t node,
                                             int32_t candidates) {
  std::vector<coordinator::ShardNode> shards;
  for (size_t r = 0; r < result.shard_summaries.size(); ++r) {
    shards.push_back(
        {&result.shard_summaries[r][node],
         absl::MakeConstSpan(result.shard_candidates[r]).subspan(node * candidates, candidates)});
  }
  return shards;
}

// A tree node samples exactly what the same node computed as a chain samples, on every rank; the
// shard winners reduce to the Gumbel-max of the full logits at the position the node predicts
// (committed_length + depth + 1).
TEST(ModelRunnerSamplingTest, TreeNodeSamplesWhatItsChainSamples) {
  const unsigned seed = 17;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  LocalModelOptions options;
  options.world_size = 2;
  options.kv_page_size = 16;
  auto model = MakeModel("tiny-v3", options);
  ASSERT_NE(model, nullptr);
  const int vocab = static_cast<int>(model->config().vocab_size);
  const SegmentSampling sampling{.temperature = 2.0f, .seed = 0x5EED5EED5EEDull, .candidates = 8};
  const coordinator::SamplingParams unrestricted{.temperature = sampling.temperature,
                                                 .seed = sampling.seed};
  coordinator::SamplingParams top_k = unrestricted;
  top_k.top_k = 5;

  const int prefix_length = 23;
  const int nodes = 40;
  const std::vector<int32_t> prefix = RandomTokens(prefix_length, vocab, rng);
  const std::vector<int32_t> tokens = RandomTokens(nodes, vocab, rng);
  const std::vector<int32_t> parents = RandomParents(nodes, false, rng);
  const std::vector<int32_t> depth = Depths(parents);
  ASSERT_TRUE(model->Prefill(1, prefix).ok());
  PrefillTokenByToken(*model, 2, prefix);
  SegmentInput tree_input{.sequence_id = 1, .token_ids = tokens, .parents = parents};
  tree_input.sampling = sampling;
  const LocalSegmentResult tree = ForwardOne(*model, tree_input, /*logits=*/true);
  ASSERT_TRUE(tree.status.ok()) << tree.status;
  ASSERT_EQ(tree.shard_summaries.size(), 2u);

  int differs_from_greedy = 0;
  for (int node = 0; node < nodes; ++node) {
    const std::string what = "node " + std::to_string(node);
    std::vector<int32_t> path;
    for (int32_t a = node; a >= 0; a = parents[a]) path.insert(path.begin(), tokens[a]);
    SegmentInput chain_input{
        .sequence_id = 2,
        .token_ids = path,
        .parents = SegmentTree::ChainParents(static_cast<int32_t>(path.size()))};
    chain_input.sampling = sampling;
    const LocalSegmentResult chain = ForwardOne(*model, chain_input);
    ASSERT_TRUE(chain.status.ok()) << chain.status;
    const size_t last = path.size() - 1;
    for (int r = 0; r < 2; ++r) {
      const NodeSummary& a = tree.shard_summaries[r][node];
      const NodeSummary& b = chain.shard_summaries[r][last];
      EXPECT_EQ(a.sampled_token, b.sampled_token) << what << " rank " << r;
      EXPECT_EQ(a.sampled_score, b.sampled_score) << what << " rank " << r;
      EXPECT_EQ(a.sampled_logit, b.sampled_logit) << what << " rank " << r;
      EXPECT_EQ(a.log_sum_exp_at_temperature, b.log_sum_exp_at_temperature) << what;
      for (int32_t i = 0; i < sampling.candidates; ++i) {
        EXPECT_EQ(tree.shard_candidates[r][node * sampling.candidates + i].token_id,
                  chain.shard_candidates[r][last * sampling.candidates + i].token_id)
            << what << " rank " << r << " candidate " << i;
      }
    }
    const int64_t position = prefix_length + depth[node] + 1;
    for (const coordinator::SamplingParams& params : {unrestricted, top_k}) {
      auto from_tree =
          coordinator::SelectToken(ShardsOf(tree, node, sampling.candidates), params, position);
      auto from_chain =
          coordinator::SelectToken(ShardsOf(chain, last, sampling.candidates), params, position);
      ASSERT_TRUE(from_tree.ok()) << from_tree.status();
      ASSERT_TRUE(from_chain.ok()) << from_chain.status();
      EXPECT_EQ(from_tree->token, from_chain->token) << what << " top_k " << params.top_k;
    }
    // The reduced winner is the Gumbel-max of the node's full logits.
    const float* logits = tree.logits.data() + int64_t{node} * vocab;
    int32_t expected = 0;
    double best = -std::numeric_limits<double>::infinity();
    for (int32_t v = 0; v < vocab; ++v) {
      const double score =
          kernels::GumbelMaxScore(logits[v], sampling.temperature, sampling.seed, position, v);
      if (score > best) {
        best = score;
        expected = v;
      }
    }
    auto selected =
        coordinator::SelectToken(ShardsOf(tree, node, sampling.candidates), unrestricted, position);
    ASSERT_TRUE(selected.ok());
    EXPECT_EQ(selected->token, expected) << what;
    differs_from_greedy += selected->token != tree.summaries[node].argmax;
    if (HasFailure()) return;
  }
  EXPECT_GT(differs_from_greedy, 0) << "at T = 2 some node should sample a non-argmax token";
}

TEST(ModelRunnerSamplingTest, BadSamplingOrLayersFailTheirSequenceAlone) {
  auto model = MakeModel("tiny-v3");
  ASSERT_NE(model, nullptr);
  const int32_t layers = static_cast<int32_t>(model->config().num_hidden_layers);
  ForwardRequest request;
  request.segments.push_back({.sequence_id = 1, .token_ids = {1, 2}, .parents = {-1, 0}});
  request.segments.back().sampling.temperature = -1.0f;
  request.segments.push_back({.sequence_id = 2, .token_ids = {1}, .parents = {-1}});
  request.segments.back().sampling = {.temperature = 1.0f, .candidates = 1025};
  request.segments.push_back({.sequence_id = 3, .token_ids = {1}, .parents = {-1}});
  request.segments.back().hidden_state_layers = {0, layers + 1};
  request.segments.push_back({.sequence_id = 4, .token_ids = {1}, .parents = {-1}});
  request.segments.back().hidden_state_layers = {1, 1};
  request.segments.push_back({.sequence_id = 5, .token_ids = {1}, .parents = {-1}});
  request.segments.back().hidden_state_layers = {-1};
  request.segments.push_back({.sequence_id = 6, .token_ids = {1, 2}, .parents = {-1, 0}});
  request.segments.back().sampling = {.temperature = 1.0f, .seed = 4, .candidates = 3};
  request.segments.back().hidden_state_layers = {layers, 0};
  auto results = model->Forward(request);
  ASSERT_TRUE(results.ok()) << results.status();
  const std::vector<std::string> messages = {"temperature", "candidates", "hidden_state_layers[1]",
                                             "twice", "hidden_state_layers[0]"};
  for (size_t s = 0; s < messages.size(); ++s) {
    EXPECT_EQ((*results)[s].status.code(), absl::StatusCode::kInvalidArgument) << "segment " << s;
    EXPECT_THAT(std::string((*results)[s].status.message()), testing::HasSubstr(messages[s]));
  }
  const LocalSegmentResult& good = (*results)[5];
  ASSERT_TRUE(good.status.ok()) << good.status;
  EXPECT_EQ(good.shard_candidates[0].size(), 6u);
  EXPECT_GE(good.shard_summaries[0][1].sampled_token, 0);
  ASSERT_EQ(good.hidden_states.size(), 2u);
  EXPECT_EQ(good.hidden_states[0].layer, layers);
  EXPECT_EQ(good.hidden_states[1].layer, 0);
  EXPECT_EQ(good.hidden_states[1].values.size(), 2u * model->config().hidden_size);
  // The rejected sequences hold no pages.
  EXPECT_EQ(model->rank(0).kv_cache().used_pages(), 1);
}

// Layer 0 is the embedding; the last layer's rows through the final norm and the LM head are
// the logits; tensor parallelism gives the same hidden states within 1e-4.
TEST(ModelRunnerHiddenStatesTest, LayersAreTheResidualStream) {
  const unsigned seed = 19;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  auto model = MakeModel("tiny-v3");
  ASSERT_NE(model, nullptr);
  const ModelConfig& config = model->config();
  const int vocab = static_cast<int>(config.vocab_size);
  const int64_t hidden = config.hidden_size;
  const int32_t layers = static_cast<int32_t>(config.num_hidden_layers);
  const std::vector<int32_t> prefix = RandomTokens(13, vocab, rng);
  const std::vector<int32_t> tokens = RandomTokens(9, vocab, rng);
  const std::vector<int32_t> parents = RandomParents(9, false, rng);
  std::vector<int32_t> requested = {layers};
  for (int32_t l = 0; l < layers; ++l) requested.push_back(l);

  auto run = [&](LocalModel& m) {
    EXPECT_TRUE(m.Prefill(1, prefix).ok());
    SegmentInput input{.sequence_id = 1, .token_ids = tokens, .parents = parents};
    input.hidden_state_layers = requested;
    LocalSegmentResult result = ForwardOne(m, input, /*logits=*/true);
    EXPECT_TRUE(m.Release(1).ok());
    return result;
  };
  const LocalSegmentResult result = run(*model);
  ASSERT_TRUE(result.status.ok()) << result.status;
  ASSERT_EQ(result.hidden_states.size(), requested.size());
  for (size_t i = 0; i < requested.size(); ++i) {
    EXPECT_EQ(result.hidden_states[i].layer, requested[i]);
    ASSERT_EQ(result.hidden_states[i].values.size(), tokens.size() * hidden);
  }

  const ModelWeights& weights = model->rank(0).weights();
  const std::vector<float>& embedded = result.hidden_states[1].values;  // layer 0
  for (size_t n = 0; n < tokens.size(); ++n) {
    for (int64_t i = 0; i < hidden; ++i) {
      ASSERT_EQ(embedded[n * hidden + i], weights.embedding[tokens[n] * hidden + i])
          << "node " << n << " dim " << i;
    }
  }
  // Consecutive layers differ: each capture is its own layer's output.
  EXPECT_NE(result.hidden_states[1].values, result.hidden_states[2].values);

  const int64_t rows = static_cast<int64_t>(tokens.size());
  std::vector<float> normed(rows * hidden);
  std::vector<float> logits(rows * vocab);
  ASSERT_TRUE(kernels::cpu::RmsNorm({.input = result.hidden_states[0].values.data(),
                                     .weight = weights.final_norm.data(),
                                     .output = normed.data(),
                                     .rows = rows,
                                     .dim = hidden,
                                     .eps = static_cast<float>(config.rms_norm_eps)})
                  .ok());
  ASSERT_TRUE(kernels::cpu::Gemm({.x = normed.data(),
                                  .weight = weights.lm_head.data(),
                                  .y = logits.data(),
                                  .m = rows,
                                  .n = vocab,
                                  .k = hidden})
                  .ok());
  for (size_t i = 0; i < logits.size(); ++i) {
    ASSERT_NEAR(logits[i], result.logits[i], 1e-5) << "row " << i / vocab << " logit " << i % vocab;
  }

  LocalModelOptions options;
  options.world_size = 2;
  auto tp2 = MakeModel("tiny-v3", options);
  ASSERT_NE(tp2, nullptr);
  const LocalSegmentResult sharded = run(*tp2);
  ASSERT_TRUE(sharded.status.ok()) << sharded.status;
  ASSERT_EQ(sharded.hidden_states.size(), requested.size());
  for (size_t l = 0; l < requested.size(); ++l) {
    ASSERT_EQ(sharded.hidden_states[l].layer, requested[l]);
    const std::vector<float>& expected = result.hidden_states[l].values;
    const std::vector<float>& actual = sharded.hidden_states[l].values;
    ASSERT_EQ(expected.size(), actual.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_NEAR(expected[i], actual[i], 1e-4) << "layer " << requested[l] << " element " << i;
    }
  }
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

namespace treeverify::worker {
namespace {

// Requests that could corrupt another sequence's state, or this one's, are refused before
// anything changes: a sequence named twice, a commit that is not a root path, positions beyond
// the model's context.
TEST(ModelRunnerSafetyTest, UnsafeRequestsAreRefusedBeforeAnythingChanges) {
  tools::LocalModelOptions options;
  options.kv_page_size = 16;
  auto model = MakeModel("tiny-v3", options);
  ASSERT_NE(model, nullptr);
  const std::vector<int32_t> prefix = {5, 6, 7, 8, 9};
  ASSERT_TRUE(model->Prefill(1, prefix).ok());
  ASSERT_TRUE(model->Prefill(2, prefix).ok());
  const SegmentInput tree{.sequence_id = 2, .token_ids = {11, 12, 13}, .parents = {-1, 0, 0}};
  const LocalSegmentResult reference = ForwardOne(*model, tree);
  ASSERT_TRUE(reference.status.ok());

  // Sequence 1 twice: both refused; sequence 2 in the same batch is untouched and exact.
  ForwardRequest request;
  request.segments.push_back({.sequence_id = 1, .token_ids = {3}, .parents = {-1}});
  request.segments.push_back(tree);
  request.segments.push_back({.sequence_id = 1, .token_ids = {4}, .parents = {-1}});
  auto results = model->Forward(request);
  ASSERT_TRUE(results.ok());
  EXPECT_EQ((*results)[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string((*results)[0].status.message()), testing::HasSubstr("more than once"));
  EXPECT_EQ((*results)[2].status.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*results)[1].status.ok());
  for (size_t n = 0; n < 3; ++n) {
    ExpectBitIdentical(reference.summaries[n], (*results)[1].summaries[n], "node");
  }

  // Siblings are not a path: refused, and the segment can still be committed properly.
  SegmentInput siblings{.sequence_id = 2,
                        .commit_nodes = std::vector<int32_t>{1, 2},
                        .token_ids = {20},
                        .parents = {-1}};
  const LocalSegmentResult refused = ForwardOne(*model, siblings);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status.message()), testing::HasSubstr("path"));
  SegmentInput path{.sequence_id = 2,
                    .commit_nodes = std::vector<int32_t>{0, 2},
                    .token_ids = {20},
                    .parents = {-1}};
  path.expected_committed_length = 7;
  EXPECT_TRUE(ForwardOne(*model, path).status.ok());

  // Beyond the context (max_position_embeddings of tiny-v3 is 1024): OUT_OF_RANGE, nothing
  // committed.
  const int64_t max_positions = model->config().max_position_embeddings;
  std::vector<int32_t> long_chain(256, 7);
  ASSERT_TRUE(model->Release(1).ok());
  for (int64_t done = 0; done + 256 <= max_positions - 10; done += 256) {
    SegmentInput chunk{
        .sequence_id = 1, .token_ids = long_chain, .parents = SegmentTree::ChainParents(256)};
    if (done > 0) {
      chunk.commit_nodes = std::vector<int32_t>(256);
      for (int i = 0; i < 256; ++i) (*chunk.commit_nodes)[i] = i;
    }
    ASSERT_TRUE(ForwardOne(*model, chunk).status.ok());
  }
  std::vector<int32_t> all(256);
  for (int i = 0; i < 256; ++i) all[i] = i;
  // Positions 768..1023: the last one the model has, so this still fits.
  SegmentInput to_the_end{.sequence_id = 1,
                          .commit_nodes = all,
                          .token_ids = long_chain,
                          .parents = SegmentTree::ChainParents(256)};
  ASSERT_TRUE(ForwardOne(*model, to_the_end).status.ok());
  ASSERT_EQ(max_positions, 1024);
  SegmentInput past_end{.sequence_id = 1, .commit_nodes = all, .token_ids = {7}, .parents = {-1}};
  const LocalSegmentResult out_of_range = ForwardOne(*model, past_end);
  EXPECT_EQ(out_of_range.status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(model->rank(0).kv_cache().committed_length(1), 768);  // the commit did not happen
}

}  // namespace
}  // namespace treeverify::worker
