// The GPU forward against the CPU backend by teacher forcing with the margin rule (DESIGN.md,
// Numerics): both runners get the same requests (a prompt as a chain, then draft trees whose
// accepted paths are committed alike), and every node's log-softmax must agree within a
// tolerance, its argmax wherever the CPU's top-1/top-2 margin exceeds twice the tolerance.
// Runs on the GPU machine; skipped, saying so, without a GPU.
#include "treeverify/worker/cuda_forward.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../kernels/cuda/cuda_test_base.h"
#include "gtest/gtest.h"
#include "margin_rule.h"
#include "treeverify/kernels/cuda/block_fp8.h"
#include "treeverify/kernels/cuda/device.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/worker/device_weights.h"
#include "treeverify/worker/model_runner.h"
#include "treeverify/worker/nccl_communicator.h"
#include "treeverify/worker/rendezvous_store.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::worker {
namespace {

// Routing is discrete: where a token's expert scores are within rounding of a tie, the GPU
// (whose router reads the bf16 normed hidden state, as transformers does in bf16) may pick other
// experts than the fp32 oracle, and that token's logits then differ by nats, not by rounding
// (on the H200, 2026-11-30: 28 of 157 rows for tiny-v3, whose groups of two experts make group
// choices close; 1 for tiny-kimi and tiny-v2-lite; the all-experts variants agree within 0.21).
// So the presets are compared twice: as they are, where at most kNearTieRowsPercent of the rows
// may disagree, and with every expert active (top_k = n_routed_experts: the routing then only
// weighs, continuously), where every row must agree. The routing kernel's choices are tested
// exactly, on identical logits, in tests/kernels/cuda/forward_ops_test.cc.
constexpr int kNearTieRowsPercent = 25;

struct Model {
  std::string name;
  tools::CheckpointSpec spec;
  bool near_ties = false;  // routing may flip at near-ties (see above)
  // Run at one rank only: FP8's 128 x 128 blocks are larger than the tiny dims, so two ranks
  // would cut them (and the loader refuses).
  bool single_rank = false;
};

// The tiny presets (MoE: sigmoid + noaux_tc with groups, Kimi's single group, V2-Lite's softmax
// + greedy without q_lora), dense variants, and one with DeepSeek-V3's attention dims (latent
// 512, rope 64), so that the production MLA kernels run inside the forward.
std::vector<Model> Models() {
  std::vector<Model> models;
  for (const char* preset : {"tiny-v3", "tiny-kimi", "tiny-v2-lite"}) {
    const tools::CheckpointSpec spec = *tools::PresetSpec(preset);
    models.push_back({preset, spec, /*near_ties=*/true});
    tools::CheckpointSpec all_experts = spec;
    all_experts.num_experts_per_tok = spec.n_routed_experts;
    all_experts.topk_group = spec.n_group;
    models.push_back({std::string(preset) + "-all-experts", all_experts});
  }
  // Kimi-K2-Thinking's INT4 experts (streamed quantized on the GPU, dequantized on the CPU), with
  // expert columns that two ranks split on group edges (32 each).
  tools::CheckpointSpec int4 = *tools::PresetSpec("tiny-kimi");
  int4.quantization.method = WeightQuantization::Method::kInt4Group;
  int4.moe_intermediate_size = 64;
  models.push_back({"tiny-kimi-int4", int4, /*near_ties=*/true});
  tools::CheckpointSpec int4_all_experts = int4;
  int4_all_experts.num_experts_per_tok = int4.n_routed_experts;
  models.push_back({"tiny-kimi-int4-all-experts", int4_all_experts});
  // DeepSeek-V3's FP8 blocks: the experts streamed in FP8, the dense projections' FP8 products
  // (blocks larger than these dims; W_UK and W_UV, whose heads cut blocks, in bf16).
  tools::CheckpointSpec fp8 = *tools::PresetSpec("tiny-kimi");
  fp8.quantization.method = WeightQuantization::Method::kFp8Block;
  models.push_back({"tiny-kimi-fp8", fp8, /*near_ties=*/true, /*single_rank=*/true});
  tools::CheckpointSpec fp8_all_experts = fp8;
  fp8_all_experts.num_experts_per_tok = fp8.n_routed_experts;
  models.push_back({"tiny-kimi-fp8-all-experts", fp8_all_experts, false, true});
  tools::CheckpointSpec v3 = *tools::PresetSpec("tiny-v3");
  v3.n_routed_experts = 0;
  models.push_back({"dense-tiny-v3", v3});
  tools::CheckpointSpec v2 = *tools::PresetSpec("tiny-v2-lite");
  v2.n_routed_experts = 0;
  models.push_back({"dense-tiny-v2-lite", v2});
  tools::CheckpointSpec wide = v3;
  wide.hidden_size = 256;
  wide.num_attention_heads = 2;
  wide.q_lora_rank = 192;
  wide.kv_lora_rank = 512;
  wide.qk_nope_head_dim = 128;
  wide.qk_rope_head_dim = 64;
  wide.v_head_dim = 128;
  wide.num_hidden_layers = 2;
  wide.vocab_size = 1024;
  // DeepSeek-V3's FP8 at its attention dims: every projection FP8 on the GPU, W_UK and W_UV a
  // head's whole blocks each; heads of 192 query rows, which a second rank would cut off a block.
  tools::CheckpointSpec wide_fp8 = wide;
  wide_fp8.quantization.method = WeightQuantization::Method::kFp8Block;
  models.push_back({"dense-v3-attention-dims-fp8", wide_fp8, false, /*single_rank=*/true});
  models.push_back({"dense-v3-attention-dims", wide});  // last: the tests below take it
  return models;
}

std::string WriteModel(const Model& model) {
  const std::string dir =
      testing::TempDir() + "/cuda_forward_test_" + model.name + "_" + std::to_string(::getpid());
  const absl::Status written = tools::WriteCheckpoint(dir, model.spec);
  EXPECT_TRUE(written.ok()) << written;
  return dir;
}

std::vector<int32_t> RandomTokens(int n, int64_t vocab, std::mt19937& rng) {
  std::vector<int32_t> tokens(n);
  for (int32_t& t : tokens) t = std::uniform_int_distribution<int32_t>(0, vocab - 1)(rng);
  return tokens;
}

class CudaForwardTest : public kernels::cuda::CudaTest {
 protected:
  // One GPU rank that keeps a StepAccount of every step.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> MakeAccountingRunner(const std::string& dir,
                                                                           Communicator& solo) {
    ModelRunnerOptions options;
    options.kv_page_size = 16;
    options.kv_pages = 64;
    options.forward_factory = [](const ModelWeights& w, const KvCacheOptions& c, Communicator* k) {
      return MakeCudaForward(w, c, k, {.account_steps = true});
    };
    return ModelRunner::Create(dir, options, &solo);
  }

