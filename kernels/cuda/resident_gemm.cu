#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "fp8_dequantize.cuh"
#include "grid_dependency.cuh"
#include "mma_sync_primitives.cuh"
#include "programmatic_launch.h"
#include "sm90_primitives.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/resident_gemm.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileRows = 16;  // weight rows of a tile: one mma's M
constexpr int kMaxTilesPerBlock = kWarps;
constexpr int kMaxKParts = 16;
// The scratch for split reductions: 2048 (tile, part) sums of 1 KB, 2048 tiles' counters.
constexpr int64_t kScratchTileParts = 2048;
constexpr int64_t kScratchTiles = 2048;
// Shared memory a block may have on sm_90 (227 KB), all of it dynamic; less where the device
// has less (ResidentGemmDevice).
constexpr int64_t kMaxSmemBytes = 227 * 1024;

// FP8 weights (block_fp8.h): a byte each, dequantized in registers with their block's scale.
using Fp8 = uint8_t;

// A row of `Element`s in shared memory: 16 bytes more than the row's, so that a warp's eight row
// addresses (ldmatrix's, or the FP8 fragments' pair loads) fall in eight different 16-byte bank
// groups.
template <typename Element>
__host__ __device__ constexpr int64_t PitchBytes(int64_t k) {
  return int64_t{sizeof(Element)} * k + 16;
}

// The FP8 scales a block's part of k touches, a tile (its columns need not start on a block).
constexpr int64_t ScaleSlots(int64_t k) { return k / 128 + 2; }

// Weight tiles, the 16 input rows, the slices' partial sums (256 floats a warp), FP8 tiles' scales,
// the mbarrier, the split reduction's last-arrival flags (all dynamic: the limit below is all a
// block has).
template <typename Weight>
constexpr int64_t SmemBytes(int64_t k, int64_t tiles_per_block) {
  const int64_t scales = std::is_same_v<Weight, Fp8> ? kMaxTilesPerBlock * ScaleSlots(k) : 0;
  return tiles_per_block * kTileRows * PitchBytes<Weight>(k) +
         kResidentGemmMaxRows * PitchBytes<Bf16>(k) +
         (kWarps * 256 + scales) * int64_t{sizeof(float)} + 16 + kMaxTilesPerBlock;
}

template <typename Weight, typename Output>
struct Args {
  const Bf16* x;
  const Weight* weight;
  const float* scales;  // FP8: [batch][ceil(n / 128)][scale_columns]
  Output* y;
  int32_t m, k;
  int64_t x_stride, w_stride, y_stride;
  int64_t x_batch_stride, w_batch_stride, y_batch_stride;
  int64_t scale_batch_stride;
  int32_t scale_columns;
  int32_t tiles_per_batch;  // n / 16
  int32_t tiles;            // batch * tiles_per_batch
  int32_t tiles_per_block;  // divides tiles_per_batch: a block's tiles share one input
  int32_t slices;           // a block's reduction of a tile in parts, one warp each
  int32_t k_parts;          // the reduction split over blocks (1: a block has all of k)
  float* part_sums;         // [tiles][k_parts][256] when k_parts > 1 (ResidentGemmScratch)
  uint32_t* arrivals;       // [tiles], zero between launches
};

template <typename Output>
__device__ Output FromFloat(float v) {
  if constexpr (std::is_same_v<Output, float>) {
    return v;
  } else {
    return __float2bfloat16_rn(v);
  }
}

