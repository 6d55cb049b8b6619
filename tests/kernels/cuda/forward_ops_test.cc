// The forward's small ops and GEMMs on the GPU against the CPU backend (the oracle), on random
// inputs of odd sizes. Inputs are rounded to bf16 on the host first, so the CPU op sees exactly
// the values the GPU reads; the outputs then differ by the output's bf16 rounding (relative
// 2^-8) and fp32 summation order, which the tolerances allow and nothing larger.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_base.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/cuda/activation.h"
#include "treeverify/kernels/cuda/embedding.h"
#include "treeverify/kernels/cuda/gemm.h"
#include "treeverify/kernels/cuda/global_timer.h"
#include "treeverify/kernels/cuda/kv_cache_ops.h"
#include "treeverify/kernels/cuda/lm_head_summary.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/kernels/cuda/moe_fp8_tiles.h"
#include "treeverify/kernels/cuda/moe_int4_tiles.h"
#include "treeverify/kernels/cuda/moe_tiles.h"
#include "treeverify/kernels/cuda/resident_gemm.h"
#include "treeverify/kernels/cuda/rms_norm.h"
#include "treeverify/kernels/cuda/rope.h"

namespace treeverify::kernels::cuda {
namespace {

std::vector<float> Random(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

// Rounds to bf16 and back: the values a bf16 buffer holds.
std::vector<float> RoundToBf16(std::vector<float> values) {
  for (float& v : values) v = __bfloat162float(__float2bfloat16_rn(v));
  return values;
}

std::vector<Bf16> ToBf16(const std::vector<float>& values) {
  std::vector<Bf16> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = __float2bfloat16_rn(values[i]);
  return out;
}

std::vector<float> ToFloat(const std::vector<Bf16>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = __bfloat162float(values[i]);
  return out;
}

// |actual - expected| <= relative * |expected| + absolute, element by element.
void ExpectClose(const std::vector<float>& actual, const std::vector<float>& expected,
                 float relative, float absolute, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_NEAR(actual[i], expected[i], relative * std::abs(expected[i]) + absolute)
        << what << ", element " << i;
  }
}

// bf16 keeps 8 significant bits: a correctly rounded output is within 2^-9 relative; 2^-8 leaves
// room for fp32 summation-order differences before the rounding.
constexpr float kBf16Relative = 1.0f / 256;

// Each token's top_k distinct experts of `experts`, ascending, with weights in [0.1, 1).
void RandomRouting(std::mt19937& rng, int64_t tokens, int32_t experts, int32_t top_k,
                   std::vector<int32_t>& ids, std::vector<float>& weights) {
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(experts);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + top_k);
    ids.insert(ids.end(), all.begin(), all.begin() + top_k);
    for (int32_t j = 0; j < top_k; ++j) {
      weights.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
    }
  }
}

class CudaForwardOpsTest : public CudaTest {};

TEST_F(CudaForwardOpsTest, EmbeddingMatchesTheCpuBackend) {
  const unsigned seed = 501;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t hidden = 733, vocab_begin = 100, vocab_end = 119;
  const std::vector<float> table = RoundToBf16(Random(rng, (vocab_end - vocab_begin) * hidden));
  const std::vector<int32_t> ids = {100, 118, 5, 107, 119, 100, 2000};  // some outside the shard
  std::vector<float> expected(ids.size() * hidden);
  ASSERT_TRUE(cpu::Embedding({.token_ids = ids.data(),
                              .table = table.data(),
                              .out = expected.data(),
                              .tokens = static_cast<int64_t>(ids.size()),
                              .hidden = hidden,
                              .vocab_begin = vocab_begin,
                              .vocab_end = vocab_end})
                  .ok());
  DeviceBuffer<int32_t> d_ids(ids.size());
  DeviceBuffer<Bf16> d_table(table.size());
  DeviceBuffer<float> d_out(expected.size());
  d_ids.CopyFrom(ids);
  d_table.CopyFrom(ToBf16(table));
  ASSERT_TRUE(Embedding({.token_ids = d_ids.get(),
                         .table = d_table.get(),
                         .out = d_out.get(),
                         .tokens = static_cast<int64_t>(ids.size()),
                         .hidden = hidden,
                         .vocab_begin = vocab_begin,
                         .vocab_end = vocab_end},
                        nullptr)
                  .ok());
  EXPECT_EQ(d_out.ToHost(), expected);  // a bf16 value is exact in fp32
}

TEST_F(CudaForwardOpsTest, RmsNormWithResidualAddMatchesTheCpuBackend) {
  const unsigned seed = 502;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int64_t rows : {1, 3, 19}) {
    for (int64_t dim : {7, 512, 1536, 7168}) {
      const std::vector<float> residual = Random(rng, rows * dim, 2.0f);
      const std::vector<float> branch = Random(rng, rows * dim, 0.5f);
      std::vector<float> weight = RoundToBf16(Random(rng, dim, 0.1f));
      for (float& w : weight) w = __bfloat162float(__float2bfloat16_rn(w + 1.0f));
      std::vector<float> sum_expected = residual, normed_expected(rows * dim);
      ASSERT_TRUE(cpu::RmsNorm({.input = residual.data(),
                                .weight = weight.data(),
                                .output = normed_expected.data(),
                                .rows = rows,
                                .dim = dim,
                                .add = branch.data(),
                                .sum = sum_expected.data()})
                      .ok());
      DeviceBuffer<float> d_residual(residual.size()), d_branch(branch.size());
      DeviceBuffer<Bf16> d_weight(dim), d_normed(rows * dim);
      d_residual.CopyFrom(residual);
      d_branch.CopyFrom(branch);
      d_weight.CopyFrom(ToBf16(weight));
      ASSERT_TRUE(RmsNorm({.input = d_residual.get(),
                           .weight = d_weight.get(),
                           .output = d_normed.get(),
                           .rows = rows,
                           .dim = dim,
                           .add = d_branch.get(),
                           .sum = d_residual.get()},
                          nullptr)
                      .ok());
      const std::string what = testing::PrintToString(rows) + " x " + std::to_string(dim);
      // The sum is one fp32 add either side: identical.
      EXPECT_EQ(d_residual.ToHost(), sum_expected) << what;
      ExpectClose(ToFloat(d_normed.ToHost()), normed_expected, kBf16Relative, 1e-6f, what);
    }
  }
}

TEST_F(CudaForwardOpsTest, LatentRmsNormOnStridedRowsMatchesTheCpuBackend) {
  const unsigned seed = 503;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t rows = 5, dim = 512, stride = 576;  // kv_a's latent part, into a cache row
  const std::vector<float> kv_a = Random(rng, rows * stride, 3.0f);
  const std::vector<float> weight = RoundToBf16(Random(rng, dim, 1.0f));
  std::vector<float> expected(rows * stride, 0.0f);
  ASSERT_TRUE(cpu::RmsNorm({.input = kv_a.data(),
                            .weight = weight.data(),
                            .output = expected.data(),
                            .rows = rows,
                            .dim = dim,
                            .input_stride = stride,
                            .output_stride = stride})
                  .ok());
  DeviceBuffer<float> d_kv_a(kv_a.size());
  DeviceBuffer<Bf16> d_weight(dim), d_out(rows * stride);
  d_kv_a.CopyFrom(kv_a);
  d_weight.CopyFrom(ToBf16(weight));
  ASSERT_EQ(cudaMemset(d_out.get(), 0, d_out.bytes()), cudaSuccess);
  ASSERT_TRUE(RmsNorm({.input = d_kv_a.get(),
                       .weight = d_weight.get(),
                       .output = d_out.get(),
                       .rows = rows,
                       .dim = dim,
                       .input_stride = stride,
                       .output_stride = stride},
                      nullptr)
                  .ok());
  // The rope columns past dim stay untouched (zero).
  ExpectClose(ToFloat(d_out.ToHost()), expected, kBf16Relative, 1e-6f, "latent norm");
}

std::vector<float> InvFreq(int64_t rope_dim) {
  std::vector<float> inv_freq(rope_dim / 2);
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / rope_dim));
  }
  return inv_freq;
}

TEST_F(CudaForwardOpsTest, RopeBothFormsMatchTheCpuBackend) {
  const unsigned seed = 504;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t rows = 7, heads = 3, rope_dim = 64, q_head = 192, q_attn_head = 576;
  const std::vector<float> inv_freq = InvFreq(rope_dim);
  std::vector<int32_t> positions(rows);
  for (int32_t& p : positions) p = std::uniform_int_distribution<int32_t>(0, 160000)(rng);
  DeviceBuffer<float> d_inv_freq(inv_freq.size());
  DeviceBuffer<int32_t> d_positions(rows);
  d_inv_freq.CopyFrom(inv_freq);
  d_positions.CopyFrom(positions);
  for (bool interleaved : {true, false}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "rotate_half");
    // q: q_pe at [128, 192) of each 192-wide head, into [512, 576) of each absorbed head.
    const std::vector<float> q = RoundToBf16(Random(rng, rows * heads * q_head));
    std::vector<float> expected(rows * heads * q_attn_head, 0.0f);
    const RopeParams q_form{.x = expected.data() + 512,
                            .positions = positions.data(),
                            .inv_freq = inv_freq.data(),
                            .rows = rows,
                            .heads = heads,
                            .rope_dim = rope_dim,
                            .row_stride = heads * q_attn_head,
                            .head_stride = q_attn_head,
                            .attention_factor = 1.3f,
                            .interleaved = interleaved,
                            .input = q.data() + 128,
                            .input_row_stride = heads * q_head,
                            .input_head_stride = q_head};
    ASSERT_TRUE(cpu::Rope(q_form).ok());
    DeviceBuffer<Bf16> d_q(q.size()), d_q_attn(expected.size());
    d_q.CopyFrom(ToBf16(q));
    ASSERT_EQ(cudaMemset(d_q_attn.get(), 0, d_q_attn.bytes()), cudaSuccess);
    RopeParamsOf<Bf16, Bf16> gpu_q{.x = d_q_attn.get() + 512,
                                   .positions = d_positions.get(),
                                   .inv_freq = d_inv_freq.get(),
                                   .rows = rows,
                                   .heads = heads,
                                   .rope_dim = rope_dim,
                                   .row_stride = heads * q_attn_head,
                                   .head_stride = q_attn_head,
                                   .attention_factor = 1.3f,
                                   .interleaved = interleaved,
                                   .input = d_q.get() + 128,
                                   .input_row_stride = heads * q_head,
                                   .input_head_stride = q_head};
    ASSERT_TRUE(Rope(gpu_q, nullptr).ok());
    ExpectClose(ToFloat(d_q_attn.ToHost()), expected, kBf16Relative, 1e-6f, "q_pe");

    // k: the fp32 kv_a row's [512, 576) into the bf16 cache row's.
    const std::vector<float> kv_a = Random(rng, rows * 576, 2.0f);
    std::vector<float> k_expected(rows * 576, 0.0f);
    ASSERT_TRUE(cpu::Rope({.x = k_expected.data() + 512,
                           .positions = positions.data(),
                           .inv_freq = inv_freq.data(),
                           .rows = rows,
                           .heads = 1,
                           .rope_dim = rope_dim,
                           .row_stride = 576,
                           .head_stride = 576,
                           .attention_factor = 1.3f,
                           .interleaved = interleaved,
                           .input = kv_a.data() + 512})
                    .ok());
    DeviceBuffer<float> d_kv_a(kv_a.size());
    DeviceBuffer<Bf16> d_row(rows * 576);
    d_kv_a.CopyFrom(kv_a);
    ASSERT_EQ(cudaMemset(d_row.get(), 0, d_row.bytes()), cudaSuccess);
    ASSERT_TRUE(Rope(RopeParamsOf<float, Bf16>{.x = d_row.get() + 512,
                                               .positions = d_positions.get(),
                                               .inv_freq = d_inv_freq.get(),
                                               .rows = rows,
                                               .heads = 1,
                                               .rope_dim = rope_dim,
                                               .row_stride = 576,
                                               .head_stride = 576,
                                               .attention_factor = 1.3f,
                                               .interleaved = interleaved,
                                               .input = d_kv_a.get() + 512},
                     nullptr)
                    .ok());
    ExpectClose(ToFloat(d_row.ToHost()), k_expected, kBf16Relative, 1e-6f, "k_pe");
  }
}

