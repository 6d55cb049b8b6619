#include "treeverify/worker/forward_backend.h"

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {

absl::Status CheckForwardInputs(const char* backend, const ModelConfig& config,
                                const KvCacheOptions& kv_rows, const Communicator* communicator) {
  if (kv_rows.num_layers != config.num_hidden_layers || kv_rows.row_dim != config.kv_row_dim()) {
    return absl::InvalidArgumentError(absl::StrCat(
        backend, ": the KV rows hold ", kv_rows.num_layers, " layers of ", kv_rows.row_dim,
        " values, the model has ", config.num_hidden_layers, " layers of ", config.kv_row_dim()));
  }
  if (communicator == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(backend, ": no communicator"));
  }
  return absl::OkStatus();
}

// Each sequence has its own sampling parameters, so the summary runs once per sequence; a row's
// summary depends only on its own logits and position, so this changes no result.
absl::Status SummarizeLogits(const BatchInputs& batch, const float* logits, int64_t vocab_shard,
                             int32_t vocab_begin, ForwardOutputs& outputs) {
  outputs.summaries.resize(batch.rows());
  outputs.candidates.resize(batch.sequences());
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const SegmentSampling& sampling = batch.sampling[s];
    const int64_t begin = batch.row_offsets[s];
    const int64_t end = batch.row_offsets[s + 1];
    outputs.candidates[s].resize((end - begin) * sampling.candidates);
    TV_RETURN_IF_ERROR(
        kernels::cpu::LmHeadSummary({.logits = logits + begin * vocab_shard,
                                     .out = outputs.summaries.data() + begin,
                                     .rows = end - begin,
                                     .vocab_shard = vocab_shard,
                                     .vocab_begin = vocab_begin,
                                     .temperature = sampling.temperature,
                                     .seed = sampling.seed,
                                     .positions = batch.sample_positions.data() + begin,
                                     .num_candidates = sampling.candidates,
                                     .candidates = outputs.candidates[s].data()}));
  }
  return absl::OkStatus();
}

}  // namespace treeverify::worker
