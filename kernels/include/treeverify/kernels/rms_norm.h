// RMSNorm as in DeepSeek-V3: y = weight * x / sqrt(mean(x^2) + eps), fp32 throughout.
// Input and output may alias (in-place normalization).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

struct RmsNormParams {
  const float* input = nullptr;   // [rows, dim], rows input_stride elements apart
  const float* weight = nullptr;  // [dim]
  float* output = nullptr;        // [rows, dim], rows output_stride elements apart
  int64_t rows = 0;
  int64_t dim = 0;
  int64_t input_stride = 0;   // 0 means dim
  int64_t output_stride = 0;  // 0 means dim
  float eps = 1e-6f;
};

namespace cpu {
absl::Status RmsNorm(const RmsNormParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
