// SiLU-and-multiply, the gated activation of DeepSeek's MLPs: out = silu(gate) * up.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

// fp32 on the CPU (SiluMulParams); fp32 in, bf16 out on the GPU. Math is fp32.
template <typename Input, typename Output>
struct SiluMulParamsOf {
  const Input* gate_up = nullptr;  // [rows, 2 * dim]: gate in [0, dim), up in [dim, 2*dim)
  Output* out = nullptr;           // [rows, dim]
  int64_t rows = 0;
  int64_t dim = 0;
};
using SiluMulParams = SiluMulParamsOf<float, float>;

namespace cpu {
absl::Status SiluMul(const SiluMulParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
