// KV append and copy on the GPU with the CPU backend's params structs, bf16 rows. The slot
// lists live in device memory, so the host cannot check them: a slot outside [0, num_slots)
// (negative: a padding row) skips its row instead of writing outside the cache.
//
// KvCopy keeps the CPU op's contract, copies in list order: one block per layer walks the moves
// in order, and each thread always handles the same elements of a row, so a move sees what
// earlier moves wrote without a barrier.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/kv_cache_ops.h"

namespace treeverify::kernels::cuda {

absl::Status KvAppend(const KvAppendParamsOf<Bf16>& params, cudaStream_t stream);
absl::Status KvCopy(const KvCopyParamsOf<Bf16>& params, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
