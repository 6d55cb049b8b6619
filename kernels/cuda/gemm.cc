// cuBLASLt GEMMs. y[m, n] = x[m, k] . weight[n, k]^T in row-major terms is, in cuBLAS's
// column-major terms, D (n x m, ld y_stride) = op(A) . B with A = the weight stored k x n
// (ld weight_stride) and op = transpose, B = x stored k x m (ld x_stride).
//
// Roofline at verify sizes (m <= 256): the weight dominates the bytes (n * k * 2), so a GEMM's
// floor is n * k * 2 / the copy bandwidth; rank_step_bench measures them against it.
#include "treeverify/kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/cuda/cublas_status.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/resident_gemm.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {

struct GemmRunner::Plan {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
  ~Plan() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (operation != nullptr) cublasLtMatmulDescDestroy(operation);
  }
};

namespace {

// The largest power of two (at most 256) that divides the address: cuBLASLt picks algorithms by
// the alignment it is promised, and its default promise is 256 bytes.
int AlignmentOf(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

absl::Status SetBatch(cublasLtMatrixLayout_t layout, int32_t batch, int64_t stride) {
  if (batch == 1) return absl::OkStatus();
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  return absl::OkStatus();
}

// Sizes cuBLASLt takes, strides that hold the rows, and arrays where there is work.
template <typename Weight, typename Output>
absl::Status CheckProduct(const GemmParamsOf<Bf16, Weight, Output>& p) {
  const int64_t x_stride = p.x_stride ? p.x_stride : p.k;
  const int64_t w_stride = p.weight_stride ? p.weight_stride : p.k;
  const int64_t y_stride = p.y_stride ? p.y_stride : p.n;
  constexpr int64_t kMaxDim = 0x7fffffff;
  if (p.m < 0 || p.n <= 0 || p.k <= 0 || p.m > kMaxDim || p.n > kMaxDim || p.k > kMaxDim ||
      p.batch < 1 || p.batch > kMaxDim || x_stride < p.k || w_stride < p.k || y_stride < p.n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::Gemm: need 0 <= m, 0 < n, k, batch < 2^31 and strides at least the rows; got m=",
        p.m, " n=", p.n, " k=", p.k, " batch=", p.batch, " strides ", x_stride, "/", w_stride, "/",
        y_stride));
  }
  if (p.m > 0 && (p.x == nullptr || p.weight == nullptr || p.y == nullptr)) {
    return absl::InvalidArgumentError("cuda::Gemm: x, weight and y must be non-null");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GemmRunner>> GemmRunner::Create(int64_t workspace_bytes,
                                                               bool resident_products) {
  if (workspace_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GemmRunner: workspace_bytes must be >= 0, got ", workspace_bytes));
  }
  ResidentGemmDevice device;
  ResidentGemmScratch scratch;
  if (resident_products) {
    TV_ASSIGN_OR_RETURN(device, PrepareResidentGemm());
    if (device.max_smem_bytes > 0) {
      TV_ASSIGN_OR_RETURN(scratch, AllocateResidentGemmScratch());
    }
  }
  void* workspace = nullptr;
  absl::Status status = absl::OkStatus();
  if (workspace_bytes > 0) {
    status = CudaStatus(cudaMalloc(&workspace, static_cast<size_t>(workspace_bytes)), "cudaMalloc");
  }
  cublasLtHandle_t handle = nullptr;
  if (status.ok()) status = CublasStatus(cublasLtCreate(&handle), "cublasLtCreate");
  if (!status.ok()) {
    cudaFree(workspace);
    FreeResidentGemmScratch(scratch);
    return status;
  }
  return std::unique_ptr<GemmRunner>(
      new GemmRunner(handle, workspace, workspace_bytes, device, scratch));
}

GemmRunner::GemmRunner(void* handle, void* workspace, int64_t workspace_bytes,
                       ResidentGemmDevice device, ResidentGemmScratch scratch)
    : handle_(handle),
      workspace_(workspace),
      workspace_bytes_(workspace_bytes),
      resident_device_(device),
      resident_scratch_(scratch) {}

GemmRunner::~GemmRunner() {
  plans_.clear();
  cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
  cudaFree(workspace_);
  cudaFree(dequantized_);
  FreeResidentGemmScratch(resident_scratch_);
}

int64_t GemmRunner::planned_shapes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(plans_.size());
}

absl::Status GemmRunner::Run(const GemmParamsOf<Bf16, Bf16, Bf16>& params, cudaStream_t stream) {
  return RunImpl(params, stream);
}

absl::Status GemmRunner::Run(const GemmParamsOf<Bf16, Bf16, float>& params, cudaStream_t stream) {
  return RunImpl(params, stream);
}

absl::Status GemmRunner::Run(const BlockFp8GemmParamsOf<Bf16>& params, cudaStream_t stream) {
  return RunFp8(params, stream);
}

absl::Status GemmRunner::Run(const BlockFp8GemmParamsOf<float>& params, cudaStream_t stream) {
  return RunFp8(params, stream);
}

absl::Status GemmRunner::ReserveDequantized(int64_t elements) {
  if (elements <= dequantized_elements_) return absl::OkStatus();
  // The old scratch may still be read by queued work on any stream this runner launched on.
  TV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  cudaFree(dequantized_);
  dequantized_ = nullptr;
  dequantized_elements_ = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&dequantized_),
                                     static_cast<size_t>(elements) * sizeof(Bf16)));
  dequantized_elements_ = elements;
  return absl::OkStatus();
}