  // With `nccl`, rank r runs on GPU r and the ranks meet over NCCL (all-reduces on the device,
  // graphs at W > 1); otherwise every rank runs on GPU 0 and they meet through the host.
  static std::unique_ptr<tools::LocalModel> MakeModel(const std::string& dir, bool gpu,
                                                      int world_size = 1,
                                                      ExpertSharding sharding = {},
                                                      bool graphs = true, bool nccl = false) {
    tools::LocalModelOptions options;
    options.world_size = world_size;
    options.expert_sharding = sharding;
    options.kv_page_size = 16;
    options.kv_pages = 64;
    if (gpu) {
      options.forward_factory = [graphs, nccl](const ModelWeights& w, const KvCacheOptions& c,
                                               Communicator* k) {
        return MakeCudaForward(w, c, k, {.device_ordinal = nccl ? k->rank() : 0, .graphs = graphs});
      };
    }
    if (nccl) {
      auto store = std::make_shared<InMemoryRendezvousStore>();
      options.communicator_factory =
          [store](int rank, int world) -> absl::StatusOr<std::unique_ptr<Communicator>> {
        return NcclCommunicator::Create(
            {.rank = rank, .world_size = world, .device_ordinal = rank, .key_prefix = "nccl/1/"},
            store.get());
      };
    }
    auto model = tools::LocalModel::Create(dir, options);
    EXPECT_TRUE(model.ok()) << model.status();
    return model.ok() ? std::move(*model) : nullptr;
  }

  // Two GPU runners, graphs on and off, take the same steps; their logits must be equal bit for
  // bit.
  static void ExpectGraphsGiveTheBytesOfEagerLaunches(const Model& model, int world_size,
                                                      bool nccl) {
    const std::string dir = WriteModel(model);
    auto graphs = MakeModel(dir, /*gpu=*/true, world_size, {}, /*graphs=*/true, nccl);
    auto eager = MakeModel(dir, /*gpu=*/true, world_size, {}, /*graphs=*/false, nccl);
    ASSERT_NE(graphs, nullptr);
    ASSERT_NE(eager, nullptr);
    std::mt19937 rng(79);
    const int64_t vocab = graphs->config().vocab_size;
    const std::vector<int32_t> parents = {-1, 0, 0, 1, 1, 2, 3};
    std::vector<ForwardRequest> steps(1);
    steps[0].return_logits = true;
    steps[0].segments.push_back({.sequence_id = 5,
                                 .token_ids = RandomTokens(30, vocab, rng),
                                 .parents = SegmentTree::ChainParents(30)});
    for (int step = 0; step < 5; ++step) {
      ForwardRequest request;
      request.return_logits = true;
      std::vector<int32_t> commit = {0, 1, 3};
      if (step == 0) {
        commit.resize(30);
        std::iota(commit.begin(), commit.end(), 0);
      }
      request.segments.push_back({.sequence_id = 5,
                                  .commit_nodes = commit,
                                  .token_ids = RandomTokens(7, vocab, rng),
                                  .parents = parents});
      steps.push_back(request);
    }
    for (size_t s = 0; s < steps.size(); ++s) {
      auto from_graph = graphs->Forward(steps[s]);
      auto from_eager = eager->Forward(steps[s]);
      ASSERT_TRUE(from_graph.ok()) << from_graph.status();
      ASSERT_TRUE(from_eager.ok()) << from_eager.status();
      const std::vector<float>& a = (*from_graph)[0].logits;
      const std::vector<float>& b = (*from_eager)[0].logits;
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "step " << s;
    }
  }
};

struct RankSetup {
  int world_size;
  ExpertSharding sharding;
  std::string name() const {
    return "tp" + std::to_string(world_size) +
           (sharding == ExpertSharding::kSplitInside ? " split inside" : " whole experts");
  }
};

void ExpectStepsAgree(const Model& model, tools::LocalModel& cpu, tools::LocalModel& gpu,
                      const std::vector<ForwardRequest>& steps, const std::string& label);

