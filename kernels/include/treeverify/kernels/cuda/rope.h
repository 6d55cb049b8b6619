// RoPE on the GPU with the CPU backend's params struct and angle rule (the fp32 product
// float(position) * inv_freq, cos and sin in double rounded to fp32, unfused fp32 rotation), so
// it rounds like the CPU op up to the output's bf16. Two forms: bf16 in place or from bf16
// (q_pe into the absorbed query), and from fp32 into bf16 (k_pe from the kv_a projection into
// the new cache row). One block per row; rope_dim at most 512.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/rope.h"

namespace treeverify::kernels::cuda {

absl::Status Rope(const RopeParamsOf<Bf16, Bf16>& params, cudaStream_t stream);
absl::Status Rope(const RopeParamsOf<float, Bf16>& params, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