template <typename Output>
absl::Status GemmRunner::RunFp8(const BlockFp8GemmParamsOf<Output>& params, cudaStream_t stream) {
  const GemmParamsOf<Bf16, uint8_t, Output>& p = params.product;
  TV_RETURN_IF_ERROR(CheckProduct(p));
  if (p.m == 0) return absl::OkStatus();
  if (p.weight_stride != 0 && p.weight_stride != p.k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::Gemm: FP8 weight rows must be k apart; got weight_stride=", p.weight_stride,
        " for k=", p.k));
  }
  if (params.scales == nullptr) {
    return absl::InvalidArgumentError("cuda::Gemm: an FP8 weight needs its scales");
  }
  if (const ResidentGemmPlan resident = PlanResidentGemm(p, resident_device_, resident_scratch_);
      resident.blocks > 0) {
    return ResidentGemm(params, resident, resident_scratch_, stream);
  }
  const int64_t elements = p.batch * p.n * p.k;
  if (elements > dequantized_elements_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda::Gemm: an FP8 product of ", p.m, " rows x ", p.batch, " x ", p.n, " x ", p.k,
        " needs ", elements, " elements of dequantized scratch; ReserveDequantized gave ",
        dequantized_elements_));
  }
  TV_RETURN_IF_ERROR(DequantizeBlockFp8(params, dequantized_, stream));
  // The scratch holds the products' weights one after another, rows k apart.
  GemmParamsOf<Bf16, Bf16, Output> bf16 = WithWeight(p, static_cast<const Bf16*>(dequantized_));
  bf16.weight_stride = 0;
  bf16.weight_batch_stride = p.n * p.k;
  return RunImpl(bf16, stream);
}