template <typename Weight, typename Output>
__global__ void __launch_bounds__(kThreads) ResidentGemmKernel(Args<Weight, Output> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kFp8 = std::is_same_v<Weight, Fp8>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int32_t kp = a.k / a.k_parts;
  const int64_t w_pitch = PitchBytes<Weight>(kp), x_pitch = PitchBytes<Bf16>(kp);
  const int32_t scale_slots = static_cast<int32_t>(ScaleSlots(kp));
  uint8_t* weights = smem;                                              // [tiles * 16][w_pitch]
  uint8_t* inputs = weights + a.tiles_per_block * kTileRows * w_pitch;  // [16][x_pitch]
  float* partial = reinterpret_cast<float*>(inputs + kResidentGemmMaxRows * x_pitch);
  float* tile_scales = partial + kWarps * 256;  // FP8: [kMaxTilesPerBlock][scale_slots]
  uint64_t* loaded =
      reinterpret_cast<uint64_t*>(tile_scales + (kFp8 ? kMaxTilesPerBlock * scale_slots : 0));
  bool* last = reinterpret_cast<bool*>(loaded + 2);  // [tiles]: this block adds the tile's parts
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Block b: the tiles of group b / k_parts, the reduction part b % k_parts (columns k0..k0+kp).
  const int32_t part = blockIdx.x % a.k_parts;
  const int32_t first_tile = blockIdx.x / a.k_parts * a.tiles_per_block;
  const int32_t tiles = min(a.tiles_per_block, a.tiles - first_tile);
  const int32_t batch = first_tile / a.tiles_per_batch;
  const int32_t row0 = (first_tile % a.tiles_per_batch) * kTileRows;  // the block's first n
  const int32_t k0 = part * kp;
  const Weight* w = a.weight + batch * a.w_batch_stride + row0 * a.w_stride + k0;

  // The weight rows depend on nothing: out before the wait, one bulk copy a row, all counted on
  // one mbarrier. The next kernel may take its place now (it waits for this one itself).
  if (threadIdx.x == 0) {
    sm90::MbarrierInit(loaded, 1);
    sm90::FenceBarrierInit();
  }
  __syncthreads();
  AllowDependentGridLaunch();
  if (warp == 0) {
    const uint32_t row_bytes = static_cast<uint32_t>(sizeof(Weight) * kp);
    if (lane == 0) sm90::MbarrierArriveExpectTx(loaded, tiles * kTileRows * row_bytes);
    __syncwarp();
    for (int r = lane; r < tiles * kTileRows; r += 32) {
      sm90::BulkLoad(weights + r * w_pitch, w + r * a.w_stride, row_bytes, loaded);
    }
  }
  // FP8: each tile's scales for the blocks its columns k0..k0+kp touch (a tile's 16 rows are in
  // one block row), slot j the block column k0 / 128 + j.
  if constexpr (kFp8) {
    const float* scales = a.scales + batch * a.scale_batch_stride;
    for (int32_t i = threadIdx.x; i < tiles * scale_slots; i += kThreads) {
      const int32_t t = i / scale_slots, column = k0 / 128 + i % scale_slots;
      const int32_t block_row = (row0 + t * kTileRows) / 128;
      tile_scales[i] =
          column < a.scale_columns ? scales[block_row * a.scale_columns + column] : 0.0f;
    }
  }

  // The input rows (the predecessor's output): zeroes past m.
  WaitForPredecessorGrid();
  const Bf16* x = a.x + batch * a.x_batch_stride + k0;
  const int32_t chunks = kp / 8;  // 16-byte pieces of a row
  for (int32_t i = threadIdx.x; i < kResidentGemmMaxRows * chunks; i += kThreads) {
    const int32_t row = i / chunks, chunk = i % chunks;
    const bool valid = row < a.m;
    mma::CpAsync16(inputs + row * x_pitch + chunk * 16,
                   x + (valid ? row : 0) * a.x_stride + chunk * 8, valid);
  }
  mma::CpAsyncCommit();
  mma::CpAsyncWait<0>();
  __syncthreads();
  sm90::MbarrierWait(loaded, 0);

  // Warp w: tile w / slices, reduction part w % slices; both 8-token halves of the input.
  const int32_t tile = warp / a.slices, slice = warp % a.slices;
  if (tile < tiles) {
    const int32_t span = kp / a.slices;  // a multiple of 32
    const uint8_t* tile_rows = weights + tile * kTileRows * w_pitch;
    const int a_row = lane % 8 + (lane / 8 % 2) * 8;
    // FP8: this lane's fragment pairs of row g = lane / 4 (and g + 8), columns 2 (lane % 4) + {0,
    // 8} of each 16-column k-step, as A registers 0 and 2 (1 and 3): the layout ldmatrix gives.
    const uint8_t* fp8_row_g = tile_rows + (lane / 4) * w_pitch + 2 * (lane % 4);
    const float* scales = tile_scales + tile * scale_slots;
    float acc[2][4] = {};
    // kk: a column of the block's part of the reduction (shared memory holds only that part).
    for (int32_t kk = slice * span; kk < (slice + 1) * span; kk += 32) {
      uint32_t af[2][4];
      if constexpr (kFp8) {
        // A 32-column step lies in one block (kk and k0 are multiples of 32).
        const float scale = scales[(k0 + kk) / 128 - k0 / 128];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const uint8_t* pair = fp8_row_g + (r % 2) * 8 * w_pitch + kk + 16 * h + 8 * (r / 2);
            af[h][r] = DequantizeFp8Pair(*reinterpret_cast<const uint16_t*>(pair), scale);
          }
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mma::LoadMatrices4(af[h],
                             tile_rows + a_row * w_pitch + 2 * (kk + 16 * h + 8 * (lane / 16)));
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t b[4];
        mma::LoadMatrices4(b, inputs + (8 * half + lane % 8) * x_pitch + 2 * (kk + 8 * (lane / 8)));
        mma::MmaBf16(acc[half], af[0], b[0], b[1]);
        mma::MmaBf16(acc[half], af[1], b[2], b[3]);
      }
    }
    float* mine = partial + warp * 256;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int j = 0; j < 4; ++j) mine[(4 * half + j) * 32 + lane] = acc[half][j];
    }
  }
  __syncthreads();

  // The slices added in order; value v of a tile is accumulator j of lane l for input half h
  // (v = (4h + j) * 32 + l): weight row l / 4 (+ 8 for j >= 2), input row 8h + 2(l % 4) + j % 2.
  // With the reduction split over blocks, each block leaves its tiles' sums in part_sums and the
  // last of a tile's k_parts blocks to arrive adds them, in part order, and stores the tile.
  Output* y = a.y + batch * a.y_batch_stride + row0;
  if (a.k_parts > 1) {
    for (int32_t v = threadIdx.x; v < tiles * 256; v += kThreads) {
      const int32_t t = v / 256, index = v % 256;
      float sum = 0.0f;
      for (int32_t s = 0; s < a.slices; ++s) sum += partial[(t * a.slices + s) * 256 + index];
      __stcg(&a.part_sums[(static_cast<int64_t>(first_tile + t) * a.k_parts + part) * 256 + index],
             sum);
    }
    __threadfence();  // each thread's sums visible device-wide before the block arrives
    __syncthreads();
    if (threadIdx.x < tiles) {
      uint32_t before;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                   : "=r"(before)
                   : "l"(a.arrivals + first_tile + threadIdx.x)
                   : "memory");
      last[threadIdx.x] = before == static_cast<uint32_t>(a.k_parts - 1);
      if (last[threadIdx.x]) a.arrivals[first_tile + threadIdx.x] = 0;  // for the next launch
    }
    __syncthreads();  // the acquiring thread's view, CTA-wide, before the others' loads
  }
  for (int32_t v = threadIdx.x; v < tiles * 256; v += kThreads) {
    const int32_t t = v / 256, index = v % 256;
    const int32_t half = index / 128, j = index / 32 % 4, l = index % 32;
    const int32_t input_row = 8 * half + 2 * (l % 4) + j % 2;
    if (input_row >= a.m) continue;
    float sum = 0.0f;
    if (a.k_parts == 1) {
      for (int32_t s = 0; s < a.slices; ++s) sum += partial[(t * a.slices + s) * 256 + index];
    } else {
      if (!last[t]) continue;
      const float* sums = a.part_sums + static_cast<int64_t>(first_tile + t) * a.k_parts * 256;
      for (int32_t q = 0; q < a.k_parts; ++q) sum += __ldcg(&sums[q * 256 + index]);
    }
    const int32_t n = t * kTileRows + l / 4 + 8 * (j / 2);
    y[input_row * a.y_stride + n] = FromFloat<Output>(sum);
  }
