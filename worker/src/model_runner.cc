#include "treeverify/worker/model_runner.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/cpu_forward.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::worker {

namespace cpu = kernels::cpu;

absl::Status ModelRunnerOptions::Validate() const {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not within a world of ", world_size, " ranks"));
  }
  if (kv_page_size < 1 || kv_pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_page_size (", kv_page_size, ") and kv_pages (", kv_pages, ") must be positive"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const std::string& model_dir,
                                                                 const ModelRunnerOptions& options,
                                                                 Communicator* communicator) {
  TV_RETURN_IF_ERROR(options.Validate());
  if (communicator == nullptr || communicator->rank() != options.rank ||
      communicator->world_size() != options.world_size) {
    return absl::InvalidArgumentError("the communicator does not match the runner's rank/world");
  }
  TV_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::FromFile(model_dir + "/config.json"));
  TV_ASSIGN_OR_RETURN(
      ShardingPlan plan,
      ShardingPlan::Make(config, options.rank, options.world_size, options.expert_sharding));
  TV_ASSIGN_OR_RETURN(std::unique_ptr<ModelWeights> weights,
                      ModelWeights::Load(model_dir, config, plan));
  KvCacheOptions cache_options;
  cache_options.num_pages = options.kv_pages;
  cache_options.page_size = options.kv_page_size;
  cache_options.num_layers = config.num_hidden_layers;
  cache_options.row_dim = config.kv_row_dim();
  const ForwardFactory& factory =
      options.forward_factory ? options.forward_factory : ForwardFactory(MakeCpuForward);
  TV_ASSIGN_OR_RETURN(ForwardParts parts, factory(*weights, cache_options, communicator));
  TV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache,
                      KvCache::Create(cache_options, std::move(parts.kv_rows)));
  return std::unique_ptr<ModelRunner>(
      new ModelRunner(std::move(weights), std::move(cache), std::move(parts.backend)));
}

ModelRunner::ModelRunner(std::unique_ptr<ModelWeights> weights, std::unique_ptr<KvCache> kv_cache,
                         std::unique_ptr<ForwardBackend> backend)
    : weights_(std::move(weights)), kv_cache_(std::move(kv_cache)), backend_(std::move(backend)) {}

ModelRunner::~ModelRunner() = default;

absl::Status ModelRunner::Release(uint64_t sequence_id) {
  segment_parents_.erase(sequence_id);
  return kv_cache_->Release(sequence_id);
}

// Committed rows become positions committed, committed + 1, ...: only a path from the segment's
// root keeps every row at the position its RoPE was computed for.
absl::Status ModelRunner::CheckCommitIsAPath(uint64_t id, absl::Span<const int32_t> nodes) const {
  if (!kv_cache_->Contains(id)) {
    return absl::NotFoundError(absl::StrFormat("sequence %#x has nothing to commit", id));
  }
  auto it = segment_parents_.find(id);
  const std::vector<int32_t> none;
  const std::vector<int32_t>& parents = it == segment_parents_.end() ? none : it->second;
  for (size_t k = 0; k < nodes.size(); ++k) {
    const int32_t node = nodes[k];
    const int32_t expected_parent = k == 0 ? -1 : nodes[k - 1];
    if (node < 0 || node >= static_cast<int32_t>(parents.size()) ||
        parents[node] != expected_parent) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequence %#x: commit node %d (index %d) does not continue a path from the segment's "
          "root (its parent must be %d)",
          id, node, k, expected_parent));
    }
  }
  return absl::OkStatus();
}

namespace {

// A chain of more rows than a tree may have: only a prompt chunk is one.
bool IsLongChain(const SegmentInput& input) {
  return input.parents.size() > static_cast<size_t>(kernels::kMaxSegmentRows) &&
         SegmentTree::IsChain(input.parents);
}

}  // namespace

