// Writes and moves latent KV rows inside a paged cache, addressed by global slot
// (page * page_size + row). Append writes new rows; copy compacts accepted tree nodes to
// contiguous positions on commit. Rows are fp32 on the CPU (KvAppendParams, KvCopyParams), bf16
// on the GPU.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

template <typename Element>
struct KvAppendParamsOf {
  const Element* rows = nullptr;  // [count, row_dim], rows row_stride elements apart
  // [count] destination global slots; a negative slot skips its row (the padding rows of a
  // CUDA-graph bucket).
  const int64_t* slots = nullptr;
  Element* cache = nullptr;  // [num_slots, row_dim]
  int64_t count = 0;
  int64_t row_dim = 0;
  int64_t row_stride = 0;  // 0 means row_dim
  int64_t num_slots = 0;   // every slot must be < num_slots
};
using KvAppendParams = KvAppendParamsOf<float>;

template <typename Element>
struct KvCopyParamsOf {
  const int64_t* src_slots = nullptr;  // [count]
  const int64_t* dst_slots = nullptr;  // [count]; copies run in order, so dst <= src compacts
  Element* cache = nullptr;            // [num_layers][num_slots, row_dim], layer_stride apart
  int64_t count = 0;
  int64_t row_dim = 0;
  int64_t num_slots = 0;  // every slot must be in [0, num_slots)
  int64_t num_layers = 1;
  int64_t layer_stride = 0;  // elements between layers; 0 means num_slots * row_dim
};
using KvCopyParams = KvCopyParamsOf<float>;

namespace cpu {
absl::Status KvAppend(const KvAppendParams& params);
absl::Status KvCopy(const KvCopyParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