// Teacher forcing, GPU against the CPU at W = 1: two sequences' prompts as chains (with hidden
// states of layer 1), then draft trees whose accepted paths are committed alike; every row by
// the margin rule.
void ExpectTeacherForcingAgrees(const Model& model, tools::LocalModel& cpu, tools::LocalModel& gpu,
                                const std::string& label) {
  const unsigned seed = 77;
  std::mt19937 rng(seed);
  const int64_t vocab = cpu.config().vocab_size;

  // Two sequences: prompts of 37 and 20 tokens as chains, with hidden states of layer 1.
  ForwardRequest prefill;
  prefill.return_logits = true;
  for (uint64_t id : {1, 2}) {
    const int length = id == 1 ? 37 : 20;
    prefill.segments.push_back({.sequence_id = id,
                                .token_ids = RandomTokens(length, vocab, rng),
                                .parents = SegmentTree::ChainParents(length),
                                .hidden_state_layers = {1}});
  }
  // Then draft trees: node 0 hangs on the prefix, the others on random earlier nodes; the
  // path 0 -> 1 -> 3 (when the tree has it) is accepted, so the commit moves rows.
  std::vector<ForwardRequest> steps = {prefill};
  for (int step = 0; step < 4; ++step) {
    ForwardRequest request;
    request.return_logits = true;
    for (uint64_t id : {1, 2}) {
      const int nodes = id == 1 ? 9 : 16;
      std::vector<int32_t> parents(nodes);
      for (int i = 0; i < nodes; ++i) {
        parents[i] = i == 0 ? -1 : std::uniform_int_distribution<int>(0, i - 1)(rng);
      }
      parents[1] = 0;
      parents[3] = 1;
      SegmentInput segment{
          .sequence_id = id, .token_ids = RandomTokens(nodes, vocab, rng), .parents = parents};
      if (step == 0) {  // the whole prompt
        segment.commit_nodes = std::vector<int32_t>(id == 1 ? 37 : 20);
        std::iota(segment.commit_nodes->begin(), segment.commit_nodes->end(), 0);
      } else {
        segment.commit_nodes = std::vector<int32_t>{0, 1, 3};
      }
      request.segments.push_back(segment);
    }
    steps.push_back(request);
  }
  ExpectStepsAgree(model, cpu, gpu, steps, label);
}

// Both runners take `steps`; every row by the margin rule (with the near-tie allowance where the
// model has near ties), hidden states within rounding.
void ExpectStepsAgree(const Model& model, tools::LocalModel& cpu, tools::LocalModel& gpu,
                      const std::vector<ForwardRequest>& steps, const std::string& label) {
  const int64_t vocab = cpu.config().vocab_size;
  Agreement agreement;
  for (size_t s = 0; s < steps.size(); ++s) {
    auto cpu_result = cpu.Forward(steps[s]);
    auto gpu_result = gpu.Forward(steps[s]);
    ASSERT_TRUE(cpu_result.ok()) << cpu_result.status();
    ASSERT_TRUE(gpu_result.ok()) << gpu_result.status();
    for (size_t q = 0; q < steps[s].segments.size(); ++q) {
      const tools::LocalSegmentResult& c = (*cpu_result)[q];
      const tools::LocalSegmentResult& g = (*gpu_result)[q];
      ASSERT_TRUE(c.status.ok()) << c.status;
      ASSERT_TRUE(g.status.ok()) << g.status;
      EXPECT_EQ(g.committed_length, c.committed_length);
      const std::string what = "step " + std::to_string(s) + " sequence " + std::to_string(q);
      CompareRows(g.logits, c.logits, vocab, what, agreement);
      // The reduced summaries are the logits' (the host summary of the GPU logits, for now).
      for (size_t r = 0; r < g.summaries.size(); ++r) {
        const float* row = g.logits.data() + r * vocab;
        EXPECT_EQ(g.summaries[r].argmax, std::max_element(row, row + vocab) - row) << what;
      }
      ASSERT_EQ(g.hidden_states.size(), c.hidden_states.size());
      for (size_t h = 0; h < g.hidden_states.size(); ++h) {
        const std::vector<float>& expected = c.hidden_states[h].values;
        const std::vector<float>& actual = g.hidden_states[h].values;
        ASSERT_EQ(actual.size(), expected.size());
        for (size_t i = 0; i < actual.size(); ++i) {
          ASSERT_NEAR(actual[i], expected[i], 0.02 * (1.0 + std::abs(expected[i])))
              << what << " hidden state " << i;
        }
      }
    }
  }
  std::cout << label << ": " << agreement.disagreeing.size() << " of " << agreement.rows
            << " rows disagree"
            << " rows, max |log-softmax diff| " << agreement.worst << " (likely tokens), "
            << agreement.worst_tail << " relative (the tail), argmax compared at "
            << agreement.argmax_compared << "\n";
  EXPECT_GT(agreement.argmax_compared, agreement.rows / 2) << "margins too small to test";
  const int allowed = model.near_ties ? agreement.rows * kNearTieRowsPercent / 100 : 0;
  EXPECT_LE(static_cast<int>(agreement.disagreeing.size()), allowed)
      << agreement.disagreeing.size() << " of " << agreement.rows
      << " rows disagree; the first: " << agreement.disagreeing.front();
}

// W = 1 for every model; W = 2 (two GPU ranks in threads of this process on one GPU, meeting
// through the host communicator) in both expert shardings for the MoE presets. The reference is
// always the CPU at W = 1.
TEST_F(CudaForwardTest, TeacherForcedStepsMatchTheCpuBackend) {
  for (const Model& model : Models()) {
    const bool moe = model.spec.n_routed_experts > 0;
    std::vector<RankSetup> setups = {{1, ExpertSharding::kSplitInside}};
    if (moe && !model.single_rank) {
      setups.push_back({2, ExpertSharding::kSplitInside});
      setups.push_back({2, ExpertSharding::kWholeExperts});
    }
    for (const RankSetup& setup : setups) {
      const std::string label = model.name + " " + setup.name();
      SCOPED_TRACE(label);
      const std::string dir = WriteModel(model);
      auto cpu = MakeModel(dir, /*gpu=*/false);
      auto gpu = MakeModel(dir, /*gpu=*/true, setup.world_size, setup.sharding);
      ASSERT_NE(cpu, nullptr);
      ASSERT_NE(gpu, nullptr);
      ExpectTeacherForcingAgrees(model, *cpu, *gpu, label);
    }
  }
}

