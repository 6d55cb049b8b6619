// The per-node summary of a vocabulary shard's logits on the GPU, with the CPU backend's params
// struct (device pointers: logits, positions, out, candidates): max, argmax (smallest id among
// equal maxima), log-sum-exp, and with a temperature the Gumbel-max winner (the same Philox noise
// and skipping rule as the CPU op; CUDA's double log may differ from the host's by an ulp) and the
// log-sum-exp at that temperature; on request the shard's top-K candidates, larger logit first,
// smaller id on ties. One block per row; the logits never leave the device.
//
// Roofline: 4 * vocab_shard bytes read per row (L2-resident right after the LM-head GEMM) and
// one or two double exps per logit. Candidates take K rounds of a block-wide selection (each
// round the best logit ranked below the previous one): fine for the default K = 64, slow near
// K = 1024. With a scratch, rows without candidates run in slices of a row over several blocks
// (the double exps of a verify step's 16 rows on 16 multiprocessors took 15 us; bench/NOTES.md,
// step 132), the last slice of a row combining the slices' maxima, sums and winners.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "treeverify/kernels/lm_head_summary.h"

namespace treeverify::kernels::cuda {

// One block per row.
absl::Status LmHeadSummary(const LmHeadSummaryParams& params, cudaStream_t stream);

// A row in at most kLmHeadMaxSlices slices of at most 256 * kLmHeadSliceValues logits.
inline constexpr int kLmHeadMaxSlices = 16;
inline constexpr int kLmHeadSliceValues = 16;
inline constexpr int64_t kLmHeadSlicePartialBytes = 48;

// Device memory of the sliced summary for up to `rows` rows: each slice's partial results and an
// arrival counter per row, which the last slice zeroes again (zero between launches). One per
// stream of launches.
struct LmHeadSummaryScratch {
  void* partials = nullptr;  // [rows][slices] partials
  uint32_t* arrivals = nullptr;
  int64_t rows = 0;
  int multiprocessors = 0;
};
absl::StatusOr<LmHeadSummaryScratch> AllocateLmHeadSummaryScratch(int64_t rows);
void FreeLmHeadSummaryScratch(LmHeadSummaryScratch& scratch);

// The same summaries; sliced where the scratch has room and no candidates are asked for, else
// one block per row.
absl::Status LmHeadSummary(const LmHeadSummaryParams& params, const LmHeadSummaryScratch& scratch,
                           cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
