#include "treeverify/worker/model_runner.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "treeverify/kernels/activation.h"
#include "treeverify/kernels/embedding.h"
#include "treeverify/kernels/gemm.h"
#include "treeverify/kernels/kv_cache_ops.h"
#include "treeverify/kernels/mla_verify_attention.h"
#include "treeverify/kernels/moe.h"
#include "treeverify/kernels/rms_norm.h"
#include "treeverify/kernels/rope.h"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::worker {

namespace cpu = kernels::cpu;

// transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps.
constexpr float kLatentNormEps = 1e-6f;

// The rows of all sequences of one forward, flattened in request order.
struct ModelRunner::Batch {
  std::vector<size_t> segment_of_sequence;  // [sequences] index into the request
  std::vector<int32_t> token_ids;           // [rows]
  std::vector<int32_t> positions;           // [rows] committed_length + depth
  // [rows] committed_length + depth + 1: the position of the token each row predicts, which keys
  // its sampling noise.
  std::vector<int64_t> sample_positions;
  std::vector<int64_t> slots;              // [rows] cache slot of each row's own KV
  std::vector<int32_t> row_offsets{0};     // [sequences + 1]
  std::vector<int32_t> committed_lengths;  // [sequences]
  std::vector<uint64_t> ancestor_mask;     // [rows, kAncestorMaskWords]
  std::vector<int32_t> page_table;         // [sequences, max_pages], padded with page 0
  int32_t max_pages = 0;
  // Hidden states some sequence asked for: capture_layer[l] for l in 0..num_hidden_layers, and
  // layer_hidden[l] = [rows, hidden] once captured.
  std::vector<bool> capture_layer;
  std::vector<std::vector<float>> layer_hidden;

  int64_t rows() const { return static_cast<int64_t>(token_ids.size()); }
  int32_t sequences() const { return static_cast<int32_t>(committed_lengths.size()); }
};

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
  TV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(cache_options));
  return std::unique_ptr<ModelRunner>(
      new ModelRunner(std::move(weights), std::move(cache), communicator));
}

ModelRunner::ModelRunner(std::unique_ptr<ModelWeights> weights, std::unique_ptr<KvCache> kv_cache,
                         Communicator* communicator)
    : weights_(std::move(weights)), kv_cache_(std::move(kv_cache)), communicator_(communicator) {
  rope_inv_freq_ = weights_->config.rope_inv_freq();
  rope_attention_factor_ = static_cast<float>(weights_->config.rope_attention_factor());
  softmax_scale_ = static_cast<float>(weights_->config.softmax_scale());
}

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

absl::Status ModelRunner::PrepareSegment(const SegmentInput& input, SegmentOutput& output,
                                         Batch& batch) {
  const uint64_t id = input.sequence_id;
  const int64_t nodes = static_cast<int64_t>(input.token_ids.size());
  if (static_cast<int64_t>(input.parents.size()) != nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat(nodes, " token ids but ", input.parents.size(), " parents"));
  }
  std::optional<SegmentTree> tree;
  if (nodes > 0) {
    TV_ASSIGN_OR_RETURN(tree, SegmentTree::Build(input.parents));
  }
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
  for (int64_t i = 0; i < nodes; ++i) deepest = std::max<int64_t>(deepest, tree->depth[i]);
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
    batch.positions.push_back(committed + tree->depth[i]);
    batch.sample_positions.push_back(int64_t{committed} + tree->depth[i] + 1);
    batch.slots.push_back(slots[i]);
  }
  batch.ancestor_mask.insert(batch.ancestor_mask.end(), tree->ancestor_mask.begin(),
                             tree->ancestor_mask.end());
  batch.row_offsets.push_back(static_cast<int32_t>(batch.rows()));
  batch.committed_lengths.push_back(committed);
  for (int32_t layer : input.hidden_state_layers) batch.capture_layer[layer] = true;
  return absl::OkStatus();
}