#else
  __trap();
#endif
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// `scales`, `scale_batch_stride`: FP8 weights' (block_fp8.h), else unused.
template <typename Weight, typename Output>
absl::Status Launch(const GemmParamsOf<Bf16, Weight, Output>& p, const float* scales,
                    int64_t scale_batch_stride, const ResidentGemmPlan& plan,
                    const ResidentGemmScratch& scratch, cudaStream_t stream) {
  const bool batched = p.batch > 1;
  const Args<Weight, Output> args{
      .x = p.x,
      .weight = p.weight,
      .scales = scales,
      .y = p.y,
      .m = static_cast<int32_t>(p.m),
      .k = static_cast<int32_t>(p.k),
      .x_stride = p.x_stride ? p.x_stride : p.k,
      .w_stride = p.weight_stride ? p.weight_stride : p.k,
      .y_stride = p.y_stride ? p.y_stride : p.n,
      .x_batch_stride = batched ? p.x_batch_stride : 0,
      .w_batch_stride = batched ? p.weight_batch_stride : 0,
      .y_batch_stride = batched ? p.y_batch_stride : 0,
      .scale_batch_stride =
          batched ? (scale_batch_stride ? scale_batch_stride : Fp8ScaleCount(p.n, p.k)) : 0,
      .scale_columns = static_cast<int32_t>(Fp8ScaleColumns(p.k)),
      .tiles_per_batch = static_cast<int32_t>(p.n / kTileRows),
      .tiles = static_cast<int32_t>(p.batch * (p.n / kTileRows)),
      .tiles_per_block = plan.tiles_per_block,
      .slices = plan.slices,
      .k_parts = plan.k_parts,
      .part_sums = scratch.part_sums,
      .arrivals = scratch.arrivals};
  return LaunchKernel(ResidentGemmKernel<Weight, Output>, dim3(static_cast<unsigned>(plan.blocks)),
                      dim3(kThreads), plan.smem_bytes, stream, /*overlap=*/true,
                      "ResidentGemmKernel launch", args);
}

