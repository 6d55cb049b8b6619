#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/global_timer.h"

namespace treeverify::kernels::cuda {
namespace {

__global__ void RecordGlobalTimerKernel(uint64_t* slot) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *slot = now;
}

}  // namespace

absl::Status RecordGlobalTimer(uint64_t* slot, cudaStream_t stream) {
  if (slot == nullptr) return absl::InvalidArgumentError("cuda::RecordGlobalTimer: null slot");
  RecordGlobalTimerKernel<<<1, 1, 0, stream>>>(slot);
  return CudaStatus(cudaGetLastError(), "RecordGlobalTimerKernel launch");
}

}  // namespace treeverify::kernels::cuda
