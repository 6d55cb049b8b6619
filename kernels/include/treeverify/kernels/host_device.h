// TV_HOST_DEVICE marks header code that both backends compile: the CPU ops and the CUDA kernels
// then share one definition of a rule (Philox noise, MoE's top-k tie order).
#pragma once

#if defined(__CUDACC__)
#define TV_HOST_DEVICE __host__ __device__
#else
#define TV_HOST_DEVICE
#endif
