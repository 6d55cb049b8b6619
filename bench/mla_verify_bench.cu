// MLA tree-verify attention on the GPU against its roofline.
//
//   mla_verify_bench [--out DIR] [--quick] [--only H,Q,L,B]... [--timestamps]
//
// Measures, in one run: the copy bandwidth (a large device-to-device copy, bytes read + written)
// and the bf16 tensor-core rate (an 8192^3 cuBLAS GEMM) as the ceilings; then for each shape (heads
// H, tree rows Q, context L, batch B) the planned kernel's median time inside CUDA graphs, with the
// KV cache rotated over copies that together exceed the L2, against
//   floor = max(B * L * 576 * 2 bytes / bandwidth, B * 2 * Q * H * L * 1088 FLOPs / rate).
// "Overlapped": the same plan launched with overlap_predecessor (programmatic dependent launch), so
// each launch of the graph streams its committed prefix while the previous one finishes, as it
// would behind the previous kernel of a decode step. For the TP8 batch-1 shapes also what the op
// adds behind a stand-in for that kernel (a 16 MB streaming read). Beside it: the planner's NSPLIT
// against a sweep (a subset of shapes), an arbitrary tree against a chain of the same size (their
// graphs replayed alternately, so that drift between passes cancels), the
// kernels the planner did not choose forced (the other wgmma kernel; the mma kernel at batch 1),
// and two reference points: a seed-style kernel (the portable kernel, one block per (row, split),
// NSPLIT fixed at 16, scalar loads) and a cuBLAS attention that materializes the scores. Writes
// mla_verify.json and mla_verify.md under --out.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "grid_dependency.cuh"
#include "nlohmann/json.hpp"
#include "sm90_primitives.cuh"
#include "tensor_map.h"
#include "treeverify/kernels/cuda/copy_bandwidth.h"
#include "treeverify/kernels/cuda/device.h"
#include "treeverify/kernels/cuda/device_fill.h"
#include "treeverify/kernels/cuda/mla_verify_attention.h"

namespace tv = treeverify::kernels;
namespace tvc = treeverify::kernels::cuda;

namespace {

constexpr int kLatent = 512;
constexpr int kRope = 64;
constexpr int kDims = kLatent + kRope;
constexpr int kPageSize = 64;
constexpr int64_t kRotationBytes = 256ll << 20;  // KV copies cycled through: 5x the 50 MB L2
// A graph replays its copies in turn, as many rounds as it takes to hold this many launches: a
// graph launch costs about 3 us of its own (an empty kernel measured 0.5 us per launch in graphs
// of 55 launches and 2.0 us in graphs of 2), which one round of 2 copies (L = 128k) would add
// half of to every launch (bench/NOTES.md, step 41).
constexpr int kMinLaunchesPerGraph = 16;

// Launches in a graph over `copies` KV copies: whole rounds, at least kMinLaunchesPerGraph.
int LaunchesPerGraph(int copies) {
  const int rounds = (kMinLaunchesPerGraph + copies - 1) / copies;
  return copies * rounds;
}

#define CHECK_CUDA(expr)                                                                        \
  do {                                                                                          \
    cudaError_t e = (expr);                                                                     \
    if (e != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)
#define CHECK_CUBLAS(expr)                                                            \
  do {                                                                                \
    cublasStatus_t s = (expr);                                                        \
    if (s != CUBLAS_STATUS_SUCCESS) {                                                 \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #expr, \
                   static_cast<int>(s));                                              \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

void CheckStatus(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(status.message()).c_str());
    std::exit(1);
  }
}

// Random bf16 in [-2, 2): never zeros (device_fill.h).
void Fill(__nv_bfloat16* data, int64_t count, uint32_t seed) {
  CheckStatus(treeverify::kernels::cuda::FillUniform(data, count, 2.0f, seed, nullptr), "Fill");
}

// The streaming probe: reads `count` 16-byte units (eight loads in flight per thread) and keeps
// them alive through a store that never happens in practice. No attention op can read its KV
// faster. As a programmatic dependent launch it behaves like an overlapped attention launch: it
// lets the next kernel start at once, reads while its predecessor finishes and waits for that
// predecessor before its (result) store; launched plainly, the wait returns at once.
__global__ void ReadKernel(const uint4* __restrict__ src, int64_t count, uint32_t* sink) {
  tvc::AllowDependentGridLaunch();
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 7 * stride < count; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < count; i += stride) acc ^= src[i].x ^ src[i].y ^ src[i].z ^ src[i].w;
  tvc::WaitForPredecessorGrid();
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// In a merge kernel's place: as a programmatic dependent launch it waits for its predecessor.
__global__ void EmptyKernel() {
  tvc::AllowDependentGridLaunch();
  tvc::WaitForPredecessorGrid();
}

// The TMA streaming probe: the wgmma kernels' load path without their work, to tell what of the
// gap to the streaming probe is the path's. A block per multiprocessor takes a contiguous share of
// the 64-key tiles of a [keys, 576] bf16 tensor and loads each tile as those kernels do (nine
// TMA boxes of 64 keys x 64 dims, 128-byte swizzle, evict-first) into two 72 KB stages; one thread
// requests, one warp waits for each tile and frees its stage.
constexpr int kTmaProbeStages = 2;  // three: the same times (bench/NOTES.md, step 75)
constexpr int kTmaProbeTileBytes = 64 * kDims * 2;
constexpr int kTmaProbeSmemBytes = kTmaProbeStages * kTmaProbeTileBytes + 1024;  // + alignment

__global__ void __launch_bounds__(64)
    TmaReadKernel(const __grid_constant__ CUtensorMap map, int32_t tiles, uint32_t* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace sm90 = tvc::sm90;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = sm90::AlignSharedUp<1024>(smem_raw);
  __shared__ uint64_t full[kTmaProbeStages];
  __shared__ uint64_t empty[kTmaProbeStages];
  tvc::AllowDependentGridLaunch();
  const int begin = static_cast<int>(int64_t{tiles} * blockIdx.x / gridDim.x);
  const int count = static_cast<int>(int64_t{tiles} * (blockIdx.x + 1) / gridDim.x) - begin;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kTmaProbeStages; ++s) {
      sm90::MbarrierInit(&full[s], 1);
      sm90::MbarrierInit(&empty[s], 1);
    }
    sm90::FenceBarrierInit();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t evict_first = sm90::L2EvictFirstPolicy();
    for (int i = 0; i < count; ++i) {
      const int stage = i % kTmaProbeStages;
      if (i >= kTmaProbeStages) {
        sm90::MbarrierWait(&empty[stage], (i / kTmaProbeStages - 1) & 1);
      }
      sm90::MbarrierArriveExpectTx(&full[stage], kTmaProbeTileBytes);
      for (int c = 0; c < kDims / 64; ++c) {
        sm90::TmaLoad2dHinted(smem + stage * kTmaProbeTileBytes + c * 64 * 128, &map, c * 64,
                              (begin + i) * 64, &full[stage], evict_first);
      }
    }
  } else if (threadIdx.x >= 32) {
    uint32_t acc = 0;
    for (int i = 0; i < count; ++i) {
      const int stage = i % kTmaProbeStages;
      sm90::MbarrierWait(&full[stage], (i / kTmaProbeStages) & 1);
      acc ^= reinterpret_cast<const uint32_t*>(smem + stage * kTmaProbeTileBytes)[threadIdx.x];
      __syncwarp();
      if (threadIdx.x == 32) sm90::MbarrierArrive(&empty[stage]);
    }
    tvc::WaitForPredecessorGrid();
    if (acc == 0x9e3779b9u) sink[0] = acc;
  }
