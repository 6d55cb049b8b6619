// One tensor-parallel rank of Kimi-K2 under TP8, verifying a draft tree: the whole GPU forward
// (CudaForward, CUDA graph replay) on random bf16 weights, phase by phase against the bytes each
// phase must move (step_accounting.h), on one GPU.
//
// Shapes of one TP8 rank: hidden 7168, 64 heads -> 8, q_lora 1536, kv_lora 512, rope 64, nope 128,
// v 128, 384 experts top-8 with moe_intermediate 2048 (256 columns each under split inside; 48
// whole experts under whole experts), one shared expert, vocabulary 163840 -> 20480. Every bench
// layer is an MoE layer (Kimi-K2's first layer is dense; per-layer figures extrapolate to 61 on
// paper). As many layers as fit in memory unless --layers says. Batch 1: one sequence with a
// committed context and a tree (binary, node i under (i - 1) / 2) of new nodes. The all-reduces
// are not run (one GPU): their phase is empty here, and the figures are the rank's own work.
//
// With --prefill, time to first token instead: each prompt length in chunks of --prefill-chunk
// rows (the prefill path, the MHA form), the sum of the chunks' steps against the FLOPs they
// must do at the tensor-core rate measured here (a large cuBLASLt GEMM): prefill is compute
// bound, so its floor is FLOPs, not bytes.
//
//   rank_step_bench [--layers N] [--contexts 4096,46080,131072] [--trees 1,9,16,64]
//                   [--sharding split,whole] [--iters 20] [--json FILE]
//                   [--prefill 4096,46080 [--prefill-chunk 8192]] [--dense resident|cublas]
//                   [--shared-experts 1] [--sequences 1] [--experts bf16|int4|fp8]
//                   [--first-dense 0] [--accepted 3]
//
// --experts int4 makes the routed experts INT4 as Kimi-K2-Thinking ships them (groups of 32,
// bf16 scales; streamed quantized: moe_int4_tiles.h), so all 61 layers of a rank fit on one H200
// (--layers 61 --first-dense 1: Kimi-K2's depth with its dense first layer); --experts fp8 makes
// the weights FP8 as DeepSeek-V3 ships them (128 x 128 blocks): the experts (moe_fp8_tiles.h) and
// the dense projections (block_fp8.h); norms, router, embedding and LM head stay bf16.
// Each row reports tokens per second at --accepted tokens a step (at most the tree's depth plus
// one; one without a tree).
//
// --sequences N verifies N sequences a step, each with the context and the tree (the batch's
// sequences padded to a bucket, cuda_forward.h: 3 run as 4 with one padding sequence).
// --shared-experts 0 takes the shared expert (and the side stream it runs on) out of the model:
// what the routed experts' phase costs on its own (bench/NOTES.md, step 125).
//
// Each sharding of a list runs in a process of its own (this program again, its rows merged into
// one JSON): a second worker in one process, after the first's gigabytes were freed, measured the
// copy bandwidth 10 % low in about half the runs, and its MoE phase ran 8 us a layer slower when
// only the order of its start-up allocations changed (bench/NOTES.md, step 128). A deployed
// worker is the first in its process. (A CUPTI trace, TREEVERIFY_TRACE, is each child's own: trace
// one sharding at a time, or the last child's trace replaces the first's.)
#include <cuda_runtime_api.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "treeverify/kernels/cuda/device.h"
#include "treeverify/kernels/cuda/device_fill.h"
#include "treeverify/kernels/cuda/gemm.h"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/cuda_forward.h"
#include "treeverify/worker/cuda_kv_storage.h"
#include "treeverify/worker/device_weights.h"
#include "treeverify/worker/segment_tree.h"
#include "treeverify/worker/sharding_plan.h"

