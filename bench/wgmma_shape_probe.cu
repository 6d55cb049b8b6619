// How long the tensor pipe takes per wgmma, by shape: the cost model behind the MLA kernels' tile
// designs (bench/NOTES.md, step 36). One block per multiprocessor runs one or two warpgroups; each
// issues m64nNk16 bf16 wgmmas with both operands in shared memory (A K-major, as the keys are read
// for S^T = K Q^T, or MN-major, as V^T is read for O^T = V^T P^T), into one accumulator (every
// wgmma depends on the one before) or four (independent chains), 16 per commit group. Prints the
// cycles per wgmma on one multiprocessor and the fraction of the dense bf16 rate (1024 FLOP per
// cycle per tensor core, 4096 per multiprocessor on sm_90). Operand values do not matter: shared
// memory is zeroed.
//
//   wgmma_shape_probe [--out DIR]     (sm_90a only; writes DIR/wgmma_shape_probe.md)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "probe_common.h"
#include "sm90_primitives.cuh"
#include "sm90_wgmma_wide.cuh"

namespace {

namespace sm90 = treeverify::kernels::cuda::sm90;

constexpr int kSteps = 16;       // wgmmas per commit group
constexpr int kIterations = 64;  // commit groups per warpgroup
constexpr int kSmemBytes = 2 * 32768 + 1024;

// One m64nNk16 with A at k-step k of a 64-wide chunk (K-major: 32 bytes apart; MN-major: 16
// contraction rows of 128 bytes apart), B K-major with N rows.
template <int kN, int kTransposeA>
__device__ void Issue(float (&d)[kN / 2], const uint8_t* a_base, const uint8_t* b_base, int k) {
  const uint64_t a = kTransposeA ? sm90::MakeSmemDescriptor(a_base + k * 16 * 128, 64 * 128, 1024)
                                 : sm90::MakeSmemDescriptor(a_base + k * 32, 16, 1024);
  const uint64_t b = sm90::MakeSmemDescriptor(b_base + k * 32, 16, 1024);
  if constexpr (kN == 64) {
    sm90::WgmmaM64N64<kTransposeA, 0>::Run(d, a, b, 1);
  } else if constexpr (kN == 256) {
    sm90::WgmmaM64N256<kTransposeA, 0>::Run(d, a, b, 1);
  } else {
    sm90::Wgmma<kN, kTransposeA>::Run(d, a, b, 1);
  }
}

template <int kN, int kTransposeA, int kChains>
__global__ void __launch_bounds__(256, 1) ProbeKernel(uint64_t* cycles) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  for (int i = threadIdx.x; i < 2 * 32768 / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  }
  sm90::FenceProxyAsync();
  __syncthreads();
  const uint8_t* a_base = smem;          // 64 rows (or 64 contraction rows) x 128 bytes, and more
  const uint8_t* b_base = smem + 32768;  // N rows x 128 bytes
  float d[kChains][kN / 2];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) d[c][i] = 0.f;
  }
  const uint64_t start = clock64();
  for (int it = 0; it < kIterations; ++it) {
    sm90::WgmmaFence();
#pragma unroll
    for (int s = 0; s < kSteps; ++s) Issue<kN, kTransposeA>(d[s % kChains], a_base, b_base, s % 4);
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
#pragma unroll
    for (int c = 0; c < kChains; ++c) sm90::FenceRegisters(d[c]);
  }
  const uint64_t end = clock64();
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) sum += d[c][0];
  if (threadIdx.x % 128 == 0) {
    const int wg = threadIdx.x / 128;
    cycles[(blockIdx.x * 2 + wg) * 2] = start;
    cycles[(blockIdx.x * 2 + wg) * 2 + 1] = end + (sum != 0.f ? 1 : 0);  // keeps d alive
  }
#else
  __trap();
#endif
}

struct Result {
  int n;
  bool transpose_a;
  int chains;
  int warpgroups;
  double cycles_per_wgmma;  // on one multiprocessor, all its warpgroups together
};