// The prefill path (the MHA form, for chains longer than a tree) against the CPU by teacher
// forcing: two prompts prefilled together, the first past a tree's size (in pieces, the MHA form)
// and the second short (absorbed in the same step), each continued by a second chunk over its
// committed prefix, then draft trees in the absorbed form over the cache the prefill path wrote.
// Every model: the padded kernels of the tiny dims and DeepSeek's 192 / 128.
TEST_F(CudaForwardTest, PrefillInTheMhaFormMatchesTheCpuBackend) {
  for (const Model& model : Models()) {
    SCOPED_TRACE(model.name);
    const std::string dir = WriteModel(model);
    auto cpu = MakeModel(dir, /*gpu=*/false);
    auto gpu = MakeModel(dir, /*gpu=*/true);
    ASSERT_NE(cpu, nullptr);
    ASSERT_NE(gpu, nullptr);
    std::mt19937 rng(83);
    const int64_t vocab = cpu->config().vocab_size;
    const std::vector<int32_t> first = {270, 20}, second = {330, 30};
    std::vector<ForwardRequest> steps;
    for (const std::vector<int32_t>* chunk : {&first, &second}) {
      ForwardRequest request;
      request.return_logits = true;
      for (uint64_t id : {1, 2}) {
        const int32_t rows = (*chunk)[id - 1];
        SegmentInput segment{.sequence_id = id,
                             .token_ids = RandomTokens(rows, vocab, rng),
                             .parents = SegmentTree::ChainParents(rows),
                             .hidden_state_layers = {1}};
        if (chunk == &second) segment.commit_nodes = SegmentTree::AllNodes(first[id - 1]);
        request.segments.push_back(segment);
      }
      steps.push_back(request);
    }
    for (int step = 0; step < 2; ++step) {
      ForwardRequest request;
      request.return_logits = true;
      for (uint64_t id : {1, 2}) {
        SegmentInput segment{.sequence_id = id,
                             .token_ids = RandomTokens(7, vocab, rng),
                             .parents = {-1, 0, 0, 1, 1, 3, 2}};
        segment.commit_nodes =
            step == 0 ? SegmentTree::AllNodes(second[id - 1]) : std::vector<int32_t>{0, 1, 3};
        request.segments.push_back(segment);
      }
      steps.push_back(request);
    }
    ExpectStepsAgree(model, *cpu, *gpu, steps, model.name + " prefill");
  }
}

// Which steps take the prefill path: those with a chain longer than a tree (a prompt chunk), the
// step's other sequences staying absorbed; never a step of trees or of short chains, however many.
TEST_F(CudaForwardTest, OnlyLongChainsTakeThePrefillPath) {
  const Model model = Models().back();  // DeepSeek's attention dims
  const std::string dir = WriteModel(model);
  SoloCommunicator solo;
  auto runner = MakeAccountingRunner(dir, solo);
  ASSERT_TRUE(runner.ok()) << runner.status();
  std::mt19937 rng(5);
  const int64_t vocab = (*runner)->config().vocab_size;
  // One forward of segments (sequence id, parents, rows to commit first).
  struct Segment {
    uint64_t id;
    std::vector<int32_t> parents;
    std::optional<int64_t> commit;
  };
  auto step = [&](const std::vector<Segment>& segments) {
    ForwardRequest request;
    for (const Segment& s : segments) {
      request.segments.push_back(
          {.sequence_id = s.id,
           .token_ids = RandomTokens(static_cast<int>(s.parents.size()), vocab, rng),
           .parents = s.parents});
      if (s.commit) request.segments.back().commit_nodes = SegmentTree::AllNodes(*s.commit);
    }
    auto result = (*runner)->Forward(request);
    EXPECT_TRUE(result.ok());
    for (const SegmentOutput& output : result->segments) EXPECT_TRUE(output.status.ok());
    return (*runner)->last_step_account().value_or(StepAccount{}).prefill;
  };
  EXPECT_TRUE(step({{1, SegmentTree::ChainParents(300), {}}}));   // pieces of 256 + 44
  EXPECT_FALSE(step({{2, SegmentTree::ChainParents(256), {}}}));  // a tree's size
  EXPECT_FALSE(step({{1, {-1, 0, 0, 1}, 300}}));                  // a tree
  // Seventeen sequences with 16-node chain drafts (272 rows): still a verify step.
  std::vector<Segment> chains;
  for (uint64_t id = 10; id < 27; ++id) chains.push_back({id, SegmentTree::ChainParents(16), {}});
  EXPECT_FALSE(step(chains));
  for (const Segment& s : chains) ASSERT_TRUE((*runner)->Release(s.id).ok());
  // A tree beside a prompt chunk over its prefix: the chunk in the MHA form, the tree absorbed.
  EXPECT_TRUE(step({{2, SegmentTree::ChainParents(257), 256}, {1, {-1, 0, 0}, 2}}));
}