#endif
}

// Launches `kernel` with `args` on `stream`, as a programmatic dependent launch if `overlap`.
template <typename... Params, typename... Args>
void LaunchProbeKernelWithSmem(void (*kernel)(Params...), int blocks, int threads,
                               size_t smem_bytes, cudaStream_t stream, bool overlap, Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, args...));
}

template <typename... Params, typename... Args>
void LaunchProbeKernel(void (*kernel)(Params...), int blocks, int threads, cudaStream_t stream,
                       bool overlap, Args... args) {
  LaunchProbeKernelWithSmem(kernel, blocks, threads, 0, stream, overlap, args...);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Milliseconds of one launch of `exec`, between two events.
double TimeOneLaunch(cudaGraphExec_t exec, cudaStream_t stream, cudaEvent_t start,
                     cudaEvent_t stop) {
  CHECK_CUDA(cudaEventRecord(start, stream));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float t = 0;
  CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
  return t;
}

// Median milliseconds of `replays` launches of each of `execs`, after two warm-up launches each;
// the graphs take turns, so that the GPU's drift between passes reaches all of them alike.
std::vector<double> TimeGraphs(const std::vector<cudaGraphExec_t>& execs, cudaStream_t stream,
                               int replays) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (cudaGraphExec_t exec : execs) {
    for (int i = 0; i < 2; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  }
  std::vector<std::vector<double>> ms(execs.size());
  for (int i = 0; i < replays; ++i) {
    for (size_t g = 0; g < execs.size(); ++g) {
      ms[g].push_back(TimeOneLaunch(execs[g], stream, start, stop));
    }
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::vector<double> medians;
  for (std::vector<double>& m : ms) medians.push_back(Median(std::move(m)));
  return medians;
}

double TimeGraph(cudaGraphExec_t exec, cudaStream_t stream, int replays) {
  return TimeGraphs({exec}, stream, replays)[0];
}

template <typename Body>
cudaGraphExec_t Capture(cudaStream_t stream, Body body) {
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  body();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return exec;
}

// Median microseconds per launch of graphs of `launches` launches, launch i queued by body(i).
template <typename Body>
double UsPerLaunch(cudaStream_t stream, int launches, int replays, Body body) {
  cudaGraphExec_t exec = Capture(stream, [&] {
    for (int i = 0; i < launches; ++i) body(i);
  });
  const double us = TimeGraph(exec, stream, replays) * 1e3 / launches;
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  return us;
}

// UsPerLaunch of two bodies whose graphs take turns (TimeGraphs): a comparison of the two that the
// GPU's drift between passes (about 5 % at batch 1, bench/NOTES.md) does not reach. Returns {a, b}.
template <typename BodyA, typename BodyB>
std::pair<double, double> UsPerLaunchAlternated(cudaStream_t stream, int launches, int replays,
                                                BodyA body_a, BodyB body_b) {
  const std::vector<cudaGraphExec_t> execs = {Capture(stream,
                                                      [&] {
                                                        for (int i = 0; i < launches; ++i)
                                                          body_a(i);
                                                      }),
                                              Capture(stream, [&] {
                                                for (int i = 0; i < launches; ++i) body_b(i);
                                              })};
  const std::vector<double> ms = TimeGraphs(execs, stream, replays);
  for (cudaGraphExec_t exec : execs) CHECK_CUDA(cudaGraphExecDestroy(exec));
  return {ms[0] * 1e3 / launches, ms[1] * 1e3 / launches};
}

struct Ceilings {
  double copy_bytes_per_s = 0;
  double memcpy_bytes_per_s = 0;
  double kernel_copy_bytes_per_s = 0;
  double tensor_flops_per_s = 0;
};

Ceilings MeasureCeilings(cudaStream_t stream, cublasHandle_t cublas) {
  Ceilings c;
  const int64_t bytes = 2ll << 30;
  __nv_bfloat16 *src, *dst;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&dst, bytes));
  Fill(src, bytes / 2, 1);
  // The faster of cudaMemcpyAsync and our own copy kernel, counting bytes read + written.
  cudaGraphExec_t copy = Capture(stream, [&] {
    CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  c.memcpy_bytes_per_s = 2.0 * bytes / (TimeGraph(copy, stream, 10) * 1e-3);
  CHECK_CUDA(cudaGraphExecDestroy(copy));
  cudaGraphExec_t kernel_copy = Capture(stream, [&] {
    // The copy ceiling: 16-byte loads and stores, four in flight per thread (copy_bandwidth.h).
    CheckStatus(treeverify::kernels::cuda::CopyWith16ByteLoads(src, dst, bytes, stream),
                "copy kernel");
  });
  c.kernel_copy_bytes_per_s = 2.0 * bytes / (TimeGraph(kernel_copy, stream, 10) * 1e-3);
  CHECK_CUDA(cudaGraphExecDestroy(kernel_copy));
  c.copy_bytes_per_s = std::max(c.memcpy_bytes_per_s, c.kernel_copy_bytes_per_s);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));

  const int n = 8192;
  __nv_bfloat16 *a, *b, *d;
  CHECK_CUDA(cudaMalloc(&a, int64_t{n} * n * 2));
  CHECK_CUDA(cudaMalloc(&b, int64_t{n} * n * 2));
  CHECK_CUDA(cudaMalloc(&d, int64_t{n} * n * 2));
  Fill(a, int64_t{n} * n, 2);
  Fill(b, int64_t{n} * n, 3);
  const float one = 1.f, zero = 0.f;
  cudaGraphExec_t gemm = Capture(stream, [&] {
    CHECK_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b,
                              CUDA_R_16BF, n, &zero, d, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  });
  c.tensor_flops_per_s = 2.0 * n * n * double(n) / (TimeGraph(gemm, stream, 10) * 1e-3);
  CHECK_CUDA(cudaGraphExecDestroy(gemm));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(d));
  return c;
}

