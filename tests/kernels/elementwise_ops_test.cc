// Tests of the CPU row-wise ops (RmsNorm, Rope, SiluMul, Embedding, LmHeadSummary with its
// sampling and candidates, KvAppend, KvCopy) against straightforward double-precision
// references, on random inputs of odd sizes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/activation.h"
#include "treeverify/kernels/embedding.h"
#include "treeverify/kernels/kv_cache_ops.h"
#include "treeverify/kernels/lm_head_summary.h"
#include "treeverify/kernels/philox.h"
#include "treeverify/kernels/rms_norm.h"
#include "treeverify/kernels/rope.h"

namespace treeverify::kernels {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kOddSizes[] = {1, 3, 7, 19, 733};

std::vector<float> RandomFloats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

// Random values of magnitude in [lo, hi] with random signs: never zero, never tiny.
std::vector<float> RandomSignedFloats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::vector<float> values = RandomFloats(rng, n, lo, hi);
  std::bernoulli_distribution negative(0.5);
  for (float& v : values) {
    if (negative(rng)) v = -v;
  }
  return values;
}

void ExpectInvalid(const absl::Status& status, const std::string& needle) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(needle));
}

// ---------------------------------------------------------------------------------------------
// RmsNorm

std::vector<double> RmsNormReference(const float* x, const float* weight, int64_t dim, float eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < dim; ++i) sum += double{x[i]} * x[i];
  const double inv_rms = 1.0 / std::sqrt(sum / dim + eps);
  std::vector<double> y(dim);
  for (int64_t i = 0; i < dim; ++i) y[i] = double{weight[i]} * x[i] * inv_rms;
  return y;
}

TEST(RmsNormTest, MatchesDoubleReference) {
  for (int64_t rows : {1, 3, 7, 19}) {
    for (int64_t dim : kOddSizes) {
      const uint32_t seed = static_cast<uint32_t>(1000 + rows * 7919 + dim);
      SCOPED_TRACE(absl::StrCat("seed=", seed, " rows=", rows, " dim=", dim));
      std::mt19937 rng(seed);
      const int64_t input_stride = dim + 3;
      const int64_t output_stride = dim + 5;
      const std::vector<float> input =
          RandomSignedFloats(rng, static_cast<size_t>(rows * input_stride), 0.01f, 3.0f);
      const std::vector<float> weight = RandomSignedFloats(rng, dim, 0.5f, 1.5f);
      std::vector<float> output(static_cast<size_t>(rows * output_stride), -7.0f);
      const RmsNormParams params{.input = input.data(),
                                 .weight = weight.data(),
                                 .output = output.data(),
                                 .rows = rows,
                                 .dim = dim,
                                 .input_stride = input_stride,
                                 .output_stride = output_stride,
                                 .eps = 1e-6f};
      ASSERT_TRUE(cpu::RmsNorm(params).ok());
      for (int64_t r = 0; r < rows; ++r) {
        const std::vector<double> ref =
            RmsNormReference(&input[r * input_stride], weight.data(), dim, params.eps);
        for (int64_t i = 0; i < dim; ++i) {
          ASSERT_NEAR(output[r * output_stride + i], ref[i], 1e-6 * std::abs(ref[i]))
              << "row " << r << " column " << i;
        }
        // The padding between rows is left alone.
        for (int64_t i = dim; i < output_stride; ++i) {
          ASSERT_EQ(output[r * output_stride + i], -7.0f);
        }
      }
    }
  }
}

TEST(RmsNormTest, InPlaceEqualsOutOfPlace) {
  const uint32_t seed = 17;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t rows = 19;
  const int64_t dim = 733;
  std::vector<float> data = RandomSignedFloats(rng, rows * dim, 0.01f, 3.0f);
  const std::vector<float> weight = RandomSignedFloats(rng, dim, 0.5f, 1.5f);
  std::vector<float> out_of_place(rows * dim);
  ASSERT_TRUE(cpu::RmsNorm({.input = data.data(),
                            .weight = weight.data(),
                            .output = out_of_place.data(),
                            .rows = rows,
                            .dim = dim})
                  .ok());
  ASSERT_TRUE(cpu::RmsNorm({.input = data.data(),
                            .weight = weight.data(),
                            .output = data.data(),
                            .rows = rows,
                            .dim = dim})
                  .ok());
  EXPECT_EQ(0, std::memcmp(data.data(), out_of_place.data(), data.size() * sizeof(float)));
}

TEST(RmsNormTest, ResidualAddNormalizesAndStoresTheSum) {
  const uint32_t seed = 4100;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t rows = 3, dim = 19;
  const std::vector<float> x = RandomSignedFloats(rng, rows * dim, 0.1f, 2.0f);
  const std::vector<float> add = RandomSignedFloats(rng, rows * dim, 0.1f, 2.0f);
  const std::vector<float> weight = RandomFloats(rng, dim, 0.5f, 1.5f);
  // Reference: the sum in fp32, then the plain op on it.
  std::vector<float> sum_expected(rows * dim), expected(rows * dim);
  for (size_t i = 0; i < x.size(); ++i) sum_expected[i] = x[i] + add[i];
  ASSERT_TRUE(cpu::RmsNorm({.input = sum_expected.data(),
                            .weight = weight.data(),
                            .output = expected.data(),
                            .rows = rows,
                            .dim = dim})
                  .ok());
  std::vector<float> residual = x, normed(rows * dim);
  ASSERT_TRUE(cpu::RmsNorm({.input = residual.data(),
                            .weight = weight.data(),
                            .output = normed.data(),
                            .rows = rows,
                            .dim = dim,
                            .add = add.data(),
                            .sum = residual.data()})
                  .ok());
  EXPECT_EQ(residual, sum_expected);
  EXPECT_EQ(normed, expected);
  ExpectInvalid(cpu::RmsNorm({.input = residual.data(),
                              .weight = weight.data(),
                              .output = normed.data(),
                              .rows = rows,
                              .dim = dim,
                              .add = add.data()}),
                "both add and sum");
}

TEST(RmsNormTest, BatchInvariant) {
  for (int64_t rows : {3, 19, 733}) {
    const int64_t dim = 733;
    const uint32_t seed = static_cast<uint32_t>(2000 + rows);
    SCOPED_TRACE(absl::StrCat("seed=", seed, " rows=", rows));
    std::mt19937 rng(seed);
    const std::vector<float> input = RandomSignedFloats(rng, rows * dim, 0.01f, 3.0f);
    const std::vector<float> weight = RandomSignedFloats(rng, dim, 0.5f, 1.5f);
    std::vector<float> batched(rows * dim);
    ASSERT_TRUE(cpu::RmsNorm({.input = input.data(),
                              .weight = weight.data(),
                              .output = batched.data(),
                              .rows = rows,
                              .dim = dim})
                    .ok());
    std::vector<float> alone(dim);
    for (int64_t r = 0; r < rows; ++r) {
      ASSERT_TRUE(cpu::RmsNorm({.input = &input[r * dim],
                                .weight = weight.data(),
                                .output = alone.data(),
                                .rows = 1,
                                .dim = dim})
                      .ok());
      ASSERT_EQ(0, std::memcmp(alone.data(), &batched[r * dim], dim * sizeof(float)))
          << "row " << r;
    }
  }
}