TEST_F(CudaForwardOpsTest, SiluMulMatchesTheCpuBackend) {
  const unsigned seed = 505;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t rows = 19, dim = 733;
  std::vector<float> gate_up = Random(rng, rows * 2 * dim, 4.0f);
  gate_up[0] = -200.0f;  // exp overflows: -0, not NaN
  std::vector<float> expected(rows * dim);
  ASSERT_TRUE(
      cpu::SiluMul({.gate_up = gate_up.data(), .out = expected.data(), .rows = rows, .dim = dim})
          .ok());
  DeviceBuffer<float> d_gate_up(gate_up.size());
  DeviceBuffer<Bf16> d_out(expected.size());
  d_gate_up.CopyFrom(gate_up);
  ASSERT_TRUE(
      SiluMul({.gate_up = d_gate_up.get(), .out = d_out.get(), .rows = rows, .dim = dim}, nullptr)
          .ok());
  ExpectClose(ToFloat(d_out.ToHost()), expected, kBf16Relative, 1e-6f, "silu_mul");
}

TEST_F(CudaForwardOpsTest, KvAppendAndCopyMatchTheCpuBackend) {
  const unsigned seed = 506;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t row_dim = 576, num_slots = 40, layers = 3;
  std::vector<float> cache = RoundToBf16(Random(rng, layers * num_slots * row_dim));
  const std::vector<float> rows = RoundToBf16(Random(rng, 5 * row_dim));
  // Padding rows (negative slots) and, on the GPU, an out-of-range slot write nothing.
  const std::vector<int64_t> slots = {7, -1, 30, 8, -5};
  // A compaction: nodes at 10, 12, 13 accepted onto 9, 10, 11 (10 is read before it is written).
  const std::vector<int64_t> src = {10, 12, 13}, dst = {9, 10, 11};
  std::vector<float> expected = cache;
  ASSERT_TRUE(cpu::KvAppend({.rows = rows.data(),
                             .slots = slots.data(),
                             .cache = expected.data() + row_dim * num_slots,  // layer 1
                             .count = 5,
                             .row_dim = row_dim,
                             .num_slots = num_slots})
                  .ok());
  ASSERT_TRUE(cpu::KvCopy({.src_slots = src.data(),
                           .dst_slots = dst.data(),
                           .cache = expected.data(),
                           .count = 3,
                           .row_dim = row_dim,
                           .num_slots = num_slots,
                           .num_layers = layers})
                  .ok());
  DeviceBuffer<Bf16> d_cache(cache.size()), d_rows(rows.size());
  DeviceBuffer<int64_t> d_slots(slots.size()), d_src(3), d_dst(3);
  d_cache.CopyFrom(ToBf16(cache));
  d_rows.CopyFrom(ToBf16(rows));
  d_slots.CopyFrom(slots);
  d_src.CopyFrom(src);
  d_dst.CopyFrom(dst);
  ASSERT_TRUE(KvAppend({.rows = d_rows.get(),
                        .slots = d_slots.get(),
                        .cache = d_cache.get() + row_dim * num_slots,
                        .count = 5,
                        .row_dim = row_dim,
                        .num_slots = num_slots},
                       nullptr)
                  .ok());
  ASSERT_TRUE(KvCopy({.src_slots = d_src.get(),
                      .dst_slots = d_dst.get(),
                      .cache = d_cache.get(),
                      .count = 3,
                      .row_dim = row_dim,
                      .num_slots = num_slots,
                      .num_layers = layers},
                     nullptr)
                  .ok());
  EXPECT_EQ(ToFloat(d_cache.ToHost()), expected);
}

struct GemmCase {
  int64_t m, n, k, batch;
  // The products' inputs side by side in each row (W_UK's heads in q's rows) and weight rows
  // padded, rather than each product's rows after the other's.
  bool interleaved = false;
};

// A case's strides: operands inside wider rows, products interleaved in y (the absorbed
// projections).
struct GemmLayout {
  int64_t x_stride, x_batch_stride, w_stride, y_stride;
  explicit GemmLayout(const GemmCase& c)
      : x_stride(c.interleaved ? c.batch * (c.k + 8) : c.k + 8),
        x_batch_stride(c.interleaved ? c.k + 8 : c.m * (c.k + 8)),
        w_stride(c.interleaved ? c.k + 16 : c.k),
        y_stride(c.batch * c.n) {}
  int64_t x_size(const GemmCase& c) const { return c.m * x_stride * (c.interleaved ? 1 : c.batch); }
};

template <typename Output>
void CheckGemm(GemmRunner& gemm, const GemmCase& c, std::mt19937& rng) {
  const GemmLayout layout(c);
  const int64_t x_stride = layout.x_stride, y_stride = layout.y_stride;
  const std::vector<float> x = RoundToBf16(Random(rng, layout.x_size(c)));
  const std::vector<float> w = RoundToBf16(Random(rng, c.batch * c.n * layout.w_stride, 0.05f));
  std::vector<float> expected(c.m * y_stride);
  const GemmParams cpu_params{.x = x.data(),
                              .weight = w.data(),
                              .y = expected.data(),
                              .m = c.m,
                              .n = c.n,
                              .k = c.k,
                              .x_stride = x_stride,
                              .weight_stride = layout.w_stride,
                              .y_stride = y_stride,
                              .batch = c.batch,
                              .x_batch_stride = layout.x_batch_stride,
                              .weight_batch_stride = c.n * layout.w_stride,
                              .y_batch_stride = c.n};
  ASSERT_TRUE(cpu::Gemm(cpu_params).ok());
  DeviceBuffer<Bf16> d_x(x.size()), d_w(w.size());
  DeviceBuffer<Output> d_y(expected.size());
  d_x.CopyFrom(ToBf16(x));
  d_w.CopyFrom(ToBf16(w));
  // NaN everywhere first: an output the product does not write fails the comparison.
  ASSERT_EQ(cudaMemset(d_y.get(), 0xff, expected.size() * sizeof(Output)), cudaSuccess);
  GemmParamsOf<Bf16, Bf16, Output> params{.x = d_x.get(),
                                          .weight = d_w.get(),
                                          .y = d_y.get(),
                                          .m = c.m,
                                          .n = c.n,
                                          .k = c.k,
                                          .x_stride = x_stride,
                                          .weight_stride = layout.w_stride,
                                          .y_stride = y_stride,
                                          .batch = c.batch,
                                          .x_batch_stride = layout.x_batch_stride,
                                          .weight_batch_stride = c.n * layout.w_stride,
                                          .y_batch_stride = c.n};
  ASSERT_TRUE(gemm.Run(params, nullptr).ok());
  std::vector<float> actual;
  if constexpr (std::is_same_v<Output, float>) {
    actual = d_y.ToHost();
  } else {
    actual = ToFloat(d_y.ToHost());
  }
  // fp32 accumulation in another order: relative to the magnitude of the terms, sqrt(k) * 0.05.
  const float absolute = 1e-5f * std::sqrt(static_cast<float>(c.k));
  const float relative = std::is_same_v<Output, float> ? 1e-5f : kBf16Relative;
  ExpectClose(actual, expected, relative, absolute,
              testing::PrintToString(std::vector<int64_t>{c.m, c.n, c.k, c.batch}));
  // A second run of the same shape reuses the plan (and a split reduction its counters, zeroed
  // again by the first run) and gives the same bytes, into NaN again.
  const std::vector<Output> first = d_y.ToHost();
  ASSERT_EQ(cudaMemset(d_y.get(), 0xff, expected.size() * sizeof(Output)), cudaSuccess);
  ASSERT_TRUE(gemm.Run(params, nullptr).ok());
  EXPECT_EQ(0, std::memcmp(first.data(), d_y.ToHost().data(), first.size() * sizeof(Output)));
}

TEST_F(CudaForwardOpsTest, GemmMatchesTheCpuBackend) {
  const unsigned seed = 507;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  // Every case through a runner that routes the products ResidentGemm takes to it, and through
  // one that runs them all on cuBLASLt.
  absl::StatusOr<std::unique_ptr<GemmRunner>> gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  absl::StatusOr<std::unique_ptr<GemmRunner>> cublas =
      GemmRunner::Create(32 << 20, /*resident_products=*/false);
  ASSERT_TRUE(cublas.ok()) << cublas.status();
  // The last five split their reductions over blocks (k = 7168: the router, the shared expert's
  // gate/up, kv_a; a batch of two); the last two have W_UK's and W_UV's interleaved inputs.
  const std::vector<GemmCase> cases = {
      {1, 1536, 7168, 1},     {3, 19, 733, 1},    {16, 576, 512, 1}, {9, 512, 128, 8},
      {19, 128, 512, 3},      {1, 48, 64, 1},     {16, 3200, 64, 1}, {13, 1024, 1536, 1},
      {16, 7168, 1024, 1},    {16, 128, 512, 8},  {5, 512, 128, 8},  {16, 384, 7168, 1},
      {13, 512, 7168, 1},     {16, 576, 7168, 1}, {4, 64, 4096, 2},  {16, 512, 128, 8, true},
      {7, 128, 512, 64, true}};
  for (const GemmCase& c : cases) {
    for (GemmRunner* runner : {gemm->get(), cublas->get()}) {
      CheckGemm<float>(*runner, c, rng);
      CheckGemm<Bf16>(*runner, c, rng);
    }
  }
  EXPECT_EQ((*cublas)->planned_shapes(), static_cast<int64_t>(2 * cases.size()));
  // cuBLASLt planned only the cases the resident kernel does not take on this device: on an
  // H200, all but the three of more than 16 rows, k not a multiple of 64, or too wide a block.
  absl::StatusOr<ResidentGemmDevice> device = PrepareResidentGemm();
  ASSERT_TRUE(device.ok()) << device.status();
  const ResidentGemmScratch room{.tile_parts = 2048, .tiles = 2048};
  alignas(16) static Bf16 aligned[8];  // planning reads only the pointers' alignment
  int64_t resident = 0;
  for (const GemmCase& c : cases) {
    const GemmLayout layout(c);
    resident += PlanResidentGemm(
                    GemmParamsOf<Bf16, Bf16, float>{.x = aligned,
                                                    .weight = aligned,
                                                    .m = c.m,
                                                    .n = c.n,
                                                    .k = c.k,
                                                    .x_stride = layout.x_stride,
                                                    .weight_stride = layout.w_stride,
                                                    .batch = c.batch,
                                                    .x_batch_stride = layout.x_batch_stride,
                                                    .weight_batch_stride = c.n * layout.w_stride},
                    *device, room)
                    .blocks > 0;
  }
  EXPECT_EQ((*gemm)->planned_shapes(), 2 * (static_cast<int64_t>(cases.size()) - resident));
  if (device->max_smem_bytes >= 227 * 1024 && device->multiprocessors >= 132) {
    EXPECT_EQ(resident, static_cast<int64_t>(cases.size()) - 3);
  }
}

