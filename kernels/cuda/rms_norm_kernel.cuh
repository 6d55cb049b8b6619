// RMSNorm kernel: one block of kThreads per row. Each thread sums the squares of a strided
// subset of the row in order, then the block folds the partial sums in a fixed tree (warp
// shuffles, then one warp over the warps' sums), so the bits depend only on the row.
//
// Input and output may alias (in-place normalization), and with a residual add the sum may alias
// the input: each thread reads and writes only its own elements (the same ones in both passes),
// so the pointers are not __restrict__ and no barrier is needed between a thread's write and its
// own later read.
#pragma once

#include <cstdint>

#include "element_convert.cuh"

namespace treeverify::kernels::cuda {

template <int kThreads, typename Input, typename Weight, typename Output>
__global__ void RmsNormKernel(const Input* input, const Input* add, Input* sum,
                              const Weight* __restrict__ weight, Output* output, int64_t dim,
                              int64_t input_stride, int64_t output_stride, float eps) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024);
  const Input* x = input + blockIdx.x * input_stride;
  Output* y = output + blockIdx.x * output_stride;
  float squares = 0.0f;
  if (add != nullptr) {
    const Input* a = add + blockIdx.x * input_stride;
    Input* s = sum + blockIdx.x * input_stride;
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
      const float v = __fadd_rn(ToFloat(x[i]), ToFloat(a[i]));
      s[i] = FromFloat<Input>(v);
      squares += v * v;
    }
    x = s;
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
      const float v = ToFloat(x[i]);
      squares += v * v;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  }
  __shared__ float warp_sums[kThreads / 32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = squares;
  __syncthreads();
  if (warp == 0) {
    squares = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) {
      squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    }
    if (lane == 0) warp_sums[0] = squares;
  }
  __syncthreads();
  const float scale = rsqrtf(warp_sums[0] / static_cast<float>(dim) + eps);
  // As transformers and the CPU op: weight * (x * scale), two rounded products.
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    y[i] = FromFloat<Output>(__fmul_rn(ToFloat(weight[i]), __fmul_rn(ToFloat(x[i]), scale)));
  }
}

}  // namespace treeverify::kernels::cuda