absl::StatusOr<ForwardResult> ModelRunner::Forward(const ForwardRequest& request) {
  const ModelConfig& c = weights_->config;
  ForwardResult result;
  result.segments.resize(request.segments.size());
  Batch batch;
  batch.capture_layer.assign(c.num_hidden_layers + 1, false);
  batch.layer_hidden.resize(c.num_hidden_layers + 1);
  // A sequence named twice would have its second segment replace the first's rows mid-batch:
  // refuse every occurrence before anything changes.
  absl::flat_hash_set<uint64_t> seen, duplicated;
  for (const SegmentInput& segment : request.segments) {
    if (!seen.insert(segment.sequence_id).second) duplicated.insert(segment.sequence_id);
  }
  for (size_t i = 0; i < request.segments.size(); ++i) {
    const int64_t rows_before = batch.rows();
    SegmentOutput& output = result.segments[i];
    output.status = duplicated.contains(request.segments[i].sequence_id)
                        ? absl::InvalidArgumentError(
                              absl::StrFormat("sequence %#x appears more than once in one forward",
                                              request.segments[i].sequence_id))
                        : PrepareSegment(request.segments[i], output, batch);
    if (output.status.ok() && batch.rows() > rows_before) batch.segment_of_sequence.push_back(i);
  }
  // Every rank sees the same request and cache state, so every rank reaches this point with the
  // same batch and makes the same collective calls.
  if (batch.rows() == 0) return result;

  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const size_t pages =
        kv_cache_->page_table(request.segments[batch.segment_of_sequence[s]].sequence_id).size();
    batch.max_pages = std::max(batch.max_pages, static_cast<int32_t>(pages));
  }
  batch.page_table.assign(int64_t{batch.sequences()} * batch.max_pages, 0);
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const std::vector<int32_t>& pages =
        kv_cache_->page_table(request.segments[batch.segment_of_sequence[s]].sequence_id);
    std::copy(pages.begin(), pages.end(), batch.page_table.begin() + int64_t{s} * batch.max_pages);
  }

  const int64_t rows = batch.rows();
  const int64_t hidden_size = c.hidden_size;
  std::vector<float> hidden(rows * hidden_size);
  TV_RETURN_IF_ERROR(
      cpu::Embedding({.token_ids = batch.token_ids.data(),
                      .table = weights_->embedding.data(),
                      .out = hidden.data(),
                      .tokens = rows,
                      .hidden = hidden_size,
                      .vocab_begin = static_cast<int32_t>(weights_->plan.vocab.begin),
                      .vocab_end = static_cast<int32_t>(weights_->plan.vocab.end)}));
  TV_RETURN_IF_ERROR(communicator_->AllReduceSum(absl::MakeSpan(hidden)));
  if (batch.capture_layer[0]) batch.layer_hidden[0] = hidden;
  TV_RETURN_IF_ERROR(RunLayers(batch, hidden));

  TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = hidden.data(),
                                   .weight = weights_->final_norm.data(),
                                   .output = hidden.data(),
                                   .rows = rows,
                                   .dim = hidden_size,
                                   .eps = static_cast<float>(c.rms_norm_eps)}));
  const int64_t vocab_shard = weights_->plan.vocab.size();
  std::vector<float> logits(rows * vocab_shard);
  TV_RETURN_IF_ERROR(cpu::Gemm({.x = hidden.data(),
                                .weight = weights_->lm_head.data(),
                                .y = logits.data(),
                                .m = rows,
                                .n = vocab_shard,
                                .k = hidden_size}));
  TV_RETURN_IF_ERROR(Summarize(request, batch, logits, result));
  return result;
}