// Two GPUs, one rank each, over NCCL: the all-reduces on the device and the steps replayed from
// CUDA graphs at W = 2, in both shardings.
TEST_F(CudaForwardTest, RanksOverNcclMatchTheCpuBackendOnTwoGpus) {
  RequireTwoGpus();
  const std::vector<Model> models = Models();
  for (const Model& model : {models[2], models[1]}) {  // tiny-kimi, tiny-v3 with every expert
    for (ExpertSharding sharding : {ExpertSharding::kSplitInside, ExpertSharding::kWholeExperts}) {
      const std::string label = model.name + " " + RankSetup{2, sharding}.name() + " over NCCL";
      SCOPED_TRACE(label);
      const std::string dir = WriteModel(model);
      auto cpu = MakeModel(dir, /*gpu=*/false);
      auto gpu = MakeModel(dir, /*gpu=*/true, 2, sharding, /*graphs=*/true, /*nccl=*/true);
      ASSERT_NE(cpu, nullptr);
      ASSERT_NE(gpu, nullptr);
      ExpectTeacherForcingAgrees(model, *cpu, *gpu, label);
    }
  }
}

// On the GPU a tree node computes what the same tokens compute as a chain, up to the GPU's
// batch-dependent rounding (the margin rule again, against the chain).
TEST_F(CudaForwardTest, TreeNodesMatchTheirChainsOnTheGpu) {
  const Model model = Models().back();
  const unsigned seed = 78;
  std::mt19937 rng(seed);
  const std::string dir = WriteModel(model);
  auto gpu = MakeModel(dir, /*gpu=*/true);
  ASSERT_NE(gpu, nullptr);
  const int64_t vocab = gpu->config().vocab_size;
  const std::vector<int32_t> prompt = RandomTokens(29, vocab, rng);
  // Tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}, 3 -> {5}. Path to 5: 0, 1, 3, 5.
  const std::vector<int32_t> parents = {-1, 0, 0, 1, 2, 3};
  const std::vector<int32_t> tree_tokens = RandomTokens(6, vocab, rng);
  const std::vector<int32_t> path = {0, 1, 3, 5};
  std::vector<int32_t> chain_tokens;
  for (int32_t node : path) chain_tokens.push_back(tree_tokens[node]);

  ForwardRequest prefill;
  for (uint64_t id : {1, 2}) {
    prefill.segments.push_back(
        {.sequence_id = id, .token_ids = prompt, .parents = SegmentTree::ChainParents(29)});
  }
  ASSERT_TRUE(gpu->Forward(prefill).ok());
  std::vector<int32_t> all(29);
  std::iota(all.begin(), all.end(), 0);
  ForwardRequest step;
  step.return_logits = true;
  step.segments.push_back(
      {.sequence_id = 1, .commit_nodes = all, .token_ids = tree_tokens, .parents = parents});
  step.segments.push_back({.sequence_id = 2,
                           .commit_nodes = all,
                           .token_ids = chain_tokens,
                           .parents = SegmentTree::ChainParents(4)});
  auto result = gpu->Forward(step);
  ASSERT_TRUE(result.ok()) << result.status();
  std::vector<float> tree_path_logits;
  for (int32_t node : path) {
    const std::vector<float>& logits = (*result)[0].logits;
    tree_path_logits.insert(tree_path_logits.end(), logits.begin() + node * vocab,
                            logits.begin() + (node + 1) * vocab);
  }
  Agreement agreement;
  CompareRows(tree_path_logits, (*result)[1].logits, vocab, "tree vs chain", agreement);
  std::cout << "tree vs chain: max |log-softmax diff| " << agreement.worst << "\n";
  EXPECT_TRUE(agreement.disagreeing.empty()) << agreement.disagreeing.front();
}

// A step replayed from its CUDA graph computes the bytes its eager launches compute: two GPU
// runners, graphs on and off, take the same steps (a prompt, then trees of one shape over a
// growing context: the shape's first step runs eagerly, its second is captured, the rest are
// replays), and their logits must be equal bit for bit.
TEST_F(CudaForwardTest, GraphReplayGivesTheBytesOfEagerLaunches) {
  for (const Model& model : {Models()[2], Models().back()}) {  // tiny-kimi (MoE), V3 attention
    SCOPED_TRACE(model.name);
    ExpectGraphsGiveTheBytesOfEagerLaunches(model, /*world_size=*/1, /*nccl=*/false);
  }
}

// The same at W = 2 over NCCL, whose all-reduces are inside the graphs.
TEST_F(CudaForwardTest, GraphReplayOverNcclGivesTheBytesOfEagerLaunchesOnTwoGpus) {
  RequireTwoGpus();
  ExpectGraphsGiveTheBytesOfEagerLaunches(Models()[2], /*world_size=*/2, /*nccl=*/true);
}

