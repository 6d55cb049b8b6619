// CPU MoE routing (the DeepSeek-V2 / V3 routers of transformers) and expert computation.
//
// Routing follows transformers' DeepseekV3TopkRouter (sigmoid + noaux_tc) and
// DeepseekV2TopkRouter (softmax + greedy / group_limited_greedy) step by step, including their
// masking (-inf for noaux_tc, 0.0 for group_limited_greedy). Any scoring may be combined with any
// method. Where torch leaves an order unspecified we fix one:
//  - top-k ties (equal values) go to the lower index, for groups and for experts;
//  - selected experts are returned in ascending id, their weights permuted alike;
//  - the normalization sum runs in double over the selected experts in ascending id.
// Sigmoid and softmax are evaluated in double and rounded to fp32 (torch computes them in fp32,
// so scores may differ from torch's in the last bit).
//
// Experts: every local expert runs its tokens as one batch through cpu::Gemm (batch invariant:
// a row's product does not depend on the other rows), and the weighted results are added to each
// token's output in ascending expert id, so a token's sum is the same in any batch.
//
// Roofline of the experts: each local expert with n routed tokens moves its 3 * hidden *
// intermediate weights (the bound at decode sizes: 44 MB per DeepSeek-V3 expert in fp32) and does
// 6 * n * hidden * intermediate flops.
#include "treeverify/kernels/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "treeverify/kernels/activation.h"
#include "treeverify/kernels/gemm.h"
#include "treeverify/kernels/status.h"
#include "treeverify/kernels/top_k.h"

namespace treeverify::kernels::cpu {
namespace {

void SortAscending(int32_t* ids, int32_t n) {
  for (int32_t i = 1; i < n; ++i) {
    const int32_t id = ids[i];
    int32_t j = i;
    for (; j > 0 && ids[j - 1] > id; --j) ids[j] = ids[j - 1];
    ids[j] = id;
  }
}

absl::Status ValidateRouting(const MoeRoutingParams& p) {
  if (p.num_experts <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeRouting: num_experts must be > 0, got ", p.num_experts));
  }
  if (p.top_k <= 0 || p.top_k > p.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("MoeRouting: top_k must be in [1, num_experts (",
                                                   p.num_experts, ")], got ", p.top_k));
  }
  if (p.num_groups <= 0 || p.num_experts % p.num_groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeRouting: num_groups must be > 0 and divide num_experts (", p.num_experts,
                     "), got ", p.num_groups));
  }
  if (p.topk_groups <= 0 || p.topk_groups > p.num_groups) {
    return absl::InvalidArgumentError(absl::StrCat("MoeRouting: topk_groups must be in [1, ",
                                                   "num_groups (", p.num_groups, ")], got ",
                                                   p.topk_groups));
  }
  if (p.tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeRouting: tokens must be >= 0, got ", p.tokens));
  }
  const int32_t group_size = p.num_experts / p.num_groups;
  if (p.method != MoeTopkMethod::kGreedy) {
    // Group-limited methods: the kept groups must hold top_k experts (else transformers would
    // pick masked experts).
    if (static_cast<int64_t>(p.top_k) > static_cast<int64_t>(p.topk_groups) * group_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("MoeRouting: top_k must be <= topk_groups * (num_experts / num_groups) (",
                       p.topk_groups * group_size, "), got ", p.top_k));
    }
  }
  if (p.method == MoeTopkMethod::kNoauxTc) {
    if (p.correction_bias == nullptr) {
      return absl::InvalidArgumentError("MoeRouting: correction_bias is null (noaux_tc needs it)");
    }
    // transformers ranks groups by topk(2) of each group, which needs two experts per group.
    if (group_size < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MoeRouting: noaux_tc needs num_experts / num_groups >= 2, got ", group_size));
    }
  }
  if (p.tokens == 0) return absl::OkStatus();
  if (p.router_logits == nullptr) {
    return absl::InvalidArgumentError("MoeRouting: router_logits is null");
  }
  if (p.topk_ids == nullptr) return absl::InvalidArgumentError("MoeRouting: topk_ids is null");
  if (p.topk_weights == nullptr) {
    return absl::InvalidArgumentError("MoeRouting: topk_weights is null");
  }
  return absl::OkStatus();
}

// Per-thread scratch for one token's routing.
struct RoutingScratch {
  explicit RoutingScratch(const MoeRoutingParams& p)
      : scores(p.num_experts),
        choice(p.num_experts),
        group_scores(p.num_groups),
        kept_groups(p.topk_groups),
        group_kept(p.num_groups) {}
  std::vector<float> scores;        // sigmoid or softmax of the logits
  std::vector<float> choice;        // what experts are ranked by, masked to the kept groups
  std::vector<float> group_scores;  // [num_groups]
  std::vector<int32_t> kept_groups;
  std::vector<char> group_kept;
};