// Whether the kernel's sm_90 image is loadable and takes `smem` bytes of shared memory.
template <typename Weight, typename Output>
bool Usable(int smem) {
  return WaitsForPredecessor(ResidentGemmKernel<Weight, Output>) &&
         cudaFuncSetAttribute(ResidentGemmKernel<Weight, Output>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess;
}

}  // namespace

template <typename Weight, typename Output>
ResidentGemmPlan PlanResidentGemm(const GemmParamsOf<Bf16, Weight, Output>& p,
                                  const ResidentGemmDevice& device,
                                  const ResidentGemmScratch& scratch) {
  const int64_t x_stride = p.x_stride ? p.x_stride : p.k;
  const int64_t w_stride = p.weight_stride ? p.weight_stride : p.k;
  const bool batched = p.batch > 1;
  constexpr int64_t kWeightBytes = sizeof(Weight);
  if (device.max_smem_bytes <= 0 || p.m < 1 || p.m > kResidentGemmMaxRows || p.n % kTileRows != 0 ||
      p.k % 64 != 0 || p.batch < 1 || !Aligned16(p.x) || !Aligned16(p.weight) ||
      (2 * x_stride) % 16 != 0 || (kWeightBytes * w_stride) % 16 != 0 ||
      (batched &&
       ((2 * p.x_batch_stride) % 16 != 0 || (kWeightBytes * p.weight_batch_stride) % 16 != 0))) {
    return {};
  }
  const int64_t tiles_per_batch = p.n / kTileRows;
  const int64_t tiles = p.batch * tiles_per_batch;
  // bf16: the reduction whole in each block if that fits, else split over the fewest blocks that
  // fit; then the fewest tiles a block (the most blocks) that one wave holds. FP8: of those that
  // fit, the most blocks (the fewest k_parts among equals), as its dequantization after the wait
  // is a block's own work, not the memory system's (bench/NOTES.md, step 141).
  constexpr bool kMostBlocks = std::is_same_v<Weight, Fp8>;
  ResidentGemmPlan best;
  for (int32_t k_parts = 1; k_parts <= kMaxKParts; k_parts *= 2) {
    const int64_t kp = p.k / k_parts;
    if (p.k % (64 * k_parts) != 0) break;
    if (k_parts > 1 && (tiles * k_parts > scratch.tile_parts || tiles > scratch.tiles)) break;
    for (int32_t per_block = 1; per_block <= kMaxTilesPerBlock; per_block *= 2) {
      const int64_t blocks = (tiles + per_block - 1) / per_block * k_parts;
      const int64_t smem = SmemBytes<Weight>(kp, per_block);
      if (tiles_per_batch % per_block != 0 || blocks > device.multiprocessors ||
          smem > device.max_smem_bytes) {
        continue;
      }
      int32_t slices = kWarps / per_block;
      while (slices > 1 && kp % (32 * slices) != 0) slices /= 2;
      const ResidentGemmPlan plan{.blocks = static_cast<int32_t>(blocks),
                                  .tiles_per_block = per_block,
                                  .slices = slices,
                                  .k_parts = k_parts,
                                  .smem_bytes = smem};
      if (!kMostBlocks) return plan;
      if (plan.blocks > best.blocks) best = plan;
      break;  // more tiles a block: fewer blocks
    }
  }
  return best;
}

