// Does one persistent kernel stream a chain of dense products faster than a launch per product?
// The question the persistent-phase design must answer first (docs/gpu-worker-plan.md,
// "Persistent phases", step (a)): step 92 streamed one matrix per launch at 1.7 TB/s and lost to
// cuBLASLt; the design bets that the ramp and the tail are paid per kernel, not per matrix.
// Answered in run 202 (bench/NOTES.md, step 105): one kernel with barriers saves 1 us over
// programmatic launches and streams the 50 MB at 1.9 TB/s; the bet does not hold at these sizes.
//
// The products are a TP8 rank of Kimi-K2's query path and output at 16 token rows, bf16:
// [q_a; kv_a] 2112 x 7168 (30 MB), q_b 1536 x 1536 (4.7 MB), o_proj 7168 x 1024 (14.7 MB). Each
// streams through the expert stream's pipeline (moe_expert_tma_kernel.cuh): a producer warp issues
// TMA boxes of 128 rows x 64 columns and cp.async token rows into 5 stages, eight mma.sync warps
// multiply; blocks claim (row tile, reduction part) items from a counter, the first item of block
// b being item b. Variants, each cold (the L2 holding another buffer's clean lines before every
// repetition), medians of 20; with barriers launched cooperatively (all blocks resident, or no
// launch):
//   launch per product   three launches in stream order, one product each
//   ..., programmatic    the same, the second and third as programmatic dependents whose weight
//                        boxes go out before they wait for the previous launch (step 100's way)
//   one kernel, barriers one launch; a product's token rows wait for a grid barrier (its input is
//                        the previous product's output), its weight boxes do not (the ring's
//                        stages are issued before the wait)
//   one kernel, free     one launch, no barriers: the bound for the chain
//   <product> alone      each product as its own launch, for the per-product rates
// against the bytes over the copy bandwidth measured in the same run. The sums are kept (each
// thread adds its own to a sink) but not checked: this measures the stream, the kernels' sums are
// checked where they are built.
//
//   phase_stream_probe [--out DIR]     (writes DIR/phase_stream_probe.md)
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "grid_dependency.cuh"
#include "l2_flush.cuh"
#include "mma_sync_primitives.cuh"
#include "probe_common.h"
#include "sm90_primitives.cuh"
#include "tensor_map.h"
#include "tma_probe_device.h"

