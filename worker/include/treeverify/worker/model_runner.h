// One tensor-parallel rank of the model: weights, paged KV cache and the forward pass of a batch
// of sequences, each a committed prefix plus a segment of new rows (a draft tree, or a chain for
// prefill). Every rank of a group receives the same ForwardRequest and calls Forward from its own
// thread or process; the ranks meet in the communicator's all-reduces.
//
// Per sequence the forward (1) commits the previous step's accepted nodes, (2) reserves cache
// slots for the new rows, (3) runs the layers, (4) returns a summary of this rank's vocabulary
// shard per node (with the sequence's own sampling parameters: the Gumbel-max winner of the
// shard and, for top-k / top-p, its largest logits), and on request the hidden states of chosen
// layers. A sequence whose request is bad or whose cache is full fails alone: its status says
// why, the others go on.
//
//   TV_ASSIGN_OR_RETURN(auto runner, ModelRunner::Create(dir, options, communicator));
//   ForwardRequest request;
//   request.segments.push_back({.sequence_id = 7, .token_ids = {5, 9}, .parents = {-1, 0}});
//   TV_ASSIGN_OR_RETURN(ForwardResult result, runner->Forward(request));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "treeverify/kernels/lm_head_summary.h"
#include "treeverify/worker/communicator.h"
#include "treeverify/worker/forward_backend.h"
#include "treeverify/worker/kv_cache.h"
#include "treeverify/worker/model_config.h"
#include "treeverify/worker/model_weights.h"

namespace treeverify::worker {

struct ModelRunnerOptions {
  int rank = 0;
  int world_size = 1;
  ExpertSharding expert_sharding = ExpertSharding::kSplitInside;
  int32_t kv_page_size = 64;
  int64_t kv_pages = 1024;
  // Where the forward runs: empty means the CPU backend (MakeCpuForward); MakeCudaForward
  // (cuda_forward.h, in treeverify::worker_cuda) runs it on a GPU.
  ForwardFactory forward_factory;

  absl::Status Validate() const;
};

struct SegmentInput {
  uint64_t sequence_id = 0;
  // Accepted node indices of this sequence's previous segment, committed before anything else
  // (nullopt: nothing to commit).
  std::optional<std::vector<int32_t>> commit_nodes;
  // If set, the committed length the caller expects after the commit; a mismatch fails the
  // sequence (FAILED_PRECONDITION), guarding against a coordinator and worker out of step.
  std::optional<int64_t> expected_committed_length;
  std::vector<int32_t> token_ids;  // [nodes]
  std::vector<int32_t> parents;    // [nodes]; -1 = hangs on the committed prefix
  SegmentSampling sampling;
  // Layers whose hidden states to return for the nodes: 0 = the embedding output (after its
  // all-reduce), l in 1..num_hidden_layers = the output of decoder layer l - 1 (the residual
  // stream; the last one is the input of the final norm). Each at most once.
  std::vector<int32_t> hidden_state_layers;
};

struct ForwardRequest {
  std::vector<SegmentInput> segments;
  bool return_logits = false;  // full logits of this rank's vocabulary shard (tests, tools)
};

struct SegmentOutput {
  absl::Status status;
  int64_t committed_length = 0;                 // before this segment's rows
  std::vector<kernels::NodeSummary> summaries;  // [nodes], this rank's vocabulary shard
  std::vector<float> logits;                    // [nodes, vocab shard] when requested
  std::vector<kernels::Candidate> candidates;   // [nodes, sampling.candidates]
  struct LayerHiddenStates {
    int32_t layer;
    std::vector<float> values;  // [nodes, hidden]
  };
  // One per requested layer, in request order. Every rank holds the same values (they follow an
  // all-reduce); the service sends rank 0's.
  std::vector<LayerHiddenStates> hidden_states;
};

struct ForwardResult {
  std::vector<SegmentOutput> segments;  // one per request segment, same order
};

class ModelRunner {
 public:
  // The communicator must outlive the runner and have the options' rank and world size.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const std::string& model_dir,
                                                             const ModelRunnerOptions& options,
                                                             Communicator* communicator);
  ~ModelRunner();

  const ModelConfig& config() const { return weights_->config; }
  const ShardingPlan& plan() const { return weights_->plan; }
  const KvCache& kv_cache() const { return *kv_cache_; }
  const ModelWeights& weights() const { return *weights_; }

  // Fails as a whole only for errors that concern every sequence (a collective failed).
  absl::StatusOr<ForwardResult> Forward(const ForwardRequest& request);
  // The last Forward's phase account, where the backend keeps one (forward_backend.h).
  std::optional<StepAccount> last_step_account() const { return backend_->last_step_account(); }
  // Drops a sequence's cache pages. NOT_FOUND for an unknown id.
  absl::Status Release(uint64_t sequence_id);

 private:
  ModelRunner(std::unique_ptr<ModelWeights> weights, std::unique_ptr<KvCache> kv_cache,
              std::unique_ptr<ForwardBackend> backend);
  absl::Status CheckCommitIsAPath(uint64_t id, absl::Span<const int32_t> nodes) const;
  absl::Status PrepareSegment(const SegmentInput& input, SegmentOutput& output, BatchInputs& batch);
  void Distribute(const ForwardRequest& request, const std::vector<size_t>& segment_of_sequence,
                  const BatchInputs& batch, ForwardOutputs& outputs, ForwardResult& result) const;

  std::unique_ptr<ModelWeights> weights_;
  // The backend reads the weights and writes the cache's rows: declared after both, so it goes
  // first.
  std::unique_ptr<KvCache> kv_cache_;
  std::unique_ptr<ForwardBackend> backend_;
  // Parents of each sequence's uncommitted segment: a commit must follow one of its paths.
  absl::flat_hash_map<uint64_t, std::vector<int32_t>> segment_parents_;
  // The ancestor masks of chains of 1..kMaxSegmentRows rows (a long chain's pieces), as built.
  absl::flat_hash_map<int32_t, std::vector<uint64_t>> chain_masks_;
};

}  // namespace treeverify::worker