// `work`'s launches on `stream`: enqueued once (eager), or captured into a graph that is replayed
// three times.
void RunEagerOrReplayed(cudaStream_t stream, bool graph, const std::function<void()>& work) {
  if (!graph) {
    work();
    return;
  }
  cudaGraph_t captured;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  work();
  ASSERT_EQ(cudaStreamEndCapture(stream, &captured), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, captured, 0), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(captured);
}

// The resident product as its predecessor's programmatic dependent: it loads its weights while
// the norm that writes its input runs, and must read that input only after the norm is done.
// Eager and captured in a graph, the product of the norm's output equals the product computed
// afterwards on its own.
TEST_F(CudaForwardOpsTest, ResidentGemmReadsItsInputAfterThePredecessorWritesIt) {
  std::mt19937 rng(511);
  constexpr int64_t kRows = 16, kDim = 1536, kOut = 1536;  // q_a's norm, then q_b
  const std::vector<float> residual = Random(rng, kRows * kDim, 2.0f);
  DeviceBuffer<float> d_residual(residual.size());
  DeviceBuffer<Bf16> d_norm_weight(kDim), d_normed(kRows * kDim), d_w(kOut * kDim);
  DeviceBuffer<Bf16> d_y(kRows * kOut), d_alone(kRows * kOut);
  d_residual.CopyFrom(residual);
  d_norm_weight.CopyFrom(ToBf16(std::vector<float>(kDim, 1.0f)));
  d_w.CopyFrom(ToBf16(Random(rng, kOut * kDim, 0.05f)));
  absl::StatusOr<std::unique_ptr<GemmRunner>> gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto product = [&](Bf16* y) {
    return (*gemm)->Run(
        {.x = d_normed.get(), .weight = d_w.get(), .y = y, .m = kRows, .n = kOut, .k = kDim},
        stream);
  };
  auto norm_then_product = [&]() {
    // Stale input first: a product that read before the norm ended would see these.
    EXPECT_EQ(cudaMemsetAsync(d_normed.get(), 0, kRows * kDim * sizeof(Bf16), stream), cudaSuccess);
    EXPECT_TRUE(RmsNorm({.input = d_residual.get(),
                         .weight = d_norm_weight.get(),
                         .output = d_normed.get(),
                         .rows = kRows,
                         .dim = kDim,
                         .eps = 1e-6f},
                        stream)
                    .ok());
    EXPECT_TRUE(product(d_y.get()).ok());
  };
  for (const bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "graph" : "eager");
    ASSERT_NO_FATAL_FAILURE(RunEagerOrReplayed(stream, graph, norm_then_product));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_TRUE(product(d_alone.get()).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<Bf16> together = d_y.ToHost(), alone = d_alone.ToHost();
    EXPECT_EQ(0, std::memcmp(together.data(), alone.data(), together.size() * sizeof(Bf16)));
    EXPECT_NE(ToFloat(alone), std::vector<float>(alone.size(), 0.0f));
  }
  cudaStreamDestroy(stream);
}

// Split reductions back to back on one stream, each the programmatic dependent of the one before
// (no host synchronization between), eager and in a graph: the router's shape, the shared
// expert's gate/up, the router's again; each run's counters are zero for the next, so the two
// router products give the same bytes and the gate/up product agrees with cuBLASLt.
TEST_F(CudaForwardOpsTest, ResidentSplitProductsBackToBackKeepTheirCounters) {
  std::mt19937 rng(513);
  constexpr int64_t kRows = 16, kK = 7168;
  DeviceBuffer<Bf16> d_x(kRows * kK), d_router(384 * kK), d_gate_up(512 * kK);
  d_x.CopyFrom(ToBf16(Random(rng, kRows * kK)));
  d_router.CopyFrom(ToBf16(Random(rng, 384 * kK, 0.05f)));
  d_gate_up.CopyFrom(ToBf16(Random(rng, 512 * kK, 0.05f)));
  DeviceBuffer<float> d_first(kRows * 384), d_again(kRows * 384), d_gate_out(kRows * 512);
  DeviceBuffer<float> d_gate_reference(kRows * 512);
  absl::StatusOr<std::unique_ptr<GemmRunner>> gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  absl::StatusOr<std::unique_ptr<GemmRunner>> cublas =
      GemmRunner::Create(32 << 20, /*resident_products=*/false);
  ASSERT_TRUE(cublas.ok()) << cublas.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto product = [&](GemmRunner& runner, const Bf16* w, float* y, int64_t n) {
    return runner.Run({.x = d_x.get(), .weight = w, .y = y, .m = kRows, .n = n, .k = kK}, stream);
  };
  ASSERT_TRUE(product(**cublas, d_gate_up.get(), d_gate_reference.get(), 512).ok());
  auto three = [&]() {
    EXPECT_TRUE(product(**gemm, d_router.get(), d_first.get(), 384).ok());
    EXPECT_TRUE(product(**gemm, d_gate_up.get(), d_gate_out.get(), 512).ok());
    EXPECT_TRUE(product(**gemm, d_router.get(), d_again.get(), 384).ok());
  };
  for (const bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "graph" : "eager");
    for (DeviceBuffer<float>* y : {&d_first, &d_again, &d_gate_out}) {
      ASSERT_EQ(cudaMemsetAsync(y->get(), 0xff, y->bytes(), stream), cudaSuccess);
    }
    ASSERT_NO_FATAL_FAILURE(RunEagerOrReplayed(stream, graph, three));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> first = d_first.ToHost(), again = d_again.ToHost();
    EXPECT_EQ(0, std::memcmp(first.data(), again.data(), first.size() * sizeof(float)));
    EXPECT_FALSE(std::any_of(first.begin(), first.end(), [](float v) { return std::isnan(v); }));
    ExpectClose(d_gate_out.ToHost(), d_gate_reference.ToHost(), 1e-5f, 1e-3f, "gate/up");
  }
  cudaStreamDestroy(stream);
}

// How ResidentGemm lays the verify step's products over an H200's 132 multiprocessors (227 KB
// of shared memory a block), and which it leaves to cuBLASLt. Planning needs no GPU.
TEST(ResidentGemmPlanTest, PlansTheVerifyProductsOfAnH200) {
  const ResidentGemmDevice h200{.multiprocessors = 132, .max_smem_bytes = 227 * 1024};
  alignas(16) static Bf16 x[16], w[16];  // never read: planning looks at shapes and alignment
  auto plan = [&](int64_t m, int64_t n, int64_t k, int64_t batch = 1) {
    return PlanResidentGemm(GemmParamsOf<Bf16, Bf16, float>{.x = x,
                                                            .weight = w,
                                                            .m = m,
                                                            .n = n,
                                                            .k = k,
                                                            .batch = batch,
                                                            .x_batch_stride = k,
                                                            .weight_batch_stride = n * k,
                                                            .y_batch_stride = n},
                            h200);
  };
  auto shape = [](const ResidentGemmPlan& p) {
    return std::vector<int64_t>{p.blocks, p.tiles_per_block, p.slices, p.k_parts};
  };
  EXPECT_EQ(shape(plan(16, 7168, 1024)), (std::vector<int64_t>{112, 4, 2, 1}));  // o_proj
  EXPECT_EQ(shape(plan(16, 1536, 1536)), (std::vector<int64_t>{96, 1, 8, 1}));   // q_b
  EXPECT_EQ(shape(plan(1, 1536, 1536)), (std::vector<int64_t>{96, 1, 8, 1}));
  EXPECT_EQ(shape(plan(16, 512, 128, 8)), (std::vector<int64_t>{128, 2, 4, 1}));  // W_UK
  EXPECT_EQ(shape(plan(16, 128, 512, 8)), (std::vector<int64_t>{64, 1, 8, 1}));   // W_UV
  // k = 7168: only with room to split the reduction over blocks.
  const ResidentGemmScratch room{.tile_parts = 2048, .tiles = 2048};
  auto split = [&](int64_t n) {
    return shape(PlanResidentGemm(
        GemmParamsOf<Bf16, Bf16, float>{.x = x, .weight = w, .m = 16, .n = n, .k = 7168}, h200,
        room));
  };
  EXPECT_EQ(split(384), (std::vector<int64_t>{96, 1, 8, 4}));   // the router
  EXPECT_EQ(split(512), (std::vector<int64_t>{128, 1, 8, 4}));  // the shared expert's gate/up
  EXPECT_EQ(split(576), (std::vector<int64_t>{72, 2, 4, 4}));   // kv_a
  EXPECT_EQ(split(1536)[0], 0);                // q_a: no split fits one wave and shared memory
  EXPECT_EQ(plan(16, 384, 7168).blocks, 0);    // the router without scratch
  EXPECT_EQ(plan(16, 1536, 7168).blocks, 0);   // q_a: a tile and the input exceed shared memory
  EXPECT_EQ(plan(16, 20480, 1024).blocks, 0);  // more tiles than 8 a multiprocessor
  EXPECT_EQ(plan(17, 1536, 1536).blocks, 0);   // more than 16 rows
  EXPECT_EQ(plan(16, 1536, 96).blocks, 0);     // k not a multiple of 64
  EXPECT_EQ(plan(16, 24, 64).blocks, 0);       // n not a multiple of 16
  const GemmParamsOf<Bf16, Bf16, float> small{.x = x, .weight = w, .m = 16, .n = 64, .k = 64};
  EXPECT_EQ(PlanResidentGemm(small, ResidentGemmDevice{}).blocks, 0);  // off (before sm_90)
  // A device of 84 multiprocessors with 99 KB a block (sm_120): W_UK takes four tiles a block,
  // o_proj's blocks do not fit.
  const ResidentGemmDevice sm120{.multiprocessors = 84, .max_smem_bytes = 99 * 1024};
  const ResidentGemmPlan w_uk =
      PlanResidentGemm(GemmParamsOf<Bf16, Bf16, float>{.x = x,
                                                       .weight = w,
                                                       .m = 16,
                                                       .n = 512,
                                                       .k = 128,
                                                       .batch = 8,
                                                       .x_batch_stride = 128,
                                                       .weight_batch_stride = 512 * 128},
                       sm120);
  EXPECT_EQ(shape(w_uk), (std::vector<int64_t>{64, 4, 2, 1}));
  EXPECT_EQ(PlanResidentGemm(
                GemmParamsOf<Bf16, Bf16, float>{.x = x, .weight = w, .m = 16, .n = 7168, .k = 1024},
                sm120)
                .blocks,
            0);
}

