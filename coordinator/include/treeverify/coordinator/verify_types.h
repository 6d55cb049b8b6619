// The plain structs of the Verifier API (proto/treeverify/v1/verifier.proto without gRPC):
// what CreateSession and Verify take and return. services/ translates them to and from protos.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "treeverify/coordinator/session_manager.h"
#include "treeverify/coordinator/token_selector.h"

namespace treeverify::coordinator {

struct ModelInfo {
  std::string model_name;
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t max_context_length = 0;
  int32_t max_draft_nodes = 0;
  int32_t world_size = 0;
  std::string backend;
  int32_t prefill_chunk = 0;  // prompt rows per prefill forward
  std::vector<int32_t> eos_token_ids;
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
};

struct CreateSessionInput {
  std::vector<int32_t> prompt_token_ids;
  SamplingParams sampling;
  StoppingCriteria stopping;
  bool return_logprobs = false;
};

struct CreateSessionOutput {
  SessionId session_id;
  int32_t pending_token_id = -1;
  int64_t context_length = 0;
  float pending_logprob = 0;
  FinishReason finish_reason = FinishReason::kNone;
};

struct VerifyInput {
  SessionId session_id;
  std::vector<int32_t> draft_token_ids;
  std::vector<int32_t> draft_parents;
  bool return_logprobs = false;
  bool return_timings = false;
  std::vector<int32_t> hidden_state_layers;
};

struct StepTimings {
  double validate_seconds = 0;
  double queue_seconds = 0;
  double fanout_seconds = 0;
  double reduce_seconds = 0;
  double accept_seconds = 0;
  int32_t batch_sequences = 0;
};

struct HiddenStateRows {
  int32_t layer = 0;
  int64_t rows = 0;
  int64_t hidden_size = 0;
  std::vector<float> values;  // [rows, hidden_size], from rank 0
};

struct VerifyOutput {
  std::vector<int32_t> accepted_node_indices;
  std::vector<int32_t> emitted_token_ids;
  int32_t pending_token_id = -1;
  int64_t context_length = 0;
  std::vector<float> logprobs;
  FinishReason finish_reason = FinishReason::kNone;
  StepTimings timings;
  std::vector<HiddenStateRows> hidden_states;
};

}  // namespace treeverify::coordinator