TEST(RmsNormTest, RejectsInvalidParams) {
  std::vector<float> x(16, 1.0f), w(16, 1.0f), y(16);
  const RmsNormParams good{
      .input = x.data(), .weight = w.data(), .output = y.data(), .rows = 2, .dim = 8};
  EXPECT_TRUE(cpu::RmsNorm(good).ok());
  RmsNormParams p = good;
  p.dim = 0;
  ExpectInvalid(cpu::RmsNorm(p), "dim must be > 0, got 0");
  p = good;
  p.rows = -1;
  ExpectInvalid(cpu::RmsNorm(p), "rows");
  p = good;
  p.input = nullptr;
  ExpectInvalid(cpu::RmsNorm(p), "input");
  p = good;
  p.weight = nullptr;
  ExpectInvalid(cpu::RmsNorm(p), "weight");
  p = good;
  p.output = nullptr;
  ExpectInvalid(cpu::RmsNorm(p), "output");
  p = good;
  p.input_stride = 7;
  ExpectInvalid(cpu::RmsNorm(p), "input_stride");
  p = good;
  p.output_stride = 7;
  ExpectInvalid(cpu::RmsNorm(p), "output_stride");
  p = good;
  p.eps = -1.0f;
  ExpectInvalid(cpu::RmsNorm(p), "eps");
  p = good;
  p.rows = 1;
  p.output = x.data();
  p.output_stride = 9;
  ExpectInvalid(cpu::RmsNorm(p), "in-place");
}

// ---------------------------------------------------------------------------------------------
// Rope

std::vector<float> DeepSeekInvFreq(int64_t rope_dim, float base) {
  std::vector<float> inv_freq(rope_dim / 2);
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(1.0 / std::pow(double{base}, 2.0 * i / rope_dim));
  }
  return inv_freq;
}

std::vector<int32_t> RandomPositions(std::mt19937& rng, int64_t rows, int32_t max_position) {
  std::uniform_int_distribution<int32_t> dist(0, max_position);
  std::vector<int32_t> positions(rows);
  for (int32_t& p : positions) p = dist(rng);
  return positions;
}

// Index of the two members of pair i in a head of rope_dim elements.
std::pair<int64_t, int64_t> PairIndices(int64_t i, int64_t rope_dim, bool interleaved) {
  return interleaved ? std::pair<int64_t, int64_t>{2 * i, 2 * i + 1}
                     : std::pair<int64_t, int64_t>{i, i + rope_dim / 2};
}

TEST(RopeTest, MatchesDoubleReference) {
  for (bool interleaved : {true, false}) {
    for (int64_t pairs : {1, 3, 7, 19, 32}) {
      for (int64_t heads : {1, 3, 7}) {
        const int64_t rows = pairs == 32 ? 733 : 7;
        const int64_t rope_dim = 2 * pairs;
        const uint32_t seed = static_cast<uint32_t>(3000 + pairs * 31 + heads + interleaved);
        SCOPED_TRACE(absl::StrCat("seed=", seed, " interleaved=", interleaved,
                                  " rope_dim=", rope_dim, " heads=", heads, " rows=", rows));
        std::mt19937 rng(seed);
        // A rope slice inside wider heads, as the q_pe part of DeepSeek's q.
        const int64_t head_stride = rope_dim + 5;
        const int64_t row_stride = heads * head_stride + 3;
        const int64_t offset = 2;
        std::vector<float> buffer =
            RandomSignedFloats(rng, rows * row_stride + offset, 0.05f, 2.0f);
        const std::vector<float> original = buffer;
        const std::vector<int32_t> positions = RandomPositions(rng, rows, 163840);
        const std::vector<float> inv_freq = DeepSeekInvFreq(rope_dim, 10000.0f);
        const float attention_factor = 1.3707f;
        ASSERT_TRUE(cpu::Rope({.x = buffer.data() + offset,
                               .positions = positions.data(),
                               .inv_freq = inv_freq.data(),
                               .rows = rows,
                               .heads = heads,
                               .rope_dim = rope_dim,
                               .row_stride = row_stride,
                               .head_stride = head_stride,
                               .attention_factor = attention_factor,
                               .interleaved = interleaved})
                        .ok());
        std::vector<char> touched(buffer.size(), 0);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t base = offset + r * row_stride + h * head_stride;
            for (int64_t i = 0; i < pairs; ++i) {
              const auto [a, b] = PairIndices(i, rope_dim, interleaved);
              // The angle is the fp32 product, as in transformers; the rest in double.
              const double angle = static_cast<float>(positions[r]) * inv_freq[i];
              const double c = std::cos(angle) * attention_factor;
              const double s = std::sin(angle) * attention_factor;
              const double x1 = original[base + a];
              const double x2 = original[base + b];
              ASSERT_NEAR(buffer[base + a], x1 * c - x2 * s, 1e-5) << "row " << r << " pair " << i;
              ASSERT_NEAR(buffer[base + b], x2 * c + x1 * s, 1e-5) << "row " << r << " pair " << i;
              touched[base + a] = touched[base + b] = 1;
            }
          }
        }
        for (size_t i = 0; i < buffer.size(); ++i) {
          if (!touched[i]) {
            ASSERT_EQ(buffer[i], original[i]) << "element " << i << " changed";
          }
        }
      }
    }
  }
}

TEST(RopeTest, SeparateInputEqualsInPlace) {
  const uint32_t seed = 4200;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t rows = 5, heads = 3, rope_dim = 8;
  const std::vector<float> inv_freq = DeepSeekInvFreq(rope_dim, 10000.0f);
  const std::vector<int32_t> positions = RandomPositions(rng, rows, 4000);
  // In place on a [rows, heads, 10]-strided buffer; out of place from a [rows, heads, 12] one.
  std::vector<float> in_place(rows * heads * 10), source(rows * heads * 12);
  for (float& v : source) v = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(source.begin() + (r * heads + h) * 12, rope_dim,
                  in_place.begin() + (r * heads + h) * 10);
  std::vector<float> out_of_place(in_place.size(), 0.0f);
  for (bool interleaved : {true, false}) {
    std::vector<float> rotated = in_place;
    ASSERT_TRUE(cpu::Rope({.x = rotated.data(),
                           .positions = positions.data(),
                           .inv_freq = inv_freq.data(),
                           .rows = rows,
                           .heads = heads,
                           .rope_dim = rope_dim,
                           .row_stride = heads * 10,
                           .head_stride = 10,
                           .attention_factor = 1.25f,
                           .interleaved = interleaved})
                    .ok());
    ASSERT_TRUE(cpu::Rope({.x = out_of_place.data(),
                           .positions = positions.data(),
                           .inv_freq = inv_freq.data(),
                           .rows = rows,
                           .heads = heads,
                           .rope_dim = rope_dim,
                           .row_stride = heads * 10,
                           .head_stride = 10,
                           .attention_factor = 1.25f,
                           .interleaved = interleaved,
                           .input = source.data(),
                           .input_row_stride = heads * 12,
                           .input_head_stride = 12})
                    .ok());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < rope_dim; ++i) {
          const int64_t at = (r * heads + h) * 10 + i;
          ASSERT_EQ(out_of_place[at], rotated[at]) << "row " << r << " head " << h << " dim " << i;
        }
  }
}

