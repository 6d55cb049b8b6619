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
#include "grid_dependency.cuh"

namespace treeverify::kernels::cuda {

// kPerThread > 0: a thread's elements (dim <= kThreads * kPerThread) are loaded at once, every
// load in flight together, and kept in registers for the second pass, so the row is read once:
// as a loop, each element one latency after another, 16 rows of 7168 took 5.1 us
// (bench/NOTES.md, step 93). The sums are the same either way (the same elements per thread, in
// the same order). kPerThread == 0: any dim, as a loop.
template <int kThreads, int kPerThread, typename Input, typename Weight, typename Output>
__global__ void RmsNormKernel(const Input* input, const Input* add, Input* sum,
                              const Weight* __restrict__ weight, Output* output, int64_t dim,
                              int64_t input_stride, int64_t output_stride, float eps,
                              uint64_t* start_stamp) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024);
  // A programmatic dependent (a resident product's weight loads, resident_gemm.h) may start now;
  // it waits for this kernel before it reads the output.
  AllowDependentGridLaunch();
  if (start_stamp != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *start_stamp = now;
  }
  const Input* x = input + blockIdx.x * input_stride;
  Output* y = output + blockIdx.x * output_stride;
  const Input* a = add == nullptr ? nullptr : add + blockIdx.x * input_stride;
  Input* s = sum == nullptr ? nullptr : sum + blockIdx.x * input_stride;
  float squares = 0.0f;
  constexpr int kHeld = kPerThread > 0 ? kPerThread : 1;
  float held[kHeld];
  float scales[kHeld];
  if constexpr (kPerThread > 0) {
    // Every load first, guarded but not broken out of: a `break`, or the residual's add between
    // one element's loads and the next's, made the compiler issue them one latency after another
    // (the add waits for its loads; step 94).
    float added[kHeld];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + int64_t{j} * kThreads;
      if (i < dim) {
        held[j] = ToFloat(x[i]);
        added[j] = a != nullptr ? ToFloat(a[i]) : 0.0f;
        scales[j] = ToFloat(weight[i]);
      }
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + int64_t{j} * kThreads;
      if (i < dim) {
        if (a != nullptr) held[j] = __fadd_rn(held[j], added[j]);
        if (s != nullptr) s[i] = FromFloat<Input>(held[j]);
        squares += held[j] * held[j];
      }
    }
  } else if (a != nullptr) {
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
  if constexpr (kPerThread > 0) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + int64_t{j} * kThreads;
      if (i < dim) y[i] = FromFloat<Output>(__fmul_rn(scales[j], __fmul_rn(held[j], scale)));
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
      y[i] = FromFloat<Output>(__fmul_rn(ToFloat(weight[i]), __fmul_rn(ToFloat(x[i]), scale)));
    }
  }
}

}  // namespace treeverify::kernels::cuda