void RouteToken(const MoeRoutingParams& p, int64_t token, RoutingScratch& s) {
  const int32_t num_experts = p.num_experts;
  const float* logits = p.router_logits + token * num_experts;
  if (p.scoring == MoeScoring::kSigmoid) {
    for (int32_t e = 0; e < num_experts; ++e) {
      s.scores[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(logits[e]))));
    }
  } else {
    float max_logit = logits[0];
    for (int32_t e = 1; e < num_experts; ++e) max_logit = std::max(max_logit, logits[e]);
    double sum = 0.0;
    for (int32_t e = 0; e < num_experts; ++e) sum += std::exp(double{logits[e]} - max_logit);
    for (int32_t e = 0; e < num_experts; ++e) {
      s.scores[e] = static_cast<float>(std::exp(double{logits[e]} - max_logit) / sum);
    }
  }

  if (p.method == MoeTopkMethod::kNoauxTc) {
    for (int32_t e = 0; e < num_experts; ++e) s.choice[e] = s.scores[e] + p.correction_bias[e];
  } else {
    s.choice = s.scores;
  }

  if (p.method != MoeTopkMethod::kGreedy && p.topk_groups < p.num_groups) {
    const int32_t group_size = num_experts / p.num_groups;
    for (int32_t g = 0; g < p.num_groups; ++g) {
      const float* group = s.choice.data() + g * group_size;
      if (p.method == MoeTopkMethod::kNoauxTc) {
        // Sum of the group's two best choices (group_size >= 2 is validated).
        int32_t best_two[2];
        TopK(group, group_size, 2, best_two);
        s.group_scores[g] = group[best_two[0]] + group[best_two[1]];
      } else {
        float best = group[0];
        for (int32_t i = 1; i < group_size; ++i) best = std::max(best, group[i]);
        s.group_scores[g] = best;
      }
    }
    TopK(s.group_scores.data(), p.num_groups, p.topk_groups, s.kept_groups.data());
    std::fill(s.group_kept.begin(), s.group_kept.end(), 0);
    for (int32_t g : s.kept_groups) s.group_kept[g] = 1;
    // transformers' masked_fill: -inf for noaux_tc, 0.0 for group_limited_greedy.
    const float masked =
        p.method == MoeTopkMethod::kNoauxTc ? -std::numeric_limits<float>::infinity() : 0.0f;
    for (int32_t e = 0; e < num_experts; ++e) {
      if (!s.group_kept[e / group_size]) s.choice[e] = masked;
    }
  }

  int32_t* ids = p.topk_ids + token * p.top_k;
  float* weights = p.topk_weights + token * p.top_k;
  TopK(s.choice.data(), num_experts, p.top_k, ids);
  SortAscending(ids, p.top_k);
  // noaux_tc weighs by the plain scores; the softmax routers by the (masked) scores they ranked.
  const std::vector<float>& weight_source =
      p.method == MoeTopkMethod::kNoauxTc ? s.scores : s.choice;
  for (int32_t j = 0; j < p.top_k; ++j) weights[j] = weight_source[ids[j]];
  if (p.normalize) {
    double sum = 0.0;
    for (int32_t j = 0; j < p.top_k; ++j) sum += weights[j];
    const float denominator = static_cast<float>(sum) + 1e-20f;
    for (int32_t j = 0; j < p.top_k; ++j) weights[j] /= denominator;
  }
  for (int32_t j = 0; j < p.top_k; ++j) weights[j] *= p.routed_scaling_factor;
}

absl::Status ValidateExperts(const MoeExpertsParams& p) {
  if (p.hidden <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeExperts: hidden must be > 0, got ", p.hidden));
  }
  if (p.intermediate <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeExperts: intermediate must be > 0, got ", p.intermediate));
  }
  if (p.top_k <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("MoeExperts: top_k must be > 0, got ", p.top_k));
  }
  if (p.first_expert < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeExperts: first_expert must be >= 0, got ", p.first_expert));
  }
  if (p.num_local_experts <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeExperts: num_local_experts must be > 0, got ", p.num_local_experts));
  }
  if (p.tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeExperts: tokens must be >= 0, got ", p.tokens));
  }
  if (p.tokens == 0) return absl::OkStatus();
  if (p.x == nullptr) return absl::InvalidArgumentError("MoeExperts: x is null");
  if (p.topk_ids == nullptr) return absl::InvalidArgumentError("MoeExperts: topk_ids is null");
  if (p.topk_weights == nullptr) {
    return absl::InvalidArgumentError("MoeExperts: topk_weights is null");
  }
  if (p.out == nullptr) return absl::InvalidArgumentError("MoeExperts: out is null");
  if (p.gate_proj == nullptr) return absl::InvalidArgumentError("MoeExperts: gate_proj is null");
  if (p.up_proj == nullptr) return absl::InvalidArgumentError("MoeExperts: up_proj is null");
  if (p.down_proj == nullptr) return absl::InvalidArgumentError("MoeExperts: down_proj is null");
  for (int32_t e = 0; e < p.num_local_experts; ++e) {
    if (p.gate_proj[e] == nullptr || p.up_proj[e] == nullptr || p.down_proj[e] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("MoeExperts: local expert ", e, " (expert id ", p.first_expert + e,
                       ") has a null gate_proj, up_proj or down_proj"));
    }
  }
  return absl::OkStatus();
}

