// KV append and copy. Roofline: 2 * row_dim bytes read and written per row (1152 B for
// DeepSeek's 576-wide rows): launch bound for a verify batch.
#include <algorithm>

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

// One thread per 16-byte unit of the output, grid-stride.
__global__ void KvGatherKernel(const uint4* __restrict__ cache, const int32_t* __restrict__ pages,
                               uint4* __restrict__ out, int64_t keys, int64_t padded_keys,
                               int64_t row_units, int32_t page_size, int64_t num_pages) {
  const int64_t total = padded_keys * row_units;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t key = i / row_units;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (key < keys) {
      const int64_t page = pages[key / page_size];
      if (page >= 0 && page < num_pages) {
        value = cache[(page * page_size + key % page_size) * row_units + i % row_units];
      }
    }
    out[i] = value;
  }
}

}  // namespace

absl::Status KvGather(const KvGatherParams& p, cudaStream_t stream) {
  if (p.keys < 0 || p.padded_keys < p.keys || p.row_dim <= 0 || p.row_dim % 8 != 0 ||
      p.page_size <= 0 || p.num_pages <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::KvGather: keys=", p.keys, " padded_keys=", p.padded_keys, " row_dim=", p.row_dim,
        " page_size=", p.page_size, " num_pages=", p.num_pages));
  }
  if (p.padded_keys == 0) return absl::OkStatus();
  if (p.cache == nullptr || p.page_table == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("cuda::KvGather: cache, page_table and out must be non-null");
  }
  const int64_t units = p.padded_keys * (p.row_dim / 8);
  const int blocks = static_cast<int>(std::min<int64_t>((units + 255) / 256, 4096));
  KvGatherKernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const uint4*>(p.cache), p.page_table,
                                             reinterpret_cast<uint4*>(p.out), p.keys, p.padded_keys,
                                             p.row_dim / 8, p.page_size, p.num_pages);
  return CudaStatus(cudaGetLastError(), "KvGatherKernel launch");
}

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
