// Kernel launches that may run as their stream predecessor's programmatic dependents (sm_90 and
// later): with `overlap`, the kernel may start while the previous kernel in the stream is still
// running, once every block of that one has allowed it (AllowDependentGridLaunch) or exited, so
// its launch and prologue hide behind the predecessor's tail (about 1 us a launch, bench/NOTES.md
// steps 67 and 99). The kernel must call WaitForPredecessorGrid (grid_dependency.cuh) before it
// touches global memory its predecessors write or read. Captured into a CUDA graph, the
// dependency becomes a programmatic edge.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/cuda_status.h"

namespace treeverify::kernels::cuda {

// Whether `kernel`'s loaded image was compiled for sm_90 or later (its PTX version), so that its
// WaitForPredecessorGrid is compiled in: a build for older GPUs, JIT-compiled on an sm_90 device,
// has the calls compiled out and must not be launched as a dependent.
template <typename... Params>
bool WaitsForPredecessor(void (*kernel)(Params...)) {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)) == cudaSuccess &&
         attributes.ptxVersion >= 90;
}

template <typename... Params, typename... Args>
absl::Status LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, int64_t smem,
                          cudaStream_t stream, bool overlap, const char* what, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  return CudaStatus(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

}  // namespace treeverify::kernels::cuda