absl::Status ModelRunner::PrepareSegment(const SegmentInput& input, SegmentOutput& output,
                                         BatchInputs& batch) {
  const uint64_t id = input.sequence_id;
  const int64_t nodes = static_cast<int64_t>(input.token_ids.size());
  if (static_cast<int64_t>(input.parents.size()) != nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat(nodes, " token ids but ", input.parents.size(), " parents"));
  }
  // A chain may be longer than a tree (segment_tree.h): its depths are its indices.
  const bool chain = SegmentTree::IsChain(input.parents);
  if (chain && nodes > kMaxChainRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("a chain holds at most ", kMaxChainRows, " nodes per step, got ", nodes));
  }
  std::optional<SegmentTree> tree;
  if (nodes > 0 && !chain) {
    if (nodes > kernels::kMaxSegmentRows) {
      return absl::InvalidArgumentError(
          absl::StrCat("a segment of ", nodes, " nodes must be a chain (parents -1, 0, 1, ...); ",
                       "a tree holds at most ", kernels::kMaxSegmentRows));
    }
    TV_ASSIGN_OR_RETURN(tree, SegmentTree::Build(input.parents));
  }
  auto depth = [&](int64_t i) { return chain ? static_cast<int32_t>(i) : tree->depth[i]; };
  const int64_t vocab = weights_->config.vocab_size;
  for (int64_t i = 0; i < nodes; ++i) {
    if (input.token_ids[i] < 0 || input.token_ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token_ids[", i, "] = ", input.token_ids[i],
                                                     " is outside the vocabulary [0, ", vocab,
                                                     ")"));
    }
  }
  const SegmentSampling& sampling = input.sampling;
  if (!std::isfinite(sampling.temperature) || sampling.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling temperature must be finite and >= 0, got ", sampling.temperature));
  }
  if (sampling.candidates < 0 || sampling.candidates > kernels::kMaxSummaryCandidates) {
    return absl::InvalidArgumentError(absl::StrCat("sampling candidates must be in 0..",
                                                   kernels::kMaxSummaryCandidates, ", got ",
                                                   sampling.candidates));
  }
  const int32_t num_layers = static_cast<int32_t>(weights_->config.num_hidden_layers);
  std::vector<bool> requested(num_layers + 1, false);
  for (size_t i = 0; i < input.hidden_state_layers.size(); ++i) {
    const int32_t layer = input.hidden_state_layers[i];
    if (layer < 0 || layer > num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden_state_layers[", i, "] = ", layer, " is not a layer: 0 (embedding) .. ",
          num_layers, " (the last decoder layer's output)"));
    }
    if (requested[layer]) {
      return absl::InvalidArgumentError(
          absl::StrCat("hidden_state_layers lists layer ", layer, " twice"));
    }
    requested[layer] = true;
  }
  const int64_t commit_count = input.commit_nodes ? input.commit_nodes->size() : 0;
  if (input.expected_committed_length &&
      *input.expected_committed_length != kv_cache_->committed_length(id) + commit_count) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "sequence %#x: expected committed length %d, the cache has %d (+%d to commit)", id,
        *input.expected_committed_length, kv_cache_->committed_length(id), commit_count));
  }
  if (input.commit_nodes) TV_RETURN_IF_ERROR(CheckCommitIsAPath(id, *input.commit_nodes));
  // Positions must stay inside the model's context: RoPE and the cache are sized by it.
  const int64_t committed_after = kv_cache_->committed_length(id) + commit_count;
  int64_t deepest = -1;
  for (int64_t i = 0; i < nodes; ++i) deepest = std::max<int64_t>(deepest, depth(i));
  if (nodes > 0 && committed_after + deepest >= weights_->config.max_position_embeddings) {
    return absl::OutOfRangeError(absl::StrFormat(
        "sequence %#x: nodes up to position %d, but the model's context ends at %d", id,
        committed_after + deepest, weights_->config.max_position_embeddings - 1));
  }

  // Checks are done; from here the sequence changes. A commit that succeeds stays even if the new
  // rows then find the cache full (SegmentOutput.committed_length shows it).
  if (input.commit_nodes) {
    TV_RETURN_IF_ERROR(kv_cache_->Commit(id, *input.commit_nodes));
    segment_parents_.erase(id);
  }
  output.committed_length = kv_cache_->committed_length(id);
  if (nodes == 0) return absl::OkStatus();
  TV_RETURN_IF_ERROR(kv_cache_->ReserveSegment(id, nodes));
  segment_parents_[id] = input.parents;

  const int32_t committed = static_cast<int32_t>(output.committed_length);
  const std::vector<int64_t> slots = kv_cache_->SegmentSlots(id);
  for (int64_t i = 0; i < nodes; ++i) {
    batch.token_ids.push_back(input.token_ids[i]);
    batch.positions.push_back(committed + depth(i));
    batch.sample_positions.push_back(int64_t{committed} + depth(i) + 1);
    batch.slots.push_back(slots[i]);
  }
  // The segment's sequences: a tree is one; a chain is pieces of at most kMaxSegmentRows rows
  // (forward_backend.h), each masked as a chain of its own on top of the pieces before it.
  for (int64_t first = 0; first < nodes; first += kernels::kMaxSegmentRows) {
    const int32_t rows =
        static_cast<int32_t>(std::min<int64_t>(kernels::kMaxSegmentRows, nodes - first));
    if (chain) {
      const std::vector<uint64_t> mask = SegmentTree::ChainMask(rows);
      batch.ancestor_mask.insert(batch.ancestor_mask.end(), mask.begin(), mask.end());
    } else {
      batch.ancestor_mask.insert(batch.ancestor_mask.end(), tree->ancestor_mask.begin(),
                                 tree->ancestor_mask.end());
    }
    batch.row_offsets.push_back(static_cast<int32_t>(batch.row_offsets.back() + rows));
    batch.committed_lengths.push_back(committed + static_cast<int32_t>(first));
    batch.sampling.push_back(input.sampling);
    batch.chain.push_back(chain);
    batch.continues_chain.push_back(first > 0);
  }
  for (int32_t layer : input.hidden_state_layers) batch.capture_layer[layer] = true;
  return absl::OkStatus();
}

