// KV append and copy. Roofline: 2 * row_dim bytes read and written per row (1152 B for
// DeepSeek's 576-wide rows): launch bound for a verify batch.
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/kv_cache_ops.h"

namespace treeverify::kernels::cuda {
namespace {

__global__ void KvAppendKernel(const Bf16* __restrict__ rows, const int64_t* __restrict__ slots,
                               Bf16* __restrict__ cache, int64_t row_dim, int64_t row_stride,
                               int64_t num_slots) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0 || slot >= num_slots) return;  // a padding row (or a bad slot: nothing written)
  const Bf16* source = rows + blockIdx.x * row_stride;
  Bf16* destination = cache + slot * row_dim;
  for (int64_t i = threadIdx.x; i < row_dim; i += blockDim.x) destination[i] = source[i];
}

// Block = one layer. Thread t always copies elements t, t + blockDim.x, ... of a row, so the
// moves run in list order per element without barriers.
__global__ void KvCopyKernel(const int64_t* __restrict__ src_slots,
                             const int64_t* __restrict__ dst_slots, Bf16* cache, int64_t count,
                             int64_t row_dim, int64_t num_slots, int64_t layer_stride) {
  Bf16* layer = cache + blockIdx.x * layer_stride;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t src = src_slots[k];
    const int64_t dst = dst_slots[k];
    if (src == dst || src < 0 || src >= num_slots || dst < 0 || dst >= num_slots) continue;
    for (int64_t i = threadIdx.x; i < row_dim; i += blockDim.x) {
      layer[dst * row_dim + i] = layer[src * row_dim + i];
    }
  }
}

}  // namespace

absl::Status KvAppend(const KvAppendParamsOf<Bf16>& p, cudaStream_t stream) {
  const int64_t row_stride = p.row_stride ? p.row_stride : p.row_dim;
  if (p.row_dim <= 0 || p.count < 0 || p.count > 0x7fffffff || row_stride < p.row_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::KvAppend: count=", p.count, " row_dim=", p.row_dim, " row_stride=", row_stride));
  }
  if (p.count == 0) return absl::OkStatus();
  if (p.rows == nullptr || p.slots == nullptr || p.cache == nullptr) {
    return absl::InvalidArgumentError("cuda::KvAppend: rows, slots and cache must be non-null");
  }
  KvAppendKernel<<<static_cast<unsigned>(p.count), 128, 0, stream>>>(
      p.rows, p.slots, p.cache, p.row_dim, row_stride, p.num_slots);
  return CudaStatus(cudaGetLastError(), "KvAppendKernel launch");
}

absl::Status KvCopy(const KvCopyParamsOf<Bf16>& p, cudaStream_t stream) {
  const int64_t layer_stride = p.layer_stride ? p.layer_stride : p.num_slots * p.row_dim;
  if (p.row_dim <= 0 || p.count < 0 || p.num_slots < 0 || p.num_layers < 1 ||
      p.num_layers > 0x7fffffff || layer_stride < p.num_slots * p.row_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::KvCopy: count=", p.count, " row_dim=", p.row_dim, " num_slots=", p.num_slots,
        " num_layers=", p.num_layers, " layer_stride=", layer_stride));
  }
  if (p.count == 0) return absl::OkStatus();
  if (p.src_slots == nullptr || p.dst_slots == nullptr || p.cache == nullptr) {
    return absl::InvalidArgumentError(
        "cuda::KvCopy: src_slots, dst_slots and cache must be non-null");
  }
  KvCopyKernel<<<static_cast<unsigned>(p.num_layers), 128, 0, stream>>>(
      p.src_slots, p.dst_slots, p.cache, p.count, p.row_dim, p.num_slots, layer_stride);
  return CudaStatus(cudaGetLastError(), "KvCopyKernel launch");
}

}  // namespace treeverify::kernels::cuda
