// The GPU backend's 16-bit element type: bf16, as the checkpoints store weights and as the MLA
// op reads the KV cache. Host code may name it (cuda_bf16.h compiles in C++ too).
#pragma once

#include <cuda_bf16.h>

namespace treeverify::kernels::cuda {

using Bf16 = __nv_bfloat16;

}  // namespace treeverify::kernels::cuda
