// One CPU verify step: a 16-node draft tree (the pending token as root + 15 drafts) over a
// 1024-token committed prefix, on the demo model (scripts/demo.sh), TP = 1.
//
// Printed next to the time: the floor it is held against, measured in the same run. The floor
// is max(bytes / measured copy bandwidth, FLOPs / measured GEMM rate), where bytes = every weight
// of the model (fp32 on the CPU backend; at 16 rows nearly every expert is touched) + the latent
// KV prefix read once per layer, and FLOPs = 2 * weights * rows + the attention's
// 2 * 2 * rows * heads * keys * (kv_lora + rope). ratio = floor / time (1.0 = at the floor).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "treeverify/kernels/gemm.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/local_model.h"

namespace treeverify {
namespace {

constexpr int kPrefix = 1024;
constexpr int kTreeNodes = 16;

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Copy bandwidth (bytes read + written per second) over a buffer far larger than the caches.
double MeasureCopyBandwidth() {
  const size_t bytes = size_t{256} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 0.0;
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
    best = std::max(best, 2.0 * bytes / Seconds(std::chrono::steady_clock::now() - start));
  }
  return best;
}

// Our batch-invariant GEMM's rate on a compute-bound shape, FLOP/s.
double MeasureGemmRate() {
  const int m = 192, n = 1024, k = 1024;
  std::vector<float> x(size_t(m) * k, 0.5f), w(size_t(n) * k, 0.25f), y(size_t(m) * n);
  double best = 0.0;
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    (void)kernels::cpu::Gemm(
        {.x = x.data(), .weight = w.data(), .y = y.data(), .m = m, .n = n, .k = k});
    best = std::max(best, 2.0 * m * n * k / Seconds(std::chrono::steady_clock::now() - start));
  }
  return best;
}

int64_t WeightCount(const worker::ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t heads = c.num_attention_heads;
  int64_t attention = c.kv_row_dim() * h +
                      heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank +
                      h * heads * c.v_head_dim;
  attention += c.q_lora_rank ? *c.q_lora_rank * h + heads * c.qk_head_dim() * *c.q_lora_rank
                             : heads * c.qk_head_dim() * h;
  int64_t total = 2 * c.vocab_size * h;  // embedding + LM head
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    total += attention;
    if (c.is_moe_layer(l)) {
      total += c.n_routed_experts * h +
               3 * h * c.moe_intermediate_size * (c.n_routed_experts + c.n_shared_experts);
    } else {
      total += 3 * h * c.intermediate_size;
    }
  }
  return total;
}

void BM_CpuVerifyStep(benchmark::State& state) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / "treeverify-bench-demo").string();
  auto spec = tools::PresetSpec("demo");
  if (!spec.ok() || !tools::WriteCheckpoint(dir, *spec).ok()) {
    state.SkipWithError("could not write the demo checkpoint");
    return;
  }
  auto model = tools::LocalModel::Create(dir, {});
  if (!model.ok()) {
    state.SkipWithError(std::string(model.status().message()).c_str());
    return;
  }
  const worker::ModelConfig& c = (*model)->config();
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
  std::vector<int32_t> prefix(kPrefix);
  for (int32_t& t : prefix) t = token(rng);
  if (!(*model)->Prefill(1, prefix).ok()) {
    state.SkipWithError("prefill failed");
    return;
  }
  // A typical draft tree: the root, 3 children, then branches of decreasing width.
  worker::ForwardRequest request;
  worker::SegmentInput tree{.sequence_id = 1,
                            .parents = {-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 10, 12}};
  for (int i = 0; i < kTreeNodes; ++i) tree.token_ids.push_back(token(rng));
  request.segments.push_back(tree);

  std::vector<double> step_seconds;
  for (auto _ : state) {
    // The segment is never committed, so every iteration verifies the same tree.
    const auto start = std::chrono::steady_clock::now();
    auto result = (*model)->Forward(request);
    step_seconds.push_back(Seconds(std::chrono::steady_clock::now() - start));
    if (!result.ok() || !(*result)[0].status.ok()) {
      state.SkipWithError("forward failed");
      return;
    }
    benchmark::DoNotOptimize(result);
  }
  std::sort(step_seconds.begin(), step_seconds.end());
  const double median = step_seconds[step_seconds.size() / 2];

  const double bandwidth = MeasureCopyBandwidth();
  const double gemm_rate = MeasureGemmRate();
  const int64_t keys = kPrefix + kTreeNodes;
  const double bytes = 4.0 * WeightCount(c) + 4.0 * c.num_hidden_layers * keys * c.kv_row_dim();
  const double flops = 2.0 * WeightCount(c) * kTreeNodes + 4.0 * c.num_hidden_layers * kTreeNodes *
                                                               c.num_attention_heads * keys *
                                                               c.kv_row_dim();
  const double floor = std::max(bytes / bandwidth, flops / gemm_rate);
  state.counters["bytes_modeled"] = bytes;
  state.counters["flops_modeled"] = flops;
  state.counters["copy_GBps"] = bandwidth / 1e9;
  state.counters["gemm_GFLOPs"] = gemm_rate / 1e9;
  state.counters["floor_ms"] = floor * 1e3;
  state.counters["median_ms"] = median * 1e3;
  state.counters["floor_over_median"] = floor / median;
}
BENCHMARK(BM_CpuVerifyStep)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace treeverify

BENCHMARK_MAIN();