// Trees of nearby sizes share a bucket's graph: 9, 10 and 11 nodes all run as 12 rows, so the
// first step runs eagerly, the second is captured and the rest replay, while every step's own
// rows agree with the CPU's by the margin rule and the padding rows take no expert (at most 3
// experts for each of the tree's tokens).
TEST_F(CudaForwardTest, TreesOfNearbySizesShareABucketsGraph) {
  const Model model = Models()[2];  // tiny-kimi: 3 of 12 experts per token
  const std::string dir = WriteModel(model);
  SoloCommunicator solo;
  auto gpu = MakeAccountingRunner(dir, solo);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu = MakeModel(dir, /*gpu=*/false);
  ASSERT_NE(cpu, nullptr);
  std::mt19937 rng(80);
  const int64_t vocab = cpu->config().vocab_size;
  // A prompt of 40 tokens, then trees whose context stays within the same power of two of pages.
  ForwardRequest prompt;
  prompt.segments.push_back({.sequence_id = 3,
                             .token_ids = RandomTokens(40, vocab, rng),
                             .parents = SegmentTree::ChainParents(40)});
  ASSERT_TRUE((*gpu)->Forward(prompt).ok());
  ASSERT_TRUE(cpu->Forward(prompt).ok());
  std::vector<int32_t> commit(40);
  std::iota(commit.begin(), commit.end(), 0);
  const std::vector<StepLaunch> expected = {StepLaunch::kEager, StepLaunch::kCapture,
                                            StepLaunch::kReplay, StepLaunch::kReplay,
                                            StepLaunch::kReplay};
  Agreement agreement;
  for (int step = 0; step < 5; ++step) {
    const int nodes = 9 + step % 3;
    std::vector<int32_t> parents(nodes);
    for (int i = 0; i < nodes; ++i) {
      parents[i] = i == 0 ? -1 : std::uniform_int_distribution<int>(0, i - 1)(rng);
    }
    ForwardRequest request;
    request.return_logits = true;
    request.segments.push_back({.sequence_id = 3,
                                .commit_nodes = commit,
                                .token_ids = RandomTokens(nodes, vocab, rng),
                                .parents = parents});
    commit = {0};
    auto from_gpu = (*gpu)->Forward(request);
    auto from_cpu = cpu->Forward(request);
    ASSERT_TRUE(from_gpu.ok()) << from_gpu.status();
    ASSERT_TRUE(from_cpu.ok()) << from_cpu.status();
    const std::optional<StepAccount> account = (*gpu)->last_step_account();
    ASSERT_TRUE(account.has_value());
    EXPECT_EQ(account->rows, nodes);
    EXPECT_EQ(account->padded_rows, 12);
    EXPECT_EQ(account->launch, expected[step]) << "step " << step;
    for (size_t l = 1; l < account->active_experts.size(); ++l) {
      EXPECT_LE(account->active_experts[l], nodes * 3) << "layer " << l;
    }
    ASSERT_EQ(from_gpu->segments.size(), 1u);
    CompareRows(from_gpu->segments[0].logits, (*from_cpu)[0].logits, vocab,
                "step " + std::to_string(step), agreement);
  }
  EXPECT_LE(static_cast<int>(agreement.disagreeing.size()),
            agreement.rows * kNearTieRowsPercent / 100);
}

// Batches of nearby sizes share a bucket's graph too: steps of three and four sequences both run
// as four (the bucket), the padding sequence without rows or keys, the attention's splits spread
// over the live ones (read on the device). The first step runs eagerly, the second is captured
// and the rest replay, while every sequence's rows agree with the CPU's by the margin rule.
TEST_F(CudaForwardTest, BatchesOfNearbySizesShareABucketsGraph) {
  const Model model = Models()[2];  // tiny-kimi
  const std::string dir = WriteModel(model);
  SoloCommunicator solo;
  auto gpu = MakeAccountingRunner(dir, solo);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu = MakeModel(dir, /*gpu=*/false);
  ASSERT_NE(cpu, nullptr);
  std::mt19937 rng(81);
  const int64_t vocab = cpu->config().vocab_size;
  // Four prompts of 40 tokens, then trees of three nodes for sequences 1..3 or 1..4.
  ForwardRequest prompts;
  for (uint64_t id = 1; id <= 4; ++id) {
    prompts.segments.push_back({.sequence_id = id,
                                .token_ids = RandomTokens(40, vocab, rng),
                                .parents = SegmentTree::ChainParents(40)});
  }
  ASSERT_TRUE((*gpu)->Forward(prompts).ok());
  ASSERT_TRUE(cpu->Forward(prompts).ok());
  std::vector<int32_t> all(40);
  std::iota(all.begin(), all.end(), 0);
  std::vector<std::vector<int32_t>> commit(5, all);
  const std::vector<StepLaunch> expected = {StepLaunch::kEager, StepLaunch::kCapture,
                                            StepLaunch::kReplay, StepLaunch::kReplay,
                                            StepLaunch::kReplay};
  Agreement agreement;
  for (int step = 0; step < 5; ++step) {
    const int sequences = step % 2 == 0 ? 3 : 4;
    ForwardRequest request;
    request.return_logits = true;
    for (int id = 1; id <= sequences; ++id) {
      request.segments.push_back({.sequence_id = static_cast<uint64_t>(id),
                                  .commit_nodes = commit[id],
                                  .token_ids = RandomTokens(3, vocab, rng),
                                  .parents = {-1, 0, 0}});
      commit[id] = {0};
    }
    auto from_gpu = (*gpu)->Forward(request);
    auto from_cpu = cpu->Forward(request);
    ASSERT_TRUE(from_gpu.ok()) << from_gpu.status();
    ASSERT_TRUE(from_cpu.ok()) << from_cpu.status();
    const std::optional<StepAccount> account = (*gpu)->last_step_account();
    ASSERT_TRUE(account.has_value());
    EXPECT_EQ(account->sequences, sequences);
    EXPECT_EQ(account->padded_sequences, 4);
    EXPECT_EQ(account->launch, expected[step]) << "step " << step;
    ASSERT_EQ(from_gpu->segments.size(), static_cast<size_t>(sequences));
    for (int i = 0; i < sequences; ++i) {
      CompareRows(from_gpu->segments[i].logits, (*from_cpu)[i].logits, vocab,
                  "step " + std::to_string(step) + " sequence " + std::to_string(i + 1), agreement);
    }
  }
  EXPECT_LE(static_cast<int>(agreement.disagreeing.size()),
            agreement.rows * kNearTieRowsPercent / 100);
}

