// The prefill path's kernels: the flash-attention kernel of the MHA form against a plain
// reference of the same formula (double, on the bf16 values the GPU reads), for DeepSeek's head
// dimensions and the test models' padded ones, chains with and without a committed prefix and
// partial row and key tiles; and the gather of a sequence's cache rows through its page table.
// That the MHA form equals the absorbed tree attention is the forward's test
// (cuda_forward_test: the prefill path against the CPU backend).
#include "treeverify/kernels/cuda/mha_prefill_attention.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cuda_test_base.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/cuda/kv_cache_ops.h"

namespace treeverify::kernels::cuda {
namespace {

std::vector<Bf16> RandomBf16(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Bf16> values(n);
  for (Bf16& v : values) v = __float2bfloat16_rn(normal(rng));
  return values;
}

float F(Bf16 v) { return __bfloat162float(v); }

struct Dims {
  int32_t nope, rope, v;
};

struct Chain {
  int32_t rows, committed;
};

// out[r, h, :] = softmax_k(scale * (q_nope . k_nope + q_pe . k_rope)) v over keys 0..committed + r.
std::vector<double> Reference(const std::vector<Bf16>& q, const std::vector<Bf16>& kv_up,
                              const std::vector<Bf16>& k_rope, int64_t k_rope_stride, const Dims& d,
                              int32_t heads, const Chain& chain, double scale) {
  const int64_t qk = d.nope + d.rope, up = d.nope + d.v;
  std::vector<double> out(int64_t{chain.rows} * heads * d.v, 0.0);
  std::vector<double> scores;
  for (int32_t r = 0; r < chain.rows; ++r) {
    const int32_t visible = chain.committed + r + 1;
    for (int32_t h = 0; h < heads; ++h) {
      const Bf16* qr = q.data() + (int64_t{r} * heads + h) * qk;
      scores.assign(visible, 0.0);
      double max = -INFINITY;
      for (int32_t k = 0; k < visible; ++k) {
        const Bf16* kn = kv_up.data() + (int64_t{k} * heads + h) * up;
        const Bf16* kr = k_rope.data() + k * k_rope_stride;
        double dot = 0.0;
        for (int32_t i = 0; i < d.nope; ++i) dot += double{F(qr[i])} * F(kn[i]);
        for (int32_t i = 0; i < d.rope; ++i) dot += double{F(qr[d.nope + i])} * F(kr[i]);
        scores[k] = dot * scale;
        max = std::max(max, scores[k]);
      }
      double sum = 0.0;
      for (double& s : scores) sum += (s = std::exp(s - max));
      double* o = out.data() + (int64_t{r} * heads + h) * d.v;
      for (int32_t k = 0; k < visible; ++k) {
        const Bf16* vk = kv_up.data() + (int64_t{k} * heads + h) * up + d.nope;
        for (int32_t i = 0; i < d.v; ++i) o[i] += scores[k] / sum * F(vk[i]);
      }
    }
  }
  return out;
}

class MhaPrefillAttentionTest : public CudaTest, public testing::WithParamInterface<Dims> {};

TEST_P(MhaPrefillAttentionTest, MatchesTheMhaFormulaOnChainsWithAndWithoutAPrefix) {
  const Dims d = GetParam();
  const int32_t heads = 3;
  const int64_t k_rope_stride = 8 + d.rope + 16;  // rope values inside a wider row, as the cache's
  // One row; a chain from position 0 over whole and partial tiles; chains after prefixes that
  // end inside a key tile.
  for (const Chain chain : {Chain{1, 0}, Chain{130, 0}, Chain{64, 700}, Chain{77, 1001}}) {
    SCOPED_TRACE(testing::Message() << "rows " << chain.rows << ", committed " << chain.committed);
    std::mt19937 rng(chain.rows * 131 + chain.committed);
    const int32_t keys = chain.committed + chain.rows;
    const std::vector<Bf16> q = RandomBf16(rng, int64_t{chain.rows} * heads * (d.nope + d.rope));
    const std::vector<Bf16> kv_up = RandomBf16(rng, int64_t{keys} * heads * (d.nope + d.v));
    const std::vector<Bf16> rope_rows = RandomBf16(rng, keys * k_rope_stride);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d.nope + d.rope));
    DeviceBuffer<Bf16> d_q(q.size()), d_up(kv_up.size()), d_rope(rope_rows.size());
    DeviceBuffer<Bf16> d_out(int64_t{chain.rows} * heads * d.v);
    d_q.CopyFrom(q);
    d_up.CopyFrom(kv_up);
    d_rope.CopyFrom(rope_rows);
    ASSERT_TRUE(MhaPrefillAttention({.q = d_q.get(),
                                     .kv_up = d_up.get(),
                                     .k_rope = d_rope.get() + 8,
                                     .out = d_out.get(),
                                     .rows = chain.rows,
                                     .keys = keys,
                                     .heads = heads,
                                     .nope_dim = d.nope,
                                     .rope_dim = d.rope,
                                     .v_dim = d.v,
                                     .k_rope_stride = k_rope_stride,
                                     .softmax_scale = static_cast<float>(scale)},
                                    nullptr)
                    .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<Bf16> actual = d_out.ToHost();
    const std::vector<Bf16> rope_view(rope_rows.begin() + 8, rope_rows.end());
    const std::vector<double> expected =
        Reference(q, kv_up, rope_view, k_rope_stride, d, heads, chain, scale);
    // P enters the value product in bf16 (2^-9 relative each) and the output is rounded to
    // bf16: a few 2^-8 of the values' scale (1) at most.
    double worst = 0.0;
    for (size_t i = 0; i < expected.size(); ++i) {
      worst = std::max(worst, std::abs(F(actual[i]) - expected[i]));
      ASSERT_NEAR(F(actual[i]), expected[i], 0.02 + std::abs(expected[i]) / 128) << "element " << i;
    }
    RecordProperty("worst_abs_error", std::to_string(worst));
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, MhaPrefillAttentionTest,
                         testing::Values(Dims{128, 64, 128},  // DeepSeek-V2/V3, Kimi-K2
                                         Dims{16, 8, 16},     // the tiny test models (padded)
                                         Dims{32, 16, 32}),   // the demo model (padded)
                         [](const testing::TestParamInfo<Dims>& info) {
                           return "Nope" + std::to_string(info.param.nope) + "Rope" +
                                  std::to_string(info.param.rope) + "V" +
                                  std::to_string(info.param.v);
                         });

class KvGatherTest : public CudaTest {};

TEST_F(KvGatherTest, CopiesASequencesRowsThroughItsPageTableAndZerosThePadding) {
  std::mt19937 rng(77);
  const int64_t row_dim = 40, page_size = 16, num_pages = 9, keys = 50, padded = 64;
  const std::vector<Bf16> cache = RandomBf16(rng, num_pages * page_size * row_dim);
  const std::vector<int32_t> pages = {7, 2, 5, 0};  // 50 keys: three whole pages and two rows
  DeviceBuffer<Bf16> d_cache(cache.size()), d_out(padded * row_dim);
  DeviceBuffer<int32_t> d_pages(pages.size());
  d_cache.CopyFrom(cache);
  d_pages.CopyFrom(pages);
  ASSERT_TRUE(KvGather({.cache = d_cache.get(),
                        .page_table = d_pages.get(),
                        .out = d_out.get(),
                        .keys = keys,
                        .padded_keys = padded,
                        .row_dim = row_dim,
                        .page_size = page_size,
                        .num_pages = num_pages},
                       nullptr)
                  .ok());
  const std::vector<Bf16> out = d_out.ToHost();
  for (int64_t key = 0; key < padded; ++key) {
    for (int64_t i = 0; i < row_dim; ++i) {
      const float expected =
          key < keys
              ? F(cache[(pages[key / page_size] * page_size + key % page_size) * row_dim + i])
              : 0.0f;
      ASSERT_EQ(F(out[key * row_dim + i]), expected) << "key " << key << ", element " << i;
    }
  }
}

// Host-side checks: no GPU needed.
TEST(MhaPrefillParamsTest, UnsupportedDimsAndBadShapesAreInvalidArguments) {
  EXPECT_TRUE(MhaPrefillSupported(128, 64, 128));
  EXPECT_TRUE(MhaPrefillSupported(16, 8, 16));
  EXPECT_FALSE(MhaPrefillSupported(128, 64, 256));  // no kernel built for v = 256
  EXPECT_FALSE(MhaPrefillSupported(12, 8, 16));     // not whole 16-byte units
  const Bf16* some = reinterpret_cast<const Bf16*>(16);
  MhaPrefillParams p{.q = some,
                     .kv_up = some,
                     .k_rope = some,
                     .out = const_cast<Bf16*>(some),
                     .rows = 10,
                     .keys = 5,  // fewer keys than rows
                     .heads = 2,
                     .nope_dim = 16,
                     .rope_dim = 8,
                     .v_dim = 16,
                     .k_rope_stride = 40,
                     .softmax_scale = 1.0f};
  EXPECT_EQ(MhaPrefillAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.keys = 20;
  p.v_dim = 256;
  EXPECT_EQ(MhaPrefillAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      KvGather({.keys = 5, .padded_keys = 4, .row_dim = 8, .page_size = 4, .num_pages = 1}, nullptr)
          .code(),
      absl::StatusCode::kInvalidArgument);
  // 2 (qk + v) per visible (row, key) and head: rows see 11..20 keys here.
  p.v_dim = 16;
  EXPECT_DOUBLE_EQ(MhaPrefillFlops(p), 2.0 * (11 + 20) * 10 / 2 * 2 * (24 + 16));
}

}  // namespace
}  // namespace treeverify::kernels::cuda
