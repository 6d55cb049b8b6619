// SiLU-and-multiply. Roofline: 8 bytes read and 2 written per output: launch bound at verify
// sizes.
#include "element_convert.cuh"
#include "silu_times_up.cuh"
#include "treeverify/kernels/cuda/activation.h"
#include "treeverify/kernels/cuda/cuda_status.h"

namespace treeverify::kernels::cuda {
namespace {

__global__ void SiluMulKernel(const float* __restrict__ gate_up, Bf16* __restrict__ out,
                              int64_t dim) {
  const float* gate = gate_up + blockIdx.x * 2 * dim;
  const float* up = gate + dim;
  Bf16* row = out + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    row[i] = FromFloat<Bf16>(SiluTimesUp(gate[i], up[i]));
  }
}

}  // namespace

absl::Status SiluMul(const SiluMulParamsOf<float, Bf16>& p, cudaStream_t stream) {
  if (p.dim <= 0 || p.rows < 0 || p.rows > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::SiluMul: need dim > 0 and 0 <= rows < 2^31; got rows=", p.rows, " dim=", p.dim));
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.gate_up == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("cuda::SiluMul: gate_up and out must be non-null");
  }
  SiluMulKernel<<<static_cast<unsigned>(p.rows), 256, 0, stream>>>(p.gate_up, p.out, p.dim);
  return CudaStatus(cudaGetLastError(), "SiluMulKernel launch");
}

}  // namespace treeverify::kernels::cuda