// Each sequence has its own sampling parameters, so the summary runs once per sequence; a row's
// summary depends only on its own logits and position, so this changes no result.
absl::Status ModelRunner::Summarize(const ForwardRequest& request, const Batch& batch,
                                    const std::vector<float>& logits, ForwardResult& result) {
  const int64_t hidden_size = weights_->config.hidden_size;
  const int64_t vocab_shard = weights_->plan.vocab.size();
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const size_t segment = batch.segment_of_sequence[s];
    const SegmentInput& input = request.segments[segment];
    SegmentOutput& output = result.segments[segment];
    const int64_t begin = batch.row_offsets[s];
    const int64_t end = batch.row_offsets[s + 1];
    const int32_t num_candidates = input.sampling.candidates;
    output.summaries.resize(end - begin);
    output.candidates.resize((end - begin) * num_candidates);
    TV_RETURN_IF_ERROR(
        cpu::LmHeadSummary({.logits = logits.data() + begin * vocab_shard,
                            .out = output.summaries.data(),
                            .rows = end - begin,
                            .vocab_shard = vocab_shard,
                            .vocab_begin = static_cast<int32_t>(weights_->plan.vocab.begin),
                            .temperature = input.sampling.temperature,
                            .seed = input.sampling.seed,
                            .positions = batch.sample_positions.data() + begin,
                            .num_candidates = num_candidates,
                            .candidates = output.candidates.data()}));
    if (request.return_logits) {
      output.logits.assign(logits.begin() + begin * vocab_shard,
                           logits.begin() + end * vocab_shard);
    }
    for (int32_t layer : input.hidden_state_layers) {
      const std::vector<float>& states = batch.layer_hidden[layer];
      output.hidden_states.push_back(
          {.layer = layer,
           .values = std::vector<float>(states.begin() + begin * hidden_size,
                                        states.begin() + end * hidden_size)});
    }
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::RunLayers(Batch& batch, std::vector<float>& hidden) {
  const ModelConfig& c = weights_->config;
  const int64_t rows = batch.rows();
  std::vector<float> normed(hidden.size());
  std::vector<float> branch(hidden.size());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& layer = weights_->layers[l];
    TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = hidden.data(),
                                     .weight = layer.input_norm.data(),
                                     .output = normed.data(),
                                     .rows = rows,
                                     .dim = c.hidden_size,
                                     .eps = static_cast<float>(c.rms_norm_eps)}));
    TV_RETURN_IF_ERROR(Attention(l, batch, normed, branch));
    TV_RETURN_IF_ERROR(communicator_->AllReduceSum(absl::MakeSpan(branch)));
    for (size_t i = 0; i < hidden.size(); ++i) hidden[i] += branch[i];

    TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = hidden.data(),
                                     .weight = layer.post_norm.data(),
                                     .output = normed.data(),
                                     .rows = rows,
                                     .dim = c.hidden_size,
                                     .eps = static_cast<float>(c.rms_norm_eps)}));
    TV_RETURN_IF_ERROR(Mlp(l, batch, normed, branch));
    TV_RETURN_IF_ERROR(communicator_->AllReduceSum(absl::MakeSpan(branch)));
    for (size_t i = 0; i < hidden.size(); ++i) hidden[i] += branch[i];
    if (batch.capture_layer[l + 1]) batch.layer_hidden[l + 1] = hidden;
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::Attention(int64_t layer_index, Batch& batch,
                                    const std::vector<float>& normed, std::vector<float>& out) {
  const ModelConfig& c = weights_->config;
  const AttentionWeights& w = weights_->layers[layer_index].attention;
  const int64_t rows = batch.rows();
  const int64_t hidden = c.hidden_size;
  const int64_t heads = weights_->plan.heads.size();
  const int64_t nope = c.qk_nope_head_dim;
  const int64_t rope = c.qk_rope_head_dim;
  const int64_t qk = c.qk_head_dim();
  const int64_t lora = c.kv_lora_rank;
  const int64_t row_dim = c.kv_row_dim();
  const int64_t v = c.v_head_dim;

  // Queries: [rows, heads, qk] from the (optionally low-rank) projection.
  std::vector<float> q(rows * heads * qk);
  if (c.q_lora_rank) {
    const int64_t q_lora = *c.q_lora_rank;
    std::vector<float> q_a(rows * q_lora);
    TV_RETURN_IF_ERROR(cpu::Gemm({.x = normed.data(),
                                  .weight = w.q_a_proj.data(),
                                  .y = q_a.data(),
                                  .m = rows,
                                  .n = q_lora,
                                  .k = hidden}));
    TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = q_a.data(),
                                     .weight = w.q_a_norm.data(),
                                     .output = q_a.data(),
                                     .rows = rows,
                                     .dim = q_lora,
                                     .eps = kLatentNormEps}));
    TV_RETURN_IF_ERROR(cpu::Gemm({.x = q_a.data(),
                                  .weight = w.q_proj.data(),
                                  .y = q.data(),
                                  .m = rows,
                                  .n = heads * qk,
                                  .k = q_lora}));
  } else {
    TV_RETURN_IF_ERROR(cpu::Gemm({.x = normed.data(),
                                  .weight = w.q_proj.data(),
                                  .y = q.data(),
                                  .m = rows,
                                  .n = heads * qk,
                                  .k = hidden}));
  }

  // Absorbed queries [rows, heads, lora + rope]: q_nope through W_UK into the latent space, then
  // the rotated rope part.
  std::vector<float> q_attn(rows * heads * row_dim);
  for (int64_t h = 0; h < heads; ++h) {
    TV_RETURN_IF_ERROR(cpu::Gemm({.x = q.data() + h * qk,
                                  .weight = w.w_uk_t.data() + h * lora * nope,
                                  .y = q_attn.data() + h * row_dim,
                                  .m = rows,
                                  .n = lora,
                                  .k = nope,
                                  .x_stride = heads * qk,
                                  .y_stride = heads * row_dim}));
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(q.data() + (r * heads + h) * qk + nope, rope,
                  q_attn.data() + (r * heads + h) * row_dim + lora);
  TV_RETURN_IF_ERROR(cpu::Rope({.x = q_attn.data() + lora,
                                .positions = batch.positions.data(),
                                .inv_freq = rope_inv_freq_.data(),
                                .rows = rows,
                                .heads = heads,
                                .rope_dim = rope,
                                .row_stride = heads * row_dim,
                                .head_stride = row_dim,
                                .attention_factor = rope_attention_factor_,
                                .interleaved = c.rope_interleave}));

  // The new rows' latent KV: normalized latent, rotated shared key; into the cache.
  std::vector<float> kv(rows * row_dim);
  TV_RETURN_IF_ERROR(cpu::Gemm({.x = normed.data(),
                                .weight = w.kv_a_proj.data(),
                                .y = kv.data(),
                                .m = rows,
                                .n = row_dim,
                                .k = hidden}));
  TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = kv.data(),
                                   .weight = w.kv_a_norm.data(),
                                   .output = kv.data(),
                                   .rows = rows,
                                   .dim = lora,
                                   .input_stride = row_dim,
                                   .output_stride = row_dim,
                                   .eps = kLatentNormEps}));
  TV_RETURN_IF_ERROR(cpu::Rope({.x = kv.data() + lora,
                                .positions = batch.positions.data(),
                                .inv_freq = rope_inv_freq_.data(),
                                .rows = rows,
                                .heads = 1,
                                .rope_dim = rope,
                                .row_stride = row_dim,
                                .head_stride = row_dim,
                                .attention_factor = rope_attention_factor_,
                                .interleaved = c.rope_interleave}));
  float* cache = kv_cache_->layer_data(layer_index);
  TV_RETURN_IF_ERROR(cpu::KvAppend(
      {.rows = kv.data(),
       .slots = batch.slots.data(),
       .cache = cache,
       .count = rows,
       .row_dim = row_dim,
       .num_slots = kv_cache_->options().num_pages * kv_cache_->options().page_size}));

  std::vector<float> latent_out(rows * heads * lora);
  std::vector<float> lse(rows * heads);
  TV_RETURN_IF_ERROR(
      cpu::MlaVerifyAttention({.q = q_attn.data(),
                               .kv_cache = cache,
                               .page_table = batch.page_table.data(),
                               .committed_lengths = batch.committed_lengths.data(),
                               .row_offsets = batch.row_offsets.data(),
                               .ancestor_mask = batch.ancestor_mask.data(),
                               .out = latent_out.data(),
                               .lse = lse.data(),
                               .num_seqs = batch.sequences(),
                               .num_heads = static_cast<int32_t>(heads),
                               .latent_dim = static_cast<int32_t>(lora),
                               .rope_dim = static_cast<int32_t>(rope),
                               .page_size = kv_cache_->options().page_size,
                               .max_pages_per_seq = batch.max_pages,
                               .num_pages = static_cast<int32_t>(kv_cache_->options().num_pages),
                               .softmax_scale = softmax_scale_}));

  // Back out of the latent space through W_UV, then o_proj (a partial sum over this rank's
  // heads; the caller all-reduces).
  std::vector<float> values(rows * heads * v);
  for (int64_t h = 0; h < heads; ++h) {
    TV_RETURN_IF_ERROR(cpu::Gemm({.x = latent_out.data() + h * lora,
                                  .weight = w.w_uv.data() + h * v * lora,
                                  .y = values.data() + h * v,
                                  .m = rows,
                                  .n = v,
                                  .k = lora,
                                  .x_stride = heads * lora,
                                  .y_stride = heads * v}));
  }
  return cpu::Gemm({.x = values.data(),
                    .weight = w.o_proj.data(),
                    .y = out.data(),
                    .m = rows,
                    .n = hidden,
                    .k = heads * v});
}

