// Prefill attention in the MHA form: a chain of new rows (a prompt chunk) attends causally over
// its sequence's whole context with keys and values up-projected out of the latent cache, the
// form in which a long chunk costs the fewest FLOPs (docs/gpu-worker-plan.md, "Prefill in the MHA
// form"). The caller gathers the context's cache rows and up-projects their latent through
// kv_b_proj (one GEMM); this kernel reads
//   q       [rows, heads, nope + rope]  q_nope, then the rotated q_pe
//   kv_up   [keys, heads, nope + v]     each head's k_nope, then its v
//   k_rope  [keys] rows k_rope_stride elements apart: the rotated shared key (rope values)
// and writes out [rows, heads, v]. Row i of the chain is at position keys - rows + i and sees
// keys 0..keys - rows + i: the committed prefix, the chain's rows before it and itself. In exact
// arithmetic this is the absorbed tree attention of a chain followed by W_UV.
//
// The kernel is flash attention on mma.sync (m16n8k16, bf16 in, fp32 accumulate): a block of
// four warps owns 64 rows of one head, each warp 16 rows, and walks the visible keys in tiles of
// 64 (two cp.async stages), with the online softmax in registers and P fed from the score
// accumulators straight into the P V products. Head dimensions are template parameters padded
// to the tensor-core tile (zero-filled), so DeepSeek's 192 / 128 and the tiny test models' sizes
// run the same code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "treeverify/kernels/cuda/bf16.h"

namespace treeverify::kernels::cuda {

struct MhaPrefillParams {
  const Bf16* q = nullptr;       // [rows, heads, nope + rope]
  const Bf16* kv_up = nullptr;   // [keys, heads, nope + v]
  const Bf16* k_rope = nullptr;  // [keys] rows of k_rope_stride elements, rope values first
  Bf16* out = nullptr;           // [rows, heads, v]
  int32_t rows = 0;              // the chain's rows, 1..keys
  int32_t keys = 0;              // committed prefix + rows
  int32_t heads = 0;
  int32_t nope_dim = 0;
  int32_t rope_dim = 0;
  int32_t v_dim = 0;
  int64_t k_rope_stride = 0;
  float softmax_scale = 0.f;
};

// Whether the kernel is built for these head dimensions (each a multiple of 8, the padded
// sizes one of the instantiated ones). The worker falls back to the absorbed form otherwise.
bool MhaPrefillSupported(int32_t nope_dim, int32_t rope_dim, int32_t v_dim);

// INVALID_ARGUMENT for a bad shape or unsupported dimensions.
absl::Status MhaPrefillAttention(const MhaPrefillParams& params, cudaStream_t stream);

// FLOPs of one call (the score and value products of the visible keys, 2 per multiply-add).
double MhaPrefillFlops(const MhaPrefillParams& params);

}  // namespace treeverify::kernels::cuda
