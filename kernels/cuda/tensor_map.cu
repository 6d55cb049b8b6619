#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "tensor_map.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {
namespace {

absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> EncodeFunction() {
  static void* function = nullptr;
  static cudaError_t error = [] {
    cudaDriverEntryPointQueryResult found;
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                     cudaEnableDefault, &found);
    if (e == cudaSuccess && found != cudaDriverEntryPointSuccess) e = cudaErrorSymbolNotFound;
    return e;
  }();
  if (error != cudaSuccess) return CudaStatus(error, "looking up cuTensorMapEncodeTiled");
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
}

}  // namespace

absl::StatusOr<CUtensorMap> MakeBf16TensorMap2d(const void* base, int64_t rows, int64_t cols,
                                                int64_t row_stride_elems, int32_t box_rows) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (row_stride_elems * 2) % 16 != 0 ||
      rows <= 0 || cols < 64 || box_rows <= 0 || box_rows > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor map: base ", reinterpret_cast<uintptr_t>(base), " rows ", rows,
                     " cols ", cols, " stride ", row_stride_elems, " box rows ", box_rows,
                     " (16-byte aligned base and stride, at least 64 columns, boxes of 1..256)"));
  }
  TV_ASSIGN_OR_RETURN(PFN_cuTensorMapEncodeTiled_v12000 encode, EncodeFunction());
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride_elems * 2)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuTensorMapEncodeTiled failed with CUresult ", static_cast<int>(result)));
  }
  return map;
}

}  // namespace treeverify::kernels::cuda
