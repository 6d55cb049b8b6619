// The checkpoint's INT4 experts into the weight stream's records on the device
// (moe_int4_tiles.h): a thread per 32-bit word of a record, nibbles or scales, gathered from the
// checkpoint's rows.
#include <cstdint>

#include "moe_record_packing.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe_int4_tiles.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRecordWords = MoeInt4Records::kRecordBytes / 4;
constexpr int64_t kNibbleWords = MoeInt4Records::kWordBytes / 4;
constexpr int64_t kGroup = MoeInt4Records::kGroup;
constexpr uint32_t kZeroNibble = 8;

struct Sources {
  const uint32_t* words[2];
  const uint16_t* scales[2];  // bf16 bits
};

__global__ void __launch_bounds__(kThreads)
    PackInt4Kernel(Sources in, int64_t total_words, MoeRecordLayout layout,
                   uint32_t* __restrict__ tiles) {
  const int64_t index = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (index >= total_words) return;
  const int64_t record = index / kRecordWords, within = index % kRecordWords;
  const int64_t chunk = record % layout.Chunks();
  const int64_t row_tile = record / layout.Chunks() % layout.RowTiles();
  const int64_t expert = record / (layout.Chunks() * layout.RowTiles());
  const int64_t words_per_row = (layout.cols + 7) / 8;
  const int64_t groups_per_row = (layout.cols + kGroup - 1) / kGroup;
  // Row `r` of the record's row tile as a row of the experts' checkpoint tensors, one expert after
  // another (or -1 past the matrix).
  auto source_row = [&](int64_t r) -> int64_t {
    const int64_t row = row_tile * layout.TileRows() + r;
    return row < layout.rows ? (expert * layout.rows + row) : -1;
  };
  uint32_t value = 0;
  if (within < kNibbleWords) {
    const int w = static_cast<int>(within / 128), lane = static_cast<int>(within / 4 % 32);
    const int k = static_cast<int>(within % 4);
    const int g = lane / 4, q = lane % 4;
    for (int p = 0; p < 4; ++p) {
      const int i = g + 8 * (p % 2);  // fragment row: p = 0, 2 row g; p = 1, 3 row g + 8
      for (int half = 0; half < 2; ++half) {
        const int64_t col =
            chunk * MoeRecordLayout::kColumns + MoeRecordLayout::FragmentColumn(k, q, p, half);
        const int m = layout.FragmentMatrix(i);
        const int64_t row = source_row(layout.FragmentRow(w, i));
        uint32_t nibble = kZeroNibble;
        if (row >= 0 && col < layout.cols) {
          nibble = in.words[m][row * words_per_row + col / 8] >> (4 * (col % 8)) & 0xF;
        }
        value |= nibble << (4 * p + 16 * half);
      }
    }
  } else {
    const int64_t s = within - kNibbleWords;  // ((w * 8 + g) * 2 + group)
    const int group = static_cast<int>(s % 2), g = static_cast<int>(s / 2 % 8);
    const int w = static_cast<int>(s / 16);
    const int64_t column_group = chunk * (MoeRecordLayout::kColumns / kGroup) + group;
    for (int half = 0; half < 2; ++half) {
      const int i = g + 8 * half;
      const int m = layout.FragmentMatrix(i);
      const int64_t row = source_row(layout.FragmentRow(w, i));
      uint32_t bits = 0;  // a scale of +0 past the matrix
      if (row >= 0 && column_group < groups_per_row) {
        bits = in.scales[m][row * groups_per_row + column_group];
      }
      value |= bits << (16 * half);
    }
  }
  tiles[index] = value;
}

}  // namespace

absl::Status PackInt4ExpertTilesOnDevice(const std::array<const uint32_t*, 2>& words,
                                         const std::array<const Bf16*, 2>& scales, int64_t experts,
                                         const MoeRecordLayout& layout, uint8_t* tiles,
                                         cudaStream_t stream) {
  TV_RETURN_IF_ERROR(CheckRecordPacking("cuda::PackInt4ExpertTilesOnDevice", "INT4",
                                        MoeInt4Records::kRecordBytes, experts, layout,
                                        {words[0], words[1]}, {scales[0], scales[1]}, tiles));
  const int64_t total_words = experts * layout.ExpertBytes() / 4;
  if (total_words == 0) return absl::OkStatus();
  Sources in{};
  for (int m = 0; m < (layout.gate_up ? 2 : 1); ++m) {
    in.words[m] = words[m];
    in.scales[m] = reinterpret_cast<const uint16_t*>(scales[m]);
  }
  const int64_t blocks = (total_words + kThreads - 1) / kThreads;
  PackInt4Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      in, total_words, layout, reinterpret_cast<uint32_t*>(tiles));
  return CudaStatus(cudaGetLastError(), "PackInt4Kernel launch");
}

}  // namespace treeverify::kernels::cuda