TEST(RopeTest, BatchInvariant) {
  for (bool interleaved : {true, false}) {
    const int64_t rows = 733;
    const int64_t heads = 3;
    const int64_t rope_dim = 64;
    const uint32_t seed = 4000 + interleaved;
    SCOPED_TRACE(absl::StrCat("seed=", seed, " interleaved=", interleaved));
    std::mt19937 rng(seed);
    const int64_t row_stride = heads * rope_dim;
    const std::vector<float> input = RandomSignedFloats(rng, rows * row_stride, 0.05f, 2.0f);
    const std::vector<int32_t> positions = RandomPositions(rng, rows, 100000);
    const std::vector<float> inv_freq = DeepSeekInvFreq(rope_dim, 10000.0f);
    RopeParams params{.positions = positions.data(),
                      .inv_freq = inv_freq.data(),
                      .rows = rows,
                      .heads = heads,
                      .rope_dim = rope_dim,
                      .row_stride = row_stride,
                      .head_stride = rope_dim,
                      .attention_factor = 1.1f,
                      .interleaved = interleaved};
    std::vector<float> batched = input;
    params.x = batched.data();
    ASSERT_TRUE(cpu::Rope(params).ok());
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<float> alone(input.begin() + r * row_stride,
                               input.begin() + (r + 1) * row_stride);
      RopeParams one = params;
      one.x = alone.data();
      one.positions = &positions[r];
      one.rows = 1;
      ASSERT_TRUE(cpu::Rope(one).ok());
      ASSERT_EQ(0, std::memcmp(alone.data(), &batched[r * row_stride], row_stride * sizeof(float)))
          << "row " << r;
    }
  }
}

// Applies rope to one head of rope_dim elements at one position.
std::vector<float> RotateHead(std::vector<float> head, int32_t position,
                              const std::vector<float>& inv_freq, bool interleaved,
                              float attention_factor = 1.0f) {
  const int64_t rope_dim = static_cast<int64_t>(head.size());
  EXPECT_TRUE(cpu::Rope({.x = head.data(),
                         .positions = &position,
                         .inv_freq = inv_freq.data(),
                         .rows = 1,
                         .rope_dim = rope_dim,
                         .row_stride = rope_dim,
                         .attention_factor = attention_factor,
                         .interleaved = interleaved})
                  .ok());
  return head;
}

std::vector<float> Deinterleave(const std::vector<float>& x) {
  const size_t half = x.size() / 2;
  std::vector<float> y(x.size());
  for (size_t i = 0; i < half; ++i) {
    y[i] = x[2 * i];
    y[i + half] = x[2 * i + 1];
  }
  return y;
}

double Dot(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) sum += double{a[i]} * b[i];
  return sum;
}

TEST(RopeTest, InterleavedAndRotateHalfLayoutsAgree) {
  const uint32_t seed = 5000;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  for (int64_t rope_dim : {2, 6, 38, 64}) {
    SCOPED_TRACE(absl::StrCat("rope_dim=", rope_dim));
    const std::vector<float> inv_freq = DeepSeekInvFreq(rope_dim, 10000.0f);
    for (int trial = 0; trial < 20; ++trial) {
      const std::vector<float> q = RandomSignedFloats(rng, rope_dim, 0.05f, 2.0f);
      const std::vector<float> k = RandomSignedFloats(rng, rope_dim, 0.05f, 2.0f);
      const std::vector<int32_t> positions = RandomPositions(rng, 2, 50000);
      const std::vector<float> q_interleaved = RotateHead(q, positions[0], inv_freq, true);
      const std::vector<float> k_interleaved = RotateHead(k, positions[1], inv_freq, true);
      const std::vector<float> q_half = RotateHead(Deinterleave(q), positions[0], inv_freq, false);
      const std::vector<float> k_half = RotateHead(Deinterleave(k), positions[1], inv_freq, false);
      // The same arithmetic on the same pairs: bit-identical after the permutation.
      EXPECT_EQ(Deinterleave(q_interleaved), q_half);
      EXPECT_EQ(Deinterleave(k_interleaved), k_half);
      EXPECT_NEAR(Dot(q_interleaved, k_interleaved), Dot(q_half, k_half), 1e-5);
    }
  }
}

TEST(RopeTest, PreservesPairNormsAndDependsOnRelativePosition) {
  const uint32_t seed = 5100;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t rope_dim = 38;
  const std::vector<float> inv_freq = DeepSeekInvFreq(rope_dim, 10000.0f);
  for (bool interleaved : {true, false}) {
    for (int trial = 0; trial < 20; ++trial) {
      const std::vector<float> q = RandomSignedFloats(rng, rope_dim, 0.05f, 2.0f);
      const std::vector<float> k = RandomSignedFloats(rng, rope_dim, 0.05f, 2.0f);
      // Small positions: the fp32 angle's rounding (half an ulp of position * inv_freq) bounds
      // how exactly q.k can depend on m - n only.
      const std::vector<int32_t> positions = RandomPositions(rng, 3, 64);
      const float factor = 1.25f;
      const std::vector<float> rotated = RotateHead(q, positions[0], inv_freq, interleaved, factor);
      for (int64_t i = 0; i < rope_dim / 2; ++i) {
        const auto [a, b] = PairIndices(i, rope_dim, interleaved);
        const double before = std::hypot(double{q[a]}, double{q[b]});
        const double after = std::hypot(double{rotated[a]}, double{rotated[b]});
        EXPECT_NEAR(after, factor * before, 1e-5 * factor * before) << "pair " << i;
      }
      // q(m).k(n) depends on m - n only: shift both by the same amount.
      const int32_t shift = positions[2];
      const double dot = Dot(RotateHead(q, positions[0], inv_freq, interleaved),
                             RotateHead(k, positions[1], inv_freq, interleaved));
      const double shifted = Dot(RotateHead(q, positions[0] + shift, inv_freq, interleaved),
                                 RotateHead(k, positions[1] + shift, inv_freq, interleaved));
      EXPECT_NEAR(dot, shifted, 1e-3 * std::sqrt(Dot(q, q) * Dot(k, k)));
    }
  }
}