absl::StatusOr<ForwardResult> ModelRunner::Forward(const ForwardRequest& request) {
  const ModelConfig& c = weights_->config;
  ForwardResult result;
  result.segments.resize(request.segments.size());
  BatchInputs batch;
  batch.capture_layer.assign(c.num_hidden_layers + 1, false);
  batch.return_logits = request.return_logits;
  std::vector<size_t> segment_of_sequence;  // [sequences] index into the request
  // A sequence named twice would have its second segment replace the first's rows mid-batch:
  // refuse every occurrence before anything changes.
  absl::flat_hash_set<uint64_t> seen, duplicated;
  for (const SegmentInput& segment : request.segments) {
    if (!seen.insert(segment.sequence_id).second) duplicated.insert(segment.sequence_id);
  }
  // Chains longer than a tree go last (BatchInputs: a backend may attend them in another form
  // than the sequences before them); the outputs keep the request's order.
  std::vector<size_t> order;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < request.segments.size(); ++i) {
      if (IsLongChain(request.segments[i]) == (pass == 1)) order.push_back(i);
    }
  }
  for (size_t i : order) {
    const int64_t rows_before = batch.rows();
    SegmentOutput& output = result.segments[i];
    output.status = duplicated.contains(request.segments[i].sequence_id)
                        ? absl::InvalidArgumentError(
                              absl::StrFormat("sequence %#x appears more than once in one forward",
                                              request.segments[i].sequence_id))
                        : PrepareSegment(request.segments[i], output, batch);
    if (output.status.ok() && batch.rows() > rows_before) {
      segment_of_sequence.resize(batch.sequences(), i);  // a long chain adds several
    }
  }
  // Every rank sees the same request and cache state, so every rank reaches this point with the
  // same batch and makes the same collective calls.
  if (batch.rows() == 0) return result;

  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const size_t pages =
        kv_cache_->page_table(request.segments[segment_of_sequence[s]].sequence_id).size();
    batch.max_pages = std::max(batch.max_pages, static_cast<int32_t>(pages));
  }
  batch.page_table.assign(int64_t{batch.sequences()} * batch.max_pages, 0);
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const std::vector<int32_t>& pages =
        kv_cache_->page_table(request.segments[segment_of_sequence[s]].sequence_id);
    std::copy(pages.begin(), pages.end(), batch.page_table.begin() + int64_t{s} * batch.max_pages);
  }

  ForwardOutputs outputs;
  TV_RETURN_IF_ERROR(backend_->Run(batch, outputs));
  Distribute(request, segment_of_sequence, batch, outputs, result);
  return result;
}

// Hands each segment its rows of the outputs: those of its sequences (one, or a long chain's
// pieces), which are consecutive.
void ModelRunner::Distribute(const ForwardRequest& request,
                             const std::vector<size_t>& segment_of_sequence,
                             const BatchInputs& batch, ForwardOutputs& outputs,
                             ForwardResult& result) const {
  const int64_t hidden_size = weights_->config.hidden_size;
  const int64_t vocab_shard = weights_->plan.vocab.size();
  for (int32_t first = 0, last = 0; first < batch.sequences(); first = last) {
    const size_t segment = segment_of_sequence[first];
    while (last < batch.sequences() && segment_of_sequence[last] == segment) ++last;
    const SegmentInput& input = request.segments[segment];
    SegmentOutput& output = result.segments[segment];
    const int64_t begin = batch.row_offsets[first];
    const int64_t end = batch.row_offsets[last];
    output.summaries.assign(outputs.summaries.begin() + begin, outputs.summaries.begin() + end);
    for (int32_t s = first; s < last; ++s) {
      output.candidates.insert(output.candidates.end(), outputs.candidates[s].begin(),
                               outputs.candidates[s].end());
    }
    if (request.return_logits) {
      output.logits.assign(outputs.logits.begin() + begin * vocab_shard,
                           outputs.logits.begin() + end * vocab_shard);
    }
    for (int32_t layer : input.hidden_state_layers) {
      const std::vector<float>& states = outputs.layer_hidden[layer];
      output.hidden_states.push_back(
          {.layer = layer,
           .values = std::vector<float>(states.begin() + begin * hidden_size,
                                        states.begin() + end * hidden_size)});
    }
  }
}

}  // namespace treeverify::worker
