#include "treeverify/worker/model_weights.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/quantized_weights.h"
#include "treeverify/worker/safetensors.h"

namespace treeverify::worker {
namespace {

// A rank's row range of a checkpoint tensor, as fp32 (dequantized if stored quantized:
// quantized_weights.h).
absl::StatusOr<std::vector<float>> Rows(const WeightReader& checkpoint, const std::string& name,
                                        const std::vector<int64_t>& shape, ShardRange rows) {
  return checkpoint.ReadRows(name, shape, rows.begin, rows.end);
}

// Rows [r0, r1) x columns [c0, c1) of a checkpoint matrix: its fp32 values, and where the
// checkpoint stores it INT4 or FP8 the slice as stored, read once and dequantized from it.
struct StoredMatrix {
  std::vector<float> values;
  std::optional<Int4Matrix> int4;
  std::optional<Fp8Matrix> fp8;
};
absl::StatusOr<StoredMatrix> LoadMatrix(const WeightReader& reader, const std::string& name,
                                        const std::vector<int64_t>& shape, int64_t r0, int64_t r1,
                                        int64_t c0, int64_t c1) {
  StoredMatrix m;
  TV_ASSIGN_OR_RETURN(m.int4, reader.ReadInt4(name, shape, r0, r1, c0, c1));
  TV_ASSIGN_OR_RETURN(m.fp8, reader.ReadFp8(name, shape, r0, r1, c0, c1));
  if (m.int4) {
    m.values = Dequantized(*m.int4);
  } else if (m.fp8) {
    m.values = Dequantized(*m.fp8);
  } else if (c0 == 0 && c1 == shape[1]) {
    TV_ASSIGN_OR_RETURN(m.values, reader.ReadRows(name, shape, r0, r1));
  } else {
    TV_ASSIGN_OR_RETURN(m.values, reader.ReadColumns(name, shape, c0, c1));
  }
  return m;
}

// A dense projection's rows (or columns) `range` ({} for all of them): its values, and its slice
// as stored where the checkpoint stores it FP8.
absl::StatusOr<std::vector<float>> Projection(const WeightReader& reader, const std::string& name,
                                              const std::vector<int64_t>& shape,
                                              std::optional<Fp8Matrix>& fp8,
                                              std::optional<ShardRange> rows = std::nullopt,
                                              std::optional<ShardRange> columns = std::nullopt) {
  const ShardRange r = rows.value_or(ShardRange{0, shape[0]});
  const ShardRange c = columns.value_or(ShardRange{0, shape[1]});
  TV_ASSIGN_OR_RETURN(StoredMatrix m,
                      LoadMatrix(reader, name, shape, r.begin, r.end, c.begin, c.end));
  fp8 = std::move(m.fp8);
  return std::move(m.values);
}

// `top`'s rows over `bottom`'s, where both are FP8 with the same columns and blocks and `top` ends
// on a block edge (else the blocks would not be the matrices'): nullopt otherwise.
std::optional<Fp8Matrix> StackRows(const std::optional<Fp8Matrix>& top,
                                   const std::optional<Fp8Matrix>& bottom) {
  if (!top || !bottom || top->cols != bottom->cols || top->block_rows != bottom->block_rows ||
      top->block_cols != bottom->block_cols || top->rows % top->block_rows != 0) {
    return std::nullopt;
  }
  Fp8Matrix stacked = *top;
  stacked.rows += bottom->rows;
  stacked.bytes.insert(stacked.bytes.end(), bottom->bytes.begin(), bottom->bytes.end());
  stacked.scales.insert(stacked.scales.end(), bottom->scales.begin(), bottom->scales.end());
  return stacked;
}

// A gated MLP [gate; up] x down whose intermediate columns `columns` this rank holds.
absl::StatusOr<MlpWeights> LoadMlp(const WeightReader& reader, const std::string& prefix,
                                   int64_t hidden, int64_t intermediate, ShardRange columns) {
  MlpWeights mlp;
  mlp.intermediate = columns.size();
  std::optional<Fp8Matrix> fp8_gate, fp8_up;
  TV_ASSIGN_OR_RETURN(
      std::vector<float> gate,
      Projection(reader, prefix + "gate_proj.weight", {intermediate, hidden}, fp8_gate, columns));
  TV_ASSIGN_OR_RETURN(std::vector<float> up, Projection(reader, prefix + "up_proj.weight",
                                                        {intermediate, hidden}, fp8_up, columns));
  mlp.gate_up = std::move(gate);
  mlp.gate_up.insert(mlp.gate_up.end(), up.begin(), up.end());
  mlp.fp8_gate_up = StackRows(fp8_gate, fp8_up);
  TV_ASSIGN_OR_RETURN(mlp.down,
                      Projection(reader, prefix + "down_proj.weight", {hidden, intermediate},
                                 mlp.fp8_down, std::nullopt, columns));
  return mlp;
}

absl::StatusOr<AttentionWeights> LoadAttention(const WeightReader& reader,
                                               const std::string& prefix, const ModelConfig& c,
                                               const ShardingPlan& plan) {
  AttentionWeights a;
  const int64_t hidden = c.hidden_size;
  const int64_t heads = c.num_attention_heads;
  const int64_t local_heads = plan.heads.size();
  const int64_t qk = c.qk_head_dim();
  const ShardRange q_rows{plan.heads.begin * qk, plan.heads.end * qk};
  if (c.q_lora_rank.has_value()) {
    const int64_t q_lora = *c.q_lora_rank;
    TV_ASSIGN_OR_RETURN(a.q_a_proj, Projection(reader, prefix + "q_a_proj.weight", {q_lora, hidden},
                                               a.fp8_q_a_proj));
    TV_ASSIGN_OR_RETURN(a.q_a_norm, reader.Read(prefix + "q_a_layernorm.weight", {q_lora}));
    TV_ASSIGN_OR_RETURN(a.q_proj, Projection(reader, prefix + "q_b_proj.weight",
                                             {heads * qk, q_lora}, a.fp8_q_proj, q_rows));
  } else {
    TV_ASSIGN_OR_RETURN(a.q_proj, Projection(reader, prefix + "q_proj.weight", {heads * qk, hidden},
                                             a.fp8_q_proj, q_rows));
  }
  TV_ASSIGN_OR_RETURN(a.kv_a_proj, Projection(reader, prefix + "kv_a_proj_with_mqa.weight",
                                              {c.kv_row_dim(), hidden}, a.fp8_kv_a_proj));
  TV_ASSIGN_OR_RETURN(a.kv_a_norm, reader.Read(prefix + "kv_a_layernorm.weight", {c.kv_lora_rank}));

  // kv_b_proj rows per head: qk_nope_head_dim key rows, then v_head_dim value rows, each
  // kv_lora_rank wide. The absorbed form needs the key part transposed (q_nope -> latent).
  const int64_t nope = c.qk_nope_head_dim;
  const int64_t v = c.v_head_dim;
  const int64_t lora = c.kv_lora_rank;
  TV_ASSIGN_OR_RETURN(
      std::vector<float> kv_b,
      Projection(reader, prefix + "kv_b_proj.weight", {heads * (nope + v), lora}, a.fp8_kv_b_proj,
                 ShardRange{plan.heads.begin * (nope + v), plan.heads.end * (nope + v)}));
  a.w_uk_t.resize(local_heads * lora * nope);
  a.w_uv.resize(local_heads * v * lora);
  for (int64_t h = 0; h < local_heads; ++h) {
    const float* head_rows = kv_b.data() + h * (nope + v) * lora;
    for (int64_t d = 0; d < nope; ++d)
      for (int64_t l = 0; l < lora; ++l)
        a.w_uk_t[(h * lora + l) * nope + d] = head_rows[d * lora + l];
    std::copy(head_rows + nope * lora, head_rows + (nope + v) * lora,
              a.w_uv.begin() + h * v * lora);
  }
  TV_ASSIGN_OR_RETURN(
      a.o_proj, Projection(reader, prefix + "o_proj.weight", {hidden, heads * v}, a.fp8_o_proj,
                           std::nullopt, ShardRange{plan.heads.begin * v, plan.heads.end * v}));
  return a;
}

// An expert's stored gate, up and down, kept where all three are stored so.
template <typename Matrix>
void KeepStored(std::optional<Matrix>& gate, std::optional<Matrix>& up, std::optional<Matrix>& down,
                std::vector<Matrix>& gates, std::vector<Matrix>& ups, std::vector<Matrix>& downs) {
  if (!gate || !up || !down) return;
  gates.push_back(*std::move(gate));
  ups.push_back(*std::move(up));
  downs.push_back(*std::move(down));
}

absl::StatusOr<MoeWeights> LoadMoe(const WeightReader& reader, const std::string& prefix,
                                   const ModelConfig& c, const ShardingPlan& plan) {
  MoeWeights m;
  const int64_t hidden = c.hidden_size;
  const int64_t experts = c.n_routed_experts;
  const int64_t inter = c.moe_intermediate_size;
  TV_ASSIGN_OR_RETURN(m.router, reader.Read(prefix + "gate.weight", {experts, hidden}));
  if (c.topk_method == kernels::MoeTopkMethod::kNoauxTc) {
    TV_ASSIGN_OR_RETURN(m.correction_bias,
                        reader.Read(prefix + "gate.e_score_correction_bias", {experts}));
  }
  for (int64_t e = plan.experts.begin; e < plan.experts.end; ++e) {
    const std::string expert = absl::StrCat(prefix, "experts.", e, ".");
    const ShardRange columns = plan.expert_intermediate;
    TV_ASSIGN_OR_RETURN(StoredMatrix gate,
                        LoadMatrix(reader, expert + "gate_proj.weight", {inter, hidden},
                                   columns.begin, columns.end, 0, hidden));
    TV_ASSIGN_OR_RETURN(StoredMatrix up,
                        LoadMatrix(reader, expert + "up_proj.weight", {inter, hidden},
                                   columns.begin, columns.end, 0, hidden));
    TV_ASSIGN_OR_RETURN(StoredMatrix down,
                        LoadMatrix(reader, expert + "down_proj.weight", {hidden, inter}, 0, hidden,
                                   columns.begin, columns.end));
    m.gate_proj.push_back(std::move(gate.values));
    m.up_proj.push_back(std::move(up.values));
    m.down_proj.push_back(std::move(down.values));
    KeepStored(gate.int4, up.int4, down.int4, m.int4_gate, m.int4_up, m.int4_down);
    KeepStored(gate.fp8, up.fp8, down.fp8, m.fp8_gate, m.fp8_up, m.fp8_down);
  }
  // Quantized for the GPU only where every held expert is.
  if (m.int4_gate.size() != m.gate_proj.size()) {
    m.int4_gate.clear();
    m.int4_up.clear();
    m.int4_down.clear();
  }
  if (m.fp8_gate.size() != m.gate_proj.size()) {
    m.fp8_gate.clear();
    m.fp8_up.clear();
    m.fp8_down.clear();
  }
  for (size_t i = 0; i < m.gate_proj.size(); ++i) {
    m.gate_ptrs.push_back(m.gate_proj[i].data());
    m.up_ptrs.push_back(m.up_proj[i].data());
    m.down_ptrs.push_back(m.down_proj[i].data());
  }
  if (c.n_shared_experts > 0) {
    TV_ASSIGN_OR_RETURN(m.shared, LoadMlp(reader, prefix + "shared_experts.", hidden,
                                          inter * c.n_shared_experts, plan.shared_intermediate));
  }
  return m;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelWeights>> ModelWeights::Load(const std::string& dir,
                                                                 const ModelConfig& c,
                                                                 const ShardingPlan& plan) {
  TV_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(dir));
  const WeightReader reader(*checkpoint, c.quantization);
  auto w = std::make_unique<ModelWeights>();
  w->config = c;
  w->plan = plan;
  const int64_t hidden = c.hidden_size;
  TV_ASSIGN_OR_RETURN(
      w->embedding, Rows(reader, "model.embed_tokens.weight", {c.vocab_size, hidden}, plan.vocab));
  TV_ASSIGN_OR_RETURN(w->final_norm, reader.Read("model.norm.weight", {hidden}));
  const std::string lm_head =
      c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  TV_ASSIGN_OR_RETURN(w->lm_head, Rows(reader, lm_head, {c.vocab_size, hidden}, plan.vocab));

  w->layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& layer = w->layers[l];
    const std::string prefix = absl::StrCat("model.layers.", l, ".");
    TV_ASSIGN_OR_RETURN(layer.input_norm, reader.Read(prefix + "input_layernorm.weight", {hidden}));
    TV_ASSIGN_OR_RETURN(layer.post_norm,
                        reader.Read(prefix + "post_attention_layernorm.weight", {hidden}));
    TV_ASSIGN_OR_RETURN(layer.attention, LoadAttention(reader, prefix + "self_attn.", c, plan));
    layer.is_moe = c.is_moe_layer(l);
    if (layer.is_moe) {
      TV_ASSIGN_OR_RETURN(layer.moe, LoadMoe(reader, prefix + "mlp.", c, plan));
    } else {
      TV_ASSIGN_OR_RETURN(layer.dense, LoadMlp(reader, prefix + "mlp.", hidden, c.intermediate_size,
                                               plan.dense_intermediate));
    }
  }
  return w;
}

}  // namespace treeverify::worker
