#include "rms_norm_kernel.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/rms_norm.h"

namespace treeverify::kernels::cuda {

absl::Status RmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  const int64_t input_stride = p.input_stride ? p.input_stride : p.dim;
  const int64_t output_stride = p.output_stride ? p.output_stride : p.dim;
  if (p.rows < 0 || p.dim <= 0 || input_stride < p.dim || output_stride < p.dim) {
    return absl::InvalidArgumentError(absl::StrCat("cuda::RmsNorm: rows=", p.rows, " dim=", p.dim,
                                                   " strides=", input_stride, "/", output_stride));
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.input == nullptr || p.weight == nullptr || p.output == nullptr) {
    return absl::InvalidArgumentError("cuda::RmsNorm: input, weight and output must be non-null");
  }
  if (p.rows > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat("cuda::RmsNorm: ", p.rows, " rows"));
  }
  constexpr int kThreads = 256;
  RmsNormKernel<kThreads><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(
      p.input, p.weight, p.output, p.dim, input_stride, output_stride, p.eps);
  return CudaStatus(cudaGetLastError(), "RmsNormKernel launch");
}

}  // namespace treeverify::kernels::cuda