// What one launch costs in this harness before any attention work: per context of the batch-1
// rows, graphs of back-to-back launches (cycling through copies of L * 576 * 2 bytes, rotated over
// 256 MB, at least kMinLaunchesPerGraph, like the workloads) of the streaming probe alone, of the
// probe followed by an empty kernel (the shape of a split kernel plus its merge), and of an empty
// kernel alone; the first two again with every kernel a programmatic dependent launch (the
// shape of launches with overlap_predecessor, whose merge kernel is such a launch too); and the
// TMA probe (the wgmma kernels' load path) alone.
struct LaunchProbe {
  int64_t context;
  double floor_us;  // the KV bytes at the copy bandwidth
  double read_us;
  double read_then_empty_us;
  double empty_us;
  double read_overlapped_us;
  double read_then_empty_overlapped_us;
  double tma_read_us;  // the TMA streaming probe, launched plainly
};

std::vector<LaunchProbe> MeasureLaunchProbes(cudaStream_t stream, int sms, const Ceilings& ceilings,
                                             const std::vector<int64_t>& contexts) {
  std::vector<LaunchProbe> probes;
  CHECK_CUDA(cudaFuncSetAttribute(TmaReadKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kTmaProbeSmemBytes));
  uint32_t* sink;
  CHECK_CUDA(cudaMalloc(&sink, 4));
  for (int64_t context : contexts) {
    const int64_t bytes = context * kDims * 2;
    const int copies =
        static_cast<int>(std::clamp<int64_t>((kRotationBytes + bytes - 1) / bytes, 2, 64));
    __nv_bfloat16* data;
    CHECK_CUDA(cudaMalloc(&data, bytes * copies));
    Fill(data, bytes * copies / 2, 7);
    std::vector<CUtensorMap> maps;
    for (int c = 0; c < copies; ++c) {
      absl::StatusOr<CUtensorMap> map = tvc::MakeBf16TensorMap2d(
          reinterpret_cast<char*>(data) + c * bytes, context, kDims, kDims, 64);
      CheckStatus(map.status(), "TMA probe tensor map");
      maps.push_back(*map);
    }
    const int32_t tiles = static_cast<int32_t>((context + 63) / 64);
    const double tma_read_us = UsPerLaunch(stream, LaunchesPerGraph(copies), 15, [&](int i) {
      LaunchProbeKernelWithSmem(TmaReadKernel, sms, 64, kTmaProbeSmemBytes, stream,
                                /*overlap=*/false, maps[i % copies], tiles, sink);
    });
    auto time_per_launch = [&](bool read, bool empty_after, bool overlap = false) {
      return UsPerLaunch(stream, LaunchesPerGraph(copies), 15, [&](int i) {
        const int c = i % copies;
        if (read) {
          LaunchProbeKernel(
              ReadKernel, sms * 4, 256, stream, overlap && i > 0,
              reinterpret_cast<const uint4*>(reinterpret_cast<char*>(data) + c * bytes), bytes / 16,
              sink);
        }
        if (empty_after) LaunchProbeKernel(EmptyKernel, 1, 32, stream, overlap);
      });
    };
    probes.push_back({context, bytes / ceilings.copy_bytes_per_s * 1e6,
                      time_per_launch(true, false), time_per_launch(true, true),
                      time_per_launch(false, true), time_per_launch(true, false, true),
                      time_per_launch(true, true, true), tma_read_us});
    CHECK_CUDA(cudaFree(data));
  }
  CHECK_CUDA(cudaFree(sink));
  return probes;
}

// A stand-in for the kernel before attention in a decode step (the query projection, a GEMM at
// batch 1 that streams its weights): each launch reads kPredecessorBytes with the streaming probe,
// from copies rotated over kRotationBytes so that they come from DRAM like a layer's weights. It
// lets the next kernel start at once (the probe's trigger comes first), and its blocks hold the
// multiprocessors while they read, as a GEMM's would.
class Predecessor {
 public:
  static constexpr int64_t kBytes = 16ll << 20;  // about a TP8 rank's query-path weights

  explicit Predecessor(int sms) : sms_(sms) {
    CHECK_CUDA(cudaMalloc(&data_, kRotationBytes));
    CHECK_CUDA(cudaMalloc(&sink_, 4));
    Fill(reinterpret_cast<__nv_bfloat16*>(data_), kRotationBytes / 2, 11);
  }
  ~Predecessor() {
    CHECK_CUDA(cudaFree(data_));
    CHECK_CUDA(cudaFree(sink_));
  }
  Predecessor(const Predecessor&) = delete;
  Predecessor& operator=(const Predecessor&) = delete;

  // Median us per launch of graphs of `launches` predecessor launches alone.
  double TimeAlone(int launches, cudaStream_t stream, int replays) const {
    return UsPerLaunch(stream, launches, replays, [&](int i) { Launch(i, stream); });
  }

  // Launch i of a graph: copy i of the rotation.
  void Launch(int i, cudaStream_t stream) const {
    const int64_t copy = i % (kRotationBytes / kBytes);
    LaunchProbeKernel(ReadKernel, sms_ * 4, 256, stream, /*overlap=*/false,
                      reinterpret_cast<const uint4*>(data_ + copy * kBytes), kBytes / 16, sink_);
  }

 private:
  int sms_;
  char* data_ = nullptr;
  uint32_t* sink_ = nullptr;
};

struct Shape {
  int heads;
  int rows;  // Q: tree rows per sequence
  int64_t context;
  int batch;
  bool chain = false;
};

