// SiLU-and-multiply, the gated activation of DeepSeek's MLPs: out = silu(gate) * up.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

struct SiluMulParams {
  const float* gate_up = nullptr;  // [rows, 2 * dim]: gate in [0, dim), up in [dim, 2*dim)
  float* out = nullptr;            // [rows, dim]
  int64_t rows = 0;
  int64_t dim = 0;
};

namespace cpu {
absl::Status SiluMul(const SiluMulParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