template <typename Output>
absl::Status GemmRunner::RunImpl(const GemmParamsOf<Bf16, Bf16, Output>& p, cudaStream_t stream) {
  TV_RETURN_IF_ERROR(CheckProduct(p));
  if (p.m == 0) return absl::OkStatus();
  const int64_t x_stride = p.x_stride ? p.x_stride : p.k;
  const int64_t w_stride = p.weight_stride ? p.weight_stride : p.k;
  const int64_t y_stride = p.y_stride ? p.y_stride : p.n;
  if (const ResidentGemmPlan resident = PlanResidentGemm(p, resident_device_, resident_scratch_);
      resident.blocks > 0) {
    return ResidentGemm(p, resident, resident_scratch_, stream);
  }
  constexpr bool kFloatOutput = std::is_same_v<Output, float>;
  const ShapeKey key{p.m,
                     p.n,
                     p.k,
                     x_stride,
                     w_stride,
                     y_stride,
                     p.batch,
                     p.batch > 1 ? p.x_batch_stride : 0,
                     p.batch > 1 ? p.weight_batch_stride : 0,
                     p.batch > 1 ? p.y_batch_stride : 0,
                     kFloatOutput,
                     AlignmentOf(p.x),
                     AlignmentOf(p.weight),
                     AlignmentOf(p.y)};
  TV_ASSIGN_OR_RETURN(const Plan* plan, PlanFor(key));
  const float alpha = 1.0f;
  const float beta = 0.0f;
  return CublasStatus(
      cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan->operation, &alpha, p.weight,
                     plan->a, p.x, plan->b, &beta, p.y, plan->d, p.y, plan->d, &plan->algorithm,
                     workspace_, static_cast<size_t>(workspace_bytes_), stream),
      "cublasLtMatmul");
}

absl::StatusOr<const GemmRunner::Plan*> GemmRunner::PlanFor(const ShapeKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = plans_.find(key);
  if (found != plans_.end()) return found->second.get();

  const auto [m, n, k, x_stride, w_stride, y_stride, batch, x_batch_stride, w_batch_stride,
              y_batch_stride, float_output, x_alignment, w_alignment, y_alignment] = key;
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t output_type = float_output ? CUDA_R_32F : CUDA_R_16BF;
  TV_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescCreate(&plan->operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T;
  const cublasOperation_t keep = CUBLAS_OP_N;
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      plan->operation, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      plan->operation, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)));
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, k, n, w_stride));
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, k, m, x_stride));
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->d, output_type, n, m, y_stride));
  const int32_t batch32 = static_cast<int32_t>(batch);
  TV_RETURN_IF_ERROR(SetBatch(plan->a, batch32, w_batch_stride));
  TV_RETURN_IF_ERROR(SetBatch(plan->b, batch32, x_batch_stride));
  TV_RETURN_IF_ERROR(SetBatch(plan->d, batch32, y_batch_stride));

  cublasLtMatmulPreference_t preference = nullptr;
  TV_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t workspace = static_cast<uint64_t>(workspace_bytes_);
  const uint32_t alignments[] = {
      static_cast<uint32_t>(w_alignment), static_cast<uint32_t>(x_alignment),
      static_cast<uint32_t>(y_alignment), static_cast<uint32_t>(y_alignment)};
  absl::Status status = CublasStatus(
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace, sizeof(workspace)),
      "workspace preference");
  const cublasLtMatmulPreferenceAttributes_t alignment_attributes[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && status.ok(); ++i) {
    status = CublasStatus(cublasLtMatmulPreferenceSetAttribute(preference, alignment_attributes[i],
                                                               &alignments[i], sizeof(uint32_t)),
                          "alignment preference");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  if (status.ok()) {
    status = CublasStatus(cublasLtMatmulAlgoGetHeuristic(
                              static_cast<cublasLtHandle_t>(handle_), plan->operation, plan->a,
                              plan->b, plan->d, plan->d, preference, 1, &result, &found_count),
                          "cublasLtMatmulAlgoGetHeuristic");
  }
  cublasLtMatmulPreferenceDestroy(preference);
  TV_RETURN_IF_ERROR(status);
  if (found_count == 0) {
    return absl::UnimplementedError(absl::StrCat("cuda::Gemm: cuBLASLt has no algorithm for m=", m,
                                                 " n=", n, " k=", k, " batch=", batch));
  }
  plan->algorithm = result.algo;
  const Plan* planned = plan.get();
  plans_.emplace(key, std::move(plan));
  return planned;
}

}  // namespace treeverify::kernels::cuda
