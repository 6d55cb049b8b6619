// Row-major experts into the weight stream's tiles on the device (moe_tiles.h): a thread per
// 16-byte unit, read from its row and written to its place in the tile.
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe_tiles.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    PackTilesKernel(const Bf16* __restrict__ row_major, int64_t units, MoeTileLayout layout,
                    int matrix, Bf16* __restrict__ tiles) {
  const int64_t index = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (index >= units) return;
  const int64_t units_per_row = layout.cols / 8;
  const int64_t unit = index % units_per_row, row = index / units_per_row;
  const int64_t expert = row / layout.rows;
  const uint4 value = reinterpret_cast<const uint4*>(row_major)[index];
  Bf16* place =
      tiles + layout.Offset(expert, row % layout.rows, unit * 8) + matrix * layout.TileElements();
  *reinterpret_cast<uint4*>(place) = value;
}

}  // namespace

absl::Status PackExpertTilesOnDevice(const Bf16* row_major, int64_t experts,
                                     const MoeTileLayout& layout, int matrix, Bf16* tiles,
                                     cudaStream_t stream) {
  if (experts < 0 || layout.rows <= 0 || layout.cols <= 0 || layout.cols % 8 != 0 ||
      layout.tile_rows <= 0 || matrix < 0 || matrix >= layout.interleave) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::PackExpertTilesOnDevice: experts=", experts, " rows=", layout.rows,
                     " cols=", layout.cols, " (a multiple of 8) tile_rows=", layout.tile_rows,
                     " matrix=", matrix, " of ", layout.interleave));
  }
  if (row_major == nullptr || tiles == nullptr ||
      reinterpret_cast<uintptr_t>(row_major) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(tiles) % 16 != 0) {
    return absl::InvalidArgumentError(
        "cuda::PackExpertTilesOnDevice: row_major and tiles must be non-null and 16-byte "
        "aligned");
  }
  const int64_t units = experts * layout.rows * (layout.cols / 8);
  if (units == 0) return absl::OkStatus();
  const int64_t blocks = (units + kThreads - 1) / kThreads;
  PackTilesKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(row_major, units, layout,
                                                                          matrix, tiles);
  return CudaStatus(cudaGetLastError(), "PackTilesKernel launch");
}

}  // namespace treeverify::kernels::cuda