struct RoutingCase {
  MoeScoring scoring;
  MoeTopkMethod method;
  int32_t experts, top_k, groups, topk_groups;
  bool normalize;
};

TEST_F(CudaForwardOpsTest, MoeRoutingMatchesTheCpuBackend) {
  const unsigned seed = 508;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t tokens = 19;
  for (const RoutingCase& c : {
           RoutingCase{MoeScoring::kSigmoid, MoeTopkMethod::kNoauxTc, 256, 8, 8, 4, true},  // V3
           RoutingCase{MoeScoring::kSigmoid, MoeTopkMethod::kNoauxTc, 384, 8, 1, 1, true},  // K2
           RoutingCase{MoeScoring::kSoftmax, MoeTopkMethod::kGreedy, 64, 6, 1, 1, false},
           RoutingCase{MoeScoring::kSoftmax, MoeTopkMethod::kGroupLimitedGreedy, 160, 6, 8, 3,
                       false},
           // Past 8 experts a token, the warp's lists are 16 and 32 long.
           RoutingCase{MoeScoring::kSoftmax, MoeTopkMethod::kGreedy, 64, 12, 1, 1, true},
           RoutingCase{MoeScoring::kSigmoid, MoeTopkMethod::kNoauxTc, 1024, 32, 8, 4, true},
       }) {
    SCOPED_TRACE(testing::Message() << c.experts << " experts, top " << c.top_k);
    std::vector<float> logits = Random(rng, tokens * c.experts, 2.0f);
    logits[5] = logits[6];  // a tie, which goes to the lower id
    // Token 2: every logit the same, so (before a bias) every expert ties, across all warps.
    std::fill(logits.begin() + 2 * c.experts, logits.begin() + 3 * c.experts, 0.25f);
    const std::vector<float> bias = Random(rng, c.experts, 0.1f);
    MoeRoutingParams params{.tokens = tokens,
                            .num_experts = c.experts,
                            .top_k = c.top_k,
                            .num_groups = c.groups,
                            .topk_groups = c.topk_groups,
                            .scoring = c.scoring,
                            .method = c.method,
                            .normalize = c.normalize,
                            .routed_scaling_factor = 2.5f};
    std::vector<int32_t> ids(tokens * c.top_k);
    std::vector<float> weights(tokens * c.top_k);
    params.router_logits = logits.data();
    params.correction_bias = bias.data();
    params.topk_ids = ids.data();
    params.topk_weights = weights.data();
    ASSERT_TRUE(cpu::MoeRouting(params).ok());
    DeviceBuffer<float> d_logits(logits.size()), d_bias(bias.size()), d_weights(weights.size());
    DeviceBuffer<int32_t> d_ids(ids.size());
    d_logits.CopyFrom(logits);
    d_bias.CopyFrom(bias);
    params.router_logits = d_logits.get();
    params.correction_bias = d_bias.get();
    params.topk_ids = d_ids.get();
    params.topk_weights = d_weights.get();
    ASSERT_TRUE(MoeRouting(params, nullptr).ok());
    EXPECT_EQ(d_ids.ToHost(), ids);
    ExpectClose(d_weights.ToHost(), weights, 1e-6f, 0.0f, "routing weights");

    // Rows past the routed count (a graph's padding) get no expert.
    const int32_t routed = 11;
    DeviceBuffer<int32_t> d_routed(1);
    d_routed.CopyFrom({routed});
    params.routed_tokens = d_routed.get();
    ASSERT_TRUE(MoeRouting(params, nullptr).ok());
    const std::vector<int32_t> padded_ids = d_ids.ToHost();
    const std::vector<float> padded_weights = d_weights.ToHost();
    for (int64_t i = 0; i < tokens * c.top_k; ++i) {
      if (i < routed * c.top_k) {
        EXPECT_EQ(padded_ids[i], ids[i]);
      } else {
        EXPECT_EQ(padded_ids[i], -1);
        EXPECT_EQ(padded_weights[i], 0.0f);
      }
    }
  }
}

// The weight stream's tiles (moe_tiles.h): every element of every expert's matrices in a place
// of its own, each 16-byte unit of 8 elements kept together at unit (c / 8 % 8) ^ (r % 8) of its
// tile row, an expert's tiles in (row tile, chunk) order with gate's and up's alternating, and the
// padding past the matrices zero. No GPU.
TEST(MoeTilesTest, PackExpertTilesPlacesEveryElementOnce) {
  // A few places by hand: [70, 130] gate/up in 2 row tiles x 3 chunks of 4096 elements, gate's and
  // up's alternating (8192 a tile position).
  constexpr MoeTileLayout kGateUp = GateUpTileLayout(70, 130);
  static_assert(kGateUp.Offset(0, 0, 0) == 0 && kGateUp.Offset(0, 0, 9) == 9);
  static_assert(kGateUp.Offset(0, 1, 0) == 64 + 8 && kGateUp.Offset(0, 1, 9) == 64 + 1);
  static_assert(kGateUp.Offset(0, 7, 63) == 7 * 64 + (7 ^ 7) * 8 + 7);
  static_assert(kGateUp.Offset(0, 0, 64) == 8192 && kGateUp.Offset(0, 64, 0) == 3 * 8192);
  static_assert(kGateUp.Offset(1, 0, 0) == 6 * 8192 && kGateUp.ExpertElements() == 6 * 8192);
  for (const MoeTileLayout& layout : {GateUpTileLayout(70, 130), DownTileLayout(200, 72)}) {
    SCOPED_TRACE(testing::Message() << layout.rows << " x " << layout.cols);
    const int64_t experts = 3;
    ASSERT_EQ(layout.ExpertElements(), layout.RowTiles() * layout.Chunks() * layout.tile_rows *
                                           MoeTileLayout::kColumns * layout.interleave);
    // Small integers, exact in bf16, none zero: 1..200 by element.
    auto value = [&](int m, int64_t e, int64_t r, int64_t c) {
      return static_cast<float>((m * 11 + e * 7 + r * 3 + c) % 200 + 1);
    };
    const std::vector<Bf16> tiles = PackExpertTiles(experts, layout, value);
    ASSERT_EQ(static_cast<int64_t>(tiles.size()), experts * layout.ExpertElements());
    std::vector<bool> used(tiles.size(), false);
    for (int m = 0; m < layout.interleave; ++m) {
      for (int64_t e = 0; e < experts; ++e) {
        for (int64_t r = 0; r < layout.rows; ++r) {
          for (int64_t c = 0; c < layout.cols; ++c) {
            const int64_t at = layout.Offset(e, r, c) + m * layout.TileElements();
            ASSERT_GE(at, 0);
            ASSERT_LT(at, static_cast<int64_t>(tiles.size()));
            ASSERT_FALSE(used[at]) << m << " " << e << " " << r << " " << c;
            used[at] = true;
            EXPECT_EQ(__bfloat162float(tiles[at]), value(m, e, r, c));
            const int64_t tile =
                layout.TileOffset(e, r / layout.tile_rows, c / 64) + m * layout.TileElements();
            const int64_t in_row = at - tile - (r % layout.tile_rows) * 64;
            EXPECT_EQ(in_row / 8, (c % 64 / 8) ^ (r % 8));
            EXPECT_EQ(in_row % 8, c % 8);
          }
        }
      }
    }
    for (size_t i = 0; i < tiles.size(); ++i) {
      if (!used[i]) {
        ASSERT_EQ(__bfloat162float(tiles[i]), 0.0f) << "padding at " << i;
      }
    }
  }
}

// The same tiles packed on the device from row-major bf16, as the worker packs them: the same
// bytes as the host's, padding included (zeroed first).
TEST_F(CudaForwardOpsTest, PackExpertTilesOnDeviceMatchesTheHost) {
  std::mt19937 rng(513);
  for (const MoeTileLayout& layout : {GateUpTileLayout(72, 136), DownTileLayout(200, 72)}) {
    SCOPED_TRACE(testing::Message() << layout.rows << " x " << layout.cols);
    const int64_t experts = 3, elements = experts * layout.rows * layout.cols;
    std::vector<std::vector<float>> matrices;
    for (int m = 0; m < layout.interleave; ++m) {
      matrices.push_back(RoundToBf16(Random(rng, elements)));
    }
    const std::vector<Bf16> expected =
        PackExpertTiles(experts, layout, [&](int m, int64_t e, int64_t r, int64_t c) {
          return matrices[m][(e * layout.rows + r) * layout.cols + c];
        });
    DeviceBuffer<Bf16> d_tiles(expected.size());
    ASSERT_EQ(cudaMemset(d_tiles.get(), 0, d_tiles.bytes()), cudaSuccess);
    std::vector<std::unique_ptr<DeviceBuffer<Bf16>>> d_rows;
    for (int m = 0; m < layout.interleave; ++m) {
      d_rows.push_back(std::make_unique<DeviceBuffer<Bf16>>(elements));
      d_rows.back()->CopyFrom(ToBf16(matrices[m]));
      ASSERT_TRUE(
          PackExpertTilesOnDevice(d_rows.back()->get(), experts, layout, m, d_tiles.get(), nullptr)
              .ok());
    }
    const std::vector<Bf16> actual = d_tiles.ToHost();
    ASSERT_EQ(actual.size(), expected.size());
    EXPECT_EQ(std::memcmp(actual.data(), expected.data(), actual.size() * sizeof(Bf16)), 0);
  }
  EXPECT_EQ(
      PackExpertTilesOnDevice(nullptr, 1, DownTileLayout(128, 60), 0, nullptr, nullptr).code(),
      absl::StatusCode::kInvalidArgument);  // columns not a multiple of 8
}

struct ExpertsCase {
  int64_t tokens, hidden, intermediate;
  int32_t top_k, experts, first_expert, local_experts;
  bool shared;
  bool packed = true;  // the experts also as the weight stream's tiles (moe_tiles.h)
};