template ResidentGemmPlan PlanResidentGemm(const GemmParamsOf<Bf16, Bf16, Bf16>&,
                                           const ResidentGemmDevice&, const ResidentGemmScratch&);
template ResidentGemmPlan PlanResidentGemm(const GemmParamsOf<Bf16, Bf16, float>&,
                                           const ResidentGemmDevice&, const ResidentGemmScratch&);
template ResidentGemmPlan PlanResidentGemm(const GemmParamsOf<Bf16, uint8_t, Bf16>&,
                                           const ResidentGemmDevice&, const ResidentGemmScratch&);
template ResidentGemmPlan PlanResidentGemm(const GemmParamsOf<Bf16, uint8_t, float>&,
                                           const ResidentGemmDevice&, const ResidentGemmScratch&);

absl::StatusOr<ResidentGemmScratch> AllocateResidentGemmScratch() {
  ResidentGemmScratch scratch{.tile_parts = kScratchTileParts, .tiles = kScratchTiles};
  const size_t sums_bytes = static_cast<size_t>(kScratchTileParts) * 256 * sizeof(float);
  const size_t arrivals_bytes = static_cast<size_t>(kScratchTiles) * sizeof(uint32_t);
  cudaError_t error = cudaMalloc(&scratch.part_sums, sums_bytes);
  if (error == cudaSuccess) error = cudaMalloc(&scratch.arrivals, arrivals_bytes);
  if (error == cudaSuccess) error = cudaMemset(scratch.arrivals, 0, arrivals_bytes);
  // The zeroes land before any launch on the runner's (non-blocking) stream reads them.
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  if (error != cudaSuccess) {
    FreeResidentGemmScratch(scratch);
    return CudaStatus(error, "the resident products' scratch");
  }
  return scratch;
}

void FreeResidentGemmScratch(ResidentGemmScratch& scratch) {
  cudaFree(scratch.part_sums);
  cudaFree(scratch.arrivals);
  scratch = {};
}

absl::StatusOr<ResidentGemmDevice> PrepareResidentGemm() {
  int device = 0, major = 0, multiprocessors = 0, optin = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (major < 9) return ResidentGemmDevice{};
  // The images must be sm_90's (their waits compiled in) and take the shared memory; where not
  // (a build without this device's architecture), the kernel is off and the error cleared.
  const int smem = static_cast<int>(std::min<int64_t>(optin, kMaxSmemBytes));
  const bool usable = Usable<Bf16, Bf16>(smem) && Usable<Bf16, float>(smem) &&
                      Usable<Fp8, Bf16>(smem) && Usable<Fp8, float>(smem);
  if (!usable) {
    cudaGetLastError();  // at a runner's creation: no other error is pending there
    return ResidentGemmDevice{};
  }
  return ResidentGemmDevice{.multiprocessors = multiprocessors, .max_smem_bytes = smem};
}

absl::Status ResidentGemm(const GemmParamsOf<Bf16, Bf16, Bf16>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream) {
  return Launch(p, nullptr, 0, plan, scratch, stream);
}

absl::Status ResidentGemm(const GemmParamsOf<Bf16, Bf16, float>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream) {
  return Launch(p, nullptr, 0, plan, scratch, stream);
}

absl::Status ResidentGemm(const BlockFp8GemmParamsOf<Bf16>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream) {
  return Launch(p.product, p.scales, p.scale_batch_stride, plan, scratch, stream);
}

absl::Status ResidentGemm(const BlockFp8GemmParamsOf<float>& p, const ResidentGemmPlan& plan,
                          const ResidentGemmScratch& scratch, cudaStream_t stream) {
  return Launch(p.product, p.scales, p.scale_batch_stride, plan, scratch, stream);
}

}  // namespace treeverify::kernels::cuda
