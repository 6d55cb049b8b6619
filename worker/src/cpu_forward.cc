#include "treeverify/worker/cpu_forward.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "treeverify/kernels/activation.h"
#include "treeverify/kernels/embedding.h"
#include "treeverify/kernels/gemm.h"
#include "treeverify/kernels/kv_cache_ops.h"
#include "treeverify/kernels/mla_verify_attention.h"
#include "treeverify/kernels/moe.h"
#include "treeverify/kernels/rms_norm.h"
#include "treeverify/kernels/rope.h"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/host_copy_bandwidth.h"

namespace treeverify::worker {

namespace cpu = kernels::cpu;

// Charges the wall time since the previous mark to a phase of the step's account.
class CpuForward::PhaseClock {
 public:
  explicit PhaseClock(StepAccount& account)
      : account_(account), last_(std::chrono::steady_clock::now()) {}
  void Mark(StepPhase phase) {
    const auto now = std::chrono::steady_clock::now();
    account_.phase(phase).seconds += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  StepAccount& account_;
  std::chrono::steady_clock::time_point last_;
};

absl::StatusOr<std::unique_ptr<CpuForward>> CpuForward::Create(const ModelWeights& weights,
                                                               CpuKvStorage& kv_rows,
                                                               Communicator* communicator) {
  TV_RETURN_IF_ERROR(
      CheckForwardInputs("CpuForward", weights.config, kv_rows.options(), communicator));
  return std::unique_ptr<CpuForward>(new CpuForward(weights, kv_rows, communicator));
}

absl::StatusOr<ForwardParts> MakeCpuForward(const ModelWeights& weights,
                                            const KvCacheOptions& cache,
                                            Communicator* communicator) {
  TV_ASSIGN_OR_RETURN(std::unique_ptr<CpuKvStorage> rows, CpuKvStorage::Create(cache));
  TV_ASSIGN_OR_RETURN(std::unique_ptr<CpuForward> backend,
                      CpuForward::Create(weights, *rows, communicator));
  return ForwardParts{.kv_rows = std::move(rows), .backend = std::move(backend)};
}

CpuForward::CpuForward(const ModelWeights& weights, CpuKvStorage& kv_rows,
                       Communicator* communicator)
    : weights_(weights),
      kv_rows_(kv_rows),
      communicator_(communicator),
      copy_bytes_per_second_(HostCopyBandwidth()) {
  rope_inv_freq_ = weights_.config.rope_inv_freq();
  rope_attention_factor_ = static_cast<float>(weights_.config.rope_attention_factor());
  softmax_scale_ = static_cast<float>(weights_.config.softmax_scale());
}

absl::Status CpuForward::Run(const BatchInputs& batch, ForwardOutputs& outputs) {
  const ModelConfig& c = weights_.config;
  outputs = ForwardOutputs();
  outputs.layer_hidden.resize(c.num_hidden_layers + 1);
  const int64_t rows = batch.rows();
  const int64_t hidden_size = c.hidden_size;
  StepAccount account;
  PhaseClock clock(account);
  active_experts_.assign(c.num_hidden_layers, 0);
  std::vector<float> hidden(rows * hidden_size);
  TV_RETURN_IF_ERROR(cpu::Embedding({.token_ids = batch.token_ids.data(),
                                     .table = weights_.embedding.data(),
                                     .out = hidden.data(),
                                     .tokens = rows,
                                     .hidden = hidden_size,
                                     .vocab_begin = static_cast<int32_t>(weights_.plan.vocab.begin),
                                     .vocab_end = static_cast<int32_t>(weights_.plan.vocab.end)}));
  clock.Mark(StepPhase::kEmbed);
  TV_RETURN_IF_ERROR(communicator_->AllReduceSum(absl::MakeSpan(hidden)));
  clock.Mark(StepPhase::kAllReduce);
  if (batch.capture_layer[0]) outputs.layer_hidden[0] = hidden;
  TV_RETURN_IF_ERROR(RunLayers(batch, hidden, outputs, clock));

  TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = hidden.data(),
                                   .weight = weights_.final_norm.data(),
                                   .output = hidden.data(),
                                   .rows = rows,
                                   .dim = hidden_size,
                                   .eps = static_cast<float>(c.rms_norm_eps)}));
  const int64_t vocab_shard = weights_.plan.vocab.size();
  std::vector<float> logits(rows * vocab_shard);
  TV_RETURN_IF_ERROR(cpu::Gemm({.x = hidden.data(),
                                .weight = weights_.lm_head.data(),
                                .y = logits.data(),
                                .m = rows,
                                .n = vocab_shard,
                                .k = hidden_size}));
  TV_RETURN_IF_ERROR(SummarizeLogits(batch, logits.data(), vocab_shard,
                                     static_cast<int32_t>(weights_.plan.vocab.begin), outputs));
  if (batch.return_logits) outputs.logits = std::move(logits);
  clock.Mark(StepPhase::kLmHead);
  Account(batch, account);
  return absl::OkStatus();
}

