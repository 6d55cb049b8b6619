#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/device.h"

namespace treeverify::kernels::cuda {

absl::StatusOr<DeviceInfo> QueryDevice(int ordinal) {
  int count = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (ordinal < 0 || ordinal >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", ordinal, " requested; this machine has ", count));
  }
  cudaDeviceProp props{};
  TV_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, ordinal));
  DeviceInfo info;
  info.ordinal = ordinal;
  info.name = props.name;
  info.compute_capability_major = props.major;
  info.compute_capability_minor = props.minor;
  info.multiprocessors = props.multiProcessorCount;
  info.global_memory_bytes = static_cast<int64_t>(props.totalGlobalMem);
  info.l2_cache_bytes = props.l2CacheSize;
  return info;
}

}  // namespace treeverify::kernels::cuda
