// RMSNorm on the GPU, with the CPU backend's params struct (device pointers): all fp32, or the
// forward's form, fp32 rows (the residual stream, a projection's output) normalized with a bf16
// weight into bf16 rows that feed the next GEMM, optionally after the residual add. One block per
// row; the sum of squares is reduced in a fixed tree, so the result is deterministic and
// independent of the number of rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/rms_norm.h"

namespace treeverify::kernels::cuda {

// start_stamp (device memory), where set: the kernel's first block writes %globaltimer there as
// it starts, which is when the stream's previous kernel has ended: a phase mark of the step
// accounting without a kernel of its own (bench/NOTES.md, step 107).
absl::Status RmsNorm(const RmsNormParams& params, cudaStream_t stream,
                     uint64_t* start_stamp = nullptr);
absl::Status RmsNorm(const RmsNormParamsOf<float, Bf16, Bf16>& params, cudaStream_t stream,
                     uint64_t* start_stamp = nullptr);

}  // namespace treeverify::kernels::cuda
