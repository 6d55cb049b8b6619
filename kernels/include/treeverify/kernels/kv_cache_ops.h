// Writes and moves latent KV rows inside a paged cache, addressed by global slot
// (page * page_size + row). Append writes new rows; copy compacts accepted tree nodes to
// contiguous positions on commit.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

struct KvAppendParams {
  const float* rows = nullptr;     // [count, row_dim], rows row_stride elements apart
  const int64_t* slots = nullptr;  // [count] destination global slots
  float* cache = nullptr;          // [num_slots, row_dim]
  int64_t count = 0;
  int64_t row_dim = 0;
  int64_t row_stride = 0;  // 0 means row_dim
  int64_t num_slots = 0;   // every slot must be in [0, num_slots)
};

struct KvCopyParams {
  const int64_t* src_slots = nullptr;  // [count]
  const int64_t* dst_slots = nullptr;  // [count]; copies run in order, so dst <= src compacts
  float* cache = nullptr;              // [num_slots, row_dim]
  int64_t count = 0;
  int64_t row_dim = 0;
  int64_t num_slots = 0;  // every slot must be in [0, num_slots)
};

namespace cpu {
absl::Status KvAppend(const KvAppendParams& params);
absl::Status KvCopy(const KvCopyParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
