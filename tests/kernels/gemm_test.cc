#include "treeverify/kernels/gemm.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace treeverify::kernels {
namespace {

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class GemmShapeTest : public testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(GemmShapeTest, MatchesDoublePrecisionReference) {
  const auto [m, n, k] = GetParam();
  const unsigned seed = 1000u + m * 31u + n * 7u + k;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const std::vector<float> x = Random(size_t(m) * k, rng);
  const std::vector<float> w = Random(size_t(n) * k, rng);
  std::vector<float> y(size_t(m) * n, NAN);
  ASSERT_TRUE(
      cpu::Gemm({.x = x.data(), .weight = w.data(), .y = y.data(), .m = m, .n = n, .k = k}).ok());
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double expected = 0.0;
      double magnitude = 0.0;
      for (int l = 0; l < k; ++l) {
        expected += double{x[size_t(i) * k + l]} * w[size_t(j) * k + l];
        magnitude += std::abs(double{x[size_t(i) * k + l]} * w[size_t(j) * k + l]);
      }
      ASSERT_NEAR(y[size_t(i) * n + j], expected, 1e-6 * magnitude + 1e-7)
          << "at (" << i << ", " << j << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(OddShapes, GemmShapeTest,
                         testing::Combine(testing::Values(1, 3, 7, 19),
                                          testing::Values(1, 5, 19, 733),
                                          testing::Values(1, 7, 8, 19, 576)));

// The defining property of the CPU backend: a row's result does not depend on the batch.
TEST(GemmTest, RowsAreBitIdenticalWhateverTheBatch) {
  const unsigned seed = 4242;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int m = 19, n = 37, k = 203;
  const std::vector<float> x = Random(size_t(m) * k, rng);
  const std::vector<float> w = Random(size_t(n) * k, rng);
  std::vector<float> batched(size_t(m) * n);
  ASSERT_TRUE(
      cpu::Gemm({.x = x.data(), .weight = w.data(), .y = batched.data(), .m = m, .n = n, .k = k})
          .ok());
  for (int batch : {1, 2, 4}) {
    for (int first = 0; first + batch <= m; first += batch) {
      std::vector<float> part(size_t(batch) * n);
      ASSERT_TRUE(cpu::Gemm({.x = x.data() + size_t(first) * k,
                             .weight = w.data(),
                             .y = part.data(),
                             .m = batch,
                             .n = n,
                             .k = k})
                      .ok());
      EXPECT_EQ(0, std::memcmp(part.data(), batched.data() + size_t(first) * n,
                               part.size() * sizeof(float)))
          << "rows " << first << ".." << first + batch;
    }
  }
  // Columns too: a slice of the weight gives bit-identical columns.
  std::vector<float> column(m);
  ASSERT_TRUE(cpu::Gemm({.x = x.data(),
                         .weight = w.data() + size_t(5) * k,
                         .y = column.data(),
                         .m = m,
                         .n = 1,
                         .k = k})
                  .ok());
  for (int i = 0; i < m; ++i) EXPECT_EQ(column[i], batched[size_t(i) * n + 5]);
}

TEST(GemmTest, BatchedProductsEqualOneAtATime) {
  std::mt19937 rng(11);
  const int m = 3, n = 5, k = 7, batch = 4;
  // Per product: x rows 2 * k apart inside a batch stride; weights packed; y interleaved.
  const std::vector<float> x = Random(size_t(batch) * m * 2 * k, rng);
  const std::vector<float> w = Random(size_t(batch) * n * k, rng);
  std::vector<float> y(size_t(m) * batch * n, -7.0f);
  ASSERT_TRUE(cpu::Gemm({.x = x.data(),
                         .weight = w.data(),
                         .y = y.data(),
                         .m = m,
                         .n = n,
                         .k = k,
                         .x_stride = 2 * k,
                         .y_stride = batch * n,
                         .batch = batch,
                         .x_batch_stride = m * 2 * k,
                         .weight_batch_stride = n * k,
                         .y_batch_stride = n})
                  .ok());
  for (int b = 0; b < batch; ++b) {
    std::vector<float> one(size_t(m) * n);
    ASSERT_TRUE(cpu::Gemm({.x = x.data() + b * m * 2 * k,
                           .weight = w.data() + b * n * k,
                           .y = one.data(),
                           .m = m,
                           .n = n,
                           .k = k,
                           .x_stride = 2 * k})
                    .ok());
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j)
        ASSERT_EQ(y[size_t(i) * batch * n + b * n + j], one[size_t(i) * n + j])
            << "product " << b << " row " << i << " col " << j;
  }
}

TEST(GemmTest, HonoursStrides) {
  std::mt19937 rng(7);
  const int m = 5, n = 6, k = 9, x_stride = 13, y_stride = 11;
  const std::vector<float> x = Random(size_t(m) * x_stride, rng);
  const std::vector<float> w = Random(size_t(n) * k, rng);
  std::vector<float> y(size_t(m) * y_stride, -7.0f);
  ASSERT_TRUE(cpu::Gemm({.x = x.data(),
                         .weight = w.data(),
                         .y = y.data(),
                         .m = m,
                         .n = n,
                         .k = k,
                         .x_stride = x_stride,
                         .y_stride = y_stride})
                  .ok());
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < y_stride; ++j) {
      if (j >= n) {
        EXPECT_EQ(y[size_t(i) * y_stride + j], -7.0f) << "padding overwritten";
        continue;
      }
      double expected = 0.0;
      for (int l = 0; l < k; ++l) expected += double{x[size_t(i) * x_stride + l]} * w[j * k + l];
      EXPECT_NEAR(y[size_t(i) * y_stride + j], expected, 1e-5);
    }
  }
}

TEST(GemmTest, RejectsBadParams) {
  float buffer[4] = {1, 2, 3, 4};
  const absl::Status negative =
      cpu::Gemm({.x = buffer, .weight = buffer, .y = buffer, .m = 1, .n = 0, .k = 1});
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(negative.message()), testing::HasSubstr("n > 0"));
  const absl::Status null =
      cpu::Gemm({.x = nullptr, .weight = buffer, .y = buffer, .m = 1, .n = 1, .k = 1});
  EXPECT_EQ(null.code(), absl::StatusCode::kInvalidArgument);
  const absl::Status stride = cpu::Gemm(
      {.x = buffer, .weight = buffer, .y = buffer, .m = 1, .n = 1, .k = 4, .x_stride = 2});
  EXPECT_EQ(stride.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace treeverify::kernels
