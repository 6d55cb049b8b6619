// Dense GEMMs on the GPU through cuBLASLt, with the CPU backend's params struct: bf16 x and
// weight, fp32 accumulation, bf16 or fp32 y; batch > 1 runs the strided batch (the absorbed MLA
// projections, one product per head).
//
// The algorithm for a shape (m, n, k, strides, batch, output type, pointer alignments) is chosen
// once, by cuBLASLt's heuristic, and kept: every later call of that shape, eager or captured in
// a CUDA graph, runs the same algorithm, so a graph replays the bytes an eager launch computes.
// cuBLASLt's split-K reductions go through the workspace, never atomics. Products of at most 16
// rows that resident_gemm.h takes run there instead (a programmatic dependent that loads its
// weights before its input exists), unless the runner was created without it. FP8 block-scaled
// weights (block_fp8.h) go the same two ways.
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<GemmRunner> gemm, GemmRunner::Create());
//   TV_RETURN_IF_ERROR(gemm->Run({.x = x, .weight = w, .y = y, .m = 16, .n = 1536, .k = 7168},
//                                stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/cuda/block_fp8.h"
#include "treeverify/kernels/cuda/resident_gemm.h"
#include "treeverify/kernels/gemm.h"

namespace treeverify::kernels::cuda {

class GemmRunner {
 public:
  // Allocates the workspace on the current device. Every Run uses it, so Runs on different
  // streams must be ordered (the forward's side stream has a runner of its own).
  // `resident_products`: route the products ResidentGemm takes to it (on the current device).
  static absl::StatusOr<std::unique_ptr<GemmRunner>> Create(int64_t workspace_bytes = 32 << 20,
                                                            bool resident_products = true);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  absl::Status Run(const GemmParamsOf<Bf16, Bf16, Bf16>& params, cudaStream_t stream);
  absl::Status Run(const GemmParamsOf<Bf16, Bf16, float>& params, cudaStream_t stream);

  // FP8 block-scaled weights: the products ResidentGemm takes stream the bytes; others are
  // dequantized into the runner's scratch first and run as bf16, which needs ReserveDequantized
  // of at least their batch * n * k (a FAILED_PRECONDITION says so otherwise).
  absl::Status Run(const BlockFp8GemmParamsOf<Bf16>& params, cudaStream_t stream);
  absl::Status Run(const BlockFp8GemmParamsOf<float>& params, cudaStream_t stream);

  // Scratch for dequantized FP8 weights of up to `elements` bf16 values. It allocates (after
  // synchronizing the device where it grows): not while a stream capture is under way.
  absl::Status ReserveDequantized(int64_t elements);

  // Shapes planned so far (each holds its descriptors and chosen algorithm).
  int64_t planned_shapes() const;

 private:
  struct Plan;
  // m, n, k, x/weight/y strides, batch, batch strides, fp32 output, x/weight/y alignment.
  using ShapeKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, bool, int, int, int>;
  GemmRunner(void* handle, void* workspace, int64_t workspace_bytes, ResidentGemmDevice device,
             ResidentGemmScratch scratch);
  template <typename Output>
  absl::Status RunImpl(const GemmParamsOf<Bf16, Bf16, Output>& params, cudaStream_t stream);
  template <typename Output>
  absl::Status RunFp8(const BlockFp8GemmParamsOf<Output>& params, cudaStream_t stream);
  absl::StatusOr<const Plan*> PlanFor(const ShapeKey& key);

  void* handle_;  // cublasLtHandle_t, kept opaque so this header needs no cuBLAS include
  void* workspace_;
  int64_t workspace_bytes_;
  // The current device's at creation, for ResidentGemm's plans (off: all on cuBLASLt).
  ResidentGemmDevice resident_device_;
  ResidentGemmScratch resident_scratch_;  // split reductions' sums and counters
  Bf16* dequantized_ = nullptr;           // ReserveDequantized's
  int64_t dequantized_elements_ = 0;
  mutable std::mutex mutex_;
  std::map<ShapeKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace treeverify::kernels::cuda
