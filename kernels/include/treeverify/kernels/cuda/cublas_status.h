// cuBLAS / cuBLASLt errors as absl::Status, with the library's own name and message.
//
//   TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
#pragma once

#include <cublasLt.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::kernels::cuda {

inline absl::Status CublasStatus(cublasStatus_t status, const char* expression) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code = status == CUBLAS_STATUS_NOT_SUPPORTED
                                    ? absl::StatusCode::kUnimplemented
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expression, ": ", cublasLtGetStatusName(status), ": ",
                                         cublasLtGetStatusString(status)));
}

}  // namespace treeverify::kernels::cuda

#define TV_CUBLAS_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                           \
    ::absl::Status tv_cublas_status_ = ::treeverify::kernels::cuda::CublasStatus((expr), #expr); \
    if (!tv_cublas_status_.ok()) return tv_cublas_status_;                                       \
  } while (0)
