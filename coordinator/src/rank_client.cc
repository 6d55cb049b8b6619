#include "treeverify/coordinator/rank_client.h"

#include "treeverify/kernels/status.h"

namespace treeverify::coordinator {

RankDescription DescribeRunner(const worker::ModelRunner& runner) {
  const worker::ModelConfig& c = runner.config();
  const worker::KvCacheOptions& cache = runner.kv_cache().options();
  RankDescription d;
  d.rank = runner.plan().rank;
  d.world_size = runner.plan().world_size;
  d.model_type = c.model_type;
  d.vocab_size = c.vocab_size;
  d.vocab_begin = runner.plan().vocab.begin;
  d.vocab_end = runner.plan().vocab.end;
  d.num_layers = c.num_hidden_layers;
  d.hidden_size = c.hidden_size;
  d.max_position_embeddings = c.max_position_embeddings;
  d.eos_token_ids = c.eos_token_ids;
  d.backend = "cpu";
  d.kv_pages_total = cache.num_pages;
  d.kv_pages_free = runner.kv_cache().free_pages();
  d.kv_page_size = cache.page_size;
  return d;
}

absl::StatusOr<RankDescription> InProcessRankClient::Describe(absl::Duration) {
  return DescribeRunner(*runner_);
}

absl::StatusOr<worker::ForwardResult> InProcessRankClient::Forward(
    const worker::ForwardRequest& request, absl::Duration) {
  return runner_->Forward(request);
}

absl::StatusOr<int64_t> InProcessRankClient::Release(absl::Span<const uint64_t> sequence_ids,
                                                     absl::Duration) {
  for (uint64_t id : sequence_ids) {
    // Releasing is idempotent: a sequence whose prefill never reached the ranks is unknown there.
    absl::Status status = runner_->Release(id);
    if (!status.ok() && !absl::IsNotFound(status)) return status;
  }
  return runner_->kv_cache().free_pages();
}

}  // namespace treeverify::coordinator
