// Does the DRAM deliver the expert stream's gate/up boxes more slowly than boxes of contiguous
// bytes? At 16 nodes the gate/up stream runs at ~3.6 TB/s and down at ~4.0 (bench/NOTES.md, step
// 116). A gate/up box is 64 rows x 64 columns of a [rows, 7168] bf16 matrix: 64 pieces of 128
// bytes, 14 KB apart; a down box (128 rows x 64 of a [rows, 256] matrix) covers a quarter of each
// 512-byte row, and an item's four boxes cover 64 KB end to end. This probe streams the same 220 MB
// (30 experts' gate and up at TP8 split inside) through the expert stream's pipeline without the
// arithmetic: a producer warp issues one stage (16 KB) per slot into 5 slots, a consumer warp
// releases each slot when it has landed, two blocks per multiprocessor claim items from a counter
// (block b's first item is item b). Variants, each cold (the L2 flushed before every repetition),
// medians of 20:
//   gate/up, row-major     the stream's boxes: per stage one 64 x 64 box of gate and the same of up
//   gate/up, tiled         the same bytes with every 64 x 64 box stored as 8 KB end to end, an
//                          item's boxes one after another (a layout the packing could choose)
//   down-shaped            [rows, 256] in 128 x 64 boxes, four stages an item
//   contiguous             16 KB bulk copies, an item's 14 stages end to end
// against the copy bandwidth measured in the same run.
//
//   weight_layout_probe [--out DIR]     (writes DIR/weight_layout_probe.md)
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "l2_flush.cuh"
#include "probe_common.h"
#include "sm90_primitives.cuh"
#include "tensor_map.h"
#include "tma_probe_device.h"

namespace {

namespace sm90 = treeverify::kernels::cuda::sm90;

constexpr int kThreads = 64;  // a producer warp, a consumer warp
constexpr int kStages = 5;
constexpr int kStageBytes = 16 * 1024;
constexpr int64_t kExperts = 30, kIntermediate = 256, kHidden = 7168;
constexpr int64_t kBytes = kExperts * 2 * kIntermediate * kHidden * 2;  // 220 MB
constexpr int32_t kTileRows = 64, kBoxColumns = 64, kParts = 8;
constexpr int32_t kChunks = kHidden / kBoxColumns;  // 112 box columns of a row
constexpr int32_t kPerPart = kChunks / kParts;      // 14 stages an item

enum Layout : int32_t { kRowMajor, kTiled, kDownShaped, kContiguous };

struct Params {
  Layout layout;
  const uint8_t* base;  // kContiguous
  int32_t items, stages_per_item;
  int32_t* claims;
};

// Stage s of `item`: its bytes into `slot`, completing on `full`.
__device__ void IssueStage(const Params& p, const CUtensorMap* map, int32_t item, int32_t s,
                           uint8_t* slot, uint64_t* full) {
  sm90::MbarrierArriveExpectTx(full, kStageBytes);
  switch (p.layout) {
    case kRowMajor: {  // [experts * 512 rows (gate 256, up 256), 7168]
      const int32_t expert = item / (4 * kParts), tile = item / kParts % 4, part = item % kParts;
      const int32_t x = (part * kPerPart + s) * kBoxColumns;
      const int32_t y = expert * 2 * kIntermediate + tile * kTileRows;
      sm90::TmaLoad2d(slot, map, x, y, full);
      sm90::TmaLoad2d(slot + kStageBytes / 2, map, x, y + kIntermediate, full);
      break;
    }
    case kTiled: {  // [tiles * 64 rows, 64]: (expert, gate|up, row tile, box column) in order
      const int32_t expert = item / (4 * kParts), tile = item / kParts % 4, part = item % kParts;
      const int32_t chunk = part * kPerPart + s;
      const int32_t gate = ((expert * 2 + 0) * 4 + tile) * kChunks + chunk;
      const int32_t up = ((expert * 2 + 1) * 4 + tile) * kChunks + chunk;
      sm90::TmaLoad2d(slot, map, 0, gate * kTileRows, full);
      sm90::TmaLoad2d(slot + kStageBytes / 2, map, 0, up * kTileRows, full);
      break;
    }
    case kDownShaped:  // [rows, 256] in 128-row boxes
      sm90::TmaLoad2d(slot, map, s * kBoxColumns, item * 128, full);
      break;
    case kContiguous:
      sm90::BulkLoad(slot, p.base + (int64_t{item} * p.stages_per_item + s) * kStageBytes,
                     kStageBytes, full);
      break;
  }
}

__global__ void __launch_bounds__(kThreads, 2)
    WeightStreamKernel(const __grid_constant__ CUtensorMap map, Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* slots = sm90::AlignSharedUp<1024>(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  int32_t* stage_count = reinterpret_cast<int32_t*>(empty + kStages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::MbarrierInit(&full[s], 1);
      sm90::MbarrierInit(&empty[s], 1);
    }
    sm90::FenceBarrierInit();
    *stage_count = -1;
  }
  __syncthreads();
  if (warp == 0) {
    if (lane != 0) return;
    int32_t stage = 0, item = blockIdx.x;
    while (item < p.items) {
      const int32_t next = atomicAdd(p.claims, 1) + static_cast<int32_t>(gridDim.x);
      for (int32_t s = 0; s < p.stages_per_item; ++s, ++stage) {
        const int32_t slot = stage % kStages;
        sm90::MbarrierWait(&empty[slot], ((stage / kStages) & 1) ^ 1);
        IssueStage(p, &map, item, s, slots + slot * kStageBytes, &full[slot]);
      }
      item = next;
    }
    // The consumer stops after `stage` stages: the count, then one more arrival to wake it.
    const int32_t slot = stage % kStages;
    sm90::MbarrierWait(&empty[slot], ((stage / kStages) & 1) ^ 1);
    *reinterpret_cast<volatile int32_t*>(stage_count) = stage;
    sm90::MbarrierArrive(&full[slot]);
    return;
  }
  if (lane != 0) return;
  for (int32_t stage = 0;; ++stage) {
    const int32_t slot = stage % kStages;
    sm90::MbarrierWait(&full[slot], (stage / kStages) & 1);
    if (*reinterpret_cast<volatile int32_t*>(stage_count) == stage) break;
    sm90::MbarrierArrive(&empty[slot]);
  }
#else
  __trap();
#endif
}

using treeverify::bench::Check;
using treeverify::bench::Median;

}  // namespace

