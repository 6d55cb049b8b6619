// RMSNorm kernel: one block of kThreads per row. Each thread sums the squares of a strided
// subset of the row in order, then the block folds the partial sums in a fixed tree (warp
// shuffles, then one warp over the warps' sums), so the bits depend only on the row. Input and
// output may alias (in-place normalization): each thread reads its elements before the block's
// barrier and writes them after it, so they are not __restrict__.
#pragma once

#include <cstdint>

namespace treeverify::kernels::cuda {

template <int kThreads>
__global__ void RmsNormKernel(const float* input, const float* __restrict__ weight, float* output,
                              int64_t dim, int64_t input_stride, int64_t output_stride, float eps) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024);
  const float* x = input + blockIdx.x * input_stride;
  float* y = output + blockIdx.x * output_stride;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += x[i] * x[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ float warp_sums[kThreads / 32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) warp_sums[0] = sum;
  }
  __syncthreads();
  const float scale = rsqrtf(warp_sums[0] / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) y[i] = weight[i] * (x[i] * scale);
}

}  // namespace treeverify::kernels::cuda
