// How far cuBLASLt's first heuristic choice is from its best candidate, for the dense products of
// one TP8 rank of Kimi-K2 at verify sizes (bench/NOTES.md, step 95). For each shape (y[m, n] =
// x[m, k] . W[n, k]^T, bf16 in, fp32 accumulate, bf16 or fp32 out, as GemmRunner asks) it takes
// up to 32 heuristic candidates and times each cold: the L2 is flushed (a 256 MB read,
// l2_flush.cuh) before every launch, since a verify step reads each weight once. Prints per shape
// the weight's bytes, the first candidate's and the fastest candidate's median time, their
// bandwidths and the floor (bytes / measured copy bandwidth); beside them the first candidate
// warm, its weight left in the L2 by the launch before: what a product whose weights were
// prefetched into the L2 would take (bench/NOTES.md, step 110).
//
//   gemm_algo_probe [--out DIR]     (writes DIR/gemm_algo_probe.md)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "l2_flush.cuh"
#include "probe_common.h"

namespace {

// Holds the stream for about `ns` nanoseconds.
__global__ void SpinKernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

#define CHECK_LT(expr)                                                                          \
  do {                                                                                          \
    const cublasStatus_t s_ = (expr);                                                           \
    Check(s_ == CUBLAS_STATUS_SUCCESS, __FILE__, __LINE__, #expr, cublasLtGetStatusString(s_)); \
  } while (0)

struct Shape {
  const char* name;
  int64_t m, n, k;
  bool float_output;
};

constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;
constexpr int kRepeats = 7;
constexpr int kMaxCandidates = 32;

using treeverify::bench::Check;
using treeverify::bench::Median;

}  // namespace

int main(int argc, char** argv) {
  const std::optional<std::string> out_argument = treeverify::bench::OutDirArgument(argc, argv);
  if (!out_argument) return 2;
  const std::string& out_dir = *out_argument;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasLtHandle_t handle;
  CHECK_LT(cublasLtCreate(&handle));
  const treeverify::bench::L2Flusher flusher;
  Check(flusher.ok(), __FILE__, __LINE__, "L2Flusher", "no memory for the flush buffer");
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, kWorkspaceBytes));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));

  // The copy bandwidth the floor is held against: a device-to-device copy of 1 GB.
  double copy_bytes_per_s = 0;
  {
    const int64_t bytes = int64_t{1} << 30;
    void *a, *b;
    CHECK_CUDA(cudaMalloc(&a, bytes));
    CHECK_CUDA(cudaMalloc(&b, bytes));
    std::vector<double> times;
    for (int r = 0; r < 5; ++r) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      times.push_back(ms * 1e-3);
    }
    copy_bytes_per_s = 2.0 * bytes / Median(times);  // read + write
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
  }

  // One TP8 rank of Kimi-K2 (hidden 7168, 8 heads, q_lora 1536, kv row 576, 384 experts, the
  // shared expert's 2048 / 8 columns, vocab 163840 / 8), with the forward's output types.
  const Shape shapes[] = {
      {"q_a", 16, 1536, 7168, true},           {"kv_a", 16, 576, 7168, true},
      {"q_a + kv_a", 16, 2112, 7168, true},    {"q_b", 16, 1536, 1536, false},
      {"o_proj", 16, 7168, 1024, true},        {"router", 16, 384, 7168, true},
      {"shared gate/up", 16, 512, 7168, true}, {"shared down", 16, 7168, 256, true},
      {"lm_head", 16, 20480, 7168, true},      {"q_a", 64, 1536, 7168, true},
      {"o_proj", 64, 7168, 1024, true},        {"q_a", 1, 1536, 7168, true},
      {"o_proj", 1, 7168, 1024, true},
  };
  std::string table =
      "| shape | m | n | k | MB | candidates | first us | first TB/s | best us | best TB/s | best "
      "is # | floor us | first / best | first warm us |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::printf("copy bandwidth %.0f GB/s\n", copy_bytes_per_s / 1e9);
  for (const Shape& s : shapes) {
    const cudaDataType_t out_type = s.float_output ? CUDA_R_32F : CUDA_R_16BF;
    const int64_t out_size = s.float_output ? 4 : 2;
    void *x, *w, *y;
    CHECK_CUDA(cudaMalloc(&x, s.m * s.k * 2));
    CHECK_CUDA(cudaMalloc(&w, s.n * s.k * 2));
    CHECK_CUDA(cudaMalloc(&y, s.m * s.n * out_size));
    CHECK_CUDA(cudaMemset(x, 0, s.m * s.k * 2));
    CHECK_CUDA(cudaMemset(w, 0, s.n * s.k * 2));
    cublasLtMatmulDesc_t op;
    CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    cublasLtMatrixLayout_t a, b, d;
    CHECK_LT(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, s.k, s.n, s.k));
    CHECK_LT(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, s.k, s.m, s.k));
    CHECK_LT(cublasLtMatrixLayoutCreate(&d, out_type, s.n, s.m, s.n));
    cublasLtMatmulPreference_t preference;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&preference));
    const uint64_t workspace_bytes = kWorkspaceBytes;
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(preference,
                                                  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace_bytes, sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t results[kMaxCandidates];
    int found = 0;
    CHECK_LT(cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, preference, kMaxCandidates,
                                            results, &found));
    const float alpha = 1.0f, beta = 0.0f;
    std::vector<double> medians;
    for (int c = 0; c < found; ++c) {
      std::vector<double> times;
      bool failed = false;
      for (int r = 0; r < kRepeats && !failed; ++r) {
        flusher.Flush(stream);
        CHECK_CUDA(cudaEventRecord(start, stream));
        failed = cublasLtMatmul(handle, op, &alpha, w, a, x, b, &beta, y, d, y, d, &results[c].algo,
                                workspace, kWorkspaceBytes, stream) != CUBLAS_STATUS_SUCCESS;
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms * 1e3);
      }
      medians.push_back(failed ? 1e30 : Median(times));
    }
    const int best =
        static_cast<int>(std::min_element(medians.begin(), medians.end()) - medians.begin());
    // The first candidate again, warm: the same product just before the timed one brings the
    // weight (and x) into the L2 where they fit (the L2 is 50 MB; lm_head's 294 MB is not). A
    // spin first keeps the GPU busy while both are queued, as the cold runs' flush does: without
    // it the host's time to enqueue the timed product falls inside the timed window.
    std::vector<double> warm_times;
    for (int r = 0; r < kRepeats; ++r) {
      SpinKernel<<<1, 1, 0, stream>>>(100'000);
      CHECK_CUDA(cudaGetLastError());
      CHECK_LT(cublasLtMatmul(handle, op, &alpha, w, a, x, b, &beta, y, d, y, d, &results[0].algo,
                              workspace, kWorkspaceBytes, stream));
      CHECK_CUDA(cudaEventRecord(start, stream));
      CHECK_LT(cublasLtMatmul(handle, op, &alpha, w, a, x, b, &beta, y, d, y, d, &results[0].algo,
                              workspace, kWorkspaceBytes, stream));
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      warm_times.push_back(ms * 1e3);
    }
    const double warm_us = Median(warm_times);
    const double bytes = static_cast<double>(s.n * s.k * 2 + s.m * s.k * 2 + s.m * s.n * out_size);
    const double floor_us = bytes / copy_bytes_per_s * 1e6;
    char line[512];
    std::snprintf(line, sizeof line,
                  "| %s | %lld | %lld | %lld | %.1f | %d | %.1f | %.2f | %.1f | %.2f | %d | %.1f | "
                  "%.2f | %.1f |\n",
                  s.name, static_cast<long long>(s.m), static_cast<long long>(s.n),
                  static_cast<long long>(s.k), bytes / 1e6, found, medians[0],
                  bytes / medians[0] / 1e6, medians[best], bytes / medians[best] / 1e6, best,
                  floor_us, medians[0] / medians[best], warm_us);
    std::printf("%s", line);
    table += line;
    cublasLtMatmulPreferenceDestroy(preference);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(d);
    cublasLtMatmulDescDestroy(op);
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(w));
    CHECK_CUDA(cudaFree(y));
  }
  std::ofstream(out_dir + "/gemm_algo_probe.md")
      << "copy bandwidth " << copy_bytes_per_s / 1e9 << " GB/s; times are medians of " << kRepeats
      << " cold launches (L2 flushed), event-timed\n\n"
      << table;
  return 0;
}
