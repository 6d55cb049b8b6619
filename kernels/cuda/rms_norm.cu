#include "rms_norm_kernel.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/rms_norm.h"

namespace treeverify::kernels::cuda {
namespace {

template <typename Input, typename Weight, typename Output>
absl::Status Launch(const RmsNormParamsOf<Input, Weight, Output>& p, cudaStream_t stream,
                    uint64_t* start_stamp) {
  const int64_t input_stride = p.input_stride ? p.input_stride : p.dim;
  const int64_t output_stride = p.output_stride ? p.output_stride : p.dim;
  if (p.rows < 0 || p.rows > 0x7fffffff || p.dim <= 0 || input_stride < p.dim ||
      output_stride < p.dim || !(p.eps >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda::RmsNorm: rows=", p.rows, " dim=", p.dim,
                                                   " strides=", input_stride, "/", output_stride,
                                                   " eps=", p.eps));
  }
  if ((p.add == nullptr) != (p.sum == nullptr)) {
    return absl::InvalidArgumentError("cuda::RmsNorm: a residual add needs both add and sum");
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.input == nullptr || p.weight == nullptr || p.output == nullptr) {
    return absl::InvalidArgumentError("cuda::RmsNorm: input, weight and output must be non-null");
  }
  // One block per row: a verify step has few rows, so wide rows (the hidden size) take 1024
  // threads, or each thread would walk its elements one latency after another (25 us at 16
  // rows of 7168 with 256 threads); up to 8 (1024 threads) or 16 (256) elements a thread are
  // held in registers, all loaded at once.
  const unsigned blocks = static_cast<unsigned>(p.rows);
  if (p.dim > 8 * 1024) {
    RmsNormKernel<1024, 0><<<blocks, 1024, 0, stream>>>(p.input, p.add, p.sum, p.weight, p.output,
                                                        p.dim, input_stride, output_stride, p.eps,
                                                        start_stamp);
  } else if (p.dim >= 4096) {
    RmsNormKernel<1024, 8><<<blocks, 1024, 0, stream>>>(p.input, p.add, p.sum, p.weight, p.output,
                                                        p.dim, input_stride, output_stride, p.eps,
                                                        start_stamp);
  } else {
    RmsNormKernel<256, 16><<<blocks, 256, 0, stream>>>(p.input, p.add, p.sum, p.weight, p.output,
                                                       p.dim, input_stride, output_stride, p.eps,
                                                       start_stamp);
  }
  return CudaStatus(cudaGetLastError(), "RmsNormKernel launch");
}

}  // namespace

absl::Status RmsNorm(const RmsNormParams& params, cudaStream_t stream, uint64_t* start_stamp) {
  return Launch(params, stream, start_stamp);
}

absl::Status RmsNorm(const RmsNormParamsOf<float, Bf16, Bf16>& params, cudaStream_t stream,
                     uint64_t* start_stamp) {
  return Launch(params, stream, start_stamp);
}

}  // namespace treeverify::kernels::cuda