TEST_F(CudaForwardOpsTest, MoeExpertsMatchTheCpuBackend) {
  const unsigned seed = 509;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const ExpertsCase& c : {
           // Split inside: every expert local, a slice of its columns.
           ExpertsCase{16, 256, 64, 4, 12, 0, 12, true},
           // Whole experts: this rank holds experts [4, 10); tokens of others are skipped.
           ExpertsCase{19, 128, 96, 3, 12, 4, 6, false},
           // More tokens per expert than one pass (8), odd sizes that take the scalar path.
           ExpertsCase{37, 76, 20, 2, 3, 0, 3, true},
           ExpertsCase{1, 7168, 256, 8, 64, 0, 64, false},
           // A verify step's shape under split inside: gate/up's reduction split across blocks
           // (GateUpParts), several tokens per expert; then the same experts unpacked (the
           // CUDA-core kernels).
           ExpertsCase{16, 7168, 256, 8, 64, 0, 64, true},
           ExpertsCase{16, 7168, 256, 8, 64, 0, 64, true, false},
           // Reductions split across blocks with a short last part (65 stages of 64 in parts of
           // 9 and 2), rows that end inside a box (96 of 128: gate/up's second tile, down's rows
           // of the next expert), and a down reduction that ends inside a stage (96 of 128).
           ExpertsCase{12, 4160, 96, 4, 8, 0, 8, false},
           // Gate/up reductions that end inside a stage (200 = 3 x 64 + 8; 4104 = 64 x 64 + 8
           // in 8 parts): the tiles' zero padding past the weights' columns, cp.async's zero
           // fill past x's.
           ExpertsCase{12, 200, 96, 4, 8, 0, 8, false},
           ExpertsCase{12, 4104, 96, 4, 8, 0, 8, false},
           // ~133 pairs per expert: the weight stream's token groups of 32, the last partial,
           // and several down items per block, so a block steps from an item's last group to
           // the next item's first; then ~80 pairs per expert with gate/up in block parts.
           ExpertsCase{200, 256, 64, 4, 6, 0, 6, false},
           ExpertsCase{120, 7168, 64, 4, 6, 0, 6, false},
           // Whole experts under TP8's shapes: gate/up in 8 parts and down in 4 (DownParts,
           // added by the combine); then 48 pairs per expert with down in 2 parts, two groups.
           ExpertsCase{9, 7168, 2048, 8, 64, 0, 8, false},
           ExpertsCase{48, 4096, 1024, 8, 8, 0, 4, true},
           // Prefill sizes (512 tokens or more): the grouped GEMM, full and partial 64-pair
           // tiles, in both shardings.
           ExpertsCase{600, 256, 128, 4, 12, 0, 12, true},
           ExpertsCase{700, 384, 192, 3, 12, 4, 6, false},
           ExpertsCase{600, 256, 128, 4, 12, 0, 12, true, false},  // from the pointer arrays
           // More entries than the one-block grouping stages (8192): the chunked grouping, under
           // the grouped GEMM and under the CUDA-core kernels.
           ExpertsCase{2100, 128, 64, 4, 12, 0, 12, true},
           ExpertsCase{2300, 256, 64, 4, 16, 4, 8, false},
           ExpertsCase{2100, 76, 20, 4, 3, 0, 3, true},
       }) {
    SCOPED_TRACE(testing::Message()
                 << c.tokens << " tokens, hidden " << c.hidden << ", intermediate "
                 << c.intermediate << (c.packed ? "" : ", unpacked"));
    const std::vector<float> x = RoundToBf16(Random(rng, c.tokens * c.hidden));
    std::vector<std::vector<float>> gate, up, down;
    std::vector<const float*> gate_ptrs, up_ptrs, down_ptrs;
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.hidden));
    for (int32_t e = 0; e < c.local_experts; ++e) {
      gate.push_back(RoundToBf16(Random(rng, c.intermediate * c.hidden, scale)));
      up.push_back(RoundToBf16(Random(rng, c.intermediate * c.hidden, scale)));
      down.push_back(RoundToBf16(Random(rng, c.hidden * c.intermediate, scale)));
    }
    for (int32_t e = 0; e < c.local_experts; ++e) {
      gate_ptrs.push_back(gate[e].data());
      up_ptrs.push_back(up[e].data());
      down_ptrs.push_back(down[e].data());
    }
    std::vector<int32_t> ids;
    std::vector<float> weights;
    RandomRouting(rng, c.tokens, c.experts, c.top_k, ids, weights);
    const std::vector<float> shared = Random(rng, c.tokens * c.hidden);
    std::vector<float> expected(c.tokens * c.hidden);
    ASSERT_TRUE(cpu::MoeExperts({.x = x.data(),
                                 .topk_ids = ids.data(),
                                 .topk_weights = weights.data(),
                                 .gate_proj = gate_ptrs.data(),
                                 .up_proj = up_ptrs.data(),
                                 .down_proj = down_ptrs.data(),
                                 .out = expected.data(),
                                 .tokens = c.tokens,
                                 .top_k = c.top_k,
                                 .hidden = c.hidden,
                                 .intermediate = c.intermediate,
                                 .first_expert = c.first_expert,
                                 .num_local_experts = c.local_experts,
                                 .shared_out = c.shared ? shared.data() : nullptr})
                    .ok());

    DeviceBuffer<Bf16> d_x(x.size());
    d_x.CopyFrom(ToBf16(x));
    // Each kind of matrix in one allocation, expert after expert, with pointers to each (the
    // CUDA-core kernels' and the grouped GEMM's input); and in the weight stream's tiles, as the
    // worker holds them on sm_90 and later.
    std::vector<std::unique_ptr<DeviceBuffer<Bf16>>> d_packed;
    std::vector<const Bf16*> d_gate, d_up, d_down;
    for (auto* matrices : {&gate, &up, &down}) {
      std::vector<float> all;
      for (const std::vector<float>& m : *matrices) all.insert(all.end(), m.begin(), m.end());
      d_packed.push_back(std::make_unique<DeviceBuffer<Bf16>>(all.size()));
      d_packed.back()->CopyFrom(ToBf16(all));
    }
    const MoeTileLayout gate_up_layout = GateUpTileLayout(c.intermediate, c.hidden);
    const MoeTileLayout down_layout = DownTileLayout(c.hidden, c.intermediate);
    DeviceBuffer<Bf16> d_gate_up_tiles(c.local_experts * gate_up_layout.ExpertElements()),
        d_down_tiles(c.local_experts * down_layout.ExpertElements());
    d_gate_up_tiles.CopyFrom(PackExpertTiles(c.local_experts, gate_up_layout,
                                             [&](int m, int64_t e, int64_t r, int64_t col) {
                                               return (m == 0 ? gate : up)[e][r * c.hidden + col];
                                             }));
    d_down_tiles.CopyFrom(PackExpertTiles(
        c.local_experts, down_layout,
        [&](int, int64_t e, int64_t r, int64_t col) { return down[e][r * c.intermediate + col]; }));
    for (int32_t e = 0; e < c.local_experts; ++e) {
      d_gate.push_back(d_packed[0]->get() + e * gate[e].size());
      d_up.push_back(d_packed[1]->get() + e * up[e].size());
      d_down.push_back(d_packed[2]->get() + e * down[e].size());
    }
    DeviceBuffer<const Bf16*> d_gate_ptrs(d_gate.size()), d_up_ptrs(d_up.size()),
        d_down_ptrs(d_down.size());
    d_gate_ptrs.CopyFrom(d_gate);
    d_up_ptrs.CopyFrom(d_up);
    d_down_ptrs.CopyFrom(d_down);
    DeviceBuffer<int32_t> d_ids(ids.size());
    DeviceBuffer<float> d_topk_weights(weights.size()), d_shared(shared.size()),
        d_out(expected.size());
    d_ids.CopyFrom(ids);
    d_topk_weights.CopyFrom(weights);
    d_shared.CopyFrom(shared);
    const int64_t bytes =
        MoeExpertsWorkspaceBytes(c.tokens, c.top_k, c.local_experts, c.intermediate, c.hidden);
    DeviceBuffer<uint8_t> workspace(bytes);
    const MoeExpertsParamsOf<Bf16, Bf16> params{
        .x = d_x.get(),
        .topk_ids = d_ids.get(),
        .topk_weights = d_topk_weights.get(),
        .gate_proj = d_gate_ptrs.get(),
        .up_proj = d_up_ptrs.get(),
        .down_proj = d_down_ptrs.get(),
        .out = d_out.get(),
        .tokens = c.tokens,
        .top_k = c.top_k,
        .hidden = c.hidden,
        .intermediate = c.intermediate,
        .first_expert = c.first_expert,
        .num_local_experts = c.local_experts,
        .shared_out = c.shared ? d_shared.get() : nullptr,
        .packed_gate = c.packed ? d_gate_up_tiles.get() : nullptr,
        .packed_up = c.packed ? d_gate_up_tiles.get() + gate_up_layout.TileElements() : nullptr,
        .packed_down = c.packed ? d_down_tiles.get() : nullptr};
    ASSERT_TRUE(MoeExperts(params, workspace.get(), bytes, nullptr).ok());
    // The activations between the projections are bf16 on the GPU: allow their rounding,
    // relative to the size of the output.
    double scale_out = 0.0;
    for (float v : expected) scale_out = std::max(scale_out, double{std::abs(v)});
    ExpectClose(d_out.ToHost(), expected, 2 * kBf16Relative, 0.01f * scale_out, "experts");
    // Twice the same launch, the same bytes.
    const std::vector<float> first = d_out.ToHost();
    ASSERT_TRUE(MoeExperts(params, workspace.get(), bytes, nullptr).ok());
    EXPECT_EQ(d_out.ToHost(), first);
    int device = 0, major = 0;
    ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
              cudaSuccess);
    if (c.packed && MoeTilesReadable(c.hidden, c.intermediate, major)) {
      // The tiles alone, as the worker holds them on sm_90 and later: the same bytes.
      MoeExpertsParamsOf<Bf16, Bf16> tiles_only = params;
      tiles_only.gate_proj = tiles_only.up_proj = tiles_only.down_proj = nullptr;
      ASSERT_TRUE(MoeExperts(tiles_only, workspace.get(), bytes, nullptr).ok());
      EXPECT_EQ(d_out.ToHost(), first);
    } else if (c.packed) {  // tiles the stream cannot read (rows of 16-byte pieces): refused
      MoeExpertsParamsOf<Bf16, Bf16> tiles_only = params;
      tiles_only.gate_proj = tiles_only.up_proj = tiles_only.down_proj = nullptr;
      EXPECT_EQ(MoeExperts(tiles_only, workspace.get(), bytes, nullptr).code(),
                absl::StatusCode::kInvalidArgument);
    }
    EXPECT_EQ(MoeExperts(params, workspace.get(), bytes - 1, nullptr).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// One kind of matrix (gate, up or down) of every expert as a checkpoint stores it, quantized, and
// its dequantized values: INT4 (random nibbles, bf16 scales per group of 32 columns: words
// [experts, rows, ceil(cols / 8)] and scales [experts, rows, ceil(cols / 32)]) or FP8 (random e4m3,
// fp32 scales per 128 x 128 block: bytes [experts, rows, cols] and scales [experts, ceil(rows /
// 128), ceil(cols / 128)]).
enum class ExpertFormat { kInt4, kFp8 };
struct QuantizedMatrices {
  std::vector<uint8_t> values, scales;          // as the checkpoint stores them
  std::vector<std::vector<float>> dequantized;  // per expert [rows, cols], as the loader does
};

template <typename T>
void Append(std::vector<uint8_t>& bytes, T value) {
  const auto* begin = reinterpret_cast<const uint8_t*>(&value);
  bytes.insert(bytes.end(), begin, begin + sizeof(T));
}

QuantizedMatrices RandomQuantized(ExpertFormat format, std::mt19937& rng, int32_t experts,
                                  int64_t rows, int64_t cols) {
  QuantizedMatrices m;
  std::uniform_int_distribution<uint32_t> bits;
  const float fan_in = static_cast<float>(cols);
  if (format == ExpertFormat::kInt4) {
    const int64_t words = (cols + 7) / 8, groups = (cols + 31) / 32;
    // Weights of std about 1/sqrt(cols): the nibbles' values have an rms of 4.6.
    std::normal_distribution<float> scale(0.0f, 1.0f / (4.6f * std::sqrt(fan_in)));
    for (int32_t e = 0; e < experts; ++e) {
      std::vector<float>& values = m.dequantized.emplace_back(rows * cols);
      for (int64_t r = 0; r < rows; ++r) {
        std::vector<uint32_t> row_words(words);
        std::vector<float> row_scales(groups);
        for (uint32_t& w : row_words) Append(m.values, w = bits(rng));
        for (float& g : row_scales) {
          const Bf16 bf16 = __float2bfloat16_rn(scale(rng));
          Append(m.scales, bf16);
          g = __bfloat162float(bf16);
        }
        for (int64_t c = 0; c < cols; ++c) {
          const int nibble = static_cast<int>(row_words[c / 8] >> (4 * (c % 8)) & 0xF);
          values[r * cols + c] = static_cast<float>(nibble - 8) * row_scales[c / 32];
        }
      }
    }
    return m;
  }
  const int64_t block_rows = (rows + 127) / 128, block_cols = (cols + 127) / 128;
  // e4m3 of every finite code's sign and size (0x7f and 0xff are NaN); weights of std about
  // 1/sqrt(cols) with scales near 1/(8 sqrt(cols)) (the codes' values span +-448).
  std::normal_distribution<float> scale(0.0f, 1.0f / (8.0f * std::sqrt(fan_in)));
  std::uniform_int_distribution<int> code(0, 255), small(0x18, 0x58);
  for (int32_t e = 0; e < experts; ++e) {
    std::vector<float> scales(block_rows * block_cols);
    for (float& s : scales) Append(m.scales, s = scale(rng));
    std::vector<float>& values = m.dequantized.emplace_back(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        // Mostly small codes (sizes like a trained layer's), every finite code now and then.
        int byte = code(rng) % 8 == 0 ? code(rng) : small(rng) | (code(rng) & 0x80);
        if ((byte & 0x7f) == 0x7f) byte &= 0xfe;
        m.values.push_back(static_cast<uint8_t>(byte));
        const float value = __half2float(
            __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3)));
        values[r * cols + c] = value * scales[(r / 128) * block_cols + c / 128];
      }
    }
  }
  return m;
}

