// Mixture-of-experts routing and expert computation (DeepSeek-V2 / V3 / Kimi-K2 routers).
//
// Routing picks top_k experts per token and their weights:
//  - sigmoid + noaux_tc (V3, K2): choice = sigmoid(logit) + correction_bias; groups ranked by the
//    sum of their two best choices; the best topk_group groups are kept; top_k experts by choice;
//    weights are the plain sigmoid scores.
//  - softmax + greedy (V2-Lite) or group_limited_greedy (V2): groups ranked by their best score.
//  Then optional renormalization (norm_topk_prob) and the routed scaling factor.
//  Dropped groups are masked as transformers does (-inf for noaux_tc, 0.0 for
//  group_limited_greedy). Ties, left unspecified by torch.topk, go to the lower group or expert
//  id. topk_ids come out in ascending expert id.
// Expert computation sums each token's experts in ascending expert id, whatever the batch, so
// the CPU backend stays batch invariant; then the shared experts' output, if given, is added.
// The routing params are fp32 on both backends; the experts' element types are template
// parameters: fp32 on the CPU (MoeExpertsParams), bf16 activations and weights on the GPU.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

enum class MoeScoring { kSigmoid, kSoftmax };
enum class MoeTopkMethod { kNoauxTc, kGreedy, kGroupLimitedGreedy };

struct MoeRoutingParams {
  const float* router_logits = nullptr;    // [tokens, num_experts]
  const float* correction_bias = nullptr;  // [num_experts] (noaux_tc only, else may be null)
  int32_t* topk_ids = nullptr;             // [tokens, top_k] ascending expert ids
  float* topk_weights = nullptr;           // [tokens, top_k] matching topk_ids
  int64_t tokens = 0;
  int32_t num_experts = 0;
  int32_t top_k = 0;
  int32_t num_groups = 1;
  int32_t topk_groups = 1;
  MoeScoring scoring = MoeScoring::kSigmoid;
  MoeTopkMethod method = MoeTopkMethod::kNoauxTc;
  bool normalize = true;  // norm_topk_prob
  float routed_scaling_factor = 1.0f;
  // Tokens from *routed_tokens on get no expert (ids -1, weights 0): rows that only pad a batch
  // up to a CUDA graph's shape. Read when the op runs (device memory for the GPU op, so a graph
  // reads each step's count; host memory for the CPU op); nullptr routes every token.
  const int32_t* routed_tokens = nullptr;
};

// The experts one rank holds, in the nn.Linear layout. With experts split inside (tensor
// parallel) every expert is present with intermediate columns of 1/W; with whole experts per rank
// (expert parallel) experts outside [first_expert, first_expert + num_local_experts) are skipped.
template <typename Input, typename Weight>
struct MoeExpertsParamsOf {
  const Input* x = nullptr;                  // [tokens, hidden]
  const int32_t* topk_ids = nullptr;         // [tokens, top_k]
  const float* topk_weights = nullptr;       // [tokens, top_k]
  const Weight* const* gate_proj = nullptr;  // [num_local_experts] -> [intermediate, hidden]
  const Weight* const* up_proj = nullptr;    // [num_local_experts] -> [intermediate, hidden]
  const Weight* const* down_proj = nullptr;  // [num_local_experts] -> [hidden, intermediate]
  float* out = nullptr;                      // [tokens, hidden], overwritten
  int64_t tokens = 0;
  int32_t top_k = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;  // per-rank columns of one expert
  int32_t first_expert = 0;
  int32_t num_local_experts = 0;
  const float* shared_out = nullptr;  // [tokens, hidden], added last when set (shared experts)
  // GPU only, optional: the same matrices in the GPU weight stream's tiles
  // (treeverify/kernels/cuda/moe_tiles.h: gate and up interleaved in one allocation by
  // GateUpTileLayout, packed_up one tile after packed_gate; down by DownTileLayout). Where given,
  // the GPU reads the experts from them, and the pointer arrays may be null; the CPU reads the
  // pointer arrays only.
  const Weight* packed_gate = nullptr;
  const Weight* packed_up = nullptr;
  const Weight* packed_down = nullptr;
  // GPU only, optional, instead of all the above: quantized experts as the weight stream's
  // records, dequantized in registers: INT4 (treeverify/kernels/cuda/moe_int4_tiles.h:
  // Int4GateUpLayout, Int4DownLayout) or FP8 (moe_fp8_tiles.h: Fp8GateUpLayout, Fp8DownLayout).
  const uint8_t* int4_gate_up = nullptr;
  const uint8_t* int4_down = nullptr;
  const uint8_t* fp8_gate_up = nullptr;
  const uint8_t* fp8_down = nullptr;
};
using MoeExpertsParams = MoeExpertsParamsOf<float, float>;

namespace cpu {
absl::Status MoeRouting(const MoeRoutingParams& params);
absl::Status MoeExperts(const MoeExpertsParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
