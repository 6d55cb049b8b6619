// Dense matrix product in the nn.Linear convention: y[m, n] = sum_k x[m, k] * weight[n, k].
//
// The CPU implementation is batch invariant: every output element is accumulated along K in the
// same order whatever m is (BLAS libraries switch kernels with m, e.g. to GEMV at m = 1, which
// changes the last bits). Row r of y depends only on row r of x.
//
//   kernels::GemmParams p{.x = h, .weight = w_q, .y = q, .m = tokens, .n = 192, .k = 64};
//   TV_RETURN_IF_ERROR(kernels::cpu::Gemm(p));
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

struct GemmParams {
  const float* x = nullptr;       // [m, k], rows x_stride elements apart
  const float* weight = nullptr;  // [n, k], row-major (rows weight_stride elements apart)
  float* y = nullptr;             // [m, n], rows y_stride elements apart
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t x_stride = 0;       // 0 means k
  int64_t weight_stride = 0;  // 0 means k
  int64_t y_stride = 0;       // 0 means n
};

namespace cpu {
absl::Status Gemm(const GemmParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