// With accounting on, every phase the step runs has time, and the bytes model is filled in.
TEST_F(CudaForwardTest, StepAccountCoversThePhases) {
  const Model model = Models()[2];  // tiny-kimi
  const std::string dir = WriteModel(model);
  SoloCommunicator solo;
  auto runner = MakeAccountingRunner(dir, solo);
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_FALSE((*runner)->last_step_account().has_value());
  ForwardRequest request;
  request.segments.push_back(
      {.sequence_id = 1, .token_ids = {1, 2, 3, 4}, .parents = SegmentTree::ChainParents(4)});
  for (int step = 0; step < 3; ++step) {  // eager, eager, captured: all accounted
    ASSERT_TRUE((*runner)->Forward(request).ok());
    request.segments[0].commit_nodes = std::vector<int32_t>{0, 1, 2, 3};
    request.segments[0].token_ids = {5, 6, 7, 8};
    const std::optional<StepAccount> account = (*runner)->last_step_account();
    ASSERT_TRUE(account.has_value());
    for (StepPhase phase :
         {StepPhase::kEmbed, StepPhase::kAttention, StepPhase::kMoe, StepPhase::kLmHead}) {
      EXPECT_GT(account->phase(phase).seconds, 0.0) << StepPhaseName(phase) << " step " << step;
      EXPECT_GT(account->phase(phase).modeled_bytes, 0.0) << StepPhaseName(phase);
    }
    // W = 1 has no all-reduce, and no event marks one (each costs the graph ~3.5 us).
    EXPECT_EQ(account->phase(StepPhase::kAllReduce).seconds, 0.0);
    EXPECT_GT(account->copy_bytes_per_second, 1e9);
    EXPECT_GT(account->TotalUtilization(), 0.0);
    EXPECT_EQ(account->rows, 4);
    EXPECT_EQ(account->padded_rows, 8);  // the smallest bucket
    // tiny-kimi: layer 0 dense, layers 1-2 MoE with at most 4 x 3 experts active.
    ASSERT_EQ(account->active_experts.size(), 3u);
    EXPECT_EQ(account->active_experts[0], 0);
    EXPECT_GT(account->active_experts[1], 0);
    EXPECT_LE(account->active_experts[1], 12);
  }
  // The copy bandwidth is the device's, measured once per process: a second worker reports the
  // first one's figure (a second measurement could read 10 % lower: bench/NOTES.md, step 128).
  auto second = MakeAccountingRunner(dir, solo);
  ASSERT_TRUE(second.ok()) << second.status();
  ForwardRequest first_step;
  first_step.segments.push_back(
      {.sequence_id = 1, .token_ids = {1, 2, 3, 4}, .parents = SegmentTree::ChainParents(4)});
  ASSERT_TRUE((*second)->Forward(first_step).ok());
  ASSERT_TRUE((*second)->last_step_account().has_value());
  EXPECT_EQ((*second)->last_step_account()->copy_bytes_per_second,
            (*runner)->last_step_account()->copy_bytes_per_second);
}

// Each sequence is summarized with its own sampling parameters on the device: the candidates
// come back per sequence, best first, led by the argmax, and only a sampling sequence has a
// sampled token.
TEST_F(CudaForwardTest, SummariesFollowEachSequencesSampling) {
  const std::string dir = WriteModel(Models()[2]);  // tiny-kimi
  SoloCommunicator solo;
  ModelRunnerOptions options;
  options.kv_page_size = 16;
  options.kv_pages = 64;
  options.forward_factory = [](const ModelWeights& w, const KvCacheOptions& c, Communicator* k) {
    return MakeCudaForward(w, c, k, {});
  };
  auto runner = ModelRunner::Create(dir, options, &solo);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ForwardRequest request;
  request.return_logits = true;
  request.segments.push_back({.sequence_id = 1,
                              .token_ids = {3, 1, 4, 1, 5},
                              .parents = SegmentTree::ChainParents(5),
                              .sampling = {.temperature = 0.8f, .seed = 42, .candidates = 4}});
  request.segments.push_back(
      {.sequence_id = 2, .token_ids = {2, 7, 1}, .parents = SegmentTree::ChainParents(3)});
  auto result = (*runner)->Forward(request);
  ASSERT_TRUE(result.ok()) << result.status();
  const int64_t vocab = (*runner)->config().vocab_size;
  const SegmentOutput& sampled = result->segments[0];
  const SegmentOutput& greedy = result->segments[1];
  ASSERT_EQ(sampled.candidates.size(), 5u * 4);
  EXPECT_TRUE(greedy.candidates.empty());
  for (size_t r = 0; r < 5; ++r) {
    const float* row = sampled.logits.data() + r * vocab;
    const int64_t argmax = std::max_element(row, row + vocab) - row;
    EXPECT_EQ(sampled.summaries[r].argmax, argmax);
    EXPECT_EQ(sampled.candidates[r * 4].token_id, argmax);
    EXPECT_EQ(sampled.candidates[r * 4].logit, row[argmax]);
    for (int k = 1; k < 4; ++k) {
      EXPECT_LE(sampled.candidates[r * 4 + k].logit, sampled.candidates[r * 4 + k - 1].logit);
    }
    EXPECT_GE(sampled.summaries[r].sampled_token, 0);
    EXPECT_LT(sampled.summaries[r].sampled_token, vocab);
    EXPECT_EQ(sampled.summaries[r].sampled_logit, row[sampled.summaries[r].sampled_token]);
  }
  for (const kernels::NodeSummary& summary : greedy.summaries) {
    EXPECT_EQ(summary.sampled_token, -1);  // greedy only
  }
}

