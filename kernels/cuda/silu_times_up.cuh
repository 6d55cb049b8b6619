// silu(gate) * up in fp32 as the CPU op computes it: gate / (1 + exp(-gate)) with expf (not the
// fast intrinsic), then times up, each step rounded to nearest. Every kernel that fuses the
// activation (SiluMul, the MoE expert kernels) calls this, so they all round alike.
#pragma once

namespace treeverify::kernels::cuda {

__device__ __forceinline__ float SiluTimesUp(float gate, float up) {
  const float silu = __fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate)));
  return __fmul_rn(silu, up);
}

}  // namespace treeverify::kernels::cuda