// The shared experts' output comes last, after every routed expert.
absl::Status AddShared(const MoeExpertsParams& p) {
  if (p.shared_out == nullptr) return absl::OkStatus();
  for (int64_t i = 0; i < p.tokens * p.hidden; ++i) p.out[i] += p.shared_out[i];
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeRouting(const MoeRoutingParams& params) {
  TV_RETURN_IF_ERROR(ValidateRouting(params));
  const int64_t tokens = params.tokens;
  const bool parallel = tokens > 1 && tokens * params.num_experts >= (int64_t{1} << 12);
#pragma omp parallel if (parallel)
  {
    RoutingScratch scratch(params);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      if (params.routed_tokens != nullptr && t >= *params.routed_tokens) {
        std::fill_n(params.topk_ids + t * params.top_k, params.top_k, -1);
        std::fill_n(params.topk_weights + t * params.top_k, params.top_k, 0.0f);
      } else {
        RouteToken(params, t, scratch);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status MoeExperts(const MoeExpertsParams& params) {
  TV_RETURN_IF_ERROR(ValidateExperts(params));
  const int64_t tokens = params.tokens;
  const int64_t hidden = params.hidden;
  const int64_t intermediate = params.intermediate;
  const int32_t top_k = params.top_k;
  const int32_t num_local = params.num_local_experts;
  if (tokens == 0) return absl::OkStatus();
  std::memset(params.out, 0, static_cast<size_t>(tokens * hidden) * sizeof(float));

  // Bucket (token, weight) entries by local expert, in token order (a counting sort). Ids outside
  // this rank's experts belong to another rank and are skipped.
  std::vector<int64_t> offsets(num_local + 1, 0);
  auto local_index = [&](int64_t entry) -> int64_t {
    return static_cast<int64_t>(params.topk_ids[entry]) - params.first_expert;
  };
  for (int64_t entry = 0; entry < tokens * top_k; ++entry) {
    const int64_t local = local_index(entry);
    if (local >= 0 && local < num_local) ++offsets[local + 1];
  }
  int64_t max_rows = 0;
  for (int32_t e = 0; e < num_local; ++e) {
    max_rows = std::max(max_rows, offsets[e + 1]);
    offsets[e + 1] += offsets[e];
  }
  if (max_rows == 0) return AddShared(params);
  std::vector<int64_t> entry_token(offsets[num_local]);
  std::vector<float> entry_weight(offsets[num_local]);
  {
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int64_t entry = 0; entry < tokens * top_k; ++entry) {
      const int64_t local = local_index(entry);
      if (local < 0 || local >= num_local) continue;
      entry_token[cursor[local]] = entry / top_k;
      entry_weight[cursor[local]] = params.topk_weights[entry];
      ++cursor[local];
    }
  }

  // rows_buffer holds the gathered inputs, then (reused) the down projection's outputs.
  std::vector<float> rows_buffer(static_cast<size_t>(max_rows * hidden));
  std::vector<float> gate_up(static_cast<size_t>(max_rows * 2 * intermediate));
  std::vector<float> activation(static_cast<size_t>(max_rows * intermediate));
  // Ascending expert id: each token's output accumulates its experts in that order.
  for (int32_t e = 0; e < num_local; ++e) {
    const int64_t begin = offsets[e];
    const int64_t rows = offsets[e + 1] - begin;
    if (rows == 0) continue;
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(rows_buffer.data() + i * hidden, params.x + entry_token[begin + i] * hidden,
                  static_cast<size_t>(hidden) * sizeof(float));
    }
    // gate and up side by side, as SiluMul expects: [rows, 2 * intermediate].
    TV_RETURN_IF_ERROR(Gemm({.x = rows_buffer.data(),
                             .weight = params.gate_proj[e],
                             .y = gate_up.data(),
                             .m = rows,
                             .n = intermediate,
                             .k = hidden,
                             .y_stride = 2 * intermediate}));
    TV_RETURN_IF_ERROR(Gemm({.x = rows_buffer.data(),
                             .weight = params.up_proj[e],
                             .y = gate_up.data() + intermediate,
                             .m = rows,
                             .n = intermediate,
                             .k = hidden,
                             .y_stride = 2 * intermediate}));
    TV_RETURN_IF_ERROR(SiluMul(
        {.gate_up = gate_up.data(), .out = activation.data(), .rows = rows, .dim = intermediate}));
    TV_RETURN_IF_ERROR(Gemm({.x = activation.data(),
                             .weight = params.down_proj[e],
                             .y = rows_buffer.data(),
                             .m = rows,
                             .n = hidden,
                             .k = intermediate}));
    // As transformers: out[t] += down(...) * weight, an fp32 product then an fp32 add.
    for (int64_t i = 0; i < rows; ++i) {
      const float weight = entry_weight[begin + i];
      const float* expert_row = rows_buffer.data() + i * hidden;
      float* out = params.out + entry_token[begin + i] * hidden;
      for (int64_t j = 0; j < hidden; ++j) out[j] += expert_row[j] * weight;
    }
  }
  return AddShared(params);
}

}  // namespace treeverify::kernels::cpu