namespace treeverify::worker {
namespace {

struct Args {
  int layers = 0;  // 0: as many as fit
  std::vector<int64_t> contexts = {4096, 46080, 131072};
  std::vector<int64_t> trees = {1, 9, 16, 64};
  std::vector<ExpertSharding> shardings = {ExpertSharding::kSplitInside,
                                           ExpertSharding::kWholeExperts};
  int iters = 20;
  std::string json;
  std::vector<int64_t> prefill;  // prompt lengths; empty: verify steps
  int64_t prefill_chunk = kMaxChainRows;
  bool resident_products = true;  // --dense cublas: every dense product through cuBLASLt
  int shared_experts = 1;         // Kimi-K2's; 0 for the routed experts alone
  int sequences = 1;              // a step's sequences, each with the context and the tree
  std::string experts = "bf16";   // --experts int4 / fp8: the routed experts quantized
  int first_dense = 0;            // --first-dense 1: Kimi-K2's dense first layer
  double accepted = 3.0;          // tokens a tree step emits, for the tokens-per-second figure
};

ModelConfig KimiK2(int layers) {
  ModelConfig c;
  c.architecture = Architecture::kDeepseekV3;
  c.model_type = "kimi_k2";
  c.vocab_size = 163840;
  c.hidden_size = 7168;
  c.intermediate_size = 18432;
  c.moe_intermediate_size = 2048;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 64;
  c.max_position_embeddings = 131072;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.n_routed_experts = 384;
  c.num_experts_per_tok = 8;
  c.n_shared_experts = 1;
  c.n_group = 1;
  c.topk_group = 1;
  c.topk_method = kernels::MoeTopkMethod::kNoauxTc;
  c.scoring_func = kernels::MoeScoring::kSigmoid;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.827;
  c.first_k_dense_replace = 0;  // every bench layer is MoE (see the header)
  c.moe_layer_freq = 1;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 50000.0;
  c.yarn = YarnScaling{.factor = 32.0,
                       .original_max_position_embeddings = 4096,
                       .beta_fast = 1.0,
                       .beta_slow = 1.0,
                       .mscale = 1.0,
                       .mscale_all_dim = 1.0};
  return c;
}

constexpr int32_t kPageSize = 64;

// Bytes of one layer's weights and KV at the longest context: what decides how many fit.
int64_t LayerBytes(const ModelConfig& c, const ShardingPlan& plan, int64_t max_keys,
                   const std::string& expert_format) {
  const int64_t h = c.hidden_size, heads = plan.heads.size();
  const int64_t attention = *c.q_lora_rank * h + heads * c.qk_head_dim() * *c.q_lora_rank +
                            c.kv_row_dim() * h + heads * c.kv_lora_rank * 256 +
                            h * heads * c.v_head_dim;
  const int64_t experts = plan.experts.size() * 3 * h * plan.expert_intermediate.size();
  const int64_t shared = 3 * h * plan.shared_intermediate.size();
  // INT4 records: half a byte and a bf16 scale per 32 weights; FP8: a byte (and a scale per 16k).
  const int64_t expert_bytes = expert_format == "int4"  ? experts / 2 + experts / 16
                               : expert_format == "fp8" ? experts + experts / 1024
                                                        : 2 * experts;
  const int64_t projection_bytes = (expert_format == "fp8" ? 1 : 2) * (attention + shared);
  return projection_bytes + 2 * c.n_routed_experts * h + expert_bytes +
         max_keys * c.kv_row_dim() * 2;
}

// Tokens a step emits: one without a tree, else the stated acceptance length, at most the
// tree's depth (a binary tree of n nodes has floor(log2 n) + 1 levels) plus the bonus token.
double TokensPerStep(int64_t nodes, double accepted) {
  if (nodes <= 1) return 1.0;
  const double levels = std::floor(std::log2(static_cast<double>(nodes))) + 1.0;
  return std::min(accepted, levels + 1.0);
}

// `sequences` sequences, each with `context` committed keys and a binary tree of `nodes` new
// ones; sequence s on pages s * P .. s * P + P - 1 in order (P: the pages one needs).
BatchInputs MakeBatch(int64_t context, int64_t nodes, int sequences, const ModelConfig& config) {
  const int32_t vocab = static_cast<int32_t>(config.vocab_size);
  BatchInputs b;
  std::vector<int32_t> parents(nodes);
  for (int64_t i = 0; i < nodes; ++i) parents[i] = i == 0 ? -1 : static_cast<int32_t>((i - 1) / 2);
  const SegmentTree tree = *SegmentTree::Build(parents);
  b.max_pages = static_cast<int32_t>((context + nodes + kPageSize - 1) / kPageSize);
  b.row_offsets = {0};
  for (int s = 0; s < sequences; ++s) {
    const int64_t first_slot = int64_t{s} * b.max_pages * kPageSize;
    for (int64_t i = 0; i < nodes; ++i) {
      b.token_ids.push_back(static_cast<int32_t>((i * 7919 + 13 + s) % vocab));
      b.positions.push_back(static_cast<int32_t>(context + tree.depth[i]));
      b.sample_positions.push_back(context + tree.depth[i] + 1);
      b.slots.push_back(first_slot + context + i);
    }
    b.ancestor_mask.insert(b.ancestor_mask.end(), tree.ancestor_mask.begin(),
                           tree.ancestor_mask.end());
    b.row_offsets.push_back(static_cast<int32_t>((s + 1) * nodes));
    b.committed_lengths.push_back(static_cast<int32_t>(context));
    for (int32_t p = 0; p < b.max_pages; ++p) b.page_table.push_back(s * b.max_pages + p);
    b.sampling.push_back(SegmentSampling{});
    b.chain.push_back(SegmentTree::IsChain(parents));
    b.continues_chain.push_back(false);
  }
  b.capture_layer.assign(config.num_hidden_layers + 1, false);
  return b;
}

// `rows` new rows of one chain after `committed` keys, as ModelRunner batches a prefill chunk:
// pieces of at most kMaxSegmentRows rows (forward_backend.h).
BatchInputs MakeChainBatch(int64_t committed, int64_t rows, const ModelConfig& config) {
  const int32_t vocab = static_cast<int32_t>(config.vocab_size);
  BatchInputs b;
  for (int64_t i = 0; i < rows; ++i) {
    b.token_ids.push_back(static_cast<int32_t>((i * 7919 + 13) % vocab));
    b.positions.push_back(static_cast<int32_t>(committed + i));
    b.sample_positions.push_back(committed + i + 1);
    b.slots.push_back(committed + i);
  }
  for (int64_t first = 0; first < rows; first += kernels::kMaxSegmentRows) {
    const int32_t n =
        static_cast<int32_t>(std::min<int64_t>(kernels::kMaxSegmentRows, rows - first));
    const std::vector<uint64_t> mask = SegmentTree::ChainMask(n);
    b.ancestor_mask.insert(b.ancestor_mask.end(), mask.begin(), mask.end());
    b.row_offsets.push_back(static_cast<int32_t>(first + n));
    b.committed_lengths.push_back(static_cast<int32_t>(committed + first));
    b.sampling.push_back(SegmentSampling{});
    b.chain.push_back(true);
    b.continues_chain.push_back(first > 0);
  }
  const int32_t pages = static_cast<int32_t>((committed + rows + kPageSize - 1) / kPageSize);
  b.max_pages = pages;
  for (int32_t s = 0; s < b.sequences(); ++s) {
    for (int32_t p = 0; p < pages; ++p) b.page_table.push_back(p);
  }
  b.capture_layer.assign(config.num_hidden_layers + 1, false);
  return b;
}

// FLOPs a prefill chunk must do, by phase (2 per multiply-add; the routed experts at their
// expected share: top-k experts of this rank's columns, whichever the sharding).
struct ChunkFlops {
  double attention = 0, moe = 0, lm_head = 0;
  double total() const { return attention + moe + lm_head; }
};
ChunkFlops FlopsOf(const ModelConfig& c, const ShardingPlan& plan, int64_t committed,
                   int64_t rows) {
  const double h = static_cast<double>(c.hidden_size), heads = plan.heads.size();
  const double q_lora = static_cast<double>(*c.q_lora_rank), lora = c.kv_lora_rank;
  const double qk = c.qk_head_dim(), v = c.v_head_dim, nope = c.qk_nope_head_dim;
  const double keys = committed + rows;
  const double padded_keys = std::ceil(keys / 256) * 256;
  const double visible = rows * static_cast<double>(committed) + rows * (rows + 1.0) / 2;
  ChunkFlops f;
  f.attention =
      c.num_hidden_layers *
      (2 * rows * (h * q_lora + q_lora * heads * qk + h * c.kv_row_dim() + heads * v * h) +
       2 * padded_keys * lora * heads * (nope + v) + 2 * visible * heads * (qk + v));
  // Per token: top-k experts, each local with probability local / all, of the local columns.
  const double expert_columns = static_cast<double>(c.num_experts_per_tok) * plan.experts.size() /
                                c.n_routed_experts * plan.expert_intermediate.size();
  f.moe = c.num_hidden_layers * 2 * rows *
          (h * c.n_routed_experts + 3 * h * expert_columns +
           3 * h * static_cast<double>(plan.shared_intermediate.size()));
  f.lm_head = 2 * rows * h * static_cast<double>(plan.vocab.size());
  return f;
}

// The dense bf16 tensor-core rate cuBLASLt reaches on this device: an 8192^3 GEMM, median of 10.
absl::StatusOr<double> MeasureTensorRate(cudaStream_t stream) {
  constexpr int64_t n = 8192;
  TV_ASSIGN_OR_RETURN(auto gemm, kernels::cuda::GemmRunner::Create());
  TV_ASSIGN_OR_RETURN(auto a, DeviceArray<Bf16>::Allocate(n * n));
  TV_ASSIGN_OR_RETURN(auto b, DeviceArray<Bf16>::Allocate(n * n));
  TV_ASSIGN_OR_RETURN(auto y, DeviceArray<Bf16>::Allocate(n * n));
  TV_RETURN_IF_ERROR(kernels::cuda::FillUniform(a.get(), n * n, 1.0f, 1, stream));
  TV_RETURN_IF_ERROR(kernels::cuda::FillUniform(b.get(), n * n, 1.0f, 2, stream));
  cudaEvent_t start, stop;
  TV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  TV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  std::vector<double> rates;
  for (int i = 0; i < 13; ++i) {
    TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    TV_RETURN_IF_ERROR(
        gemm->Run({.x = a.get(), .weight = b.get(), .y = y.get(), .m = n, .n = n, .k = n}, stream));
    TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    TV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0;
    TV_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) rates.push_back(2.0 * n * n * n / (ms * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// The --sharding spelling of a sharding.
const char* ShardingName(ExpertSharding sharding) {
  return sharding == ExpertSharding::kSplitInside ? "split" : "whole";
}

// Time to first token of each prompt length: its chunks' steps in order (twice: the first pass
// warms plans and buffers), the sum of the second pass's against the FLOP floor.
absl::Status RunPrefill(const Args& args, const ModelConfig& config, const ShardingPlan& plan,
                        const char* sharding_name, CudaForward& forward, cudaStream_t stream,
                        nlohmann::json& results) {
  TV_ASSIGN_OR_RETURN(const double rate, MeasureTensorRate(stream));
  std::printf("tensor-core rate (cuBLASLt bf16 8192^3): %.0f TFLOP/s\n", rate / 1e12);
  const int layers = static_cast<int>(config.num_hidden_layers);
  for (int64_t prompt : args.prefill) {
    double wall = 0;
    std::array<double, kStepPhases> phase_seconds{};
    ChunkFlops flops;
    for (int pass = 0; pass < 2; ++pass) {
      wall = 0;
      phase_seconds = {};
      flops = {};
      for (int64_t committed = 0; committed < prompt; committed += args.prefill_chunk) {
        const int64_t rows = std::min(args.prefill_chunk, prompt - committed);
        const BatchInputs batch = MakeChainBatch(committed, rows, config);
        ForwardOutputs outputs;
        const auto start = std::chrono::steady_clock::now();
        TV_RETURN_IF_ERROR(forward.Run(batch, outputs));
        wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const StepAccount account = *forward.last_step_account();
        if (rows > kernels::kMaxSegmentRows && !account.prefill) {
          return absl::InternalError(
              absl::StrCat("chunk at ", committed, " missed the prefill path"));
        }
        for (int p = 0; p < kStepPhases; ++p) {
          phase_seconds[p] += account.phase(static_cast<StepPhase>(p)).seconds;
        }
        const ChunkFlops chunk = FlopsOf(config, plan, committed, rows);
        flops.attention += chunk.attention;
        flops.moe += chunk.moe;
        flops.lm_head += chunk.lm_head;
      }
    }
    double gpu = 0;
    for (double seconds : phase_seconds) gpu += seconds;
    const auto phase = [&](StepPhase p) { return phase_seconds[static_cast<int>(p)]; };
    nlohmann::json row = {
        {"sharding", sharding_name},    {"layers", layers},      {"prompt", prompt},
        {"chunk", args.prefill_chunk},  {"ttft_ms", wall * 1e3}, {"gpu_ms", gpu * 1e3},
        {"tensor_tflop_s", rate / 1e12}};
    std::string line = absl::StrCat(sharding_name, " prefill ", prompt, " in chunks of ",
                                    args.prefill_chunk, ": ttft ", static_cast<int>(wall * 1e3),
                                    " ms (gpu ", static_cast<int>(gpu * 1e3), " ms)");
    for (const auto& [name, p, f] :
         {std::tuple{"attention", StepPhase::kAttention, flops.attention},
          std::tuple{"moe", StepPhase::kMoe, flops.moe},
          std::tuple{"lm_head", StepPhase::kLmHead, flops.lm_head}}) {
      const double floor = f / rate;
      row["phases"][name] = {{"ms", phase(p) * 1e3},
                             {"tflop", f / 1e12},
                             {"floor_ms", floor * 1e3},
                             {"compute_utilization", floor / phase(p)}};
      absl::StrAppend(&line, " ", name, " ", static_cast<int>(phase(p) * 1e3), "ms/",
                      static_cast<int>(floor * 1e3), "ms(",
                      static_cast<int>(100 * floor / phase(p)), "%)");
    }
    const double floor = flops.total() / rate;
    row["total"] = {{"tflop", flops.total() / 1e12},
                    {"floor_ms", floor * 1e3},
                    {"compute_utilization", floor / gpu},
                    {"per_layer_ms", (gpu - phase(StepPhase::kLmHead)) * 1e3 / layers}};
    absl::StrAppend(&line, " | floor ", static_cast<int>(floor * 1e3), " ms (",
                    static_cast<int>(100 * floor / gpu), "% of the gpu time), per layer ",
                    (gpu - phase(StepPhase::kLmHead)) * 1e3 / layers, " ms");
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    results["prefill"].push_back(row);
  }
  return absl::OkStatus();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

absl::Status RunSharding(const Args& args, ExpertSharding sharding,
                         const kernels::cuda::DeviceInfo& device, nlohmann::json& results) {
  // Every sequence's keys (each on whole pages of its own).
  const int64_t max_keys =
      args.prefill.empty()
          ? args.sequences *
                ((*std::max_element(args.contexts.begin(), args.contexts.end()) +
                  *std::max_element(args.trees.begin(), args.trees.end()) + kPageSize - 1) /
                 kPageSize * kPageSize)
          : *std::max_element(args.prefill.begin(), args.prefill.end());
  ModelConfig config = KimiK2(1);
  config.n_shared_experts = args.shared_experts;
  if (args.experts == "int4") {
    config.quantization = {.method = WeightQuantization::Method::kInt4Group, .group_size = 32};
  } else if (args.experts == "fp8") {
    config.quantization = {.method = WeightQuantization::Method::kFp8Block};
  }
  TV_ASSIGN_OR_RETURN(ShardingPlan plan, ShardingPlan::Make(config, 0, 8, sharding));
  int layers = args.layers;
  if (layers == 0) {
    size_t free_bytes = 0, total_bytes = 0;
    TV_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    // Leave room for the embedding, the LM head, activations and workspaces.
    const int64_t spare = int64_t{6} << 30;
    layers = static_cast<int>((static_cast<int64_t>(free_bytes) - spare) /
                              LayerBytes(config, plan, max_keys, args.experts));
  }
  config.num_hidden_layers = layers;
  config.first_k_dense_replace = std::min(args.first_dense, layers);
  config.n_routed_experts = 384;
  TV_ASSIGN_OR_RETURN(plan, ShardingPlan::Make(config, 0, 8, sharding));
  const char* sharding_name = ShardingName(sharding);
  std::printf("sharding %s: %d layers (%d dense), %lld local experts x %lld columns, %s experts\n",
              sharding_name, layers, static_cast<int>(config.first_k_dense_replace),
              static_cast<long long>(plan.experts.size()),
              static_cast<long long>(plan.expert_intermediate.size()), args.experts.c_str());
  std::fflush(stdout);

  TV_ASSIGN_OR_RETURN(DeviceWeights weights, RandomDeviceWeights(config, plan, 2026));
  cudaStream_t stream;
  TV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const KvCacheOptions cache{.num_pages = (max_keys + kPageSize - 1) / kPageSize + 1,
                             .page_size = kPageSize,
                             .num_layers = layers,
                             .row_dim = config.kv_row_dim()};
  TV_ASSIGN_OR_RETURN(std::unique_ptr<CudaKvStorage> kv, CudaKvStorage::Create(cache, stream));
  TV_RETURN_IF_ERROR(kernels::cuda::FillUniform(
      kv->layer_data(0), layers * cache.num_slots() * cache.row_dim, 1.0f, 7, stream));
  SoloCommunicator solo;
  TV_ASSIGN_OR_RETURN(
      std::unique_ptr<CudaForward> forward,
      CudaForward::Create(std::move(weights), *kv, &solo, device, stream,
                          {.account_steps = true, .resident_products = args.resident_products}));

  if (!args.prefill.empty()) {
    TV_RETURN_IF_ERROR(RunPrefill(args, config, plan, sharding_name, *forward, stream, results));
  }
  for (int64_t context : args.contexts) {
    for (int64_t nodes : args.trees) {
      if (!args.prefill.empty()) break;
      const BatchInputs batch = MakeBatch(context, nodes, args.sequences, config);
      // The previous step's accepted path, as a commit moves it: nodes 1 and 3 onto positions 1
      // and 2 (the rows are the bench's, the moves a commit's).
      std::vector<int64_t> src, dst;
      if (nodes >= 4) {
        src = {context + 1, context + 3};
        dst = {context + 1, context + 2};
      }
      std::vector<StepAccount> accounts;
      std::vector<double> wall;
      for (int it = 0; it < args.iters + 3; ++it) {
        if (!src.empty()) TV_RETURN_IF_ERROR(kv->MoveRows(src, dst));
        ForwardOutputs outputs;
        const auto start = std::chrono::steady_clock::now();
        TV_RETURN_IF_ERROR(forward->Run(batch, outputs));
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (it < 3) continue;  // warm-up: plans, algorithms, caches
        accounts.push_back(*forward->last_step_account());
        wall.push_back(seconds);
      }
      nlohmann::json row = {{"sharding", sharding_name},
                            {"layers", layers},
                            {"dense_layers", config.first_k_dense_replace},
                            {"experts", args.experts},
                            {"context", context},
                            {"tree", nodes},
                            {"sequences", args.sequences},
                            {"wall_ms", Median(wall) * 1e3}};
      const double copy = accounts[0].copy_bytes_per_second;
      row["copy_tb_s"] = copy / 1e12;
      std::vector<double> active;
      for (const StepAccount& a : accounts) {
        double sum = 0;
        for (int32_t n : a.active_experts) sum += n;
        active.push_back(sum / layers);
      }
      row["active_experts_per_layer"] = Median(active);
      std::string line = absl::StrCat(
          sharding_name, " ctx ", context, " tree ", nodes,
          args.sequences > 1 ? absl::StrCat(" x ", args.sequences, " sequences") : "", ":");
      for (int p = 0; p < kStepPhases; ++p) {
        const StepPhase phase = static_cast<StepPhase>(p);
        std::vector<double> times;
        for (const StepAccount& a : accounts) times.push_back(a.phase(phase).seconds);
        const double seconds = Median(times);
        const double bytes = accounts.back().phase(phase).modeled_bytes;
        const double floor = bytes / copy;
        row["phases"][StepPhaseName(phase)] = {
            {"us", seconds * 1e6},
            {"bytes", bytes},
            {"floor_us", floor * 1e6},
            {"tb_s", seconds > 0 ? bytes / seconds / 1e12 : 0.0},
            {"dram_utilization", seconds > 0 ? floor / seconds : 0.0}};
        if (seconds > 0) {
          absl::StrAppend(&line, " ", StepPhaseName(phase), " ", static_cast<int>(seconds * 1e6),
                          "us/", static_cast<int>(floor * 1e6), "us(",
                          static_cast<int>(100 * floor / seconds), "%)");
        }
      }
      std::vector<double> totals;
      for (const StepAccount& a : accounts) totals.push_back(a.total_seconds);
      const double total = Median(totals);
      const double total_floor = accounts.back().total_bytes() / copy;
      const double tokens = TokensPerStep(nodes, args.accepted) * args.sequences;
      row["total"] = {{"us", total * 1e6},
                      {"bytes", accounts.back().total_bytes()},
                      {"floor_us", total_floor * 1e6},
                      {"dram_utilization", total_floor / total},
                      {"per_layer_us", total * 1e6 / layers},
                      {"tokens_per_step", tokens},
                      {"tokens_per_second", tokens / total}};
      absl::StrAppend(&line, " | total ", static_cast<int>(total * 1e6), "us/",
                      static_cast<int>(total_floor * 1e6), "us (",
                      static_cast<int>(100 * total_floor / total), "%), wall ",
                      static_cast<int>(Median(wall) * 1e6), "us, active ",
                      static_cast<int>(Median(active)), ", ", static_cast<int>(tokens / total),
                      " tok/s at ", tokens, " a step");
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      results["rows"].push_back(row);
    }
  }
  forward.reset();
  kv.reset();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> ParseList(const std::string& text) {
  std::vector<int64_t> values;
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(piece, &value) || value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("not a positive integer list: ", text));
    }
    values.push_back(value);
  }
  return values;
}

// Runs this program once per sharding (each with its own --sharding and a temporary --json, the
// other flags as given) and appends the rows each wrote to `results`.
absl::Status RunShardingsApart(int argc, char** argv, const std::vector<ExpertSharding>& shardings,
                               nlohmann::json& results) {
  for (const ExpertSharding each : shardings) {
    const std::string sharding = ShardingName(each);
    char path[] = "/tmp/rank_step_bench.XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) return absl::InternalError("rank_step_bench: mkstemp failed");
    close(fd);
    std::vector<std::string> args = {argv[0]};
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag == "--sharding" || flag == "--json") continue;
      args.insert(args.end(), {flag, argv[i + 1]});
    }
    args.insert(args.end(), {"--sharding", sharding, "--json", path});
    std::vector<char*> child_argv;
    for (std::string& a : args) child_argv.push_back(a.data());
    child_argv.push_back(nullptr);
    std::fflush(stdout);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, child_argv.data(), environ) != 0) {
      unlink(path);
      return absl::InternalError("rank_step_bench: could not start a child for " + sharding);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    std::ifstream in(path);
    nlohmann::json child = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    unlink(path);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || child.is_discarded()) {
      return absl::InternalError(absl::StrCat("rank_step_bench: the ", sharding, " run failed"));
    }
    results["device"] = child["device"];
    for (auto& row : child["rows"]) results["rows"].push_back(row);
  }
  return absl::OkStatus();
}

