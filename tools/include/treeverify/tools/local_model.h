// A whole model replica inside one process: W tensor-parallel ranks as threads joined by an
// in-process communicator, plus the coordinator-side reduction of their vocabulary-shard
// summaries. Used by `treeverify-cli generate`, the benchmarks and the tests; the service runs
// the same ModelRunner in worker processes instead.
//
//   TV_ASSIGN_OR_RETURN(auto model, LocalModel::Create(dir, {.world_size = 2}));
//   TV_ASSIGN_OR_RETURN(Generation g, model->GenerateGreedy(/*id=*/1, {1, 2, 3}, 16));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/coordinator/rank_client.h"
#include "treeverify/kernels/lm_head_summary.h"
#include "treeverify/worker/communicator.h"
#include "treeverify/worker/model_runner.h"

namespace treeverify::tools {

struct LocalModelOptions {
  int world_size = 1;
  worker::ExpertSharding expert_sharding = worker::ExpertSharding::kSplitInside;
  int32_t kv_page_size = 64;
  int64_t kv_pages = 1024;
  int32_t prefill_chunk = 256;  // rows per prefill forward (at most worker::kMaxChainRows)
  worker::ForwardFactory forward_factory;  // every rank's backend; empty: the CPU's
  // Every rank's communicator, made in that rank's thread (all ranks at once, as NCCL needs);
  // empty: an in-process group. The model owns what it returns.
  std::function<absl::StatusOr<std::unique_ptr<worker::Communicator>>(int rank, int world_size)>
      communicator_factory;
};

// The reduced result of one segment: per node, the full-vocabulary summary, and the full logits
// (shards concatenated in vocabulary order) when requested. The reduced summaries carry the
// greedy fields (max logit, argmax, log-sum-exp); for sampling, the ranks' own summaries and
// candidates are kept so that callers can select with coordinator::SelectToken.
struct LocalSegmentResult {
  absl::Status status;
  int64_t committed_length = 0;
  std::vector<kernels::NodeSummary> summaries;                     // [nodes]
  std::vector<float> logits;                                       // [nodes, vocab] when requested
  std::vector<std::vector<kernels::NodeSummary>> shard_summaries;  // [rank][node]
  std::vector<std::vector<kernels::Candidate>> shard_candidates;   // [rank][node, candidates]
  std::vector<worker::SegmentOutput::LayerHiddenStates> hidden_states;  // rank 0's, as requested
};

struct Generation {
  std::vector<int32_t> tokens;  // the new tokens
  std::vector<float> logprobs;  // log-probability of each new token under the model
};

class LocalModel {
 public:
  static absl::StatusOr<std::unique_ptr<LocalModel>> Create(const std::string& model_dir,
                                                            const LocalModelOptions& options);
  ~LocalModel();

  const worker::ModelConfig& config() const { return runners_[0]->config(); }
  int world_size() const { return static_cast<int>(runners_.size()); }
  const worker::ModelRunner& rank(int r) const { return *runners_[r]; }

  // Runs the request on every rank (in parallel threads) and reduces the summaries.
  absl::StatusOr<std::vector<LocalSegmentResult>> Forward(const worker::ForwardRequest& request);

  // Prefills `prompt` in chunks as a chain and returns the summary of its last node (the model's
  // prediction for the next token). The sequence's cache then holds the whole prompt.
  absl::StatusOr<kernels::NodeSummary> Prefill(uint64_t sequence_id,
                                               const std::vector<int32_t>& prompt);

  // Greedy autoregressive decoding: prefill, then one token per step.
  absl::StatusOr<Generation> GenerateGreedy(uint64_t sequence_id,
                                            const std::vector<int32_t>& prompt, int max_new_tokens);

  absl::Status Release(uint64_t sequence_id);

  // In-process rank clients over this model's runners, for a coordinator::VerifyEngine in this
  // process. The model must outlive them, and must not run Forward itself meanwhile.
  std::vector<std::unique_ptr<coordinator::RankClient>> RankClients();

 private:
  LocalModel(LocalModelOptions options, std::unique_ptr<worker::InProcessGroup> group,
             std::vector<std::unique_ptr<worker::Communicator>> communicators,
             std::vector<std::unique_ptr<worker::ModelRunner>> runners);

  LocalModelOptions options_;
  // The ranks' communicators (one or the other), declared before the runners that use them.
  std::unique_ptr<worker::InProcessGroup> group_;
  std::vector<std::unique_ptr<worker::Communicator>> communicators_;
  std::vector<std::unique_ptr<worker::ModelRunner>> runners_;
};

}  // namespace treeverify::tools