void CpuForward::Account(const BatchInputs& batch, StepAccount& account) {
  account.copy_bytes_per_second = copy_bytes_per_second_;
  account.rows = account.padded_rows = batch.rows();
  account.sequences = account.padded_sequences = batch.sequences();
  account.active_experts = active_experts_;
  StepShape shape{.rows = batch.rows(),
                  .active_experts = active_experts_,
                  .weight_bytes = sizeof(float),
                  .kv_bytes = sizeof(float),
                  .expert_weight_bytes = sizeof(float),
                  .projection_weight_bytes = sizeof(float)};
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    shape.keys.push_back(int64_t{batch.committed_lengths[s]} + batch.row_offsets[s + 1] -
                         batch.row_offsets[s]);
  }
  ModelStepBytes(weights_.config, weights_.plan, shape, account);
  for (const PhaseAccount& phase : account.phases) account.total_seconds += phase.seconds;
  last_account_ = std::move(account);
}

absl::Status CpuForward::RunLayers(const BatchInputs& batch, std::vector<float>& hidden,
                                   ForwardOutputs& outputs, PhaseClock& clock) {
  const ModelConfig& c = weights_.config;
  const int64_t rows = batch.rows();
  std::vector<float> normed(hidden.size());
  std::vector<float> branch(hidden.size());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& layer = weights_.layers[l];
    TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = hidden.data(),
                                     .weight = layer.input_norm.data(),
                                     .output = normed.data(),
                                     .rows = rows,
                                     .dim = c.hidden_size,
                                     .eps = static_cast<float>(c.rms_norm_eps)}));
    TV_RETURN_IF_ERROR(Attention(l, batch, normed, branch));
    clock.Mark(StepPhase::kAttention);
    TV_RETURN_IF_ERROR(communicator_->AllReduceSum(absl::MakeSpan(branch)));
    clock.Mark(StepPhase::kAllReduce);
    for (size_t i = 0; i < hidden.size(); ++i) hidden[i] += branch[i];

    TV_RETURN_IF_ERROR(cpu::RmsNorm({.input = hidden.data(),
                                     .weight = layer.post_norm.data(),
                                     .output = normed.data(),
                                     .rows = rows,
                                     .dim = c.hidden_size,
                                     .eps = static_cast<float>(c.rms_norm_eps)}));
    TV_RETURN_IF_ERROR(Mlp(l, batch, normed, branch));
    clock.Mark(StepPhase::kMoe);
    TV_RETURN_IF_ERROR(communicator_->AllReduceSum(absl::MakeSpan(branch)));
    clock.Mark(StepPhase::kAllReduce);
    for (size_t i = 0; i < hidden.size(); ++i) hidden[i] += branch[i];
    if (batch.capture_layer[l + 1]) outputs.layer_hidden[l + 1] = hidden;
  }
  return absl::OkStatus();
}

absl::Status CpuForward::Attention(int64_t layer_index, const BatchInputs& batch,
                                   const std::vector<float>& normed, std::vector<float>& out) {
  const ModelConfig& c = weights_.config;
  const AttentionWeights& w = weights_.layers[layer_index].attention;
  const int64_t rows = batch.rows();
  const int64_t hidden = c.hidden_size;
  const int64_t heads = weights_.plan.heads.size();
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
  float* cache = kv_rows_.layer_data(layer_index);
  TV_RETURN_IF_ERROR(
      cpu::KvAppend({.rows = kv.data(),
                     .slots = batch.slots.data(),
                     .cache = cache,
                     .count = rows,
                     .row_dim = row_dim,
                     .num_slots = kv_rows_.options().num_pages * kv_rows_.options().page_size}));

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
                               .page_size = kv_rows_.options().page_size,
                               .max_pages_per_seq = batch.max_pages,
                               .num_pages = static_cast<int32_t>(kv_rows_.options().num_pages),
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

absl::Status CpuForward::Mlp(int64_t layer_index, const BatchInputs& batch,
                             const std::vector<float>& normed, std::vector<float>& out) {
  const ModelConfig& c = weights_.config;
  const LayerWeights& layer = weights_.layers[layer_index];
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
  std::vector<float> shared;
  if (moe.shared.intermediate > 0) {
    shared.resize(rows * hidden);
    TV_RETURN_IF_ERROR(GatedMlp(moe.shared, normed.data(), rows, hidden, shared.data()));
  }
  const ShardingPlan& plan = weights_.plan;
  // The local experts with tokens: the bytes model's experts this layer must read.
  std::vector<bool> active(plan.experts.size(), false);
  for (int32_t id : topk_ids) {
    const int64_t local = id - plan.experts.begin;
    if (local >= 0 && local < plan.experts.size()) active[local] = true;
  }
  active_experts_[layer_index] =
      static_cast<int32_t>(std::count(active.begin(), active.end(), true));
  return cpu::MoeExperts({.x = normed.data(),
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
                          .num_local_experts = static_cast<int32_t>(plan.experts.size()),
                          .shared_out = shared.empty() ? nullptr : shared.data()});
}

}  // namespace treeverify::worker
