// A cold L2 for the probes that time one launch as a verify step sees it (each weight read once):
// a read of a buffer larger than the L2, so that it holds only that buffer's clean lines. A
// memset would leave dirty lines, written back inside the timed window as the weights evict them
// (bench/NOTES.md, step 105).
//
//   L2Flusher flusher;  // 256 MB, once
//   flusher.Flush(stream);  // before each timed launch
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace treeverify::bench {

__global__ void ReadAllKernel(const uint4* words, int64_t count, uint32_t* sink) {
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 w = words[i];
    x ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (x == 0x9e3779b9u) *sink = x;  // keeps the loads; practically never taken
}

class L2Flusher {
 public:
  // Allocation failures leave the flusher empty: ok() says so, Flush does nothing.
  explicit L2Flusher(int64_t bytes = int64_t{256} << 20) : bytes_(bytes) {
    if (cudaMalloc(&buffer_, static_cast<size_t>(bytes_)) != cudaSuccess ||
        cudaMalloc(&sink_, sizeof(uint32_t)) != cudaSuccess ||
        cudaMemset(buffer_, 1, static_cast<size_t>(bytes_)) != cudaSuccess) {
      bytes_ = 0;
    }
    int device = 0, multiprocessors = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
            cudaSuccess) {
      bytes_ = 0;
    }
    blocks_ = 4 * multiprocessors;
  }
  ~L2Flusher() {
    cudaFree(buffer_);
    cudaFree(sink_);
  }
  L2Flusher(const L2Flusher&) = delete;
  L2Flusher& operator=(const L2Flusher&) = delete;

  bool ok() const { return bytes_ > 0; }
  // Enqueues the read on `stream`; the launch's error, if any, is the stream's next.
  void Flush(cudaStream_t stream) const {
    if (!ok()) return;
    ReadAllKernel<<<blocks_, 256, 0, stream>>>(static_cast<const uint4*>(buffer_),
                                               bytes_ / static_cast<int64_t>(sizeof(uint4)), sink_);
  }

 private:
  int64_t bytes_;
  int blocks_ = 0;  // four a multiprocessor
  void* buffer_ = nullptr;
  uint32_t* sink_ = nullptr;
};

}  // namespace treeverify::bench