// Where there is no GPU (CI, a developer's laptop), asking for the CUDA backend is a clear
// FAILED_PRECONDITION, not a crash. (On a GPU machine only the options check runs.)
// A quantized checkpoint's experts reach the GPU as the stream's records, not dequantized (the
// models above then test the quantized streams against the CPU): INT4 at both shardings of two
// ranks (4.5 KB records: gate/up's of 64-row tiles of gate and up, down's of 128 rows, each 64
// columns), FP8 at one rank (8208-byte records).
TEST_F(CudaForwardTest, QuantizedExpertsStayQuantizedOnTheGpu) {
  struct Case {
    std::string model;
    int world_size;
    DeviceMoeWeights::Layout layout;
    int64_t record_bytes;
  };
  for (const Case& c : {Case{"tiny-kimi-int4", 2, DeviceMoeWeights::Layout::kInt4, 4608},
                        Case{"tiny-kimi-fp8", 1, DeviceMoeWeights::Layout::kFp8, 8208}}) {
    SCOPED_TRACE(c.model);
    std::optional<Model> model;
    for (const Model& m : Models()) {
      if (m.name == c.model) model = m;
    }
    ASSERT_TRUE(model.has_value());
    const std::string dir = WriteModel(*model);
    auto config = ModelConfig::FromFile(dir + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    for (ExpertSharding sharding : {ExpertSharding::kSplitInside, ExpertSharding::kWholeExperts}) {
      auto plan = ShardingPlan::Make(*config, c.world_size - 1, c.world_size, sharding);
      ASSERT_TRUE(plan.ok()) << plan.status();
      auto weights = ModelWeights::Load(dir, *config, *plan);
      ASSERT_TRUE(weights.ok()) << weights.status();
      auto device = UploadWeights(**weights);
      ASSERT_TRUE(device.ok()) << device.status();
      int moe_layers = 0;
      for (const DeviceLayerWeights& layer : device->layers) {
        if (!layer.is_moe) continue;
        ++moe_layers;
        EXPECT_EQ(layer.moe.layout, c.layout);
        const int64_t experts = plan->experts.size(), columns = plan->expert_intermediate.size();
        const int64_t hidden = config->hidden_size;
        EXPECT_EQ(layer.moe.records_gate_up.size(),
                  experts * ((columns + 63) / 64) * ((hidden + 63) / 64) * c.record_bytes);
        EXPECT_EQ(layer.moe.records_down.size(),
                  experts * ((hidden + 127) / 128) * ((columns + 63) / 64) * c.record_bytes);
        EXPECT_EQ(layer.moe.gate.size(), 0);
      }
      EXPECT_GT(moe_layers, 0);
    }
    std::filesystem::remove_all(dir);
  }
}

// An FP8 checkpoint's dense projections reach the GPU as stored, bytes and block scales (the
// models above then test the FP8 products against the CPU): every one at DeepSeek-V3's attention
// dims; at the tiny dims all but W_UK and W_UV, whose 16-row heads cut the 128-row blocks, and the
// shared expert's gate/up, whose 32 gate rows would leave up's rows mid-block (bf16 of the same
// values); the dense MLP's 128 gate rows end on a block edge.
TEST_F(CudaForwardTest, Fp8ProjectionsStayFp8OnTheGpu) {
  for (const std::string name : {"tiny-kimi-fp8", "dense-v3-attention-dims-fp8"}) {
    SCOPED_TRACE(name);
    std::optional<Model> model;
    for (const Model& m : Models()) {
      if (m.name == name) model = m;
    }
    ASSERT_TRUE(model.has_value());
    const std::string dir = WriteModel(*model);
    auto config = ModelConfig::FromFile(dir + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    auto plan = ShardingPlan::Make(*config, 0, 1, ExpertSharding::kSplitInside);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto weights = ModelWeights::Load(dir, *config, *plan);
    ASSERT_TRUE(weights.ok()) << weights.status();
    auto device = UploadWeights(**weights);
    ASSERT_TRUE(device.ok()) << device.status();
    const bool absorbed_fp8 = name != "tiny-kimi-fp8";
    for (const DeviceLayerWeights& layer : device->layers) {
      const DeviceAttentionWeights& a = layer.attention;
      for (const DeviceProjection* w :
           {&a.q_a_proj, &a.q_proj, &a.kv_a_proj, &a.kv_b_proj, &a.o_proj, &layer.dense.gate_up,
            &layer.dense.down, &layer.moe.shared.down}) {
        if (w->elements() == 0) continue;  // dense or MoE: the other's
        EXPECT_TRUE(w->is_fp8());
        EXPECT_EQ(w->bf16.size(), 0);
      }
      if (layer.is_moe) {
        EXPECT_FALSE(layer.moe.shared.gate_up.is_fp8());  // tiny-kimi's 32 rows of gate
      }
      EXPECT_EQ(a.w_uk_t.is_fp8(), absorbed_fp8);
      EXPECT_EQ(a.w_uv.is_fp8(), absorbed_fp8);
      const int64_t heads = plan->heads.size(), lora = config->kv_lora_rank;
      EXPECT_EQ(a.w_uk_t.elements(), heads * lora * config->qk_nope_head_dim);
      EXPECT_EQ(a.o_proj.fp8_scales.size(),
                kernels::cuda::Fp8ScaleCount(config->hidden_size, heads * config->v_head_dim));
    }
    std::filesystem::remove_all(dir);
  }
}

TEST(CudaForwardWithoutGpuTest, RefusesWithAFailedPrecondition) {
  EXPECT_EQ(CudaForwardOptions{.device_ordinal = -1}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  // On a GPU machine only the options check applies (and scripts/gpu-check.sh counts a skip
  // there as a failure).
  if (kernels::cuda::QueryDevice(0).ok()) return;
  const std::string dir = WriteModel(Models().back());
  SoloCommunicator solo;
  ModelRunnerOptions options;
  options.forward_factory = [](const ModelWeights& w, const KvCacheOptions& c, Communicator* k) {
    return MakeCudaForward(w, c, k, {});
  };
  const auto runner = ModelRunner::Create(dir, options, &solo);
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kFailedPrecondition) << runner.status();
}

}  // namespace
}  // namespace treeverify::worker
