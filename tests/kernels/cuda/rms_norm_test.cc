// GPU RMSNorm against the CPU backend (the oracle) on random rows of odd sizes.
#include "treeverify/kernels/cuda/rms_norm.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda_test_base.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/cuda/global_timer.h"

namespace treeverify::kernels::cuda {
namespace {

class CudaRmsNormTest : public CudaTest {};

TEST_F(CudaRmsNormTest, MatchesTheCpuBackend) {
  const unsigned seed = 2026;
  SCOPED_TRACE(testing::Message() << "seed " << seed << " on " << device_.name);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  for (int64_t rows : {1, 3, 19}) {
    // Each launch shape and its edges: 256 threads holding up to 16 elements (dim < 4096), 1024
    // holding up to 8 (4096..8192), and the loop beyond.
    for (int64_t dim : {1, 7, 512, 733, 4095, 4096, 7168, 8192, 8193}) {
      std::vector<float> x(rows * dim), w(dim);
      for (float& v : x) v = dist(rng);
      for (float& v : w) v = 1.0f + 0.1f * dist(rng);
      std::vector<float> expected(rows * dim);
      ASSERT_TRUE(cpu::RmsNorm({.input = x.data(),
                                .weight = w.data(),
                                .output = expected.data(),
                                .rows = rows,
                                .dim = dim,
                                .eps = 1e-6f})
                      .ok());
      DeviceBuffer<float> dx(x.size()), dw(w.size()), dy(x.size());
      dx.CopyFrom(x);
      dw.CopyFrom(w);
      ASSERT_TRUE(RmsNorm({.input = dx.get(),
                           .weight = dw.get(),
                           .output = dy.get(),
                           .rows = rows,
                           .dim = dim,
                           .eps = 1e-6f},
                          nullptr)
                      .ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> actual = dy.ToHost();
      for (size_t i = 0; i < actual.size(); ++i) {
        ASSERT_NEAR(actual[i], expected[i], 1e-5f * (1.0f + std::abs(expected[i])))
            << "rows " << rows << " dim " << dim << " element " << i;
      }
    }
  }
}

// The start stamp (a phase mark of the step accounting): written by the norm between the stamps
// of the kernels before and after it on the stream, and the output is unchanged by it.
TEST_F(CudaRmsNormTest, StampsItsStartBetweenItsNeighbours) {
  const int64_t rows = 4, dim = 7168;
  std::vector<float> x(rows * dim, 0.5f), w(dim, 1.0f);
  DeviceBuffer<float> dx(x.size()), dw(w.size()), dy(x.size()), plain(x.size());
  DeviceBuffer<uint64_t> stamps(3);
  dx.CopyFrom(x);
  dw.CopyFrom(w);
  stamps.CopyFrom({0, 0, 0});
  const RmsNormParams params{
      .input = dx.get(), .weight = dw.get(), .output = dy.get(), .rows = rows, .dim = dim};
  ASSERT_TRUE(RecordGlobalTimer(stamps.get(), nullptr).ok());
  ASSERT_TRUE(RmsNorm(params, nullptr, stamps.get() + 1).ok());
  ASSERT_TRUE(RecordGlobalTimer(stamps.get() + 2, nullptr).ok());
  RmsNormParams unstamped = params;
  unstamped.output = plain.get();
  ASSERT_TRUE(RmsNorm(unstamped, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint64_t> t = stamps.ToHost();
  EXPECT_GT(t[0], 0u);
  EXPECT_LE(t[0], t[1]);
  EXPECT_LE(t[1], t[2]);
  EXPECT_EQ(dy.ToHost(), plain.ToHost());
}

// Parameter checks happen before any CUDA call, so they run without a GPU too.
TEST(CudaRmsNormParamsTest, RejectsBadShapes) {
  EXPECT_EQ(RmsNorm(RmsNormParams{.rows = 1, .dim = 0}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNorm(RmsNormParams{.rows = 1, .dim = 4}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace treeverify::kernels::cuda
