#include "treeverify/worker/step_accounting.h"

namespace treeverify::worker {

const char* StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kEmbed:
      return "embed";
    case StepPhase::kAttention:
      return "attention";
    case StepPhase::kMoe:
      return "moe";
    case StepPhase::kAllReduce:
      return "allreduce";
    case StepPhase::kLmHead:
      return "lm_head";
    case StepPhase::kKvCommit:
      return "kv_commit";
  }
  return "unknown";
}

double StepAccount::total_bytes() const {
  double bytes = 0.0;
  for (const PhaseAccount& p : phases) bytes += p.modeled_bytes;
  return bytes;
}

double StepAccount::Bandwidth(StepPhase p) const {
  const PhaseAccount& account = phase(p);
  return account.seconds > 0.0 ? account.modeled_bytes / account.seconds : 0.0;
}

double StepAccount::Utilization(StepPhase p) const {
  return copy_bytes_per_second > 0.0 ? Bandwidth(p) / copy_bytes_per_second : 0.0;
}

double StepAccount::TotalBandwidth() const {
  return total_seconds > 0.0 ? total_bytes() / total_seconds : 0.0;
}

double StepAccount::TotalUtilization() const {
  return copy_bytes_per_second > 0.0 ? TotalBandwidth() / copy_bytes_per_second : 0.0;
}

// Weights and KV rows as the backend stores them (StepShape: bf16 on GPUs, fp32 on CPUs), the
// correction bias fp32. Activations are left out:
// at verify sizes they are a fraction of a percent of the weights (16 rows of 7168 against
// matrices of 7168 x 1536 and up).
void ModelStepBytes(const ModelConfig& c, const ShardingPlan& plan, const StepShape& shape,
                    StepAccount& account) {
  const double weight = shape.weight_bytes;
  const double hidden = static_cast<double>(c.hidden_size);
  const double heads = static_cast<double>(plan.heads.size());
  const double row_dim = static_cast<double>(c.kv_row_dim());
  const double rows = static_cast<double>(shape.rows);
  for (PhaseAccount& p : account.phases) p.modeled_bytes = 0.0;

  // Embedding: the rows' table rows read, the fp32 residual written.
  account.phase(StepPhase::kEmbed).modeled_bytes = rows * hidden * (weight + 4.0);

  const double projection = shape.projection_weight_bytes;
  double attention_weight_bytes = hidden * weight;  // input norm
  if (c.q_lora_rank) {
    const double q_lora = static_cast<double>(*c.q_lora_rank);
    attention_weight_bytes +=
        (q_lora * hidden + heads * c.qk_head_dim() * q_lora) * projection + q_lora * weight;
  } else {
    attention_weight_bytes += heads * c.qk_head_dim() * hidden * projection;
  }
  attention_weight_bytes +=
      row_dim * hidden * projection + c.kv_lora_rank * weight;  // kv_a, its norm
  attention_weight_bytes +=
      heads * c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim) * projection;  // W_UK, W_UV
  attention_weight_bytes += hidden * heads * c.v_head_dim * projection;           // o_proj
  double keys = 0.0;
  for (int64_t k : shape.keys) keys += static_cast<double>(k);
  const double kv_bytes = (keys + rows) * row_dim * shape.kv_bytes;  // read every key, write new
  account.phase(StepPhase::kAttention).modeled_bytes =
      c.num_hidden_layers * (attention_weight_bytes + kv_bytes);

  double moe = 0.0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    double layer = hidden;  // post-attention norm
    if (c.is_moe_layer(l)) {
      const double active =
          l < static_cast<int64_t>(shape.active_experts.size()) ? shape.active_experts[l] : 0;
      layer += c.n_routed_experts * hidden;  // router
      const double shared = 3.0 * hidden * static_cast<double>(plan.shared_intermediate.size());
      const double experts =
          active * 3.0 * hidden * static_cast<double>(plan.expert_intermediate.size());
      // + the fp32 correction bias
      moe += layer * weight + shared * projection + experts * shape.expert_weight_bytes +
             c.n_routed_experts * 4.0;
    } else {
      const double dense = 3.0 * hidden * static_cast<double>(plan.dense_intermediate.size());
      moe += layer * weight + dense * projection;
    }
  }
  account.phase(StepPhase::kMoe).modeled_bytes = moe;
  account.phase(StepPhase::kLmHead).modeled_bytes =
      (hidden + static_cast<double>(plan.vocab.size()) * hidden) * weight;
  account.phase(StepPhase::kKvCommit).modeled_bytes = static_cast<double>(shape.committed_moves) *
                                                      c.num_hidden_layers * row_dim *
                                                      shape.kv_bytes * 2.0;
}

}  // namespace treeverify::worker