// Quantized experts (moe_records.h: INT4, W4A16; FP8, W8A16) give the sums of the bf16 experts on
// their dequantized weights (the bf16 a loader rounds them to; bit for bit where neither stream
// parts the reduction), and so are close to the CPU backend on the dequantized fp32 weights: at
// shapes whose groups, chunks, blocks and row tiles end part way (a partial group's or block's
// scale, values past the matrix), with more than a token group per expert, at few pairs
// (reductions in parts), at a Kimi-K2 rank's shape, and at prefill sizes (the grouped GEMM with
// the records dequantized per stage where the tiles are whole, else the stream).
void ExpectQuantizedExpertsStream(ExpertFormat format) {
  struct Case {
    int64_t tokens;
    int32_t experts, top_k;
    int64_t hidden, intermediate;
  };
  const unsigned seed = format == ExpertFormat::kInt4 ? 4096 : 8192;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const bool int4 = format == ExpertFormat::kInt4;
  // The last two at prefill sizes: whole tiles (the grouped GEMM) and odd ones (the stream).
  for (const Case& c : {Case{16, 8, 4, 256, 64}, Case{40, 8, 6, 232, 72}, Case{3, 16, 8, 7168, 256},
                        Case{600, 16, 4, 256, 128}, Case{520, 8, 4, 232, 72}}) {
    SCOPED_TRACE(testing::Message() << c.tokens << " tokens, " << c.experts << " experts, hidden "
                                    << c.hidden << ", intermediate " << c.intermediate);
    const QuantizedMatrices gate =
        RandomQuantized(format, rng, c.experts, c.intermediate, c.hidden);
    const QuantizedMatrices up = RandomQuantized(format, rng, c.experts, c.intermediate, c.hidden);
    const QuantizedMatrices down =
        RandomQuantized(format, rng, c.experts, c.hidden, c.intermediate);
    const std::vector<float> x = RoundToBf16(Random(rng, c.tokens * c.hidden));
    std::vector<int32_t> ids;
    std::vector<float> topk_weights;
    RandomRouting(rng, c.tokens, c.experts, c.top_k, ids, topk_weights);
    std::vector<const float*> gate_ptrs, up_ptrs, down_ptrs;
    for (int32_t e = 0; e < c.experts; ++e) {
      gate_ptrs.push_back(gate.dequantized[e].data());
      up_ptrs.push_back(up.dequantized[e].data());
      down_ptrs.push_back(down.dequantized[e].data());
    }
    std::vector<float> expected(c.tokens * c.hidden);
    ASSERT_TRUE(cpu::MoeExperts({.x = x.data(),
                                 .topk_ids = ids.data(),
                                 .topk_weights = topk_weights.data(),
                                 .gate_proj = gate_ptrs.data(),
                                 .up_proj = up_ptrs.data(),
                                 .down_proj = down_ptrs.data(),
                                 .out = expected.data(),
                                 .tokens = c.tokens,
                                 .top_k = c.top_k,
                                 .hidden = c.hidden,
                                 .intermediate = c.intermediate,
                                 .num_local_experts = c.experts})
                    .ok());

    // The records, packed on the device from the checkpoint's layout.
    const MoeRecordLayout gate_up_records = int4 ? Int4GateUpLayout(c.intermediate, c.hidden)
                                                 : Fp8GateUpLayout(c.intermediate, c.hidden);
    const MoeRecordLayout down_records =
        int4 ? Int4DownLayout(c.hidden, c.intermediate) : Fp8DownLayout(c.hidden, c.intermediate);
    std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> stored;
    for (const QuantizedMatrices* m : {&gate, &up, &down}) {
      for (const std::vector<uint8_t>* bytes : {&m->values, &m->scales}) {
        stored.push_back(std::make_unique<DeviceBuffer<uint8_t>>(bytes->size()));
        stored.back()->CopyFrom(*bytes);
      }
    }
    auto values = [&](int m) { return stored[2 * m]->get(); };
    auto scales = [&](int m) { return stored[2 * m + 1]->get(); };
    DeviceBuffer<uint8_t> d_gate_up(c.experts * gate_up_records.ExpertBytes()),
        d_down(c.experts * down_records.ExpertBytes());
    if (int4) {
      auto words = [&](int m) { return reinterpret_cast<const uint32_t*>(values(m)); };
      auto bf16 = [&](int m) { return reinterpret_cast<const Bf16*>(scales(m)); };
      ASSERT_TRUE(PackInt4ExpertTilesOnDevice({words(0), words(1)}, {bf16(0), bf16(1)}, c.experts,
                                              gate_up_records, d_gate_up.get(), nullptr)
                      .ok());
      ASSERT_TRUE(PackInt4ExpertTilesOnDevice({words(2), nullptr}, {bf16(2), nullptr}, c.experts,
                                              down_records, d_down.get(), nullptr)
                      .ok());
    } else {
      auto fp32 = [&](int m) { return reinterpret_cast<const float*>(scales(m)); };
      ASSERT_TRUE(PackFp8ExpertTilesOnDevice({values(0), values(1)}, {fp32(0), fp32(1)}, c.experts,
                                             gate_up_records, d_gate_up.get(), nullptr)
                      .ok());
      ASSERT_TRUE(PackFp8ExpertTilesOnDevice({values(2), nullptr}, {fp32(2), nullptr}, c.experts,
                                             down_records, d_down.get(), nullptr)
                      .ok());
    }
    // The bf16 tiles of the dequantized weights.
    const MoeTileLayout gate_up_layout = GateUpTileLayout(c.intermediate, c.hidden);
    const MoeTileLayout down_layout = DownTileLayout(c.hidden, c.intermediate);
    DeviceBuffer<Bf16> d_gate_up_tiles(c.experts * gate_up_layout.ExpertElements()),
        d_down_tiles(c.experts * down_layout.ExpertElements());
    d_gate_up_tiles.CopyFrom(
        PackExpertTiles(c.experts, gate_up_layout, [&](int m, int64_t e, int64_t r, int64_t col) {
          return (m == 0 ? gate : up).dequantized[e][r * c.hidden + col];
        }));
    d_down_tiles.CopyFrom(
        PackExpertTiles(c.experts, down_layout, [&](int, int64_t e, int64_t r, int64_t col) {
          return down.dequantized[e][r * c.intermediate + col];
        }));

    DeviceBuffer<Bf16> d_x(x.size());
    d_x.CopyFrom(ToBf16(x));
    DeviceBuffer<int32_t> d_ids(ids.size());
    DeviceBuffer<float> d_topk_weights(topk_weights.size()), d_out(expected.size());
    d_ids.CopyFrom(ids);
    d_topk_weights.CopyFrom(topk_weights);
    const int64_t bytes =
        MoeExpertsWorkspaceBytes(c.tokens, c.top_k, c.experts, c.intermediate, c.hidden);
    DeviceBuffer<uint8_t> workspace(bytes);
    ASSERT_EQ(cudaMemset(workspace.get(), 0, bytes), cudaSuccess);
    MoeExpertsParamsOf<Bf16, Bf16> quantized{.x = d_x.get(),
                                             .topk_ids = d_ids.get(),
                                             .topk_weights = d_topk_weights.get(),
                                             .out = d_out.get(),
                                             .tokens = c.tokens,
                                             .top_k = c.top_k,
                                             .hidden = c.hidden,
                                             .intermediate = c.intermediate,
                                             .num_local_experts = c.experts};
    (int4 ? quantized.int4_gate_up : quantized.fp8_gate_up) = d_gate_up.get();
    (int4 ? quantized.int4_down : quantized.fp8_down) = d_down.get();
    ASSERT_TRUE(MoeExperts(quantized, workspace.get(), bytes, nullptr).ok());
    const std::vector<float> streamed = d_out.ToHost();
    double scale_out = 0.0;
    for (float v : expected) scale_out = std::max(scale_out, double{std::abs(v)});
    ExpectClose(streamed, expected, 2 * kBf16Relative, 0.01f * scale_out, "quantized experts");
    ASSERT_TRUE(MoeExperts(quantized, workspace.get(), bytes, nullptr).ok());
    EXPECT_EQ(d_out.ToHost(), streamed) << "a second launch";

    MoeExpertsParamsOf<Bf16, Bf16> bf16 = quantized;
    bf16.int4_gate_up = bf16.int4_down = bf16.fp8_gate_up = bf16.fp8_down = nullptr;
    bf16.packed_gate = d_gate_up_tiles.get();
    bf16.packed_up = d_gate_up_tiles.get() + gate_up_layout.TileElements();
    bf16.packed_down = d_down_tiles.get();
    ASSERT_TRUE(MoeExperts(bf16, workspace.get(), bytes, nullptr).ok());
    const std::vector<float> tiles = d_out.ToHost();
    // Parted reductions (few pairs, long reductions): the quantized stream cuts its parts at its
    // stages' edges (256 or 128 columns), the bf16 stream at its 64-column ones, so the fp32
    // partial sums add in other groupings. Otherwise both take the same kernel (the stream, or
    // from 512 tokens at whole tiles the grouped GEMM, the records dequantized per stage) on the
    // same bf16 weights: the same sums in the same order.
    const bool parted = c.tokens * c.top_k <= 512 && c.hidden >= 512;
    if (parted) {
      ExpectClose(streamed, tiles, 1e-5f, 1e-5f * scale_out, "the bf16 stream, parted");
    } else {
      EXPECT_EQ(streamed, tiles) << "the bf16 experts' kernel on the dequantized weights";
    }
  }
}

