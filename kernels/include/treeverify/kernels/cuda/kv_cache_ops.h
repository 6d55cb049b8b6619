// KV append, copy and gather on the GPU with the CPU backend's params structs, bf16 rows. The slot
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

// Copies one sequence's cache rows at positions 0..keys-1 (through its page table) into
// contiguous rows, then zeros up to padded_keys rows (a GEMM's padding): the prefill path's
// input to the up-projection. A page outside the cache reads as zeros.
struct KvGatherParams {
  const Bf16* cache = nullptr;          // [num_pages * page_size, row_dim]
  const int32_t* page_table = nullptr;  // [ceil(keys / page_size)] in device memory
  Bf16* out = nullptr;                  // [padded_keys, row_dim]
  int64_t keys = 0;
  int64_t padded_keys = 0;  // >= keys
  int64_t row_dim = 0;      // a multiple of 8 (16-byte units)
  int32_t page_size = 0;
  int64_t num_pages = 0;
};
absl::Status KvGather(const KvGatherParams& params, cudaStream_t stream);

absl::Status KvAppend(const KvAppendParamsOf<Bf16>& params, cudaStream_t stream);
absl::Status KvCopy(const KvCopyParamsOf<Bf16>& params, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
