// TMA tensor maps for 2D bf16 tensors with 128-byte swizzle (the layout wgmma reads). The driver
// function that encodes them is looked up through the runtime, so nothing links libcuda.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace treeverify::kernels::cuda {

// A row-major [rows, cols] bf16 tensor at `base` (16-byte aligned, row stride `row_stride_elems`)
// read in boxes of [box_rows, 64] columns. Reads outside the tensor return zeros.
absl::StatusOr<CUtensorMap> MakeBf16TensorMap2d(const void* base, int64_t rows, int64_t cols,
                                                int64_t row_stride_elems, int32_t box_rows);

}  // namespace treeverify::kernels::cuda
