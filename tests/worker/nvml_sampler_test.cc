// NVML's samples of a GPU under copy traffic: they arrive every period, lie in [0, 1], and show
// the memory busy while device-to-device copies run (and, on GPUs with GPM, DRAM bandwidth in
// use). GPU test: skipped, saying so, without a GPU.
#include "treeverify/worker/nvml_sampler.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/cuda/device.h"

namespace treeverify::worker {
namespace {

TEST(NvmlSamplerTest, SamplesShowCopyTraffic) {
  const absl::StatusOr<kernels::cuda::DeviceInfo> device = kernels::cuda::QueryDevice(0);
  if (!device.ok()) GTEST_SKIP() << "GPU test skipped: " << device.status();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  absl::Mutex mu;
  std::vector<NvmlSample> samples;
  absl::StatusOr<std::unique_ptr<NvmlSampler>> sampler =
      NvmlSampler::Start(0, absl::Milliseconds(100), [&](const NvmlSample& sample) {
        absl::MutexLock lock(&mu);
        samples.push_back(sample);
      });
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  // Two seconds of 1 GiB device-to-device copies.
  constexpr size_t kBytes = size_t{1} << 30;
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, kBytes), cudaSuccess);
  const absl::Time end = absl::Now() + absl::Seconds(2);
  while (absl::Now() < end) {
    for (int i = 0; i < 8; ++i)
      ASSERT_EQ(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  absl::SleepFor(absl::Milliseconds(150));  // a sample after the last copies
  const bool gpm = (*sampler)->has_gpm();
  sampler->reset();
  cudaFree(a);
  cudaFree(b);
  absl::MutexLock lock(&mu);
  ASSERT_GE(samples.size(), 10u);
  double busiest = 0, most_bandwidth = 0;
  int with_bandwidth = 0;
  for (const NvmlSample& s : samples) {
    ASSERT_TRUE(s.memory_utilization.has_value());
    EXPECT_GE(*s.memory_utilization, 0.0);
    EXPECT_LE(*s.memory_utilization, 1.0);
    busiest = std::max(busiest, *s.memory_utilization);
    if (s.dram_bandwidth_utilization) {
      ++with_bandwidth;
      EXPECT_GE(*s.dram_bandwidth_utilization, 0.0);
      EXPECT_LE(*s.dram_bandwidth_utilization, 1.0);
      most_bandwidth = std::max(most_bandwidth, *s.dram_bandwidth_utilization);
    }
  }
  std::printf("%s: %zu samples, memory utilization up to %.2f, GPM %s, DRAM bandwidth up to %.2f\n",
              device->name.c_str(), samples.size(), busiest, gpm ? "yes" : "no", most_bandwidth);
  EXPECT_GT(busiest, 0.2) << "copies at full speed should keep device memory busy";
  if (gpm) {
    EXPECT_GT(with_bandwidth, 0);
    EXPECT_GT(most_bandwidth, 0.2) << "copies at full speed should use DRAM bandwidth";
  } else {
    EXPECT_EQ(with_bandwidth, 0);
  }
}

}  // namespace
}  // namespace treeverify::worker
