// Embedding lookup on the GPU: the CPU backend's params struct with a bf16 table and fp32 rows
// (the residual stream). A token outside the shard (or a negative id, which the host refuses
// before it gets here) gives a zero row. One block per token.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/embedding.h"

namespace treeverify::kernels::cuda {

absl::Status Embedding(const EmbeddingParamsOf<Bf16, float>& params, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