template <int kN, int kTransposeA, int kChains>
Result Measure(int warpgroups, int multiprocessors) {
  auto kernel = ProbeKernel<kN, kTransposeA, kChains>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  uint64_t* cycles = nullptr;
  cudaMalloc(&cycles, multiprocessors * 4 * sizeof(uint64_t));
  kernel<<<multiprocessors, 128 * warpgroups, kSmemBytes>>>(cycles);  // warm-up
  kernel<<<multiprocessors, 128 * warpgroups, kSmemBytes>>>(cycles);
  std::vector<uint64_t> host(multiprocessors * 4);
  cudaMemcpy(host.data(), cycles, host.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost);
  cudaFree(cycles);
  if (cudaGetLastError() != cudaSuccess) return {kN, kTransposeA != 0, kChains, warpgroups, -1};
  // Median over multiprocessors of (last end - first start) on that multiprocessor.
  std::vector<double> spans;
  for (int b = 0; b < multiprocessors; ++b) {
    uint64_t first = host[b * 4], last = host[b * 4 + 1];
    if (warpgroups == 2) {
      first = std::min(first, host[b * 4 + 2]);
      last = std::max(last, host[b * 4 + 3]);
    }
    spans.push_back(static_cast<double>(last - first));
  }
  std::sort(spans.begin(), spans.end());
  const double wgmmas = static_cast<double>(warpgroups) * kIterations * kSteps;
  return {kN, kTransposeA != 0, kChains, warpgroups, spans[spans.size() / 2] / wgmmas};
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<std::string> out_argument = treeverify::bench::OutDirArgument(argc, argv);
  if (!out_argument) return 2;
  const std::string& out_dir = *out_argument;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr, "wgmma_shape_probe: needs an sm_90 GPU\n");
    return 1;
  }
  const int sms = prop.multiProcessorCount;
  std::vector<Result> results;
  for (int wgs : {1, 2}) {
    results.push_back(Measure<8, 0, 1>(wgs, sms));
    results.push_back(Measure<8, 0, 4>(wgs, sms));
    results.push_back(Measure<8, 1, 1>(wgs, sms));
    results.push_back(Measure<8, 1, 4>(wgs, sms));
    results.push_back(Measure<16, 0, 1>(wgs, sms));
    results.push_back(Measure<16, 0, 4>(wgs, sms));
    results.push_back(Measure<24, 0, 1>(wgs, sms));
    results.push_back(Measure<32, 0, 1>(wgs, sms));
    results.push_back(Measure<32, 0, 4>(wgs, sms));
    results.push_back(Measure<32, 1, 1>(wgs, sms));
    results.push_back(Measure<64, 0, 1>(wgs, sms));
    results.push_back(Measure<64, 0, 2>(wgs, sms));
    results.push_back(Measure<64, 1, 1>(wgs, sms));
    results.push_back(Measure<256, 0, 1>(wgs, sms));
    results.push_back(Measure<256, 1, 1>(wgs, sms));
  }
  std::string table =
      "# wgmma cost by shape (bench/wgmma_shape_probe)\n\n"
      "Device: " +
      std::string(prop.name) + ", " + std::to_string(sms) +
      " SMs. Both operands in shared memory, 128-byte swizzle, B K-major; 16 wgmmas per commit "
      "group, 64 groups per warpgroup; one block per SM; cycles per wgmma on one SM (median SM), "
      "all its warpgroups together; FLOP fraction against 4096 bf16 FLOP per cycle per SM.\n\n"
      "| N | A | accumulator chains | warpgroups | cycles per wgmma | cycles per wgmma at full "
      "rate | fraction of the rate |\n|---|---|---|---|---|---|---|\n";
  for (const Result& r : results) {
    const double ideal = 2.0 * 64 * r.n * 16 / 4096.0;
    char line[256];
    std::snprintf(line, sizeof(line), "| %d | %s | %d | %d | %.1f | %.1f | %.2f |\n", r.n,
                  r.transpose_a ? "MN-major" : "K-major", r.chains, r.warpgroups,
                  r.cycles_per_wgmma, ideal, ideal / r.cycles_per_wgmma);
    table += line;
  }
  std::fputs(table.c_str(), stdout);
  std::ofstream(out_dir + "/wgmma_shape_probe.md") << table;
  return 0;
}
