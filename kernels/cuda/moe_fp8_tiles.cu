// The checkpoint's FP8 experts into the weight stream's records on the device (moe_fp8_tiles.h):
// a thread per 32-bit word of a record, four weight bytes or a scale, gathered from the
// checkpoint's rows.
#include <cstdint>
#include <cstring>

#include "moe_record_packing.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe_fp8_tiles.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRecordWords = MoeFp8Records::kRecordBytes / 4;
constexpr int64_t kWeightWords = MoeFp8Records::kWeightBytes / 4;
constexpr int64_t kBlock = MoeFp8Records::kBlock;

struct Sources {
  const uint8_t* weights[2];
  const float* scales[2];
};

__global__ void __launch_bounds__(kThreads)
    PackFp8Kernel(Sources in, int64_t total_words, MoeRecordLayout layout,
                  uint32_t* __restrict__ tiles) {
  const int64_t index = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (index >= total_words) return;
  const int64_t record = index / kRecordWords, within = index % kRecordWords;
  const int64_t chunk = record % layout.Chunks();
  const int64_t row_tile = record / layout.Chunks() % layout.RowTiles();
  const int64_t expert = record / (layout.Chunks() * layout.RowTiles());
  uint32_t value = 0;
  if (within < kWeightWords) {
    for (int t = 0; t < 4; ++t) {
      const int64_t byte = 4 * within + t;
      const int64_t piece = byte / 16;  // (warp * 2 + k / 2) * 32 + lane
      const int lane = static_cast<int>(piece % 32);
      const int k = static_cast<int>(piece / 32 % 2 * 2 + byte % 16 / 8);
      const int w = static_cast<int>(piece / 64);
      const int p = static_cast<int>(byte % 8 / 2), half = static_cast<int>(byte % 2);
      const int i = lane / 4 + 8 * (p % 2);  // fragment row
      const int m = layout.FragmentMatrix(i);
      const int64_t row = row_tile * layout.TileRows() + layout.FragmentRow(w, i);
      const int64_t col =
          chunk * MoeRecordLayout::kColumns + MoeRecordLayout::FragmentColumn(k, lane % 4, p, half);
      uint32_t bits = 0;  // fp8 zero past the matrix
      if (row < layout.rows && col < layout.cols) {
        bits = in.weights[m][(expert * layout.rows + row) * layout.cols + col];
      }
      value |= bits << (8 * t);
    }
  } else if (within - kWeightWords < (layout.gate_up ? 2 : 1)) {
    const int m = static_cast<int>(within - kWeightWords);
    const int64_t scale_rows = (layout.rows + kBlock - 1) / kBlock;
    const int64_t scale_cols = (layout.cols + kBlock - 1) / kBlock;
    const int64_t block_row = row_tile * layout.TileRows() / kBlock;
    const int64_t block_col = chunk * MoeRecordLayout::kColumns / kBlock;
    const float scale = in.scales[m][(expert * scale_rows + block_row) * scale_cols + block_col];
    memcpy(&value, &scale, 4);
  }
  tiles[index] = value;
}

}  // namespace

absl::Status PackFp8ExpertTilesOnDevice(const std::array<const uint8_t*, 2>& weights,
                                        const std::array<const float*, 2>& scales, int64_t experts,
                                        const MoeRecordLayout& layout, uint8_t* tiles,
                                        cudaStream_t stream) {
  TV_RETURN_IF_ERROR(CheckRecordPacking("cuda::PackFp8ExpertTilesOnDevice", "FP8",
                                        MoeFp8Records::kRecordBytes, experts, layout,
                                        {weights[0], weights[1]}, {scales[0], scales[1]}, tiles));
  const int64_t total_words = experts * layout.ExpertBytes() / 4;
  if (total_words == 0) return absl::OkStatus();
  Sources in{};
  for (int m = 0; m < (layout.gate_up ? 2 : 1); ++m) {
    in.weights[m] = weights[m];
    in.scales[m] = scales[m];
  }
  const int64_t blocks = (total_words + kThreads - 1) / kThreads;
  PackFp8Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      in, total_words, layout, reinterpret_cast<uint32_t*>(tiles));
  return CudaStatus(cudaGetLastError(), "PackFp8Kernel launch");
}

}  // namespace treeverify::kernels::cuda
