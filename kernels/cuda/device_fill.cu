#include <cuda_fp8.h>

#include <algorithm>

#include "element_convert.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/device_fill.h"

namespace treeverify::kernels::cuda {
namespace {

__device__ __forceinline__ uint32_t Hash(uint64_t index, uint32_t seed) {
  uint32_t x =
      static_cast<uint32_t>(index) * 2654435761u ^ seed ^ static_cast<uint32_t>(index >> 32);
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ float HashUniform(uint64_t index, uint32_t seed) {
  return static_cast<float>(Hash(index, seed) >> 8) / 16777216.0f * 2.0f - 1.0f;  // [-1, 1)
}

__global__ void FillFp8Kernel(uint8_t* data, int64_t count, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = __nv_cvt_float_to_fp8(HashUniform(i, seed) * scale, __NV_SATFINITE, __NV_E4M3);
  }
}

__global__ void FillRandomBitsKernel(uint32_t* data, int64_t count, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = Hash(i, seed);
  }
}

template <typename T>
__global__ void FillUniformKernel(T* data, int64_t count, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = FromFloat<T>(HashUniform(i, seed) * scale);
  }
}

__global__ void FillConstantKernel(Bf16* data, int64_t count, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = FromFloat<Bf16>(value);
  }
}

unsigned Blocks(int64_t count) {
  return static_cast<unsigned>(std::min<int64_t>(4096, (count + 255) / 256));
}

template <typename T>
absl::Status Launch(T* data, int64_t count, float scale, uint32_t seed, cudaStream_t stream) {
  if (count < 0 || (count > 0 && data == nullptr)) {
    return absl::InvalidArgumentError("FillUniform: a negative count or no buffer");
  }
  if (count == 0) return absl::OkStatus();
  FillUniformKernel<<<Blocks(count), 256, 0, stream>>>(data, count, scale, seed);
  return CudaStatus(cudaGetLastError(), "FillUniformKernel launch");
}

}  // namespace

absl::Status FillUniform(Bf16* data, int64_t count, float scale, uint32_t seed,
                         cudaStream_t stream) {
  return Launch(data, count, scale, seed, stream);
}

absl::Status FillUniform(float* data, int64_t count, float scale, uint32_t seed,
                         cudaStream_t stream) {
  return Launch(data, count, scale, seed, stream);
}

absl::Status FillConstant(Bf16* data, int64_t count, float value, cudaStream_t stream) {
  if (count < 0 || (count > 0 && data == nullptr)) {
    return absl::InvalidArgumentError("FillConstant: a negative count or no buffer");
  }
  if (count == 0) return absl::OkStatus();
  FillConstantKernel<<<Blocks(count), 256, 0, stream>>>(data, count, value);
  return CudaStatus(cudaGetLastError(), "FillConstantKernel launch");
}

absl::Status FillRandomBits(uint32_t* data, int64_t count, uint32_t seed, cudaStream_t stream) {
  if (count < 0 || (count > 0 && data == nullptr)) {
    return absl::InvalidArgumentError("FillRandomBits: a negative count or no buffer");
  }
  if (count == 0) return absl::OkStatus();
  FillRandomBitsKernel<<<Blocks(count), 256, 0, stream>>>(data, count, seed);
  return CudaStatus(cudaGetLastError(), "FillRandomBitsKernel launch");
}

absl::Status FillUniformFp8E4M3(uint8_t* data, int64_t count, float scale, uint32_t seed,
                                cudaStream_t stream) {
  if (count < 0 || (count > 0 && data == nullptr) || !(scale > 0.0f && scale <= 448.0f)) {
    return absl::InvalidArgumentError(
        "FillUniformFp8E4M3: a negative count, no buffer, or a scale outside (0, 448]");
  }
  if (count == 0) return absl::OkStatus();
  FillFp8Kernel<<<Blocks(count), 256, 0, stream>>>(data, count, scale, seed);
  return CudaStatus(cudaGetLastError(), "FillFp8Kernel launch");
}

}  // namespace treeverify::kernels::cuda
