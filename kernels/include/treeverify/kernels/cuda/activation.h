// SiLU-and-multiply on the GPU with the CPU backend's params struct: fp32 gate and up (the
// gate_up projection's output), bf16 out (the down projection's input), fp32 math.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "treeverify/kernels/activation.h"
#include "treeverify/kernels/cuda/bf16.h"

namespace treeverify::kernels::cuda {

absl::Status SiluMul(const SiluMulParamsOf<float, Bf16>& params, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