absl::Status Main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
    const std::string value = argv[++i];
    if (flag == "--layers") {
      if (!absl::SimpleAtoi(value, &args.layers)) return absl::InvalidArgumentError(value);
    } else if (flag == "--contexts") {
      TV_ASSIGN_OR_RETURN(args.contexts, ParseList(value));
    } else if (flag == "--trees") {
      TV_ASSIGN_OR_RETURN(args.trees, ParseList(value));
    } else if (flag == "--iters") {
      if (!absl::SimpleAtoi(value, &args.iters)) return absl::InvalidArgumentError(value);
    } else if (flag == "--prefill") {
      TV_ASSIGN_OR_RETURN(args.prefill, ParseList(value));
    } else if (flag == "--prefill-chunk") {
      if (!absl::SimpleAtoi(value, &args.prefill_chunk) || args.prefill_chunk < 1 ||
          args.prefill_chunk > kMaxChainRows) {
        return absl::InvalidArgumentError(
            absl::StrCat("--prefill-chunk must be in 1..", kMaxChainRows, ", got ", value));
      }
    } else if (flag == "--json") {
      args.json = value;
    } else if (flag == "--dense") {
      if (value != "resident" && value != "cublas") {
        return absl::InvalidArgumentError(absl::StrCat("--dense resident or cublas; got ", value));
      }
      args.resident_products = value == "resident";
    } else if (flag == "--sequences") {
      if (!absl::SimpleAtoi(value, &args.sequences) || args.sequences < 1 || args.sequences > 64) {
        return absl::InvalidArgumentError(absl::StrCat("--sequences 1..64; got ", value));
      }
    } else if (flag == "--shared-experts") {
      if (!absl::SimpleAtoi(value, &args.shared_experts) || args.shared_experts < 0) {
        return absl::InvalidArgumentError(absl::StrCat("--shared-experts 0, 1, ...; got ", value));
      }
    } else if (flag == "--experts") {
      if (value != "bf16" && value != "int4" && value != "fp8") {
        return absl::InvalidArgumentError(absl::StrCat("--experts bf16, int4 or fp8; got ", value));
      }
      args.experts = value;
    } else if (flag == "--first-dense") {
      if (!absl::SimpleAtoi(value, &args.first_dense) || args.first_dense < 0) {
        return absl::InvalidArgumentError(absl::StrCat("--first-dense 0, 1, ...; got ", value));
      }
    } else if (flag == "--accepted") {
      if (!absl::SimpleAtod(value, &args.accepted) || args.accepted < 1.0) {
        return absl::InvalidArgumentError(absl::StrCat("--accepted >= 1; got ", value));
      }
    } else if (flag == "--sharding") {
      args.shardings.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        if (s == "split") {
          args.shardings.push_back(ExpertSharding::kSplitInside);
        } else if (s == "whole") {
          args.shardings.push_back(ExpertSharding::kWholeExperts);
        } else {
          return absl::InvalidArgumentError(absl::StrCat("--sharding split,whole; got ", value));
        }
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag));
    }
  }
  nlohmann::json results = {{"device", ""}, {"rows", nlohmann::json::array()}};
  if (args.shardings.size() > 1) {  // before this process touches the GPU
    TV_RETURN_IF_ERROR(RunShardingsApart(argc, argv, args.shardings, results));
  } else {
    TV_ASSIGN_OR_RETURN(kernels::cuda::DeviceInfo device, kernels::cuda::QueryDevice(0));
    std::printf("device: %s, %d SMs\n", device.name.c_str(), device.multiprocessors);
    results["device"] = device.name;
    for (ExpertSharding sharding : args.shardings) {
      TV_RETURN_IF_ERROR(RunSharding(args, sharding, device, results));
    }
  }
  if (!args.json.empty()) std::ofstream(args.json) << results.dump(1) << "\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace treeverify::worker

int main(int argc, char** argv) {
  const absl::Status status = treeverify::worker::Main(argc, argv);
  if (!status.ok()) {
    std::fprintf(stderr, "rank_step_bench: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