TEST(RopeTest, RejectsInvalidParams) {
  std::vector<float> x(64, 1.0f);
  const std::vector<float> inv_freq = DeepSeekInvFreq(8, 10000.0f);
  std::vector<int32_t> positions = {3, 4};
  const RopeParams good{.x = x.data(),
                        .positions = positions.data(),
                        .inv_freq = inv_freq.data(),
                        .rows = 2,
                        .heads = 2,
                        .rope_dim = 8,
                        .row_stride = 16,
                        .head_stride = 8};
  EXPECT_TRUE(cpu::Rope(good).ok());
  RopeParams p = good;
  p.rope_dim = 7;
  ExpectInvalid(cpu::Rope(p), "rope_dim");
  p = good;
  p.rope_dim = 0;
  ExpectInvalid(cpu::Rope(p), "rope_dim");
  p = good;
  p.heads = 0;
  ExpectInvalid(cpu::Rope(p), "heads");
  p = good;
  p.rows = -2;
  ExpectInvalid(cpu::Rope(p), "rows");
  p = good;
  p.head_stride = 4;
  ExpectInvalid(cpu::Rope(p), "head_stride");
  p = good;
  p.row_stride = 15;
  ExpectInvalid(cpu::Rope(p), "row_stride");
  p = good;
  p.x = nullptr;
  ExpectInvalid(cpu::Rope(p), "x is null");
  p = good;
  p.positions = nullptr;
  ExpectInvalid(cpu::Rope(p), "positions");
  p = good;
  p.inv_freq = nullptr;
  ExpectInvalid(cpu::Rope(p), "inv_freq");
  p = good;
  p.attention_factor = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(cpu::Rope(p), "attention_factor");
  positions[1] = -1;
  ExpectInvalid(cpu::Rope(good), "positions[1]");
}

// ---------------------------------------------------------------------------------------------
// SiluMul

TEST(SiluMulTest, MatchesDoubleReference) {
  for (int64_t rows : {1, 3, 7, 19}) {
    for (int64_t dim : kOddSizes) {
      const uint32_t seed = static_cast<uint32_t>(6000 + rows * 1009 + dim);
      SCOPED_TRACE(absl::StrCat("seed=", seed, " rows=", rows, " dim=", dim));
      std::mt19937 rng(seed);
      const std::vector<float> gate_up = RandomSignedFloats(rng, rows * 2 * dim, 0.01f, 8.0f);
      std::vector<float> out(rows * dim);
      ASSERT_TRUE(
          cpu::SiluMul({.gate_up = gate_up.data(), .out = out.data(), .rows = rows, .dim = dim})
              .ok());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < dim; ++i) {
          const double gate = gate_up[r * 2 * dim + i];
          const double up = gate_up[r * 2 * dim + dim + i];
          const double ref = gate / (1.0 + std::exp(-gate)) * up;
          ASSERT_NEAR(out[r * dim + i], ref, 1e-6 * std::abs(ref)) << "row " << r << " " << i;
        }
      }
    }
  }
}

TEST(SiluMulTest, SaturatesWithoutNaN) {
  // exp(200) overflows fp32: silu(-200) must come out as -0, not NaN.
  const std::vector<float> gate_up = {-200.0f, 200.0f, -80.0f, 1.5f, 2.0f, 3.0f};
  std::vector<float> out(3);
  ASSERT_TRUE(
      cpu::SiluMul({.gate_up = gate_up.data(), .out = out.data(), .rows = 1, .dim = 3}).ok());
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 400.0f);
  const double ref = -80.0 / (1.0 + std::exp(80.0)) * 3.0;
  EXPECT_NEAR(out[2], ref, 1e-6 * std::abs(ref));
}

TEST(SiluMulTest, RejectsInvalidParams) {
  std::vector<float> gate_up(8, 1.0f), out(4);
  const SiluMulParams good{.gate_up = gate_up.data(), .out = out.data(), .rows = 2, .dim = 2};
  EXPECT_TRUE(cpu::SiluMul(good).ok());
  SiluMulParams p = good;
  p.dim = 0;
  ExpectInvalid(cpu::SiluMul(p), "dim must be > 0, got 0");
  p = good;
  p.rows = -1;
  ExpectInvalid(cpu::SiluMul(p), "rows");
  p = good;
  p.gate_up = nullptr;
  ExpectInvalid(cpu::SiluMul(p), "gate_up");
  p = good;
  p.out = nullptr;
  ExpectInvalid(cpu::SiluMul(p), "out");
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(EmbeddingTest, ShardsCopyTheirRowsAndSumToTheFullTable) {
  for (int64_t hidden : kOddSizes) {
    const uint32_t seed = static_cast<uint32_t>(7000 + hidden);
    SCOPED_TRACE(absl::StrCat("seed=", seed, " hidden=", hidden));
    std::mt19937 rng(seed);
    const int32_t vocab = 19;
    const int32_t split = 7;
    const std::vector<float> table = RandomSignedFloats(rng, vocab * hidden, 0.01f, 1.0f);
    std::uniform_int_distribution<int32_t> id_dist(0, vocab - 1);
    const int64_t tokens = 19;
    std::vector<int32_t> ids(tokens);
    for (int32_t& id : ids) id = id_dist(rng);
    ids[0] = 0;
    ids[1] = split - 1;
    ids[2] = split;
    ids[3] = vocab - 1;
    ids[4] = vocab + 100;  // beyond every shard: zeros everywhere

    std::vector<float> first(tokens * hidden, 5.0f), second(tokens * hidden, 5.0f);
    ASSERT_TRUE(cpu::Embedding({.token_ids = ids.data(),
                                .table = table.data(),
                                .out = first.data(),
                                .tokens = tokens,
                                .hidden = hidden,
                                .vocab_begin = 0,
                                .vocab_end = split})
                    .ok());
    ASSERT_TRUE(cpu::Embedding({.token_ids = ids.data(),
                                .table = table.data() + split * hidden,
                                .out = second.data(),
                                .tokens = tokens,
                                .hidden = hidden,
                                .vocab_begin = split,
                                .vocab_end = vocab})
                    .ok());
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t id = ids[t];
      for (int64_t i = 0; i < hidden; ++i) {
        const float full = id < vocab ? table[id * hidden + i] : 0.0f;
        ASSERT_EQ(first[t * hidden + i], id < split ? full : 0.0f) << "token " << t;
        ASSERT_EQ(second[t * hidden + i], id >= split ? full : 0.0f) << "token " << t;
        ASSERT_EQ(first[t * hidden + i] + second[t * hidden + i], full) << "token " << t;
      }
    }
  }
}

