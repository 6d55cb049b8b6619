// RMSNorm on the GPU, with the CPU backend's params struct (device pointers). One warp-sized
// block per row; the sum of squares is reduced in a fixed tree, so the result is deterministic
// and independent of the number of rows.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "treeverify/kernels/rms_norm.h"

namespace treeverify::kernels::cuda {

absl::Status RmsNorm(const RmsNormParams& params, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
