// Device buffers filled on the device: random bf16 weights for benchmarks of shapes no checkpoint
// here has, and constants (norm weights).
//
//   TV_RETURN_IF_ERROR(FillUniform(weights, count, 1.0f / std::sqrt(fan_in), seed, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"

namespace treeverify::kernels::cuda {

// Uniform in [-scale, scale), from a hash of (seed, index): the same for every launch shape.
absl::Status FillUniform(Bf16* data, int64_t count, float scale, uint32_t seed,
                         cudaStream_t stream);
absl::Status FillUniform(float* data, int64_t count, float scale, uint32_t seed,
                         cudaStream_t stream);
absl::Status FillConstant(Bf16* data, int64_t count, float value, cudaStream_t stream);
// e4m3 (fn) bytes of values uniform in [-scale, scale), rounded to nearest; scale at most 448.
absl::Status FillUniformFp8E4M3(uint8_t* data, int64_t count, float scale, uint32_t seed,
                                cudaStream_t stream);
// Uniformly random words (packed INT4 weights), from the same hash of (seed, index).
absl::Status FillRandomBits(uint32_t* data, int64_t count, uint32_t seed, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
