// Translation between the generated proto messages of treeverify.v1 and the plain structs of the
// coordinator and worker libraries, for both directions of both APIs: the public Verifier API
// (client <-> coordinator) and the Worker protocol (coordinator <-> ranks).
//
// Whatever comes from the network is validated while it is translated: repeated field sizes,
// numeric ranges and enum values are checked here, with INVALID_ARGUMENT naming the field, before
// anything reaches a library. (The libraries check what needs their state: tree topology, token
// ids against the vocabulary, session ids against live sessions.) Responses decoded on the client
// side are checked against the request that produced them; a mismatch is INTERNAL.
//
// Hidden states travel as row-major bfloat16, little-endian (worker::FloatToBf16: round to
// nearest even).
//
//   TV_ASSIGN_OR_RETURN(coordinator::VerifyInput input, VerifyInputFromProto(request, info));
//   engine->VerifyAsync(std::move(input), ...);
//   VerifyOutputToProto(output, request.session_id(), &response);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "treeverify/coordinator/rank_client.h"
#include "treeverify/coordinator/session_manager.h"
#include "treeverify/coordinator/verify_types.h"
#include "treeverify/kernels/lm_head_summary.h"
#include "treeverify/kernels/mla_verify_attention.h"
#include "treeverify/v1/verifier.pb.h"
#include "treeverify/v1/worker.pb.h"
#include "treeverify/worker/model_runner.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::services {

// ---------------------------------------------------------------------------------------------
// bfloat16 payloads.

// Row-major values as little-endian bf16 bytes (2 per value).
std::string EncodeBf16(absl::Span<const float> values);
// The inverse; INVALID_ARGUMENT unless the byte count is 2 * expected_values.
absl::StatusOr<std::vector<float>> DecodeBf16(absl::string_view bytes, int64_t expected_values,
                                              absl::string_view field);

// ---------------------------------------------------------------------------------------------
// Worker protocol.

// Bounds a rank enforces on a ForwardRequest.
struct ForwardLimits {
  int64_t num_layers = 0;  // hidden_state_layers must lie in [0, num_layers]
  // Rows of any segment (a chain's bound; the runner holds trees to kMaxSegmentRows).
  int32_t max_segment_rows = worker::kMaxChainRows;
  int32_t max_candidates = kernels::kMaxSummaryCandidates;
  int64_t max_sequences = 65536;
  float max_temperature = 100.0f;
};

// Rank side.
absl::StatusOr<worker::ForwardRequest> ForwardRequestFromProto(const v1::ForwardRequest& proto,
                                                               const ForwardLimits& limits);
// Hidden states are sent only by rank 0 (`include_hidden_states`): every rank holds the same.
void ForwardResultToProto(const worker::ForwardResult& result, bool include_hidden_states,
                          v1::ForwardResponse* proto);

// Coordinator side. An absent expected_committed_length travels as -1.
void ForwardRequestToProto(const worker::ForwardRequest& request, v1::ForwardRequest* proto);
// Checks the response against `request` (sequence count, nodes, candidates, hidden states).
absl::StatusOr<worker::ForwardResult> ForwardResultFromProto(const v1::ForwardResponse& proto,
                                                             const worker::ForwardRequest& request);

void RankDescriptionToProto(const coordinator::RankDescription& description,
                            v1::DescribeResponse* proto);
coordinator::RankDescription RankDescriptionFromProto(const v1::DescribeResponse& proto);

// ---------------------------------------------------------------------------------------------
// Verifier API.

// The most stop token ids a session may set.
inline constexpr int kMaxStopTokenIds = 1024;

v1::FinishReason FinishReasonToProto(coordinator::FinishReason reason);
// INVALID_ARGUMENT for a value this build does not know.
absl::StatusOr<coordinator::FinishReason> FinishReasonFromProto(int reason);

// INVALID_ARGUMENT, naming the field, unless `hex` is 32 hex digits.
absl::StatusOr<coordinator::SessionId> SessionIdFromProto(absl::string_view hex);

void ModelInfoToProto(const coordinator::ModelInfo& info, v1::GetModelInfoResponse* proto);
coordinator::ModelInfo ModelInfoFromProto(const v1::GetModelInfoResponse& proto);

// Coordinator side: requests are checked against the served model.
absl::StatusOr<coordinator::CreateSessionInput> CreateSessionInputFromProto(
    const v1::CreateSessionRequest& proto, const coordinator::ModelInfo& info);
void CreateSessionOutputToProto(const coordinator::CreateSessionOutput& output,
                                v1::CreateSessionResponse* proto);
absl::StatusOr<coordinator::VerifyInput> VerifyInputFromProto(const v1::VerifyRequest& proto,
                                                              const coordinator::ModelInfo& info);
void VerifyOutputToProto(const coordinator::VerifyOutput& output, absl::string_view session_id,
                         v1::VerifyResponse* proto);

// Client side.
void CreateSessionInputToProto(const coordinator::CreateSessionInput& input,
                               v1::CreateSessionRequest* proto);
absl::StatusOr<coordinator::CreateSessionOutput> CreateSessionOutputFromProto(
    const v1::CreateSessionResponse& proto);
void VerifyInputToProto(const coordinator::VerifyInput& input, v1::VerifyRequest* proto);
absl::StatusOr<coordinator::VerifyOutput> VerifyOutputFromProto(const v1::VerifyResponse& proto);

}  // namespace treeverify::services
