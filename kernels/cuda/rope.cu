// RoPE. Roofline: heads * rope_dim elements read and written per row plus rope_dim / 2 cos/sin
// pairs in double: nanoseconds of work at verify sizes, launch bound. Double math is no cost
// here even at a consumer GPU's FP64 rate (32 pairs per row).
#include "element_convert.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/rope.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kMaxRopeDim = 512;

template <typename Input, typename Output>
__global__ void RopeKernel(RopeParamsOf<Input, Output> p, int64_t input_row_stride,
                           int64_t input_head_stride) {
  __shared__ float cos_values[kMaxRopeDim / 2];
  __shared__ float sin_values[kMaxRopeDim / 2];
  const int64_t half = p.rope_dim / 2;
  const int64_t r = blockIdx.x;
  const float position = static_cast<float>(p.positions[r]);
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = __fmul_rn(position, p.inv_freq[i]);
    cos_values[i] =
        __fmul_rn(static_cast<float>(cos(static_cast<double>(angle))), p.attention_factor);
    sin_values[i] =
        __fmul_rn(static_cast<float>(sin(static_cast<double>(angle))), p.attention_factor);
  }
  __syncthreads();
  // Interleaved pairs sit at (2i, 2i+1); rotate_half pairs at (i, i + d/2).
  const int64_t first_step = p.interleaved ? 2 : 1;
  const int64_t second_offset = p.interleaved ? 1 : half;
  for (int64_t t = threadIdx.x; t < p.heads * half; t += blockDim.x) {
    const int64_t h = t / half;
    const int64_t i = t % half;
    Output* x = p.x + r * p.row_stride + h * p.head_stride + i * first_step;
    float x1, x2;
    if (p.input != nullptr) {
      const Input* in = p.input + r * input_row_stride + h * input_head_stride + i * first_step;
      x1 = ToFloat(in[0]);
      x2 = ToFloat(in[second_offset]);
    } else {
      x1 = ToFloat(x[0]);
      x2 = ToFloat(x[second_offset]);
    }
    const float c = cos_values[i];
    const float s = sin_values[i];
    x[0] = FromFloat<Output>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    x[second_offset] = FromFloat<Output>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
}

template <typename Input, typename Output>
absl::Status Launch(const RopeParamsOf<Input, Output>& p, cudaStream_t stream) {
  const int64_t input_row_stride = p.input_row_stride ? p.input_row_stride : p.row_stride;
  const int64_t input_head_stride = p.input_head_stride ? p.input_head_stride : p.head_stride;
  const bool several_heads = p.heads > 1;
  if (p.rope_dim <= 0 || p.rope_dim % 2 != 0 || p.rope_dim > kMaxRopeDim || p.heads <= 0 ||
      p.rows < 0 || p.rows > 0x7fffffff ||
      (several_heads && (p.head_stride < p.rope_dim || input_head_stride < p.rope_dim)) ||
      p.row_stride < (p.heads - 1) * p.head_stride + p.rope_dim ||
      input_row_stride < (p.heads - 1) * input_head_stride + p.rope_dim ||
      !isfinite(p.attention_factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::Rope: rows=", p.rows, " heads=", p.heads, " rope_dim=", p.rope_dim,
                     " (even, at most ", kMaxRopeDim, ") row/head strides ", p.row_stride, "/",
                     p.head_stride, " input strides ", input_row_stride, "/", input_head_stride,
                     " attention_factor=", p.attention_factor));
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.x == nullptr || p.positions == nullptr || p.inv_freq == nullptr) {
    return absl::InvalidArgumentError("cuda::Rope: x, positions and inv_freq must be non-null");
  }
  RopeKernel<<<static_cast<unsigned>(p.rows), 256, 0, stream>>>(p, input_row_stride,
                                                                input_head_stride);
  return CudaStatus(cudaGetLastError(), "RopeKernel launch");
}

}  // namespace

absl::Status Rope(const RopeParamsOf<Bf16, Bf16>& params, cudaStream_t stream) {
  return Launch(params, stream);
}

absl::Status Rope(const RopeParamsOf<float, Bf16>& params, cudaStream_t stream) {
  if (params.input == nullptr && params.rows > 0) {
    return absl::InvalidArgumentError("cuda::Rope: fp32 to bf16 needs an input");
  }
  return Launch(params, stream);
}

}  // namespace treeverify::kernels::cuda