TEST(EmbeddingTest, RejectsInvalidParams) {
  std::vector<float> table(12, 1.0f), out(8, 3.0f);
  std::vector<int32_t> ids = {0, 1};
  const EmbeddingParams good{.token_ids = ids.data(),
                             .table = table.data(),
                             .out = out.data(),
                             .tokens = 2,
                             .hidden = 4,
                             .vocab_begin = 0,
                             .vocab_end = 3};
  EXPECT_TRUE(cpu::Embedding(good).ok());
  EmbeddingParams p = good;
  p.hidden = 0;
  ExpectInvalid(cpu::Embedding(p), "hidden");
  p = good;
  p.tokens = -1;
  ExpectInvalid(cpu::Embedding(p), "tokens");
  p = good;
  p.vocab_end = 0;
  ExpectInvalid(cpu::Embedding(p), "vocab_end");
  p = good;
  p.vocab_begin = -1;
  ExpectInvalid(cpu::Embedding(p), "vocab_begin");
  p = good;
  p.token_ids = nullptr;
  ExpectInvalid(cpu::Embedding(p), "token_ids");
  p = good;
  p.table = nullptr;
  ExpectInvalid(cpu::Embedding(p), "table");
  p = good;
  p.out = nullptr;
  ExpectInvalid(cpu::Embedding(p), "out");
  std::fill(out.begin(), out.end(), 3.0f);
  ids[1] = -5;
  ExpectInvalid(cpu::Embedding(good), "token_ids[1]");
  EXPECT_EQ(out, std::vector<float>(8, 3.0f)) << "a rejected call must not write";
}

// ---------------------------------------------------------------------------------------------
// LmHeadSummary

TEST(LmHeadSummaryTest, MatchesDoubleReference) {
  for (int64_t rows : {1, 3, 7, 19}) {
    for (int64_t vocab : kOddSizes) {
      const uint32_t seed = static_cast<uint32_t>(8000 + rows * 997 + vocab);
      SCOPED_TRACE(absl::StrCat("seed=", seed, " rows=", rows, " vocab=", vocab));
      std::mt19937 rng(seed);
      const std::vector<float> logits = RandomSignedFloats(rng, rows * vocab, 0.01f, 20.0f);
      const int32_t vocab_begin = 1000;
      std::vector<NodeSummary> out(rows);
      ASSERT_TRUE(cpu::LmHeadSummary({.logits = logits.data(),
                                      .out = out.data(),
                                      .rows = rows,
                                      .vocab_shard = vocab,
                                      .vocab_begin = vocab_begin})
                      .ok());
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = &logits[r * vocab];
        int64_t argmax = 0;
        for (int64_t v = 1; v < vocab; ++v) {
          if (row[v] > row[argmax]) argmax = v;
        }
        double sum = 0.0;
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double{row[v]} - row[argmax]);
        const double lse = row[argmax] + std::log(sum);
        EXPECT_EQ(out[r].argmax, vocab_begin + argmax) << "row " << r;
        EXPECT_EQ(out[r].max_logit, row[argmax]) << "row " << r;
        EXPECT_NEAR(out[r].log_sum_exp, lse, 1e-6 * std::max(1.0, std::abs(lse))) << "row " << r;
      }
    }
  }
}

TEST(LmHeadSummaryTest, TiesGoToTheSmallestIdAndShardsCombine) {
  const uint32_t seed = 8500;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 733;
  const int64_t split = 300;
  std::vector<float> logits = RandomSignedFloats(rng, vocab, 0.01f, 10.0f);
  logits[123] = 12.5f;
  logits[456] = 12.5f;
  logits[600] = 12.5f;
  NodeSummary full, first, second;
  ASSERT_TRUE(
      cpu::LmHeadSummary({.logits = logits.data(), .out = &full, .rows = 1, .vocab_shard = vocab})
          .ok());
  ASSERT_TRUE(
      cpu::LmHeadSummary({.logits = logits.data(), .out = &first, .rows = 1, .vocab_shard = split})
          .ok());
  ASSERT_TRUE(cpu::LmHeadSummary({.logits = logits.data() + split,
                                  .out = &second,
                                  .rows = 1,
                                  .vocab_shard = vocab - split,
                                  .vocab_begin = static_cast<int32_t>(split)})
                  .ok());
  EXPECT_EQ(full.argmax, 123);
  EXPECT_EQ(first.argmax, 123);
  EXPECT_EQ(second.argmax, 456);
  EXPECT_EQ(full.max_logit, 12.5f);
  const double m = std::max(first.log_sum_exp, second.log_sum_exp);
  const double combined =
      m + std::log(std::exp(first.log_sum_exp - m) + std::exp(second.log_sum_exp - m));
  EXPECT_NEAR(full.log_sum_exp, combined, 1e-6 * std::abs(combined));
}

TEST(LmHeadSummaryTest, AllMaskedRowHasMinusInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {-inf, -inf, -inf};
  NodeSummary out;
  ASSERT_TRUE(
      cpu::LmHeadSummary(
          {.logits = logits.data(), .out = &out, .rows = 1, .vocab_shard = 3, .vocab_begin = 9})
          .ok());
  EXPECT_EQ(out.argmax, 9);
  EXPECT_EQ(out.max_logit, -inf);
  EXPECT_EQ(out.log_sum_exp, -inf);
}

TEST(LmHeadSummaryTest, RejectsInvalidParams) {
  std::vector<float> logits(6, 1.0f);
  std::vector<NodeSummary> out(2);
  const LmHeadSummaryParams good{
      .logits = logits.data(), .out = out.data(), .rows = 2, .vocab_shard = 3};
  EXPECT_TRUE(cpu::LmHeadSummary(good).ok());
  LmHeadSummaryParams p = good;
  p.vocab_shard = 0;
  ExpectInvalid(cpu::LmHeadSummary(p), "vocab_shard must be > 0, got 0");
  p = good;
  p.rows = -1;
  ExpectInvalid(cpu::LmHeadSummary(p), "rows");
  p = good;
  p.vocab_begin = -1;
  ExpectInvalid(cpu::LmHeadSummary(p), "vocab_begin");
  p = good;
  p.vocab_begin = std::numeric_limits<int32_t>::max() - 1;
  ExpectInvalid(cpu::LmHeadSummary(p), "int32");
  p = good;
  p.logits = nullptr;
  ExpectInvalid(cpu::LmHeadSummary(p), "logits");
  p = good;
  p.out = nullptr;
  ExpectInvalid(cpu::LmHeadSummary(p), "out");
}

// The sampling winner by brute force: every column's score, no skipping.
struct SampledReference {
  int32_t token;
  double score;
  double log_sum_exp_at_temperature;
};

SampledReference SampleReference(const float* logits, int64_t vocab, int32_t vocab_begin,
                                 float temperature, uint64_t seed, int64_t position) {
  SampledReference ref{-1, -std::numeric_limits<double>::infinity(), 0.0};
  double max_scaled = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < vocab; ++v) {
    const int32_t token = static_cast<int32_t>(vocab_begin + v);
    const double score = GumbelMaxScore(logits[v], temperature, seed, position, token);
    if (ref.token < 0 || score > ref.score) {
      ref.token = token;
      ref.score = score;
    }
    max_scaled = std::max(max_scaled, double{logits[v]} / temperature);
  }
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double{logits[v]} / temperature - max_scaled);
  ref.log_sum_exp_at_temperature = max_scaled + std::log(sum);
  return ref;
}

