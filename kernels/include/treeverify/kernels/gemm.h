// Dense matrix product in the nn.Linear convention: y[m, n] = sum_k x[m, k] * weight[n, k].
//
// The CPU implementation is batch invariant: every output element is accumulated along K in the
// same order whatever m is (BLAS libraries switch kernels with m, e.g. to GEMV at m = 1, which
// changes the last bits). Row r of y depends only on row r of x.
//
// With batch > 1, batch independent products at the given strides (the absorbed MLA projections:
// one per head). Element types: fp32 on the CPU (GemmParams); bf16 x and weight with fp32
// accumulation and a bf16 or fp32 y on the GPU (cuda/gemm.h).
//
//   kernels::GemmParams p{.x = h, .weight = w_q, .y = q, .m = tokens, .n = 192, .k = 64};
//   TV_RETURN_IF_ERROR(kernels::cpu::Gemm(p));
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

template <typename Input, typename Weight, typename Output>
struct GemmParamsOf {
  const Input* x = nullptr;        // [batch][m, k], rows x_stride elements apart
  const Weight* weight = nullptr;  // [batch][n, k], row-major (rows weight_stride elements apart)
  Output* y = nullptr;             // [batch][m, n], rows y_stride elements apart
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t x_stride = 0;       // 0 means k
  int64_t weight_stride = 0;  // 0 means k
  int64_t y_stride = 0;       // 0 means n
  int64_t batch = 1;
  // Elements between consecutive products' x, weight and y (used when batch > 1).
  int64_t x_batch_stride = 0;
  int64_t weight_batch_stride = 0;
  int64_t y_batch_stride = 0;
};
using GemmParams = GemmParamsOf<float, float, float>;

// `p` with `weight` in place of its weight (another element type, the same layout in elements):
// one product's params for weights stored two ways (FP8 bytes, their bf16 values).
template <typename Weight, typename Input, typename From, typename Output>
GemmParamsOf<Input, Weight, Output> WithWeight(const GemmParamsOf<Input, From, Output>& p,
                                               const Weight* weight) {
  return {.x = p.x,
          .weight = weight,
          .y = p.y,
          .m = p.m,
          .n = p.n,
          .k = p.k,
          .x_stride = p.x_stride,
          .weight_stride = p.weight_stride,
          .y_stride = p.y_stride,
          .batch = p.batch,
          .x_batch_stride = p.x_batch_stride,
          .weight_batch_stride = p.weight_batch_stride,
          .y_batch_stride = p.y_batch_stride};
}

namespace cpu {
absl::Status Gemm(const GemmParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