TEST_F(CudaForwardOpsTest, MoeExpertsInt4StreamsItsDequantizedWeights) {
  if (device_.compute_capability_major < 9) {
    GTEST_SKIP() << "GPU test skipped: quantized experts stream on sm_90 and later";
  }
  ExpectQuantizedExpertsStream(ExpertFormat::kInt4);
}

TEST_F(CudaForwardOpsTest, MoeExpertsFp8StreamsItsDequantizedWeights) {
  if (device_.compute_capability_major < 9) {
    GTEST_SKIP() << "GPU test skipped: quantized experts stream on sm_90 and later";
  }
  ExpectQuantizedExpertsStream(ExpertFormat::kFp8);
}

// The routing's last block groups the pairs (MoeRoutingAndGrouping) exactly as MoeExperts' own
// grouping does: the same ids, weights, active count and output bytes as routing then MoeExperts
// on a workspace of its own, launch after launch on new logits (the block count back at zero
// after each), into a workspace and outputs filled with garbage first (so a grouping that did not
// run, or ran on stale ids, shows), with padding rows; under the stream (tiles), the grouped GEMM
// (512 tokens) and the CUDA-core kernels (pointer arrays); and a prefill batch's entries, too many
// for the staged grouping, are left to MoeExperts.
struct RouteAndGroupCase {
  int64_t tokens;
  int32_t experts, first_expert, local_experts;
  int32_t routed;  // rows routed (the rest pad a graph's shape)
  MoeGrouping expected;
  bool tiles = true;  // the experts as tiles, else row-major behind pointer arrays
};

TEST_F(CudaForwardOpsTest, MoeRoutingAndGroupingGroupsAsTheExpertsWould) {
  const unsigned seed = 512;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int32_t top_k = 8;
  const int64_t hidden = 256, intermediate = 64;
  for (const RouteAndGroupCase& c : {
           // Kimi-K2's router under split inside (every expert local), 16 rows of which 13 route.
           RouteAndGroupCase{16, 384, 0, 384, 13, MoeGrouping::kInRouting},
           // Whole experts: this rank holds [96, 192).
           RouteAndGroupCase{16, 384, 96, 96, 16, MoeGrouping::kInRouting},
           // The CUDA-core kernels.
           RouteAndGroupCase{16, 384, 0, 384, 16, MoeGrouping::kInRouting, false},
           // 512 x 8 entries, grouped in the routing, multiplied by the grouped GEMM.
           RouteAndGroupCase{512, 64, 0, 64, 500, MoeGrouping::kInRouting},
           // 1100 x 8 entries: past the staged grouping's shared memory.
           RouteAndGroupCase{1100, 64, 0, 64, 1100, MoeGrouping::kInExperts},
       }) {
    SCOPED_TRACE(testing::Message() << c.tokens << " tokens, experts [" << c.first_expert << ", +"
                                    << c.local_experts << ")" << (c.tiles ? "" : ", pointers"));
    DeviceBuffer<float> d_logits(c.tokens * c.experts), d_bias(c.experts),
        d_weights(c.tokens * top_k), d_out(c.tokens * hidden);
    DeviceBuffer<int32_t> d_ids(c.tokens * top_k), d_routed(1), d_active(1);
    d_bias.CopyFrom(Random(rng, c.experts, 0.1f));
    d_routed.CopyFrom({c.routed});
    DeviceBuffer<Bf16> d_x(c.tokens * hidden);
    d_x.CopyFrom(ToBf16(Random(rng, c.tokens * hidden)));
    // The experts (their values random: the layout does not matter to the comparison).
    const float scale = 1.0f / std::sqrt(static_cast<float>(hidden));
    const MoeTileLayout gate_up = GateUpTileLayout(intermediate, hidden);
    const int64_t gate_up_elements = c.local_experts * gate_up.ExpertElements();
    const int64_t down_elements =
        c.local_experts * DownTileLayout(hidden, intermediate).ExpertElements();
    DeviceBuffer<Bf16> d_gate_up(gate_up_elements), d_down(down_elements);
    d_gate_up.CopyFrom(ToBf16(Random(rng, gate_up_elements, scale)));
    d_down.CopyFrom(ToBf16(Random(rng, down_elements, scale)));
    // Row-major: gate, then up, in the gate/up buffer; down in its own.
    const int64_t matrix = intermediate * hidden;
    std::vector<const Bf16*> gate, up, down;
    for (int32_t e = 0; e < c.local_experts; ++e) {
      gate.push_back(d_gate_up.get() + e * matrix);
      up.push_back(d_gate_up.get() + (c.local_experts + e) * matrix);
      down.push_back(d_down.get() + e * matrix);
    }
    DeviceBuffer<const Bf16*> d_gate_ptrs(gate.size()), d_up_ptrs(up.size()),
        d_down_ptrs(down.size());
    d_gate_ptrs.CopyFrom(gate);
    d_up_ptrs.CopyFrom(up);
    d_down_ptrs.CopyFrom(down);
    const MoeRoutingParams routing{.router_logits = d_logits.get(),
                                   .correction_bias = d_bias.get(),
                                   .topk_ids = d_ids.get(),
                                   .topk_weights = d_weights.get(),
                                   .tokens = c.tokens,
                                   .num_experts = c.experts,
                                   .top_k = top_k,
                                   .routed_scaling_factor = 2.5f,
                                   .routed_tokens = d_routed.get()};
    MoeExpertsParamsOf<Bf16, Bf16> experts{.x = d_x.get(),
                                           .topk_ids = d_ids.get(),
                                           .topk_weights = d_weights.get(),
                                           .out = d_out.get(),
                                           .tokens = c.tokens,
                                           .top_k = top_k,
                                           .hidden = hidden,
                                           .intermediate = intermediate,
                                           .first_expert = c.first_expert,
                                           .num_local_experts = c.local_experts};
    if (c.tiles) {
      experts.packed_gate = d_gate_up.get();
      experts.packed_up = d_gate_up.get() + gate_up.TileElements();
      experts.packed_down = d_down.get();
    } else {
      experts.gate_proj = d_gate_ptrs.get();
      experts.up_proj = d_up_ptrs.get();
      experts.down_proj = d_down_ptrs.get();
    }
    const int64_t bytes =
        MoeExpertsWorkspaceBytes(c.tokens, top_k, c.local_experts, intermediate, hidden);
    DeviceBuffer<uint8_t> workspace(bytes), baseline_workspace(bytes);
    ASSERT_EQ(cudaMemset(workspace.get(), 0, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(baseline_workspace.get(), 0, bytes), cudaSuccess);
    for (int launch = 0; launch < 3; ++launch) {
      SCOPED_TRACE(testing::Message() << "launch " << launch);
      d_logits.CopyFrom(Random(rng, c.tokens * c.experts, 2.0f));
      ASSERT_TRUE(MoeRouting(routing, nullptr).ok());
      ASSERT_TRUE(
          MoeExperts(experts, baseline_workspace.get(), bytes, nullptr, d_active.get()).ok());
      const std::vector<int32_t> ids = d_ids.ToHost();
      const std::vector<float> weights = d_weights.ToHost(), out = d_out.ToHost();
      const int32_t active = d_active.ToHost()[0];
      EXPECT_GT(active, 0);
      // Garbage everywhere the fused launch must write, and in the workspace past its count.
      ASSERT_EQ(cudaMemset(d_out.get(), 0xff, d_out.bytes()), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_ids.get(), 0xff, d_ids.bytes()), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_weights.get(), 0xff, d_weights.bytes()), cudaSuccess);
      ASSERT_EQ(cudaMemset(workspace.get() + 256, 0xff, bytes - 256), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_active.get(), 0, sizeof(int32_t)), cudaSuccess);
      const absl::StatusOr<MoeGrouping> grouping =
          MoeRoutingAndGrouping(routing, experts, workspace.get(), bytes, nullptr, d_active.get());
      ASSERT_TRUE(grouping.ok()) << grouping.status();
      EXPECT_EQ(*grouping, c.expected);
      ASSERT_TRUE(
          MoeExperts(experts, workspace.get(), bytes, nullptr, d_active.get(), nullptr, *grouping)
              .ok());
      EXPECT_EQ(d_ids.ToHost(), ids);
      EXPECT_EQ(d_weights.ToHost(), weights);
      EXPECT_EQ(d_active.ToHost()[0], active);
      const std::vector<float> again = d_out.ToHost();
      ASSERT_EQ(again.size(), out.size());
      EXPECT_EQ(std::memcmp(again.data(), out.data(), out.size() * sizeof(float)), 0);
      int32_t arrivals = -1;  // the routing blocks' count, back at zero
      ASSERT_EQ(cudaMemcpy(&arrivals, workspace.get(), sizeof(int32_t), cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(arrivals, 0);
    }
  }
}

