// Programmatic dependent launch (sm_90 and later): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the previous kernel in the
// stream is still running, once every block of that kernel has allowed it (or exited).
// WaitForPredecessorGrid() returns when the previous kernel has completed and its writes are
// visible; without such a launch it returns at once, so a kernel can always call both.
#pragma once

namespace treeverify::kernels::cuda {

__device__ inline void WaitForPredecessorGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ inline void AllowDependentGridLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace treeverify::kernels::cuda