TEST(LmHeadSummaryTest, SamplingMatchesBruteForce) {
  for (float temperature : {0.3f, 1.0f, 2.5f}) {
    for (float spread : {3.0f, 60.0f}) {  // flat, and peaked (most columns skipped)
      for (int64_t vocab : kOddSizes) {
        const int64_t rows = 7;
        const uint32_t seed =
            static_cast<uint32_t>(8600 + vocab + 10 * spread + 1000 * temperature);
        SCOPED_TRACE(
            absl::StrCat("seed=", seed, " T=", temperature, " spread=", spread, " vocab=", vocab));
        std::mt19937 rng(seed);
        const std::vector<float> logits = RandomSignedFloats(rng, rows * vocab, 0.01f, spread);
        std::vector<int64_t> positions(rows);
        for (int64_t& p : positions) p = std::uniform_int_distribution<int64_t>(0, 1 << 20)(rng);
        const uint64_t sampling_seed = rng() * 0x100000001ull;
        const int32_t vocab_begin = 4321;
        std::vector<NodeSummary> out(rows);
        ASSERT_TRUE(cpu::LmHeadSummary({.logits = logits.data(),
                                        .out = out.data(),
                                        .rows = rows,
                                        .vocab_shard = vocab,
                                        .vocab_begin = vocab_begin,
                                        .temperature = temperature,
                                        .seed = sampling_seed,
                                        .positions = positions.data()})
                        .ok());
        for (int64_t r = 0; r < rows; ++r) {
          const float* row = &logits[r * vocab];
          const SampledReference ref =
              SampleReference(row, vocab, vocab_begin, temperature, sampling_seed, positions[r]);
          EXPECT_EQ(out[r].sampled_token, ref.token) << "row " << r;
          EXPECT_EQ(out[r].sampled_score, ref.score) << "row " << r;
          EXPECT_EQ(out[r].sampled_logit, row[ref.token - vocab_begin]) << "row " << r;
          EXPECT_NEAR(out[r].log_sum_exp_at_temperature, ref.log_sum_exp_at_temperature,
                      1e-6 * std::max(1.0, std::abs(ref.log_sum_exp_at_temperature)))
              << "row " << r;
        }
      }
    }
  }
}

TEST(LmHeadSummaryTest, GreedyFieldsDoNotDependOnSampling) {
  const uint32_t seed = 8700;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t rows = 19, vocab = 733;
  const std::vector<float> logits = RandomSignedFloats(rng, rows * vocab, 0.01f, 20.0f);
  std::vector<int64_t> positions(rows, 17);
  std::vector<NodeSummary> greedy(rows), sampled(rows);
  std::vector<Candidate> candidates(rows * 5);
  ASSERT_TRUE(
      cpu::LmHeadSummary(
          {.logits = logits.data(), .out = greedy.data(), .rows = rows, .vocab_shard = vocab})
          .ok());
  ASSERT_TRUE(cpu::LmHeadSummary({.logits = logits.data(),
                                  .out = sampled.data(),
                                  .rows = rows,
                                  .vocab_shard = vocab,
                                  .temperature = 0.7f,
                                  .seed = 3,
                                  .positions = positions.data(),
                                  .num_candidates = 5,
                                  .candidates = candidates.data()})
                  .ok());
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(greedy[r].argmax, sampled[r].argmax);
    EXPECT_EQ(greedy[r].max_logit, sampled[r].max_logit);
    EXPECT_EQ(greedy[r].log_sum_exp, sampled[r].log_sum_exp);
    // Greedy leaves the sampling fields at their defaults.
    EXPECT_EQ(greedy[r].sampled_token, -1);
    EXPECT_EQ(greedy[r].sampled_score, -std::numeric_limits<double>::infinity());
    EXPECT_GE(sampled[r].sampled_token, 0);
  }
}

// Gumbel-max over fixed logits at 20000 positions draws tokens with frequencies
// softmax(logits / T). The noise is deterministic, so is the statistic.
TEST(LmHeadSummaryTest, GumbelMaxFrequenciesMatchTheSoftmax) {
  const uint32_t seed = 8800;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t vocab = 50;
  const int64_t samples = 20000;
  const float temperature = 0.8f;
  const std::vector<float> row = RandomFloats(rng, vocab, -2.0f, 2.0f);
  std::vector<float> logits(samples * vocab);
  for (int64_t s = 0; s < samples; ++s) std::copy(row.begin(), row.end(), &logits[s * vocab]);
  std::vector<int64_t> positions(samples);
  for (int64_t s = 0; s < samples; ++s) positions[s] = 1000 + s;
  std::vector<NodeSummary> out(samples);
  ASSERT_TRUE(cpu::LmHeadSummary({.logits = logits.data(),
                                  .out = out.data(),
                                  .rows = samples,
                                  .vocab_shard = vocab,
                                  .temperature = temperature,
                                  .seed = 0xC0FFEE,
                                  .positions = positions.data()})
                  .ok());
  std::vector<int64_t> counts(vocab, 0);
  for (const NodeSummary& s : out) {
    ASSERT_GE(s.sampled_token, 0);
    ASSERT_LT(s.sampled_token, vocab);
    ++counts[s.sampled_token];
  }
  double max_scaled = -1e300;
  for (float l : row) max_scaled = std::max(max_scaled, double{l} / temperature);
  double z = 0.0;
  for (float l : row) z += std::exp(double{l} / temperature - max_scaled);
  double chi_square = 0.0;
  double min_expected = 1e300;
  for (int64_t v = 0; v < vocab; ++v) {
    const double expected = samples * std::exp(double{row[v]} / temperature - max_scaled) / z;
    min_expected = std::min(min_expected, expected);
    chi_square += (counts[v] - expected) * (counts[v] - expected) / expected;
  }
  ASSERT_GT(min_expected, 5.0) << "every cell needs enough expected counts";
  // 49 degrees of freedom: mean 49, sd 9.9; 120 is beyond 7 sd.
  EXPECT_LT(chi_square, 120.0);
  // A wrong temperature must fail the same test.
  double chi_square_wrong = 0.0;
  double z_wrong = 0.0;
  for (float l : row) z_wrong += std::exp(double{l} - max_scaled * temperature);
  for (int64_t v = 0; v < vocab; ++v) {
    const double expected = samples * std::exp(double{row[v]} - max_scaled * temperature) / z_wrong;
    chi_square_wrong += (counts[v] - expected) * (counts[v] - expected) / expected;
  }
  EXPECT_GT(chi_square_wrong, 200.0);
}