// The summary of the same fp32 logits on both backends: greedy fields, the Gumbel winner and the
// candidates equal; the log-sum-exps (double sums in another order) within an ulp or two. Both
// GPU kernels: one block a row, and a row's slices over blocks (vocab 65536: 16 slices of 4096).
TEST_F(CudaForwardOpsTest, LmHeadSummaryMatchesTheCpuBackend) {
  const unsigned seed = 510;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  absl::StatusOr<LmHeadSummaryScratch> allocated = AllocateLmHeadSummaryScratch(8);
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  LmHeadSummaryScratch scratch = *allocated;  // freed at the end
  for (const int64_t vocab : {int64_t{7}, int64_t{733}, int64_t{20480}, int64_t{65536}}) {
    for (const float temperature : {0.0f, 0.7f}) {
      for (const int32_t candidates : {0, 5, 9}) {
        SCOPED_TRACE(testing::Message()
                     << "vocab " << vocab << ", T " << temperature << ", K " << candidates);
        const int64_t rows = 5;
        std::vector<float> logits = Random(rng, rows * vocab, 3.0f);
        logits[1] = logits[2] = 50.0f;  // a tie for the maximum: the smaller id wins
        if (vocab > 10) logits[vocab + 3] = logits[vocab + 4];  // a tie among candidates
        std::vector<int64_t> positions(rows);
        for (int64_t& p : positions) p = std::uniform_int_distribution<int64_t>(0, 100000)(rng);
        LmHeadSummaryParams params{.rows = rows,
                                   .vocab_shard = vocab,
                                   .vocab_begin = 1000,
                                   .temperature = temperature,
                                   .seed = 0x1234abcdULL,
                                   .num_candidates = candidates};
        std::vector<NodeSummary> expected(rows);
        std::vector<Candidate> expected_candidates(rows * candidates);
        params.logits = logits.data();
        params.positions = positions.data();
        params.out = expected.data();
        params.candidates = expected_candidates.data();
        ASSERT_TRUE(cpu::LmHeadSummary(params).ok());
        DeviceBuffer<float> d_logits(logits.size());
        DeviceBuffer<int64_t> d_positions(rows);
        DeviceBuffer<NodeSummary> d_out(rows);
        DeviceBuffer<Candidate> d_candidates(std::max<int64_t>(1, rows * candidates));
        d_logits.CopyFrom(logits);
        d_positions.CopyFrom(positions);
        params.logits = d_logits.get();
        params.positions = d_positions.get();
        params.out = d_out.get();
        params.candidates = d_candidates.get();
        // One block per row, then (candidates aside) a row's slices over several blocks, twice
        // (the arrival counters zeroed again for the next launch).
        for (int pass = 0; pass < 3; ++pass) {
          SCOPED_TRACE(testing::Message() << (pass == 0 ? "one block a row" : "sliced"));
          ASSERT_EQ(cudaMemset(d_out.get(), 0xff, rows * sizeof(NodeSummary)), cudaSuccess);
          if (pass == 0) {
            ASSERT_TRUE(LmHeadSummary(params, nullptr).ok());
          } else {
            ASSERT_TRUE(LmHeadSummary(params, scratch, nullptr).ok());
          }
          const std::vector<NodeSummary> actual = d_out.ToHost();
          for (int64_t r = 0; r < rows; ++r) {
            EXPECT_EQ(actual[r].argmax, expected[r].argmax) << "row " << r;
            EXPECT_EQ(actual[r].max_logit, expected[r].max_logit) << "row " << r;
            EXPECT_NEAR(actual[r].log_sum_exp, expected[r].log_sum_exp,
                        2e-6f * std::abs(expected[r].log_sum_exp) + 1e-6f);
            EXPECT_EQ(actual[r].sampled_token, expected[r].sampled_token) << "row " << r;
            EXPECT_EQ(actual[r].sampled_logit, expected[r].sampled_logit) << "row " << r;
            if (std::isfinite(expected[r].sampled_score)) {
              EXPECT_NEAR(actual[r].sampled_score, expected[r].sampled_score,
                          1e-12 * (1.0 + std::abs(expected[r].sampled_score)));
            } else {  // greedy: the default -inf
              EXPECT_EQ(actual[r].sampled_score, expected[r].sampled_score);
            }
            EXPECT_NEAR(actual[r].log_sum_exp_at_temperature,
                        expected[r].log_sum_exp_at_temperature,
                        2e-6f * std::abs(expected[r].log_sum_exp_at_temperature) + 1e-6f);
          }
          if (candidates > 0) {
            const std::vector<Candidate> got = d_candidates.ToHost();
            for (int64_t i = 0; i < rows * candidates; ++i) {
              EXPECT_EQ(got[i].token_id, expected_candidates[i].token_id) << "candidate " << i;
              EXPECT_EQ(got[i].logit, expected_candidates[i].logit) << "candidate " << i;
            }
          }
        }
      }
    }
  }
  FreeLmHeadSummaryScratch(scratch);
}

// The phase clock: stamps on one stream are in order, nanoseconds apart as the host sees them.
TEST_F(CudaForwardOpsTest, GlobalTimerStampsFollowTheStream) {
  DeviceBuffer<uint64_t> stamps(2);
  ASSERT_TRUE(RecordGlobalTimer(stamps.get(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(2)) {
  }
  ASSERT_TRUE(RecordGlobalTimer(stamps.get() + 1, nullptr).ok());
  const std::vector<uint64_t> t = stamps.ToHost();
  // The second kernel was launched 2 ms after the first had run; well under a second.
  EXPECT_GT(t[1] - t[0], uint64_t{1'000'000});
  EXPECT_LT(t[1] - t[0], uint64_t{1'000'000'000});
}

// Parameter checks happen before any CUDA call, so they run without a GPU too.
TEST(CudaForwardOpsParamsTest, BadShapesAreInvalidArguments) {
  EXPECT_EQ(Embedding({.tokens = 1, .hidden = 0}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RecordGlobalTimer(nullptr, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNorm(RmsNormParamsOf<float, Bf16, Bf16>{.rows = 1, .dim = 4}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  float sum = 0.0f;
  EXPECT_EQ(
      RmsNorm(RmsNormParamsOf<float, Bf16, Bf16>{.rows = 1, .dim = 4, .sum = &sum}, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Rope(RopeParamsOf<Bf16, Bf16>{.rows = 1, .rope_dim = 3}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Rope(RopeParamsOf<float, Bf16>{.rows = 1, .rope_dim = 1024}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SiluMul({.rows = -1, .dim = 4}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LmHeadSummary({.rows = 1, .vocab_shard = 0}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LmHeadSummary({.rows = 1, .vocab_shard = 8, .num_candidates = 1025}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvAppend({.count = 1, .row_dim = 0}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvCopy({.count = 1, .row_dim = 4, .num_slots = 2, .num_layers = 0}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);

  // MoE: routing that cannot be done, and expert launches whose workspace is too small (the
  // pointers are never dereferenced: the checks come first).
  float logits = 0.0f;
  int32_t ids = 0;
  const MoeRoutingParams routing{.router_logits = &logits,
                                 .topk_ids = &ids,
                                 .topk_weights = &logits,
                                 .tokens = 1,
                                 .num_experts = 8,
                                 .top_k = 9,
                                 .method = MoeTopkMethod::kGreedy};
  EXPECT_EQ(MoeRouting(routing, nullptr).code(), absl::StatusCode::kInvalidArgument);
  MoeRoutingParams no_bias = routing;
  no_bias.top_k = 2;
  no_bias.method = MoeTopkMethod::kNoauxTc;  // needs a correction bias
  EXPECT_EQ(MoeRouting(no_bias, nullptr).code(), absl::StatusCode::kInvalidArgument);
  const Bf16* weights[1] = {nullptr};
  Bf16 x{};
  alignas(256) static uint8_t workspace[256];
  const MoeExpertsParamsOf<Bf16, Bf16> experts{.x = &x,
                                               .topk_ids = &ids,
                                               .topk_weights = &logits,
                                               .gate_proj = weights,
                                               .up_proj = weights,
                                               .down_proj = weights,
                                               .out = &logits,
                                               .tokens = 4,
                                               .top_k = 2,
                                               .hidden = 64,
                                               .intermediate = 32,
                                               .num_local_experts = 8};
  const int64_t needed = MoeExpertsWorkspaceBytes(4, 2, 8, 32, 64);
  EXPECT_GT(needed, 256);
  const absl::Status small = MoeExperts(experts, workspace, 256, nullptr);
  EXPECT_EQ(small.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(small.message()), testing::HasSubstr(std::to_string(needed)));
  MoeExpertsParamsOf<Bf16, Bf16> partly = experts;  // two of the three tiles
  partly.packed_gate = partly.packed_up = &x;
  EXPECT_EQ(MoeExperts(partly, workspace, needed, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  MoeExpertsParamsOf<Bf16, Bf16> apart = experts;  // tiles, but gate and up not interleaved
  apart.packed_gate = apart.packed_up = apart.packed_down = &x;
  const absl::Status not_interleaved = MoeExperts(apart, workspace, needed, nullptr);
  EXPECT_EQ(not_interleaved.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(not_interleaved.message()), testing::HasSubstr("interleaved"));
  alignas(16) static uint8_t int4_stages[32];
  MoeExpertsParamsOf<Bf16, Bf16> int4_and_bf16 = experts;  // INT4 stages come alone
  int4_and_bf16.int4_gate_up = int4_and_bf16.int4_down = int4_stages;
  EXPECT_EQ(MoeExperts(int4_and_bf16, workspace, needed, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  MoeExpertsParamsOf<Bf16, Bf16> int4_half = experts;  // gate/up without down
  int4_half.gate_proj = int4_half.up_proj = int4_half.down_proj = nullptr;
  int4_half.int4_gate_up = int4_stages;
  EXPECT_EQ(MoeExperts(int4_half, workspace, needed, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  MoeExpertsParamsOf<Bf16, Bf16> two_formats = int4_half;  // INT4 and FP8 records at once
  two_formats.int4_down = two_formats.fp8_gate_up = two_formats.fp8_down = int4_stages;
  EXPECT_EQ(MoeExperts(two_formats, workspace, needed, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PackFp8ExpertTilesOnDevice({nullptr, nullptr}, {nullptr, nullptr}, 1,
                                       Fp8GateUpLayout(64, 64), int4_stages, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PackFp8ExpertTilesOnDevice({int4_stages, int4_stages},
                                       {reinterpret_cast<const float*>(int4_stages),
                                        reinterpret_cast<const float*>(int4_stages)},
                                       1, Int4GateUpLayout(64, 64), int4_stages, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);  // an INT4 layout
  MoeExpertsParamsOf<Bf16, Bf16> int4_unaligned = int4_half;
  int4_unaligned.int4_down = int4_stages + 8;
  const absl::Status unaligned = MoeExperts(int4_unaligned, workspace, needed, nullptr);
  EXPECT_EQ(unaligned.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unaligned.message()), testing::HasSubstr("16-byte aligned"));
  EXPECT_EQ(PackInt4ExpertTilesOnDevice({nullptr, nullptr}, {nullptr, nullptr}, 1,
                                        Int4GateUpLayout(64, 64), int4_stages, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  MoeExpertsParamsOf<Bf16, Bf16> too_many = experts;
  too_many.tokens = 65536;  // the combine's grid
  EXPECT_EQ(MoeExperts(too_many, workspace, 256, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  // Routing and grouping together: the experts must read the routing's ids, into a workspace
  // large enough.
  int32_t other_ids_buffer = 0;
  MoeRoutingParams routed = routing;
  routed.top_k = 2;
  routed.tokens = 4;
  routed.topk_ids = &other_ids_buffer;
  const absl::StatusOr<MoeGrouping> other_ids =
      MoeRoutingAndGrouping(routed, experts, workspace, needed, nullptr);
  EXPECT_EQ(other_ids.status().code(), absl::StatusCode::kInvalidArgument);
  routed.topk_ids = &ids;  // the experts' ids
  const absl::StatusOr<MoeGrouping> too_small =
      MoeRoutingAndGrouping(routed, experts, workspace, 256, nullptr);
  EXPECT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_small.status().message()),
              testing::HasSubstr(std::to_string(needed)));
}

}  // namespace
}  // namespace treeverify::kernels::cuda