namespace {

namespace sm90 = treeverify::kernels::cuda::sm90;
namespace mma = treeverify::kernels::cuda::mma;

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * 32;
constexpr int kRows = 16 * kConsumerWarps;  // weight rows per box
constexpr int kCols = 64;                   // reduction columns per stage
constexpr int kTokens = 16;                 // token rows: two mma passes of 8
constexpr int kWeightBytes = kRows * kCols * 2;
constexpr int kStageBytes = kWeightBytes + kTokens * kCols * 2;
static_assert(kStageBytes % 1024 == 0);
constexpr int kStages = 5;
constexpr int kMaxSegments = 3;

struct Segment {
  int32_t rows, cols;
  int32_t parts, per_part;  // reduction parts of an item and 64-column chunks per part
  int32_t items;            // row tiles x parts
};

struct Params {
  Segment segment[kMaxSegments];
  int32_t first, last;  // the products [first, last) this launch streams
  bool barriers;        // a grid barrier before each product's token rows (not the first's)
  bool after_previous;  // a programmatic dependent: the first product's token rows wait for the
                        // previous launch (griddepcontrol.wait), its weight boxes do not
  const __nv_bfloat16* x;
  int32_t x_stride;
  float* sink;         // a float per thread of the grid
  int32_t* claims;     // per product, zeroed before the launch
  uint32_t* arrivals;  // the barriers' count, zeroed before the launch
};

// What a stage holds (beside its slot).
struct Ticket {
  int32_t kind;  // kWork, kSegmentEnd (the block is done with the product), kExit
  int32_t segment;
  int32_t k0;
  int32_t flags;  // kFirst | kLast of an item's stages
};
constexpr int32_t kWork = 0, kSegmentEnd = 1, kExit = 2;
constexpr int32_t kFirst = 1, kLast = 2;

__device__ uint32_t LoadAcquire(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__global__ void __launch_bounds__(kThreads, 2)
    PhaseStreamKernel(const __grid_constant__ CUtensorMap map0,
                      const __grid_constant__ CUtensorMap map1,
                      const __grid_constant__ CUtensorMap map2, Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* slots = sm90::AlignSharedUp<1024>(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  Ticket* tickets = reinterpret_cast<Ticket*>(empty + kStages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::MbarrierInit(&full[s], 1 + 32);
      sm90::MbarrierInit(&empty[s], kConsumerWarps * 32);
    }
    sm90::FenceBarrierInit();
  }
  __syncthreads();
  treeverify::kernels::cuda::AllowDependentGridLaunch();

  if (warp == kConsumerWarps) {
    int32_t stage = 0;          // stages whose ticket (and weights) are out
    int32_t tokens_issued = 0;  // stages whose token rows (and the warp's arrivals) are out
    // Products whose token rows (and segment-end markers) may go: after the previous launch for
    // a programmatic dependent, after the grid barrier for each product past the first.
    int32_t open = p.after_previous ? p.first - 1 : p.barriers ? p.first : p.last;
    // The token rows of every stage up to `stage` whose product is open; with `wait`, the first
    // held one's wait is waited for. A marker is held too: a block with no items in a product
    // must not count itself done with it before the product's barrier has passed.
    auto issue_tokens = [&](bool wait) {
      while (tokens_issued < stage) {
        const int32_t slot = tokens_issued % kStages;
        const Ticket t = tickets[slot];
        if (t.kind != kExit && t.segment > open) {
          if (t.segment == p.first) {  // after_previous: griddepcontrol.wait cannot be polled
            if (!wait) return;
            treeverify::kernels::cuda::WaitForPredecessorGrid();
          } else {
            const uint32_t needed = static_cast<uint32_t>(t.segment - p.first) * gridDim.x;
            bool passed = false;
            while (true) {
              passed = __shfl_sync(0xffffffffu, lane == 0 && LoadAcquire(p.arrivals) >= needed, 0);
              if (passed || !wait) break;
              __nanosleep(64);
            }
            if (!passed) return;
            __syncwarp();  // lane 0's acquire, before every lane's reads of the product's input
          }
          open = t.segment;
        }
        if (t.kind == kWork) {
          uint8_t* tokens = slots + slot * kStageBytes + kWeightBytes;
#pragma unroll
          for (int turn = 0; turn < kTokens * 8 / 32; ++turn) {
            const int row = lane / 8 + 4 * turn, column = t.k0 + 8 * (lane % 8);
            mma::CpAsync16(tokens + sm90::Swizzle128(row, 8 * (lane % 8)),
                           p.x + static_cast<int64_t>(row) * p.x_stride + column,
                           column < p.segment[t.segment].cols);
          }
        }
        mma::CpAsyncArriveOn(&full[slot]);
        ++tokens_issued;
      }
    };
    // The next stage's ticket and weight box; a ring full of stages held at a barrier waits there.
    auto emit = [&](Ticket t, int32_t row0) {
      while (stage - tokens_issued >= kStages) issue_tokens(true);
      const int32_t slot = stage % kStages;
      sm90::MbarrierWait(&empty[slot], ((stage / kStages) & 1) ^ 1);
      if (lane == 0) {
        tickets[slot] = t;
        sm90::MbarrierArriveExpectTx(&full[slot], t.kind == kWork ? kWeightBytes : 0);
        if (t.kind == kWork) {
          const CUtensorMap* map = t.segment == 0 ? &map0 : t.segment == 1 ? &map1 : &map2;
          sm90::TmaLoad2d(slots + slot * kStageBytes, map, t.k0, row0, &full[slot]);
        }
      }
      __syncwarp();
      ++stage;
      issue_tokens(false);
    };
    for (int32_t s = p.first; s < p.last; ++s) {
      const Segment& g = p.segment[s];
      const int32_t chunks = (g.cols + kCols - 1) / kCols;
      int32_t claimed = blockIdx.x;  // lane 0's next item
      while (true) {
        const int32_t item = __shfl_sync(0xffffffffu, claimed, 0);
        if (item >= g.items) break;
        if (lane == 0) claimed = atomicAdd(&p.claims[s], 1) + static_cast<int32_t>(gridDim.x);
        const int32_t row0 = item / g.parts * kRows, part = item % g.parts;
        const int32_t begin = part * g.per_part, end = min(chunks, begin + g.per_part);
        for (int32_t c = begin; c < end; ++c) {
          emit(Ticket{kWork, s, c * kCols, (c == begin ? kFirst : 0) | (c == end - 1 ? kLast : 0)},
               row0);
        }
      }
      if (p.barriers && s + 1 < p.last) emit(Ticket{kSegmentEnd, s, 0, 0}, 0);
    }
    emit(Ticket{kExit, 0, 0, 0}, 0);
    issue_tokens(true);
    return;
  }

  // A consumer: 16 weight rows of each box against the 16 token rows.
  const int a_row = 16 * warp + lane % 8 + (lane / 8 % 2) * 8;
  float acc[2][4] = {};
  float kept = 0.0f;
  for (int32_t stage = 0;; ++stage) {
    const int32_t slot = stage % kStages;
    sm90::MbarrierWait(&full[slot], (stage / kStages) & 1);
    const Ticket t = tickets[slot];
    if (t.kind == kExit) break;
    if (t.kind == kSegmentEnd) {
      sm90::MbarrierArrive(&empty[slot]);
      // Every consumer's sums of the product are stored: the block arrives (release).
      sm90::NamedBarrier<1, kConsumerWarps * 32>();
      if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p.arrivals) : "memory");
      }
      continue;
    }
    if (t.flags & kFirst) {
      for (auto& pass : acc) {
        for (float& v : pass) v = 0.0f;
      }
    }
    const uint8_t* weights = slots + slot * kStageBytes;
    const uint8_t* tokens = weights + kWeightBytes;
#pragma unroll
    for (int j = 0; j < kCols / 32; ++j) {
      uint32_t a[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mma::LoadMatrices4(a[h],
                           weights + sm90::Swizzle128(a_row, 8 * (4 * j + 2 * h + lane / 16)));
      }
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        uint32_t b[4];
        mma::LoadMatrices4(b,
                           tokens + sm90::Swizzle128(8 * pass + lane % 8, 8 * (4 * j + lane / 8)));
        mma::MmaBf16(acc[pass], a[0], b[0], b[1]);
        mma::MmaBf16(acc[pass], a[1], b[2], b[3]);
      }
    }
    sm90::MbarrierArrive(&empty[slot]);
    if (t.flags & kLast) {
      for (auto& pass : acc) {
        for (float v : pass) kept += v;
      }
    }
  }
  p.sink[static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x] += kept;
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
  const std::string& out_dir = *out_argument;
  const treeverify::bench::TmaProbeDevice probe = treeverify::bench::SetUpTmaProbeDevice();
  const cudaDeviceProp& properties = probe.properties;
  const int multiprocessors = probe.multiprocessors;
  cudaStream_t stream = probe.stream;
  const double copy = probe.copy_bytes_per_s;

  const char* names[kMaxSegments] = {"[q_a; kv_a]", "q_b", "o_proj"};
  const int32_t shapes[kMaxSegments][2] = {{2112, 7168}, {1536, 1536}, {7168, 1024}};
  const int smem = 1024 + kStages * (kStageBytes + 16 + static_cast<int>(sizeof(Ticket)));
  CHECK_CUDA(
      cudaFuncSetAttribute(PhaseStreamKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int resident = 0;
  CHECK_CUDA(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, PhaseStreamKernel, kThreads, smem));
  Check(resident >= 1, __FILE__, __LINE__, "occupancy", "no block fits");
  const int grid = std::min(resident, 2) * multiprocessors;

  Params params{};
  std::vector<void*> weights(kMaxSegments);
  std::vector<CUtensorMap> maps(kMaxSegments);
  double all_bytes = 0.0;
  std::vector<double> bytes(kMaxSegments);
  for (int s = 0; s < kMaxSegments; ++s) {
    Segment& g = params.segment[s];
    g.rows = shapes[s][0];
    g.cols = shapes[s][1];
    const int32_t tiles = (g.rows + kRows - 1) / kRows, chunks = (g.cols + kCols - 1) / kCols;
    // About two items per block or more, each a whole number of 64-column stages, so the claims
    // even out the blocks' shares.
    g.per_part = std::max(1, tiles * chunks / (2 * grid));
    g.parts = (chunks + g.per_part - 1) / g.per_part;
    g.items = tiles * g.parts;
    bytes[s] = 2.0 * g.rows * g.cols;
    all_bytes += bytes[s];
    CHECK_CUDA(cudaMalloc(&weights[s], static_cast<size_t>(bytes[s])));
    CHECK_CUDA(cudaMemset(weights[s], 0x3c, static_cast<size_t>(bytes[s])));
    const absl::StatusOr<CUtensorMap> map =
        treeverify::kernels::cuda::MakeBf16TensorMap2d(weights[s], g.rows, g.cols, g.cols, kRows);
    Check(map.ok(), __FILE__, __LINE__, "MakeBf16TensorMap2d", map.status().ToString().c_str());
    maps[s] = *map;
  }
  __nv_bfloat16* x = nullptr;
  float* sink = nullptr;
  int32_t* counters = nullptr;  // kMaxSegments claims, then the arrivals
  CHECK_CUDA(cudaMalloc(&x, size_t{kTokens} * 7168 * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMemset(x, 0x3c, size_t{kTokens} * 7168 * sizeof(__nv_bfloat16)));
  const size_t sink_bytes = static_cast<size_t>(grid) * kThreads * sizeof(float);
  CHECK_CUDA(cudaMalloc(&sink, sink_bytes));
  CHECK_CUDA(cudaMemset(sink, 0, sink_bytes));
  CHECK_CUDA(cudaMalloc(&counters, (kMaxSegments + 1) * sizeof(int32_t)));
  const treeverify::bench::L2Flusher flusher;
  Check(flusher.ok(), __FILE__, __LINE__, "L2Flusher", "no memory for the flush buffer");
  params.x = x;
  params.x_stride = 7168;
  params.sink = sink;
  params.claims = counters;
  params.arrivals = reinterpret_cast<uint32_t*>(counters + kMaxSegments);

  // One variant: the launches of `runs` ({first, last, barriers}), cold, 20 times; median us.
  struct Run {
    int32_t first, last;
    bool barriers;
    bool after_previous;
  };
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  auto measure = [&](const std::vector<Run>& runs) {
    std::vector<double> times;
    for (int repeat = 0; repeat < 23; ++repeat) {
      flusher.Flush(stream);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaMemsetAsync(counters, 0, (kMaxSegments + 1) * sizeof(int32_t), stream));
      CHECK_CUDA(cudaEventRecord(start, stream));
      for (const Run& run : runs) {
        Params p = params;
        p.first = run.first;
        p.last = run.last;
        p.barriers = run.barriers;
        p.after_previous = run.after_previous;
        // With barriers, cooperative, so that a grid whose blocks cannot all be resident fails to
        // launch rather than hangs in a barrier; programmatic where the run asks for it.
        cudaLaunchAttribute attributes[1] = {};
        if (run.barriers) {
          attributes[0].id = cudaLaunchAttributeCooperative;
          attributes[0].val.cooperative = 1;
        } else {
          attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attributes[0].val.programmaticStreamSerializationAllowed = 1;
        }
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(static_cast<unsigned>(grid));
        config.blockDim = dim3(kThreads);
        config.dynamicSmemBytes = static_cast<size_t>(smem);
        config.stream = stream;
        config.attrs = attributes;
        config.numAttrs = run.barriers || run.after_previous ? 1 : 0;
        CHECK_CUDA(cudaLaunchKernelEx(&config, PhaseStreamKernel, maps[0], maps[1], maps[2], p));
      }
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (repeat >= 3) times.push_back(1000.0 * ms);  // after 3 warm-ups
    }
    return Median(times);
  };

  std::string table;
  char line[512];
  std::snprintf(
      line, sizeof(line),
      "device %s, %d SMs, %d blocks of %d threads, copy bandwidth %.2f TB/s\n\n"
      "| variant | bytes (MB) | us | TB/s | %% of copy bandwidth |\n|---|---|---|---|---|\n",
      properties.name, multiprocessors, grid, kThreads, copy / 1e12);
  table += line;
  auto row = [&](const std::string& name, double b, double us) {
    std::snprintf(line, sizeof(line), "| %s | %.1f | %.1f | %.2f | %.0f %% |\n", name.c_str(),
                  b / 1e6, us, b / us / 1e6, 100.0 * (b / copy) / (us / 1e6));
    table += line;
  };
  for (int s = 0; s < kMaxSegments; ++s) {
    row(std::string(names[s]) + " alone", bytes[s], measure({{s, s + 1, false, false}}));
  }
  row("launch per product", all_bytes,
      measure({{0, 1, false, false}, {1, 2, false, false}, {2, 3, false, false}}));
  row("launch per product, programmatic", all_bytes,
      measure({{0, 1, false, false}, {1, 2, false, true}, {2, 3, false, true}}));
  row("one kernel, barriers", all_bytes, measure({{0, 3, true, false}}));
  row("one kernel, free", all_bytes, measure({{0, 3, false, false}}));
  std::fputs(table.c_str(), stdout);
  std::ofstream(out_dir + "/phase_stream_probe.md") << table;
  return 0;
}
