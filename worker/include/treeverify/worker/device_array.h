// Device memory owned by one object: allocated on the current device, freed on destruction.
//
//   TV_ASSIGN_OR_RETURN(DeviceArray<Bf16> table, DeviceArray<Bf16>::Allocate(rows * hidden));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/cuda_status.h"

namespace treeverify::worker {

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  static absl::StatusOr<DeviceArray> Allocate(int64_t count) {
    DeviceArray array;
    if (count > 0) {
      TV_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&array.data_),
                                         static_cast<size_t>(count) * sizeof(T)));
    }
    array.count_ = count;
    return array;
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(DeviceArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  int64_t size() const { return count_; }
  int64_t bytes() const { return count_ * static_cast<int64_t>(sizeof(T)); }

 private:
  T* data_ = nullptr;
  int64_t count_ = 0;
};

}  // namespace treeverify::worker
