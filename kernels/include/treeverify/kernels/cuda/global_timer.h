// The GPU's global nanosecond clock (%globaltimer), written into device memory by a one-thread
// kernel: a step's phase boundaries, which inside a CUDA graph cost a tiny kernel node rather
// than an event record node (that left the GPU idle for ~6 us at each boundary; bench/NOTES.md,
// step 88). The clock is the device's, shared by its SMs, in nanoseconds.
//
//   TV_RETURN_IF_ERROR(RecordGlobalTimer(stamps + i, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels::cuda {

// INVALID_ARGUMENT for a null slot.
absl::Status RecordGlobalTimer(uint64_t* slot, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
