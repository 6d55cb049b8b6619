// Base fixture of GPU tests: skips, saying why, on a machine without a usable GPU, so CI (which
// has none) shows these tests as skipped rather than passed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gtest/gtest.h"
#include "treeverify/kernels/cuda/device.h"

namespace treeverify::kernels::cuda {

// GPUs the CUDA runtime sees; 0 where it cannot start.
inline int VisibleGpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

class CudaTest : public testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<DeviceInfo> device = QueryDevice(0);
    if (!device.ok()) GTEST_SKIP() << "GPU test skipped: " << device.status();
    device_ = *device;
  }
  // Skips, saying why, with fewer than two GPUs (NCCL puts one rank on each); the
  // nvidia-h200-x2 machine runs these tests (scripts/gpu-check.sh).
  void RequireTwoGpus() {
    if (VisibleGpus() < 2) {
      GTEST_SKIP() << "GPU test skipped: needs 2 GPUs (NCCL puts one rank on each), "
                   << VisibleGpus() << " visible";
    }
  }
  DeviceInfo device_;
};

// A device buffer that frees itself.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return data_; }
  int64_t bytes() const { return static_cast<int64_t>(count_ * sizeof(T)); }
  void CopyFrom(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), count_);
    ASSERT_EQ(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> ToHost() const {
    std::vector<T> host(count_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace treeverify::kernels::cuda
