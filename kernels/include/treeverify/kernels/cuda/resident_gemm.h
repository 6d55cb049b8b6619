// Dense products of a verify step's few token rows whose weights are in shared memory before the
// product's input exists. A product of a handful of rows against a 1-15 MB weight is a short,
// latency-bound DRAM stream: cuBLASLt takes 3-7 us for what the bandwidth moves in 1-3 (run 203's
// timeline). Its weights depend on nothing, so this kernel, launched as its predecessor's
// programmatic dependent, loads its blocks' weight rows (bulk copies into shared memory) while
// the predecessor still runs, then waits for it, reads the input rows from the L2 and multiplies
// on the tensor cores (bench/NOTES.md, step 111).
//
// Each block owns 16-row tiles of one product of the batch with the whole reduction where that
// fits in shared memory; where it does not (k = 7168: the router, the shared expert's gate/up)
// the reduction is split over k_parts blocks, whose sums go to a scratch buffer, and the last
// block of a tile to arrive adds them. Every sum is added in one order, so the bytes do not
// depend on scheduling. GemmRunner routes the products it takes here (gemm.h).
//
// FP8 block-scaled weights (block_fp8.h) stream as their bytes, half the bf16 weight's, and are
// dequantized in registers: the products are bit for bit those of the dequantized bf16 weights.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/cuda/block_fp8.h"
#include "treeverify/kernels/gemm.h"

namespace treeverify::kernels::cuda {

inline constexpr int64_t kResidentGemmMaxRows = 16;

// How a product is laid out over blocks: tiles_per_block 16-row tiles of one batch element each,
// every tile's reduction in `slices` parts over the block's warps.
struct ResidentGemmPlan {
  int32_t blocks = 0;
  int32_t tiles_per_block = 0;
  int32_t slices = 0;
  int32_t k_parts = 0;  // the reduction split over this many blocks a tile
  int64_t smem_bytes = 0;
};

// Device memory for split reductions: a tile's parts' sums, and an arrival counter per tile that
// the last block of the tile zeroes again. One per stream of launches (a GemmRunner's).
struct ResidentGemmScratch {
  float* part_sums = nullptr;  // [tile_parts][256]
  uint32_t* arrivals = nullptr;
  int64_t tile_parts = 0;
  int64_t tiles = 0;
};
absl::StatusOr<ResidentGemmScratch> AllocateResidentGemmScratch();
void FreeResidentGemmScratch(ResidentGemmScratch& scratch);

// What the plans need of the device: the kernel is off (max_smem_bytes 0) below compute
// capability 9.0, or where its sm_90 image cannot be loaded or given its shared memory.
struct ResidentGemmDevice {
  int multiprocessors = 0;
  int64_t max_smem_bytes = 0;  // a block's shared memory, at most 227 KB (sm_120: 99 KB)
};

// The current device's, with the kernels' shared-memory limit set (once per device, before the
// first launch). Errors only where the device cannot be queried; an unusable kernel is "off".
absl::StatusOr<ResidentGemmDevice> PrepareResidentGemm();

// The plan when the kernel takes the product, else blocks == 0. It takes products of 1..16 rows
// with n a multiple of 16 and k of 64 and 16-byte aligned weight and input rows, whose blocks'
// weight rows and input fit in the device's shared memory, in at most one block per
// multiprocessor; a split reduction needs room in `scratch` (none: only whole reductions).
// Weight: Bf16, or uint8_t for FP8 block-scaled bytes.
template <typename Weight, typename Output>
ResidentGemmPlan PlanResidentGemm(const GemmParamsOf<Bf16, Weight, Output>& p,
                                  const ResidentGemmDevice& device,
                                  const ResidentGemmScratch& scratch = {});

// Launches the planned product on `stream` as a programmatic dependent of the kernel before it,
// with the scratch it was planned with.
absl::Status ResidentGemm(const GemmParamsOf<Bf16, Bf16, Bf16>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream);
absl::Status ResidentGemm(const GemmParamsOf<Bf16, Bf16, float>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream);
// The same for FP8 weights, planned with p.product.
absl::Status ResidentGemm(const BlockFp8GemmParamsOf<Bf16>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream);
absl::Status ResidentGemm(const BlockFp8GemmParamsOf<float>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
