#include <algorithm>
#include <vector>

#include "treeverify/kernels/cuda/copy_bandwidth.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {
namespace {

__global__ void CopyKernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t count) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < count; i += stride) dst[i] = src[i];
}

// Frees what it holds on every path.
struct Resources {
  void* src = nullptr;
  void* dst = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Resources() {
    cudaFree(src);
    cudaFree(dst);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
};

template <typename Copy>
absl::StatusOr<double> MedianBytesPerSecond(Resources& r, int64_t bytes, cudaStream_t stream,
                                            Copy copy) {
  TV_RETURN_IF_ERROR(copy());  // warm-up
  std::vector<double> rates;
  for (int run = 0; run < 7; ++run) {
    TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.start, stream));
    TV_RETURN_IF_ERROR(copy());
    TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.stop, stream));
    TV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(r.stop));
    float ms = 0.0f;
    TV_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, r.start, r.stop));
    rates.push_back(2.0 * static_cast<double>(bytes) / (ms * 1e-3));
  }
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

}  // namespace

absl::Status CopyWith16ByteLoads(const void* src, void* dst, int64_t bytes, cudaStream_t stream) {
  if (bytes < 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CopyWith16ByteLoads: ", bytes, " bytes, pointers 16-byte aligned needed"));
  }
  int device = 0, multiprocessors = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  CopyKernel<<<multiprocessors * 8, 256, 0, stream>>>(static_cast<const uint4*>(src),
                                                      static_cast<uint4*>(dst), bytes / 16);
  return CudaStatus(cudaGetLastError(), "CopyKernel launch");
}

absl::StatusOr<double> MeasureCopyBandwidth(int64_t bytes, cudaStream_t stream) {
  if (bytes < (int64_t{64} << 20) || bytes % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MeasureCopyBandwidth: need a multiple of 16 of at least 64 MB, got ", bytes));
  }
  Resources r;
  TV_CUDA_RETURN_IF_ERROR(cudaMalloc(&r.src, bytes));
  TV_CUDA_RETURN_IF_ERROR(cudaMalloc(&r.dst, bytes));
  TV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(r.src, 1, bytes, stream));
  TV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&r.start));
  TV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&r.stop));
  TV_ASSIGN_OR_RETURN(const double kernel, MedianBytesPerSecond(r, bytes, stream, [&] {
                        return CopyWith16ByteLoads(r.src, r.dst, bytes, stream);
                      }));
  TV_ASSIGN_OR_RETURN(const double memcpy, MedianBytesPerSecond(r, bytes, stream, [&] {
                        return CudaStatus(
                            cudaMemcpyAsync(r.dst, r.src, bytes, cudaMemcpyDeviceToDevice, stream),
                            "cudaMemcpyAsync");
                      }));
  return std::max(kernel, memcpy);
}

}  // namespace treeverify::kernels::cuda
