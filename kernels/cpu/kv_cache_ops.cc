// CPU writes and moves of latent KV rows by global slot.
//
// Both run sequentially in slot-list order: rows are small (576 floats for DeepSeek-V3), counts
// are a verify batch at most, and the order is part of KvCopy's contract (compaction with
// dst <= src reads each source before a later copy overwrites it).
#include "treeverify/kernels/kv_cache_ops.h"

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::kernels::cpu {

absl::Status KvAppend(const KvAppendParams& params) {
  const int64_t row_dim = params.row_dim;
  if (row_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("KvAppend: row_dim must be > 0, got ", row_dim));
  }
  if (params.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvAppend: count must be >= 0, got ", params.count));
  }
  const int64_t row_stride = params.row_stride == 0 ? row_dim : params.row_stride;
  if (row_stride < row_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvAppend: row_stride must be >= row_dim (", row_dim, "), got ", row_stride));
  }
  if (params.count == 0) return absl::OkStatus();
  if (params.rows == nullptr) return absl::InvalidArgumentError("KvAppend: rows is null");
  if (params.slots == nullptr) return absl::InvalidArgumentError("KvAppend: slots is null");
  if (params.cache == nullptr) return absl::InvalidArgumentError("KvAppend: cache is null");
  for (int64_t i = 0; i < params.count; ++i) {
    if (params.slots[i] >= params.num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("KvAppend: slots[", i, "] = ", params.slots[i],
                                                     " is not below num_slots (", params.num_slots,
                                                     ")"));
    }
  }

  const size_t row_bytes = static_cast<size_t>(row_dim) * sizeof(float);
  for (int64_t i = 0; i < params.count; ++i) {
    if (params.slots[i] < 0) continue;  // a padding row
    // memmove: the source rows may themselves live in the cache.
    std::memmove(params.cache + params.slots[i] * row_dim, params.rows + i * row_stride, row_bytes);
  }
  return absl::OkStatus();
}

absl::Status KvCopy(const KvCopyParams& params) {
  const int64_t row_dim = params.row_dim;
  if (row_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("KvCopy: row_dim must be > 0, got ", row_dim));
  }
  if (params.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCopy: count must be >= 0, got ", params.count));
  }
  const int64_t layer_stride =
      params.layer_stride == 0 ? params.num_slots * row_dim : params.layer_stride;
  if (params.num_layers < 1 || layer_stride < params.num_slots * row_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCopy: need num_layers >= 1 and layer_stride >= num_slots * row_dim; got ",
                     params.num_layers, " layers ", layer_stride, " apart"));
  }
  if (params.count == 0) return absl::OkStatus();
  if (params.src_slots == nullptr) return absl::InvalidArgumentError("KvCopy: src_slots is null");
  if (params.dst_slots == nullptr) return absl::InvalidArgumentError("KvCopy: dst_slots is null");
  if (params.cache == nullptr) return absl::InvalidArgumentError("KvCopy: cache is null");
  for (int64_t i = 0; i < params.count; ++i) {
    if (params.src_slots[i] < 0 || params.src_slots[i] >= params.num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("KvCopy: src_slots[", i,
                                                     "] = ", params.src_slots[i],
                                                     " is outside [0, ", params.num_slots, ")"));
    }
    if (params.dst_slots[i] < 0 || params.dst_slots[i] >= params.num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("KvCopy: dst_slots[", i,
                                                     "] = ", params.dst_slots[i],
                                                     " is outside [0, ", params.num_slots, ")"));
    }
  }

  const size_t row_bytes = static_cast<size_t>(row_dim) * sizeof(float);
  for (int64_t layer = 0; layer < params.num_layers; ++layer) {
    float* cache = params.cache + layer * layer_stride;
    for (int64_t i = 0; i < params.count; ++i) {
      if (params.src_slots[i] == params.dst_slots[i]) continue;
      std::memmove(cache + params.dst_slots[i] * row_dim, cache + params.src_slots[i] * row_dim,
                   row_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
