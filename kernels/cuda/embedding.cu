// Embedding gather: bf16 table rows to fp32 residual rows. Roofline: 2 * hidden bytes read and 4
// * hidden written per token, a few microseconds' worth for a verify batch: launch bound.
#include "element_convert.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/embedding.h"

namespace treeverify::kernels::cuda {
namespace {

__global__ void EmbeddingKernel(const int32_t* __restrict__ token_ids,
                                const Bf16* __restrict__ table, float* __restrict__ out,
                                int64_t hidden, int32_t vocab_begin, int32_t vocab_end) {
  const int32_t id = token_ids[blockIdx.x];
  float* row = out + blockIdx.x * hidden;
  if (id < vocab_begin || id >= vocab_end) {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) row[i] = 0.0f;
    return;
  }
  const Bf16* source = table + static_cast<int64_t>(id - vocab_begin) * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) row[i] = ToFloat(source[i]);
}

}  // namespace

absl::Status Embedding(const EmbeddingParamsOf<Bf16, float>& p, cudaStream_t stream) {
  if (p.hidden <= 0 || p.tokens < 0 || p.tokens > 0x7fffffff || p.vocab_begin < 0 ||
      p.vocab_end <= p.vocab_begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::Embedding: hidden=", p.hidden, " tokens=", p.tokens, " vocab [", p.vocab_begin, ", ",
        p.vocab_end, "): need hidden > 0, 0 <= tokens < 2^31, 0 <= begin < end"));
  }
  if (p.tokens == 0) return absl::OkStatus();
  if (p.token_ids == nullptr || p.table == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("cuda::Embedding: token_ids, table and out must be non-null");
  }
  EmbeddingKernel<<<static_cast<unsigned>(p.tokens), 1024, 0, stream>>>(
      p.token_ids, p.table, p.out, p.hidden, p.vocab_begin, p.vocab_end);
  return CudaStatus(cudaGetLastError(), "EmbeddingKernel launch");
}

}  // namespace treeverify::kernels::cuda
