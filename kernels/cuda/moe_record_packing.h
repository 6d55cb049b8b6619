// What the record packers (moe_int4_tiles.cu, moe_fp8_tiles.cu) check before they launch a thread
// per 32-bit word of the records they write.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "treeverify/kernels/cuda/moe_records.h"

namespace treeverify::kernels::cuda {

// OK where `experts` experts of `layout` can be packed into `records` (non-null, 16-byte aligned)
// as `format`'s records of `record_bytes`, from `values` and `scales` of each matrix (gate and up
// for a gate/up layout, down alone otherwise); else INVALID_ARGUMENT naming `packer`.
inline absl::Status CheckRecordPacking(const char* packer, const char* format, int64_t record_bytes,
                                       int64_t experts, const MoeRecordLayout& layout,
                                       const std::array<const void*, 2>& values,
                                       const std::array<const void*, 2>& scales,
                                       const uint8_t* records) {
  if (experts < 0 || layout.rows <= 0 || layout.cols <= 0 || layout.record_bytes != record_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        packer, ": experts=", experts, " rows=", layout.rows, " cols=", layout.cols,
        " record_bytes=", layout.record_bytes, " (", format, "'s ", record_bytes, ")"));
  }
  const int matrices = layout.gate_up ? 2 : 1;
  for (int m = 0; m < matrices; ++m) {
    if (values[m] == nullptr || scales[m] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(packer, ": matrix ", m, " of ", matrices, " has no values or scales"));
    }
  }
  if (records == nullptr || reinterpret_cast<uintptr_t>(records) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(packer, ": the records must be non-null and 16-byte aligned"));
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cuda