int main(int argc, char** argv) {
  const std::optional<std::string> out_argument = treeverify::bench::OutDirArgument(argc, argv);
  if (!out_argument) return 2;
  const treeverify::bench::TmaProbeDevice probe = treeverify::bench::SetUpTmaProbeDevice();
  const cudaDeviceProp& properties = probe.properties;
  const int multiprocessors = probe.multiprocessors;
  cudaStream_t stream = probe.stream;
  const double copy = probe.copy_bytes_per_s;

  const int smem = 1024 + kStages * (kStageBytes + 16) + 16;
  CHECK_CUDA(
      cudaFuncSetAttribute(WeightStreamKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int grid = 2 * multiprocessors;
  uint8_t* weights = nullptr;
  int32_t* claims = nullptr;
  CHECK_CUDA(cudaMalloc(&weights, static_cast<size_t>(kBytes)));
  CHECK_CUDA(cudaMemset(weights, 0x3c, static_cast<size_t>(kBytes)));
  CHECK_CUDA(cudaMalloc(&claims, sizeof(int32_t)));
  const treeverify::bench::L2Flusher flusher;
  Check(flusher.ok(), __FILE__, __LINE__, "L2Flusher", "no memory for the flush buffer");
  auto map_of = [&](int64_t rows, int64_t cols, int32_t box_rows) {
    const absl::StatusOr<CUtensorMap> map =
        treeverify::kernels::cuda::MakeBf16TensorMap2d(weights, rows, cols, cols, box_rows);
    Check(map.ok(), __FILE__, __LINE__, "MakeBf16TensorMap2d", map.status().ToString().c_str());
    return *map;
  };
  const int32_t gate_up_items = static_cast<int32_t>(kExperts * 4 * kParts);
  struct Variant {
    const char* name;
    Layout layout;
    CUtensorMap map;
    int32_t items, stages_per_item;
  };
  const std::vector<Variant> variants = {
      {"gate/up, row-major (the stream's boxes)", kRowMajor,
       map_of(kExperts * 2 * kIntermediate, kHidden, kTileRows), gate_up_items, kPerPart},
      {"gate/up, tiled (8 KB boxes end to end)", kTiled, map_of(kBytes / 128, 64, kTileRows),
       gate_up_items, kPerPart},
      {"down-shaped (128 x 64 of [rows, 256])", kDownShaped, map_of(kBytes / 512, 256, 128),
       static_cast<int32_t>(kBytes / 512 / 128), 4},
      {"contiguous 16 KB bulk copies", kContiguous, map_of(kBytes / 128, 64, kTileRows),
       static_cast<int32_t>(kBytes / kStageBytes / kPerPart), kPerPart},
  };
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::string table;
  char line[512];
  std::snprintf(line, sizeof(line),
                "device %s, %d SMs, %d blocks, %d slots of %d KB, copy bandwidth %.2f TB/s\n\n"
                "| variant | MB | us | TB/s | %% of copy bandwidth |\n|---|---|---|---|---|\n",
                properties.name, multiprocessors, grid, kStages, kStageBytes / 1024, copy / 1e12);
  table += line;
  for (const Variant& v : variants) {
    const Params p{.layout = v.layout,
                   .base = weights,
                   .items = v.items,
                   .stages_per_item = v.stages_per_item,
                   .claims = claims};
    const double bytes = double{kStageBytes} * v.items * v.stages_per_item;
    std::vector<double> times;
    for (int repeat = 0; repeat < 23; ++repeat) {
      flusher.Flush(stream);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaMemsetAsync(claims, 0, sizeof(int32_t), stream));
      CHECK_CUDA(cudaEventRecord(start, stream));
      WeightStreamKernel<<<grid, kThreads, smem, stream>>>(v.map, p);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (repeat >= 3) times.push_back(1000.0 * ms);  // after 3 warm-ups
    }
    const double us = Median(times);
    std::snprintf(line, sizeof(line), "| %s | %.1f | %.1f | %.2f | %.0f %% |\n", v.name,
                  bytes / 1e6, us, bytes / us / 1e6, 100.0 * (bytes / copy) / (us / 1e6));
    table += line;
  }
  std::fputs(table.c_str(), stdout);
  std::ofstream(*out_argument + "/weight_layout_probe.md") << table;
  return 0;
}
