// CUDA runtime errors as absl::Status, with the runtime's own message, at the call site.
//
//   TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::kernels::cuda {

inline absl::Status CudaStatus(cudaError_t error, const char* expression) {
  if (error == cudaSuccess) return absl::OkStatus();
  // No device or no driver is a property of the machine, not a bug: callers report it as such.
  const absl::StatusCode code = error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver
                                    ? absl::StatusCode::kFailedPrecondition
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expression, ": ", cudaGetErrorName(error), ": ",
                                         cudaGetErrorString(error)));
}

}  // namespace treeverify::kernels::cuda

#define TV_CUDA_RETURN_IF_ERROR(expr)                                                        \
  do {                                                                                       \
    ::absl::Status tv_cuda_status_ = ::treeverify::kernels::cuda::CudaStatus((expr), #expr); \
    if (!tv_cuda_status_.ok()) return tv_cuda_status_;                                       \
  } while (0)