TEST(LmHeadSummaryTest, CandidatesAreTheLargestLogitsWithTiesBySmallerId) {
  for (int64_t vocab : kOddSizes) {
    for (int32_t k : {1, 4, 64}) {
      const uint32_t seed = static_cast<uint32_t>(8900 + vocab * 7 + k);
      SCOPED_TRACE(absl::StrCat("seed=", seed, " vocab=", vocab, " k=", k));
      std::mt19937 rng(seed);
      const int64_t rows = 3;
      std::vector<float> logits = RandomSignedFloats(rng, rows * vocab, 0.01f, 5.0f);
      // Ties: copy some values onto other columns.
      for (int64_t i = 0; i < vocab / 3; ++i) {
        const int64_t from = std::uniform_int_distribution<int64_t>(0, rows * vocab - 1)(rng);
        const int64_t to = std::uniform_int_distribution<int64_t>(0, rows * vocab - 1)(rng);
        logits[to] = logits[from];
      }
      const int32_t vocab_begin = 77;
      std::vector<NodeSummary> out(rows);
      std::vector<Candidate> candidates(rows * k, Candidate{123, 4.5f});
      ASSERT_TRUE(cpu::LmHeadSummary({.logits = logits.data(),
                                      .out = out.data(),
                                      .rows = rows,
                                      .vocab_shard = vocab,
                                      .vocab_begin = vocab_begin,
                                      .num_candidates = k,
                                      .candidates = candidates.data()})
                      .ok());
      for (int64_t r = 0; r < rows; ++r) {
        std::vector<std::pair<float, int32_t>> order;
        for (int64_t v = 0; v < vocab; ++v) {
          order.push_back({logits[r * vocab + v], static_cast<int32_t>(vocab_begin + v)});
        }
        std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        for (int32_t i = 0; i < k; ++i) {
          const Candidate& c = candidates[r * k + i];
          if (i < vocab) {
            EXPECT_EQ(c.token_id, order[i].second) << "row " << r << " rank " << i;
            EXPECT_EQ(c.logit, order[i].first) << "row " << r << " rank " << i;
          } else {
            EXPECT_EQ(c.token_id, -1) << "padding, row " << r << " rank " << i;
            EXPECT_EQ(c.logit, -std::numeric_limits<float>::infinity());
          }
        }
        EXPECT_EQ(candidates[r * k].token_id, out[r].argmax);
      }
    }
  }
}

// A row's sampled token and candidates do not depend on the other rows of the call.
TEST(LmHeadSummaryTest, SamplingIsBatchInvariant) {
  const uint32_t seed = 9000;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t rows = 19, vocab = 733;
  const int32_t k = 8;
  const std::vector<float> logits = RandomSignedFloats(rng, rows * vocab, 0.01f, 10.0f);
  std::vector<int64_t> positions(rows);
  for (int64_t& p : positions) p = std::uniform_int_distribution<int64_t>(0, 5000)(rng);
  auto run = [&](int64_t first, int64_t count, std::vector<NodeSummary>& out,
                 std::vector<Candidate>& candidates) {
    out.resize(count);
    candidates.resize(count * k);
    return cpu::LmHeadSummary({.logits = logits.data() + first * vocab,
                               .out = out.data(),
                               .rows = count,
                               .vocab_shard = vocab,
                               .temperature = 1.3f,
                               .seed = 99,
                               .positions = positions.data() + first,
                               .num_candidates = k,
                               .candidates = candidates.data()});
  };
  std::vector<NodeSummary> all;
  std::vector<Candidate> all_candidates;
  ASSERT_TRUE(run(0, rows, all, all_candidates).ok());
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<NodeSummary> one;
    std::vector<Candidate> one_candidates;
    ASSERT_TRUE(run(r, 1, one, one_candidates).ok());
    EXPECT_EQ(one[0].sampled_token, all[r].sampled_token) << "row " << r;
    EXPECT_EQ(one[0].sampled_score, all[r].sampled_score) << "row " << r;
    EXPECT_EQ(one[0].log_sum_exp_at_temperature, all[r].log_sum_exp_at_temperature);
    for (int32_t i = 0; i < k; ++i) {
      EXPECT_EQ(one_candidates[i].token_id, all_candidates[r * k + i].token_id);
    }
  }
}

TEST(LmHeadSummaryTest, RejectsInvalidSamplingParams) {
  std::vector<float> logits(6, 1.0f);
  std::vector<NodeSummary> out(2);
  std::vector<int64_t> positions = {3, 4};
  std::vector<Candidate> candidates(2 * 1024);
  const LmHeadSummaryParams good{.logits = logits.data(),
                                 .out = out.data(),
                                 .rows = 2,
                                 .vocab_shard = 3,
                                 .temperature = 1.0f,
                                 .positions = positions.data(),
                                 .num_candidates = 2,
                                 .candidates = candidates.data()};
  EXPECT_TRUE(cpu::LmHeadSummary(good).ok());
  LmHeadSummaryParams p = good;
  p.temperature = -0.5f;
  ExpectInvalid(cpu::LmHeadSummary(p), "temperature");
  p.temperature = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(cpu::LmHeadSummary(p), "temperature");
  p.temperature = std::numeric_limits<float>::infinity();
  ExpectInvalid(cpu::LmHeadSummary(p), "temperature");
  p = good;
  p.positions = nullptr;
  ExpectInvalid(cpu::LmHeadSummary(p), "positions");
  p.temperature = 0.0f;  // greedy needs no positions
  EXPECT_TRUE(cpu::LmHeadSummary(p).ok());
  p = good;
  p.num_candidates = 1025;
  ExpectInvalid(cpu::LmHeadSummary(p), "num_candidates");
  p.num_candidates = -1;
  ExpectInvalid(cpu::LmHeadSummary(p), "num_candidates");
  p.num_candidates = 1024;
  EXPECT_TRUE(cpu::LmHeadSummary(p).ok());
  p.candidates = nullptr;
  ExpectInvalid(cpu::LmHeadSummary(p), "candidates");
}

// ---------------------------------------------------------------------------------------------
// KvAppend / KvCopy

TEST(KvCacheOpsTest, AppendWritesRowsToTheirSlots) {
  for (int64_t row_dim : kOddSizes) {
    const uint32_t seed = static_cast<uint32_t>(9000 + row_dim);
    SCOPED_TRACE(absl::StrCat("seed=", seed, " row_dim=", row_dim));
    std::mt19937 rng(seed);
    const int64_t num_slots = 41;
    const int64_t count = 7;
    const int64_t row_stride = row_dim + 3;
    std::vector<float> cache = RandomSignedFloats(rng, num_slots * row_dim, 0.01f, 1.0f);
    const std::vector<float> before = cache;
    const std::vector<float> rows = RandomSignedFloats(rng, count * row_stride, 2.0f, 3.0f);
    const std::vector<int64_t> slots = {40, 0, 17, 18, 5, 33, 1};
    ASSERT_TRUE(cpu::KvAppend({.rows = rows.data(),
                               .slots = slots.data(),
                               .cache = cache.data(),
                               .count = count,
                               .row_dim = row_dim,
                               .row_stride = row_stride,
                               .num_slots = num_slots})
                    .ok());
    std::vector<float> expected = before;
    for (int64_t i = 0; i < count; ++i) {
      std::copy(rows.begin() + i * row_stride, rows.begin() + i * row_stride + row_dim,
                expected.begin() + slots[i] * row_dim);
    }
    EXPECT_EQ(cache, expected);
  }
}