// Device buffers of one shape: `copies` caches (identity page tables into disjoint pages) cycled
// through so that the KV comes from DRAM, not the L2.
class Workload {
 public:
  Workload(const Shape& s, uint32_t seed) : shape_(s) {
    keys_ = s.context + s.rows;
    pages_per_seq_ = static_cast<int32_t>((keys_ + kPageSize - 1) / kPageSize);
    const int64_t copy_bytes = int64_t{s.batch} * pages_per_seq_ * kPageSize * kDims * 2;
    copies_ = static_cast<int>(
        std::clamp<int64_t>((kRotationBytes + copy_bytes - 1) / copy_bytes, 2, 64));
    num_pages_ = copies_ * s.batch * pages_per_seq_;
    CHECK_CUDA(cudaMalloc(&cache_, int64_t{num_pages_} * kPageSize * kDims * 2));
    Fill(cache_, int64_t{num_pages_} * kPageSize * kDims, seed);
    const int64_t q_rows = int64_t{s.batch} * s.rows * s.heads;
    CHECK_CUDA(cudaMalloc(&q_, q_rows * kDims * 2));
    Fill(q_, q_rows * kDims, seed + 1);
    CHECK_CUDA(cudaMalloc(&out_, q_rows * kLatent * 2));
    CHECK_CUDA(cudaMalloc(&lse_, q_rows * 4));

    std::vector<int32_t> tables(int64_t{copies_} * s.batch * pages_per_seq_);
    for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
    CHECK_CUDA(cudaMalloc(&page_tables_, tables.size() * 4));
    CHECK_CUDA(cudaMemcpy(page_tables_, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> committed(s.batch, static_cast<int32_t>(s.context));
    std::vector<int32_t> offsets(s.batch + 1);
    for (int b = 0; b <= s.batch; ++b) offsets[b] = b * s.rows;
    std::mt19937 rng(seed);
    std::vector<uint64_t> masks(int64_t{s.batch} * s.rows * tv::kAncestorMaskWords, 0);
    for (int b = 0; b < s.batch; ++b) {
      std::vector<int> parent(s.rows, -1);
      for (int i = 1; i < s.rows; ++i) {
        parent[i] = s.chain ? i - 1 : std::uniform_int_distribution<int>(0, i - 1)(rng);
      }
      for (int i = 0; i < s.rows; ++i) {
        for (int a = i; a >= 0; a = parent[a]) {
          masks[(int64_t{b} * s.rows + i) * tv::kAncestorMaskWords + a / 64] |= uint64_t{1}
                                                                                << (a % 64);
        }
      }
    }
    CHECK_CUDA(cudaMalloc(&committed_, s.batch * 4));
    CHECK_CUDA(cudaMalloc(&offsets_, (s.batch + 1) * 4));
    CHECK_CUDA(cudaMalloc(&masks_, masks.size() * 8));
    CHECK_CUDA(cudaMemcpy(committed_, committed.data(), s.batch * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(offsets_, offsets.data(), (s.batch + 1) * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(masks_, masks.data(), masks.size() * 8, cudaMemcpyHostToDevice));
  }
  ~Workload() {
    cudaFree(cache_);
    cudaFree(q_);
    cudaFree(out_);
    cudaFree(lse_);
    cudaFree(page_tables_);
    cudaFree(committed_);
    cudaFree(offsets_);
    cudaFree(masks_);
  }
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  tvc::MlaVerifyShape MlaShape() const {
    return {.num_seqs = shape_.batch,
            .max_rows_per_seq = shape_.rows,
            .row_capacity = shape_.batch * shape_.rows,
            .num_heads = shape_.heads,
            .latent_dim = kLatent,
            .rope_dim = kRope,
            .page_size = kPageSize};
  }

  tvc::MlaVerifyParamsBf16 Params(int copy) const {
    tvc::MlaVerifyParamsBf16 p;
    p.q = q_;
    p.kv_cache = cache_;
    p.page_table = page_tables_ + int64_t{copy} * shape_.batch * pages_per_seq_;
    p.committed_lengths = committed_;
    p.row_offsets = offsets_;
    p.ancestor_mask = masks_;
    p.out = out_;
    p.lse = lse_;
    p.num_seqs = shape_.batch;
    p.num_heads = shape_.heads;
    p.latent_dim = kLatent;
    p.rope_dim = kRope;
    p.page_size = kPageSize;
    p.max_pages_per_seq = pages_per_seq_;
    p.num_pages = num_pages_;
    p.softmax_scale = 1.f / std::sqrt(192.f);
    return p;
  }

  // Median microseconds of one launch of `plan`, from graphs of back-to-back launches that cycle
  // through the copies; with `before`, each launch follows one of its launches (the time then
  // includes the predecessor's).
  double TimePlan(const tvc::MlaVerifyPlan& plan, void* workspace, cudaStream_t stream, int replays,
                  const Predecessor* before = nullptr) const {
    return UsPerLaunch(stream, LaunchesPerGraph(copies_), replays, [&](int i) {
      if (before != nullptr) before->Launch(i, stream);
      Launch(plan, i, workspace, stream);
    });
  }

  // Launch i of a graph: the op on copy i of the rotation.
  void Launch(const tvc::MlaVerifyPlan& plan, int i, void* workspace, cudaStream_t stream) const {
    // The bench's workspace holds at least every plan's bytes (ensure_workspace in main).
    CheckStatus(tvc::MlaVerifyAttention(Params(i % copies_), MlaShape(), plan, workspace,
                                        plan.workspace_bytes, stream),
                "MlaVerifyAttention");
  }

  const Shape& shape() const { return shape_; }
  int copies() const { return copies_; }
  int64_t keys() const { return keys_; }
  __nv_bfloat16* cache() const { return cache_; }
  __nv_bfloat16* q() const { return q_; }
  uint64_t* masks() const { return masks_; }
  int32_t pages_per_seq() const { return pages_per_seq_; }

 private:
  Shape shape_;
  int64_t keys_ = 0;
  int32_t pages_per_seq_ = 0;
  int copies_ = 0;
  int32_t num_pages_ = 0;
  __nv_bfloat16* cache_ = nullptr;
  __nv_bfloat16* q_ = nullptr;
  __nv_bfloat16* out_ = nullptr;
  float* lse_ = nullptr;
  int32_t* page_tables_ = nullptr;
  int32_t* committed_ = nullptr;
  int32_t* offsets_ = nullptr;
  uint64_t* masks_ = nullptr;
};

// Masked softmax of one row of materialized scores (the cuBLAS reference): P in bf16.
__global__ void MaskedSoftmax(const float* scores, __nv_bfloat16* probs, const uint64_t* masks,
                              int64_t keys, int64_t committed, int heads, float scale) {
  __shared__ float reduce[32];
  const int row = blockIdx.x;
  const int node = row / heads;
  const float* s = scores + int64_t{row} * keys;
  auto visible = [&](int64_t k) {
    if (k < committed) return true;
    const int64_t j = k - committed;
    return ((masks[node * tv::kAncestorMaskWords + j / 64] >> (j % 64)) & 1) != 0;
  };
  float m = -INFINITY;
  for (int64_t k = threadIdx.x; k < keys; k += blockDim.x) {
    if (visible(k)) m = fmaxf(m, s[k] * scale);
  }
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = m;
  __syncthreads();
  m = reduce[0];
  for (int w = 1; w < blockDim.x / 32; ++w) m = fmaxf(m, reduce[w]);
  __syncthreads();
  float sum = 0;
  for (int64_t k = threadIdx.x; k < keys; k += blockDim.x) {
    sum += visible(k) ? expf(s[k] * scale - m) : 0.f;
  }
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = sum;
  __syncthreads();
  sum = 0;
  for (int w = 0; w < blockDim.x / 32; ++w) sum += reduce[w];
  const float inv = 1.f / sum;
  for (int64_t k = threadIdx.x; k < keys; k += blockDim.x) {
    probs[int64_t{row} * keys + k] =
        __float2bfloat16(visible(k) ? expf(s[k] * scale - m) * inv : 0.f);
  }
}

// cuBLAS attention at batch 1: S = Q K^T (fp32), masked softmax, O = P V. Microseconds, or -1
// when the materialized scores would not fit the budget.
double TimeCublasReference(const Workload& w, cublasHandle_t cublas, cudaStream_t stream) {
  const Shape& s = w.shape();
  const int64_t rows = int64_t{s.rows} * s.heads;
  const int64_t keys = w.keys();
  if (s.batch != 1 || rows * keys * 6 > (3ll << 30)) return -1;
  float* scores;
  __nv_bfloat16 *probs, *out;
  CHECK_CUDA(cudaMalloc(&scores, rows * keys * 4));
  CHECK_CUDA(cudaMalloc(&probs, rows * keys * 2));
  CHECK_CUDA(cudaMalloc(&out, rows * kLatent * 2));
  const float one = 1.f, zero = 0.f;
  const int copies = w.copies();
  const double us = UsPerLaunch(stream, LaunchesPerGraph(copies), 3, [&](int i) {
    const int c = i % copies;
    // Copy c's pages are contiguous: its KV is a [keys, 576] row-major matrix.
    const __nv_bfloat16* kv = w.cache() + int64_t{c} * w.pages_per_seq() * kPageSize * kDims;
    CHECK_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(keys),
                              static_cast<int>(rows), kDims, &one, kv, CUDA_R_16BF, kDims, w.q(),
                              CUDA_R_16BF, kDims, &zero, scores, CUDA_R_32F, static_cast<int>(keys),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    MaskedSoftmax<<<static_cast<unsigned>(rows), 256, 0, stream>>>(
        scores, probs, w.masks(), keys, s.context, s.heads, 1.f / std::sqrt(192.f));
    CHECK_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, kLatent, static_cast<int>(rows),
                              static_cast<int>(keys), &one, kv, CUDA_R_16BF, kDims, probs,
                              CUDA_R_16BF, static_cast<int>(keys), &zero, out, CUDA_R_16BF, kLatent,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  });
  CHECK_CUDA(cudaFree(scores));
  CHECK_CUDA(cudaFree(probs));
  CHECK_CUDA(cudaFree(out));
  return us;
}

// Eager launches of `plan` (after warm-up launches) with per-block timestamps, written as
// timeline-H-Q-L-B[-overlapped].csv: launch, block, sm, then start / first tile / last tile done /
// end (and the in-grid merge's points) in us from the first stamped launch's earliest block start.
// Plain: one stamped launch. Overlapped: two back to back with overlap_predecessor, so the second
// shows where a launch starts and streams while its predecessor finishes.
void WriteTimeline(const Workload& w, tvc::MlaVerifyPlan plan, void* workspace, cudaStream_t stream,
                   const std::string& out_dir, bool overlapped) {
  constexpr int kPerBlock = tvc::kMlaVerifyTimestampsPerBlock;
  const int launches = overlapped ? 2 : 1;
  const int64_t entries = int64_t{plan.blocks} * kPerBlock;
  plan.overlap_predecessor = overlapped;
  uint64_t* stamps;
  CHECK_CUDA(cudaMalloc(&stamps, entries * launches * 8));
  CHECK_CUDA(cudaMemsetAsync(stamps, 0, entries * launches * 8, stream));
  for (int i = 0; i < 3 + launches; ++i) {
    plan.timestamps = i < 3 ? nullptr : stamps + (i - 3) * entries;
    CheckStatus(tvc::MlaVerifyAttention(w.Params(i % w.copies()), w.MlaShape(), plan, workspace,
                                        plan.workspace_bytes, stream),
                i < 3 ? "warm-up" : "timed launch");
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint64_t> host(entries * launches);
  CHECK_CUDA(cudaMemcpy(host.data(), stamps, host.size() * 8, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(stamps));
  uint64_t t0 = UINT64_MAX;
  for (int64_t b = 0; b < plan.blocks; ++b) {
    if (host[b * kPerBlock] != 0) t0 = std::min(t0, host[b * kPerBlock]);
  }
  const Shape& s = w.shape();
  const std::string path = out_dir + "/timeline-" + std::to_string(s.heads) + "-" +
                           std::to_string(s.rows) + "-" + std::to_string(s.context) + "-" +
                           std::to_string(s.batch) + (overlapped ? "-overlapped" : "") + ".csv";
  std::ofstream csv(path);
  csv << "launch,block,sm,start_us,first_tile_us,last_tile_done_us,end_us,partial_stored_us,"
         "merge_released_us\n";
  auto rel = [&](uint64_t t) { return t == 0 ? -1.0 : (static_cast<double>(t) - t0) * 1e-3; };
  for (int launch = 0; launch < launches; ++launch) {
    for (int64_t b = 0; b < plan.blocks; ++b) {
      const uint64_t* e = &host[(launch * plan.blocks + b) * kPerBlock];
      csv << launch << "," << b << "," << e[4] << "," << rel(e[0]) << "," << rel(e[1]) << ","
          << rel(e[2]) << "," << rel(e[3]) << "," << rel(e[5]) << "," << rel(e[6]) << "\n";
    }
  }
}

struct Row {
  Shape shape;
  tvc::MlaVerifyPlan plan;
  double us = 0;
  double floor_us = 0;
  double bytes = 0;
  double flops = 0;
  double best_sweep_us = -1;
  int best_sweep_nsplit = 0;
  double chain_us = -1;        // a chain of the same size, alternated with the tree:
  double tree_paired_us = -1;  // the tree's time in those alternated replays
  double seed_us = -1;
  double cublas_us = -1;
  double other_kernel_us = -1;
  double mma_kernel_us = -1;    // the mma kernel forced (wgmma GPUs, batch 1)
  double merge_kernel_us = -1;  // plans that merge in the grid: the same with the merge kernel
  double overlap_us = -1;
  // TP8 batch-1 shapes: behind a Predecessor, the op's time on top of the predecessor's alone,
  // launched plainly and overlapped.
  double behind_us = -1;
  double behind_overlap_us = -1;
  std::string other_kernel_plan;
  nlohmann::json sweep = nlohmann::json::array();
};

std::string Fmt(const char* format, double v) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, v);
  return buffer;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir = ".";
  bool quick = false;
  std::vector<Shape> only;  // --only: just these shapes (profiling)
  bool timestamps = false;  // --timestamps: per-block timelines of eager launches per shape
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--timestamps")) {
      timestamps = true;
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      Shape s{};
      long long context = 0;
      if (std::sscanf(argv[++i], "%d,%d,%lld,%d", &s.heads, &s.rows, &context, &s.batch) != 4) {
        std::fprintf(stderr, "--only wants H,Q,L,B\n");
        return 2;
      }
      s.context = context;
      only.push_back(s);
    } else {
      std::fprintf(stderr, "usage: %s [--out DIR] [--quick] [--only H,Q,L,B]... [--timestamps]\n",
                   argv[0]);
      return 2;
    }
  }
  std::error_code created;
  std::filesystem::create_directories(out_dir, created);
  if (created) {
    std::fprintf(stderr, "cannot create --out %s: %s\n", out_dir.c_str(),
                 created.message().c_str());
    return 2;
  }
  absl::StatusOr<tvc::DeviceInfo> device = tvc::QueryDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "mla_verify_bench needs a GPU: %s\n",
                 std::string(device.status().message()).c_str());
    return 1;
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas;
  CHECK_CUBLAS(cublasCreate(&cublas));
  CHECK_CUBLAS(cublasSetStream(cublas, stream));
  void* cublas_workspace;
  CHECK_CUDA(cudaMalloc(&cublas_workspace, 64 << 20));
  CHECK_CUBLAS(cublasSetWorkspace(cublas, cublas_workspace, 64 << 20));

  const Ceilings ceilings = MeasureCeilings(stream, cublas);
  std::printf(
      "device %s, %d SMs: copy %.0f GB/s (cudaMemcpyAsync %.0f, copy kernel %.0f), bf16 GEMM "
      "%.0f TFLOP/s\n",
      device->name.c_str(), device->multiprocessors, ceilings.copy_bytes_per_s / 1e9,
      ceilings.memcpy_bytes_per_s / 1e9, ceilings.kernel_copy_bytes_per_s / 1e9,
      ceilings.tensor_flops_per_s / 1e12);

  const std::vector<LaunchProbe> probes =
      MeasureLaunchProbes(stream, device->multiprocessors, ceilings, {4096, 16384, 46000, 131072});
  for (const LaunchProbe& probe : probes) {
    const double floor_us = probe.floor_us;
    std::printf(
        "probe L=%6lld: floor %5.1f us, read %5.1f us (%4.1f%%), read + empty kernel %5.1f us "
        "(%4.1f%%), empty kernel %4.1f us; overlapped: read %5.1f us (%4.1f%%), read + empty "
        "kernel %5.1f us (%4.1f%%); TMA read %5.1f us (%4.1f%%)\n",
        static_cast<long long>(probe.context), floor_us, probe.read_us,
        100 * floor_us / probe.read_us, probe.read_then_empty_us,
        100 * floor_us / probe.read_then_empty_us, probe.empty_us, probe.read_overlapped_us,
        100 * floor_us / probe.read_overlapped_us, probe.read_then_empty_overlapped_us,
        100 * floor_us / probe.read_then_empty_overlapped_us, probe.tma_read_us,
        100 * floor_us / probe.tma_read_us);
  }

  std::vector<Shape> shapes;
  const std::vector<int> heads = quick ? std::vector<int>{8, 16} : std::vector<int>{8, 16, 64, 128};
  const std::vector<int> tree_rows =
      quick ? std::vector<int>{1, 9} : std::vector<int>{1, 9, 16, 32, 64};
  const std::vector<int64_t> contexts =
      quick ? std::vector<int64_t>{4096, 46000} : std::vector<int64_t>{4096, 16384, 46000, 131072};
  for (int h : heads) {
    for (int q : tree_rows) {
      for (int64_t l : contexts) shapes.push_back({h, q, l, 1});
      if (!quick) {
        for (int b : {8, 32}) shapes.push_back({h, q, 16384, b});
      }
    }
  }
  if (!only.empty()) shapes = only;
  auto sweep_shape = [](const Shape& s) {
    // Batch 1 in each regime, and one batch whose unsplit blocks fill half a wave.
    const bool batch_one =
        s.batch == 1 && (s.context == 16384 || s.context == 46000) &&
        ((s.heads == 8 && (s.rows == 1 || s.rows == 9)) || (s.heads == 16 && s.rows == 16) ||
         (s.heads == 64 && s.rows == 9) || (s.heads == 128 && s.rows == 1));
    return batch_one || (s.batch == 8 && s.heads == 64 && s.rows == 9);
  };
  auto chain_shape = [](const Shape& s) {
    return s.batch == 1 && s.rows >= 9 && s.heads <= 16 && s.context >= 16384;
  };

  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  auto ensure_workspace = [&](int64_t bytes) {
    if (bytes <= workspace_bytes) return;
    if (workspace) CHECK_CUDA(cudaFree(workspace));
    CHECK_CUDA(cudaMalloc(&workspace, bytes));
    CheckStatus(tvc::PrepareMlaVerifyWorkspace(workspace, bytes, stream), "workspace");
    workspace_bytes = bytes;
  };

  const Predecessor predecessor(device->multiprocessors);
  std::vector<Row> rows;
  uint32_t seed = 100;
  for (const Shape& shape : shapes) {
    Row row;
    row.shape = shape;
    Workload w(shape, seed++);
    absl::StatusOr<tvc::MlaVerifyPlan> plan = tvc::PlanMlaVerify(w.MlaShape(), *device, {});
    CheckStatus(plan.status(), "plan");
    row.plan = *plan;
    ensure_workspace(plan->workspace_bytes);
    const int replays = 15;
    row.us = w.TimePlan(*plan, workspace, stream, replays);
    {
      // The same plan launched to overlap its predecessor (here: the previous launch).
      tvc::MlaVerifyPlan overlapped = *plan;
      overlapped.overlap_predecessor = true;
      row.overlap_us = w.TimePlan(overlapped, workspace, stream, replays);
      if (shape.batch == 1 && shape.heads == 8 && (shape.rows == 1 || shape.rows == 9)) {
        // Behind the stand-in for the decode step's previous kernel: what the op adds to it.
        const double alone = predecessor.TimeAlone(LaunchesPerGraph(w.copies()), stream, replays);
        row.behind_us = w.TimePlan(*plan, workspace, stream, replays, &predecessor) - alone;
        row.behind_overlap_us =
            w.TimePlan(overlapped, workspace, stream, replays, &predecessor) - alone;
      }
    }
    row.bytes = double(shape.batch) * shape.context * kDims * 2;
    row.flops =
        double(shape.batch) * 2.0 * shape.rows * shape.heads * shape.context * (kDims + kLatent);
    row.floor_us =
        std::max(row.bytes / ceilings.copy_bytes_per_s, row.flops / ceilings.tensor_flops_per_s) *
        1e6;

    if (plan->merge_in_grid) {
      absl::StatusOr<tvc::MlaVerifyPlan> separate = tvc::PlanMlaVerify(
          w.MlaShape(), *device, {.merge = tvc::MlaVerifyOptions::Merge::kSeparateKernel});
      CheckStatus(separate.status(), "plan");
      row.merge_kernel_us = w.TimePlan(*separate, workspace, stream, replays);
    }
    if (timestamps && row.plan.kernel != tvc::MlaVerifyKernel::kSimt) {
      WriteTimeline(w, *plan, workspace, stream, out_dir, /*overlapped=*/false);
      WriteTimeline(w, *plan, workspace, stream, out_dir, /*overlapped=*/true);
    }
    if (sweep_shape(shape)) {
      for (int nsplit : {1, 2, 3, 4, 5, 6, 8, 11, 16, 22, 33, 44, 66, 88, 132, 176, 256}) {
        absl::StatusOr<tvc::MlaVerifyPlan> forced =
            tvc::PlanMlaVerify(w.MlaShape(), *device, {.forced_nsplit = nsplit});
        CheckStatus(forced.status(), "plan");
        ensure_workspace(forced->workspace_bytes);
        const double us = w.TimePlan(*forced, workspace, stream, 7);
        row.sweep.push_back({{"nsplit", nsplit}, {"us", us}});
        if (row.best_sweep_us < 0 || us < row.best_sweep_us) {
          row.best_sweep_us = us;
          row.best_sweep_nsplit = nsplit;
        }
      }
    }
    const bool wgmma_plan = row.plan.kernel == tvc::MlaVerifyKernel::kWgmmaNarrow ||
                            row.plan.kernel == tvc::MlaVerifyKernel::kWgmmaWide;
    // The other wgmma kernel on the same inputs: what the planner's narrow/wide rule gives up.
    if (shape.batch == 1 && shape.context != 131072 && wgmma_plan) {
      const tvc::MlaVerifyKernel other = row.plan.kernel == tvc::MlaVerifyKernel::kWgmmaWide
                                             ? tvc::MlaVerifyKernel::kWgmmaNarrow
                                             : tvc::MlaVerifyKernel::kWgmmaWide;
      absl::StatusOr<tvc::MlaVerifyPlan> alt =
          tvc::PlanMlaVerify(w.MlaShape(), *device, {.kernel = other});
      CheckStatus(alt.status(), "plan");
      ensure_workspace(alt->workspace_bytes);
      row.other_kernel_us = w.TimePlan(*alt, workspace, stream, 7);
      row.other_kernel_plan = alt->ToString();
    }
    // The mma.sync kernel (the choice of GPUs without wgmma) on the same inputs, at batch 1.
    if (shape.batch == 1 && wgmma_plan) {
      absl::StatusOr<tvc::MlaVerifyPlan> mma =
          tvc::PlanMlaVerify(w.MlaShape(), *device, {.kernel = tvc::MlaVerifyKernel::kMma});
      CheckStatus(mma.status(), "plan");
      ensure_workspace(mma->workspace_bytes);
      row.mma_kernel_us = w.TimePlan(*mma, workspace, stream, 7);
    }
    if (chain_shape(shape)) {
      Shape chain = shape;
      chain.chain = true;
      Workload wc(chain, seed++);
      std::tie(row.tree_paired_us, row.chain_us) = UsPerLaunchAlternated(
          stream, LaunchesPerGraph(w.copies()), replays,
          [&](int i) { w.Launch(*plan, i, workspace, stream); },
          [&](int i) { wc.Launch(*plan, i, workspace, stream); });
    }
    const double work = double(shape.batch) * shape.rows * shape.heads * shape.context;
    if (work <= 2e7) {
      absl::StatusOr<tvc::MlaVerifyPlan> seed_plan = tvc::PlanMlaVerify(
          w.MlaShape(), *device, {.forced_nsplit = 16, .kernel = tvc::MlaVerifyKernel::kSimt});
      CheckStatus(seed_plan.status(), "plan");
      ensure_workspace(seed_plan->workspace_bytes);
      row.seed_us = w.TimePlan(*seed_plan, workspace, stream, 3);
    }
    row.cublas_us = TimeCublasReference(w, cublas, stream);
    std::printf(
        "H=%3d Q=%2d L=%6lld B=%2d  %9.1f us  floor %8.1f us  %5.1f%%  overlapped %9.1f us "
        "%5.1f%%  other %7.1f us  merge kernel %7.1f us  %s\n",
        shape.heads, shape.rows, static_cast<long long>(shape.context), shape.batch, row.us,
        row.floor_us, 100 * row.floor_us / row.us, row.overlap_us,
        100 * row.floor_us / row.overlap_us, row.other_kernel_us, row.merge_kernel_us,
        row.plan.ToString().c_str());
    if (row.behind_us > 0) {
      std::printf(
          "    behind a 16 MB predecessor: adds %.1f us (%.1f%%), overlapped %.1f us (%.1f%%)\n",
          row.behind_us, 100 * row.floor_us / row.behind_us, row.behind_overlap_us,
          100 * row.floor_us / row.behind_overlap_us);
    }
    std::fflush(stdout);
    rows.push_back(std::move(row));
  }

  nlohmann::json json;
  json["device"] = device->name;
  json["multiprocessors"] = device->multiprocessors;
  json["copy_bytes_per_s"] = ceilings.copy_bytes_per_s;
  json["memcpy_bytes_per_s"] = ceilings.memcpy_bytes_per_s;
  json["kernel_copy_bytes_per_s"] = ceilings.kernel_copy_bytes_per_s;
  json["tensor_flops_per_s"] = ceilings.tensor_flops_per_s;
  json["rows"] = nlohmann::json::array();
  std::string md =
      "| H | Q | L | B | us | floor us | % roofline | overlapped us | overlapped % | GB/s | "
      "TFLOP/s | kernel | rows/tile | NSPLIT | waves | merge | merge-kernel us | best swept "
      "NSPLIT (us) | other wgmma kernel us | mma kernel us | tree vs chain % | seed-style us | "
      "cuBLAS us "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
      "---|\n";
  for (const Row& r : rows) {
    nlohmann::json j = {{"heads", r.shape.heads},
                        {"rows", r.shape.rows},
                        {"context", r.shape.context},
                        {"batch", r.shape.batch},
                        {"us", r.us},
                        {"floor_us", r.floor_us},
                        {"roofline_fraction", r.floor_us / r.us},
                        {"gbps", r.bytes / r.us / 1e3},
                        {"tflops", r.flops / r.us / 1e6},
                        {"plan", r.plan.ToString()},
                        {"nsplit", r.plan.nsplit},
                        {"waves", r.plan.waves},
                        {"row_tile", r.plan.row_tile},
                        {"sweep", r.sweep},
                        {"chain_us", r.chain_us},
                        {"tree_paired_us", r.tree_paired_us},
                        {"seed_style_us", r.seed_us},
                        {"cublas_us", r.cublas_us},
                        {"other_kernel_us", r.other_kernel_us},
                        {"mma_kernel_us", r.mma_kernel_us},
                        {"merge_kernel_us", r.merge_kernel_us},
                        {"overlap_us", r.overlap_us},
                        {"overlap_roofline_fraction", r.floor_us / r.overlap_us},
                        {"behind_predecessor_us", r.behind_us},
                        {"behind_predecessor_overlap_us", r.behind_overlap_us},
                        {"other_kernel_plan", r.other_kernel_plan}};
    json["rows"].push_back(j);
    md += "| " + std::to_string(r.shape.heads) + " | " + std::to_string(r.shape.rows) + " | " +
          std::to_string(r.shape.context) + " | " + std::to_string(r.shape.batch) + " | " +
          Fmt("%.1f", r.us) + " | " + Fmt("%.1f", r.floor_us) + " | " +
          Fmt("%.1f", 100 * r.floor_us / r.us) + " | " + Fmt("%.1f", r.overlap_us) + " | " +
          Fmt("%.1f", 100 * r.floor_us / r.overlap_us) + " | " + Fmt("%.0f", r.bytes / r.us / 1e3) +
          " | " + Fmt("%.0f", r.flops / r.us / 1e6) + " | " +
          tvc::MlaVerifyKernelName(r.plan.kernel) + " | " + std::to_string(r.plan.row_tile) +
          " | " + std::to_string(r.plan.nsplit) + " | " + Fmt("%.2f", r.plan.waves) + " | " +
          (r.plan.nsplit == 1 ? "" : (r.plan.merge_in_grid ? "grid" : "kernel")) + " | " +
          (r.merge_kernel_us > 0 ? Fmt("%.1f", r.merge_kernel_us) : "") + " | " +
          (r.best_sweep_us > 0
               ? std::to_string(r.best_sweep_nsplit) + " (" + Fmt("%.1f", r.best_sweep_us) + ")"
               : std::string("")) +
          " | " + (r.other_kernel_us > 0 ? Fmt("%.1f", r.other_kernel_us) : "") + " | " +
          (r.mma_kernel_us > 0 ? Fmt("%.1f", r.mma_kernel_us) : "") + " | " +
          (r.chain_us > 0 ? Fmt("%+.1f", 100 * (r.tree_paired_us / r.chain_us - 1)) : "") + " | " +
          (r.seed_us > 0 ? Fmt("%.1f", r.seed_us) : "") + " | " +
          (r.cublas_us > 0 ? Fmt("%.1f", r.cublas_us) : "") + " |\n";
  }
  md +=
      "\nBehind a predecessor (TP8 shapes, batch 1): each launch follows a stand-in for the "
      "decode step's previous kernel, a streaming read of 16 MB rotated past the L2 (about a TP8 "
      "rank's query-path weights), which lets the op start at once; 'adds' is the graph's time "
      "per launch minus the predecessor's alone, for the op launched plainly and overlapped.\n\n"
      "| H | Q | L | floor us | adds us | % of floor | overlapped adds us | % of floor |\n"
      "|---|---|---|---|---|---|---|---|\n";
  for (const Row& r : rows) {
    if (r.behind_us <= 0) continue;
    md += "| " + std::to_string(r.shape.heads) + " | " + std::to_string(r.shape.rows) + " | " +
          std::to_string(r.shape.context) + " | " + Fmt("%.1f", r.floor_us) + " | " +
          Fmt("%.1f", r.behind_us) + " | " + Fmt("%.1f", 100 * r.floor_us / r.behind_us) + " | " +
          Fmt("%.1f", r.behind_overlap_us) + " | " +
          Fmt("%.1f", 100 * r.floor_us / r.behind_overlap_us) + " |\n";
  }
  md +=
      "\nWhat a launch costs in this harness (batch 1, the same graphs and KV rotation): the "
      "streaming probe reads the KV bytes with 16-byte loads and does nothing else. "
      "'Overlapped': every kernel a programmatic dependent launch, as with overlap_predecessor "
      "(the probe reads while its predecessor finishes and waits for it before its store; the "
      "empty kernel waits for the probe). 'TMA read': the wgmma kernels' load path alone (a block "
      "per multiprocessor, 64-key tiles in nine 64-dim TMA boxes, two 72 KB stages), launched "
      "plainly.\n\n"
      "| L | floor us | read us | % of floor | read + empty kernel us | % of floor | empty kernel "
      "us | overlapped read us | % of floor | overlapped read + empty kernel us | % of floor "
      "| TMA read us | % of floor |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  json["launch_probes"] = nlohmann::json::array();
  for (const LaunchProbe& probe : probes) {
    const double floor_us = probe.floor_us;
    json["launch_probes"].push_back(
        {{"context", probe.context},
         {"floor_us", floor_us},
         {"read_us", probe.read_us},
         {"read_then_empty_us", probe.read_then_empty_us},
         {"empty_us", probe.empty_us},
         {"read_overlapped_us", probe.read_overlapped_us},
         {"read_then_empty_overlapped_us", probe.read_then_empty_overlapped_us},
         {"tma_read_us", probe.tma_read_us}});
    md += "| " + std::to_string(probe.context) + " | " + Fmt("%.1f", floor_us) + " | " +
          Fmt("%.1f", probe.read_us) + " | " + Fmt("%.1f", 100 * floor_us / probe.read_us) + " | " +
          Fmt("%.1f", probe.read_then_empty_us) + " | " +
          Fmt("%.1f", 100 * floor_us / probe.read_then_empty_us) + " | " +
          Fmt("%.1f", probe.empty_us) + " | " + Fmt("%.1f", probe.read_overlapped_us) + " | " +
          Fmt("%.1f", 100 * floor_us / probe.read_overlapped_us) + " | " +
          Fmt("%.1f", probe.read_then_empty_overlapped_us) + " | " +
          Fmt("%.1f", 100 * floor_us / probe.read_then_empty_overlapped_us) + " | " +
          Fmt("%.1f", probe.tma_read_us) + " | " + Fmt("%.1f", 100 * floor_us / probe.tma_read_us) +
          " |\n";
  }
  std::ofstream(out_dir + "/mla_verify.json") << json.dump(1) << "\n";
  std::ofstream(out_dir + "/mla_verify.md") << md;
  std::printf("copy %.0f GB/s, GEMM %.0f TFLOP/s\n%s", ceilings.copy_bytes_per_s / 1e9,
              ceilings.tensor_flops_per_s / 1e12, md.c_str());
  if (workspace) CHECK_CUDA(cudaFree(workspace));
  CHECK_CUDA(cudaFree(cublas_workspace));
  cublasDestroy(cublas);
  return 0;
}
