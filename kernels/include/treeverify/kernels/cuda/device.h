// What the CUDA backend needs to know about a GPU, and a clear answer when there is none.
//
//   absl::StatusOr<DeviceInfo> gpu = QueryDevice(0);
//   if (!gpu.ok()) { /* FAILED_PRECONDITION: no CUDA device (cudaErrorInsufficientDriver ...) */ }
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace treeverify::kernels::cuda {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int multiprocessors = 0;
  int64_t global_memory_bytes = 0;
  int64_t l2_cache_bytes = 0;
};

// FAILED_PRECONDITION when the machine has no usable GPU (no device or no driver).
absl::StatusOr<DeviceInfo> QueryDevice(int ordinal);

}  // namespace treeverify::kernels::cuda