TEST(KvCacheOpsTest, AppendSkipsNegativeSlots) {
  std::vector<float> cache(5 * 3);
  std::iota(cache.begin(), cache.end(), 1.0f);
  const std::vector<float> before = cache;
  const std::vector<float> rows = {-1, -2, -3, -4, -5, -6, -7, -8, -9};
  const std::vector<int64_t> slots = {-1, 3, -7};  // only the middle row is real
  ASSERT_TRUE(cpu::KvAppend({.rows = rows.data(),
                             .slots = slots.data(),
                             .cache = cache.data(),
                             .count = 3,
                             .row_dim = 3,
                             .num_slots = 5})
                  .ok());
  std::vector<float> expected = before;
  std::copy(rows.begin() + 3, rows.begin() + 6, expected.begin() + 3 * 3);
  EXPECT_EQ(cache, expected);
}

TEST(KvCacheOpsTest, CopyMovesTheSameRowsInEveryLayer) {
  const uint32_t seed = 9200;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t row_dim = 7, num_slots = 9, layers = 3, layer_stride = num_slots * row_dim + 5;
  std::vector<float> cache = RandomSignedFloats(rng, layers * layer_stride, 0.01f, 1.0f);
  const std::vector<float> before = cache;
  const std::vector<int64_t> src = {2, 5, 8};
  const std::vector<int64_t> dst = {1, 2, 3};
  ASSERT_TRUE(cpu::KvCopy({.src_slots = src.data(),
                           .dst_slots = dst.data(),
                           .cache = cache.data(),
                           .count = 3,
                           .row_dim = row_dim,
                           .num_slots = num_slots,
                           .num_layers = layers,
                           .layer_stride = layer_stride})
                  .ok());
  std::vector<float> expected = before;
  for (int64_t layer = 0; layer < layers; ++layer) {
    float* base = expected.data() + layer * layer_stride;
    for (size_t i = 0; i < src.size(); ++i) {
      std::copy_n(base + src[i] * row_dim, row_dim, base + dst[i] * row_dim);
    }
  }
  EXPECT_EQ(cache, expected);
}

TEST(KvCacheOpsTest, CopyRunsInOrderSoCompactionIsSafe) {
  const uint32_t seed = 9100;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937 rng(seed);
  const int64_t row_dim = 19;
  const int64_t num_slots = 16;
  std::vector<float> cache = RandomSignedFloats(rng, num_slots * row_dim, 0.01f, 1.0f);
  const std::vector<float> before = cache;
  // Accepted tree nodes at slots 3, 4, 7, 8, 12 move down to 3, 4, 5, 6, 7: slot 7 and 8 are read
  // before later copies overwrite them. One copy is a no-op (src == dst).
  const std::vector<int64_t> src = {3, 4, 7, 8, 12};
  const std::vector<int64_t> dst = {3, 4, 5, 6, 7};
  ASSERT_TRUE(cpu::KvCopy({.src_slots = src.data(),
                           .dst_slots = dst.data(),
                           .cache = cache.data(),
                           .count = 5,
                           .row_dim = row_dim,
                           .num_slots = num_slots})
                  .ok());
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    int64_t source = slot;  // untouched unless some copy wrote it
    for (size_t i = 0; i < dst.size(); ++i) {
      if (dst[i] == slot) source = src[i];
    }
    for (int64_t j = 0; j < row_dim; ++j) {
      ASSERT_EQ(cache[slot * row_dim + j], before[source * row_dim + j]) << "slot " << slot;
    }
  }
}

TEST(KvCacheOpsTest, RejectsInvalidParams) {
  std::vector<float> cache(32, 1.0f), rows(8, 2.0f);
  std::vector<int64_t> slots = {1, 2};
  const KvAppendParams good_append{.rows = rows.data(),
                                   .slots = slots.data(),
                                   .cache = cache.data(),
                                   .count = 2,
                                   .row_dim = 4,
                                   .num_slots = 8};
  EXPECT_TRUE(cpu::KvAppend(good_append).ok());
  KvAppendParams a = good_append;
  a.row_dim = 0;
  ExpectInvalid(cpu::KvAppend(a), "row_dim must be > 0, got 0");
  a = good_append;
  a.count = -1;
  ExpectInvalid(cpu::KvAppend(a), "count");
  a = good_append;
  a.row_stride = 3;
  ExpectInvalid(cpu::KvAppend(a), "row_stride");
  a = good_append;
  a.rows = nullptr;
  ExpectInvalid(cpu::KvAppend(a), "rows is null");
  a = good_append;
  a.slots = nullptr;
  ExpectInvalid(cpu::KvAppend(a), "slots");
  a = good_append;
  a.cache = nullptr;
  ExpectInvalid(cpu::KvAppend(a), "cache");

  std::vector<int64_t> src = {4, 5}, dst = {0, 1};
  const KvCopyParams good_copy{.src_slots = src.data(),
                               .dst_slots = dst.data(),
                               .cache = cache.data(),
                               .count = 2,
                               .row_dim = 4,
                               .num_slots = 8};
  EXPECT_TRUE(cpu::KvCopy(good_copy).ok());
  KvCopyParams c = good_copy;
  c.row_dim = -4;
  ExpectInvalid(cpu::KvCopy(c), "row_dim");
  c = good_copy;
  c.count = -1;
  ExpectInvalid(cpu::KvCopy(c), "count");
  c = good_copy;
  c.src_slots = nullptr;
  ExpectInvalid(cpu::KvCopy(c), "src_slots");
  c = good_copy;
  c.dst_slots = nullptr;
  ExpectInvalid(cpu::KvCopy(c), "dst_slots");
  c = good_copy;
  c.cache = nullptr;
  ExpectInvalid(cpu::KvCopy(c), "cache");

  src[0] = -3;
  ExpectInvalid(cpu::KvCopy(good_copy), "src_slots[0]");
  src[0] = 4;
  dst[1] = -2;
  ExpectInvalid(cpu::KvCopy(good_copy), "dst_slots[1]");
  dst[1] = 1;
  // Slots past the end of the cache are refused before anything is written.
  slots[1] = 8;
  ExpectInvalid(cpu::KvAppend(good_append), "slots[1] = 8 is not below num_slots (8)");
  src[1] = 8;
  ExpectInvalid(cpu::KvCopy(good_copy), "src_slots[1] = 8 is outside [0, 8)");
  src[1] = 5;
  dst[0] = 9;
  ExpectInvalid(cpu::KvCopy(good_copy), "dst_slots[0] = 9 is outside [0, 8)");
}

}  // namespace
}  // namespace treeverify::kernels
