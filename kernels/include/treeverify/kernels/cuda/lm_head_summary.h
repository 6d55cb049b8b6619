// The per-node summary of a vocabulary shard's logits on the GPU, with the CPU backend's params
// struct (device pointers: logits, positions, out, candidates): max, argmax (smallest id among
// equal maxima), log-sum-exp, and with a temperature the Gumbel-max winner (the same Philox noise
// and skipping rule as the CPU op; CUDA's double log may differ from the host's by an ulp) and the
// log-sum-exp at that temperature; on request the shard's top-K candidates, larger logit first,
// smaller id on ties. One block per row; the logits never leave the device.
//
// Roofline: 4 * vocab_shard bytes read per row (L2-resident right after the LM-head GEMM) and
// one or two exps per logit. Candidates take K rounds of a block-wide selection (each round the
// best logit ranked below the previous one): fine for the default K = 64, slow near K = 1024.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "treeverify/kernels/lm_head_summary.h"

namespace treeverify::kernels::cuda {

absl::Status LmHeadSummary(const LmHeadSummaryParams& params, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
