// RMSNorm as in DeepSeek-V3: y = weight * x / sqrt(mean(x^2) + eps), computed in fp32 whatever
// the element types. Input and output may alias (in-place normalization). With a residual add,
// the row normalized is input + add, and that sum is stored too: the decoder's
// "residual += branch; normed = norm(residual)" in one pass.
//
// The element types are template parameters so that the CPU backend (all fp32, RmsNormParams)
// and the GPU backend (fp32 residual, bf16 weight and output) share one struct.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

template <typename Input, typename Weight, typename Output>
struct RmsNormParamsOf {
  const Input* input = nullptr;    // [rows, dim], rows input_stride elements apart
  const Weight* weight = nullptr;  // [dim]
  Output* output = nullptr;        // [rows, dim], rows output_stride elements apart
  int64_t rows = 0;
  int64_t dim = 0;
  int64_t input_stride = 0;   // 0 means dim
  int64_t output_stride = 0;  // 0 means dim
  float eps = 1e-6f;
  // Residual add, both or neither: the rows normalized are input + add (an fp32 sum), stored in
  // sum. Both have input's layout; sum may be input.
  const Input* add = nullptr;  // [rows, dim]
  Input* sum = nullptr;        // [rows, dim]
};
using RmsNormParams = RmsNormParamsOf<float, float, float>;

namespace cpu {
absl::Status RmsNorm(const RmsNormParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