namespace {

// out = down(silu(gate(x)) * up(x)) for one rank's columns of a gated MLP.
absl::Status GatedMlp(const MlpWeights& mlp, const float* x, int64_t rows, int64_t hidden,
                      float* out) {
  std::vector<float> gate_up(rows * 2 * mlp.intermediate);
  TV_RETURN_IF_ERROR(cpu::Gemm({.x = x,
                                .weight = mlp.gate_up.data(),
                                .y = gate_up.data(),
                                .m = rows,
                                .n = 2 * mlp.intermediate,
                                .k = hidden}));
  std::vector<float> activated(rows * mlp.intermediate);
  TV_RETURN_IF_ERROR(cpu::SiluMul(
      {.gate_up = gate_up.data(), .out = activated.data(), .rows = rows, .dim = mlp.intermediate}));
  return cpu::Gemm({.x = activated.data(),
                    .weight = mlp.down.data(),
                    .y = out,
                    .m = rows,
                    .n = hidden,
                    .k = mlp.intermediate});
}

}  // namespace

absl::Status ModelRunner::Mlp(int64_t layer_index, Batch& batch, const std::vector<float>& normed,
                              std::vector<float>& out) {
  const ModelConfig& c = weights_->config;
  const LayerWeights& layer = weights_->layers[layer_index];
  const int64_t rows = batch.rows();
  const int64_t hidden = c.hidden_size;
  if (!layer.is_moe) return GatedMlp(layer.dense, normed.data(), rows, hidden, out.data());

  const MoeWeights& moe = layer.moe;
  const int32_t experts = static_cast<int32_t>(c.n_routed_experts);
  const int32_t top_k = static_cast<int32_t>(c.num_experts_per_tok);
  std::vector<float> router_logits(rows * experts);
  TV_RETURN_IF_ERROR(cpu::Gemm({.x = normed.data(),
                                .weight = moe.router.data(),
                                .y = router_logits.data(),
                                .m = rows,
                                .n = experts,
                                .k = hidden}));
  std::vector<int32_t> topk_ids(rows * top_k);
  std::vector<float> topk_weights(rows * top_k);
  TV_RETURN_IF_ERROR(cpu::MoeRouting(
      {.router_logits = router_logits.data(),
       .correction_bias = moe.correction_bias.empty() ? nullptr : moe.correction_bias.data(),
       .topk_ids = topk_ids.data(),
       .topk_weights = topk_weights.data(),
       .tokens = rows,
       .num_experts = experts,
       .top_k = top_k,
       .num_groups = static_cast<int32_t>(c.n_group),
       .topk_groups = static_cast<int32_t>(c.topk_group),
       .scoring = c.scoring_func,
       .method = c.topk_method,
       .normalize = c.norm_topk_prob,
       .routed_scaling_factor = static_cast<float>(c.routed_scaling_factor)}));
  const ShardingPlan& plan = weights_->plan;
  TV_RETURN_IF_ERROR(
      cpu::MoeExperts({.x = normed.data(),
                       .topk_ids = topk_ids.data(),
                       .topk_weights = topk_weights.data(),
                       .gate_proj = moe.gate_ptrs.data(),
                       .up_proj = moe.up_ptrs.data(),
                       .down_proj = moe.down_ptrs.data(),
                       .out = out.data(),
                       .tokens = rows,
                       .top_k = top_k,
                       .hidden = hidden,
                       .intermediate = plan.expert_intermediate.size(),
                       .first_expert = static_cast<int32_t>(plan.experts.begin),
                       .num_local_experts = static_cast<int32_t>(plan.experts.size())}));
  if (moe.shared.intermediate > 0) {
    std::vector<float> shared(rows * hidden);
    TV_RETURN_IF_ERROR(GatedMlp(moe.shared, normed.data(), rows, hidden, shared.data()));
    for (size_t i = 0; i < shared.size(); ++i) out[i] += shared[i];
  }
  return absl::OkStatus();
}

}  // namespace treeverify::worker
