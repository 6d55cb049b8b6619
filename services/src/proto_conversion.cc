#include "treeverify/services/proto_conversion.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "treeverify/coordinator/token_selector.h"
#include "treeverify/kernels/status.h"
#include "treeverify/services/status_conversion.h"
#include "treeverify/worker/safetensors.h"

namespace treeverify::services {
namespace {

absl::Status Malformed(absl::string_view what, absl::string_view detail) {
  return absl::InternalError(absl::StrCat("malformed ", what, ": ", detail));
}

// hidden_state_layers: each in [0, num_layers], each at most once.
absl::Status ValidateHiddenStateLayers(const google::protobuf::RepeatedField<int32_t>& layers,
                                       int64_t num_layers, absl::string_view field) {
  absl::flat_hash_set<int32_t> seen;
  for (int i = 0; i < layers.size(); ++i) {
    const int32_t layer = layers[i];
    if (layer < 0 || layer > num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] = ", layer, " is not a layer in [0, ", num_layers, "]"));
    }
    if (!seen.insert(layer).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] repeats layer ", layer, "; ask for each layer once"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSampling(const v1::SamplingParams& sampling) {
  if (!(sampling.temperature() >= 0.0f && sampling.temperature() <= 100.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.temperature must be in [0, 100], got ", sampling.temperature()));
  }
  if (!(sampling.top_p() >= 0.0f && sampling.top_p() <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p must be in [0, 1], got ", sampling.top_p()));
  }
  // Each rank sends at most kMaxCandidatesPerShard candidates; more cannot be exact.
  const int64_t max_top_k = coordinator::kMaxCandidatesPerShard;
  if (sampling.top_k() < 0 || sampling.top_k() > max_top_k) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.top_k must be in [0, ", max_top_k,
                                                   "] (the candidates each rank sends), got ",
                                                   sampling.top_k()));
  }
  return absl::OkStatus();
}

std::vector<int32_t> ToVector(const google::protobuf::RepeatedField<int32_t>& field) {
  return std::vector<int32_t>(field.begin(), field.end());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// bfloat16 payloads.

std::string EncodeBf16(absl::Span<const float> values) {
  std::string bytes(values.size() * 2, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = worker::FloatToBf16(values[i]);
    bytes[2 * i] = static_cast<char>(bits & 0xff);
    bytes[2 * i + 1] = static_cast<char>(bits >> 8);
  }
  return bytes;
}

absl::StatusOr<std::vector<float>> DecodeBf16(absl::string_view bytes, int64_t expected_values,
                                              absl::string_view field) {
  if (expected_values < 0 || static_cast<int64_t>(bytes.size()) != 2 * expected_values) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", bytes.size(),
                                                   " bytes; expected ", 2 * expected_values,
                                                   " (2 per bf16 value)"));
  }
  std::vector<float> values(static_cast<size_t>(expected_values));
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = static_cast<uint16_t>(static_cast<uint8_t>(bytes[2 * i]) |
                                                (static_cast<uint8_t>(bytes[2 * i + 1]) << 8));
    values[i] = worker::Bf16ToFloat(bits);
  }
  return values;
}

// ---------------------------------------------------------------------------------------------
// Worker protocol.

absl::StatusOr<worker::ForwardRequest> ForwardRequestFromProto(const v1::ForwardRequest& proto,
                                                               const ForwardLimits& limits) {
  if (proto.sequences_size() > limits.max_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("sequences has ", proto.sequences_size(),
                                                   " entries; at most ", limits.max_sequences,
                                                   " per forward"));
  }
  worker::ForwardRequest request;
  request.return_logits = proto.return_logits();
  request.segments.reserve(proto.sequences_size());
  absl::flat_hash_set<uint64_t> sequence_ids;
  for (int i = 0; i < proto.sequences_size(); ++i) {
    const v1::ForwardSequence& s = proto.sequences(i);
    const std::string field = absl::StrCat("sequences[", i, "]");
    if (!sequence_ids.insert(s.sequence_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".sequence_id ", s.sequence_id(), " appears twice in one forward"));
    }
    if (s.token_ids_size() != s.parents_size()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".token_ids has ", s.token_ids_size(),
                                                     " entries but ", field, ".parents has ",
                                                     s.parents_size()));
    }
    if (s.token_ids_size() > limits.max_segment_rows) {
      return absl::InvalidArgumentError(absl::StrCat(field, " has ", s.token_ids_size(),
                                                     " rows; at most ", limits.max_segment_rows));
    }
    if (!s.has_commit() && s.commit_nodes_size() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".commit_nodes is set but ", field, ".has_commit is false"));
    }
    if (s.commit_nodes_size() > limits.max_segment_rows) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".commit_nodes has ",
                                                     s.commit_nodes_size(), " entries; at most ",
                                                     limits.max_segment_rows));
    }
    const v1::ShardSampling& sampling = s.sampling();
    if (!(sampling.temperature() >= 0.0f && sampling.temperature() <= limits.max_temperature)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".sampling.temperature must be in [0, ",
                                                     limits.max_temperature, "], got ",
                                                     sampling.temperature()));
    }
    if (sampling.candidates() < 0 || sampling.candidates() > limits.max_candidates) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".sampling.candidates must be in [0, ",
                                                     limits.max_candidates, "], got ",
                                                     sampling.candidates()));
    }
    TV_RETURN_IF_ERROR(ValidateHiddenStateLayers(s.hidden_state_layers(), limits.num_layers,
                                                 absl::StrCat(field, ".hidden_state_layers")));

    worker::SegmentInput& segment = request.segments.emplace_back();
    segment.sequence_id = s.sequence_id();
    if (s.has_commit()) segment.commit_nodes = ToVector(s.commit_nodes());
    if (s.expected_committed_length() >= 0) {
      segment.expected_committed_length = s.expected_committed_length();
    }
    segment.token_ids = ToVector(s.token_ids());
    segment.parents = ToVector(s.parents());
    segment.sampling = {.temperature = sampling.temperature(),
                        .seed = sampling.seed(),
                        .candidates = sampling.candidates()};
    segment.hidden_state_layers = ToVector(s.hidden_state_layers());
  }
  return request;
}

void ForwardResultToProto(const worker::ForwardResult& result, bool include_hidden_states,
                          v1::ForwardResponse* proto) {
  proto->mutable_sequences()->Reserve(static_cast<int>(result.segments.size()));
  for (const worker::SegmentOutput& segment : result.segments) {
    v1::ForwardSequenceResult* out = proto->add_sequences();
    out->set_status_code(static_cast<int32_t>(segment.status.code()));
    out->set_status_message(std::string(segment.status.message()));
    out->set_committed_length(segment.committed_length);
    const size_t nodes = segment.summaries.size();
    const size_t per_node = nodes > 0 ? segment.candidates.size() / nodes : 0;
    out->mutable_nodes()->Reserve(static_cast<int>(nodes));
    for (size_t n = 0; n < nodes; ++n) {
      const kernels::NodeSummary& summary = segment.summaries[n];
      v1::NodeSummary* node = out->add_nodes();
      node->set_max_logit(summary.max_logit);
      node->set_argmax(summary.argmax);
      node->set_log_sum_exp(summary.log_sum_exp);
      node->set_sampled_token(summary.sampled_token);
      node->set_sampled_score(summary.sampled_score);
      node->set_sampled_logit(summary.sampled_logit);
      node->set_log_sum_exp_at_temperature(summary.log_sum_exp_at_temperature);
      node->mutable_candidates()->Reserve(static_cast<int>(per_node));
      for (size_t k = 0; k < per_node; ++k) {
        const kernels::Candidate& candidate = segment.candidates[n * per_node + k];
        v1::Candidate* c = node->add_candidates();
        c->set_token_id(candidate.token_id);
        c->set_logit(candidate.logit);
      }
    }
    out->mutable_logits()->Add(segment.logits.begin(), segment.logits.end());
    if (include_hidden_states) {
      for (const worker::SegmentOutput::LayerHiddenStates& layer : segment.hidden_states) {
        v1::LayerHiddenStates* h = out->add_hidden_states();
        h->set_layer(layer.layer);
        h->set_bf16_data(EncodeBf16(layer.values));
      }
    }
  }
}

void ForwardRequestToProto(const worker::ForwardRequest& request, v1::ForwardRequest* proto) {
  proto->set_return_logits(request.return_logits);
  proto->mutable_sequences()->Reserve(static_cast<int>(request.segments.size()));
  for (const worker::SegmentInput& segment : request.segments) {
    v1::ForwardSequence* s = proto->add_sequences();
    s->set_sequence_id(segment.sequence_id);
    if (segment.commit_nodes) {
      s->set_has_commit(true);
      s->mutable_commit_nodes()->Add(segment.commit_nodes->begin(), segment.commit_nodes->end());
    }
    s->set_expected_committed_length(segment.expected_committed_length.value_or(-1));
    s->mutable_token_ids()->Add(segment.token_ids.begin(), segment.token_ids.end());
    s->mutable_parents()->Add(segment.parents.begin(), segment.parents.end());
    s->mutable_sampling()->set_temperature(segment.sampling.temperature);
    s->mutable_sampling()->set_seed(segment.sampling.seed);
    s->mutable_sampling()->set_candidates(segment.sampling.candidates);
    s->mutable_hidden_state_layers()->Add(segment.hidden_state_layers.begin(),
                                          segment.hidden_state_layers.end());
  }
}

absl::StatusOr<worker::ForwardResult> ForwardResultFromProto(
    const v1::ForwardResponse& proto, const worker::ForwardRequest& request) {
  constexpr absl::string_view kWhat = "ForwardResponse from a rank";
  if (proto.sequences_size() != static_cast<int>(request.segments.size())) {
    return Malformed(kWhat, absl::StrCat(proto.sequences_size(), " sequences for a request of ",
                                         request.segments.size()));
  }
  worker::ForwardResult result;
  result.segments.resize(request.segments.size());
  for (size_t i = 0; i < request.segments.size(); ++i) {
    const worker::SegmentInput& input = request.segments[i];
    const v1::ForwardSequenceResult& in = proto.sequences(static_cast<int>(i));
    worker::SegmentOutput& out = result.segments[i];
    out.status = StatusFromCode(in.status_code(), in.status_message());
    out.committed_length = in.committed_length();
    if (!out.status.ok()) continue;

    const size_t nodes = input.token_ids.size();
    if (in.nodes_size() != static_cast<int>(nodes)) {
      return Malformed(kWhat, absl::StrCat("sequences[", i, "] has ", in.nodes_size(),
                                           " node summaries for ", nodes, " rows"));
    }
    const int32_t per_node = input.sampling.candidates;
    out.summaries.resize(nodes);
    out.candidates.reserve(nodes * static_cast<size_t>(per_node));
    for (size_t n = 0; n < nodes; ++n) {
      const v1::NodeSummary& node = in.nodes(static_cast<int>(n));
      kernels::NodeSummary& summary = out.summaries[n];
      summary.max_logit = node.max_logit();
      summary.argmax = node.argmax();
      summary.log_sum_exp = node.log_sum_exp();
      summary.sampled_token = node.sampled_token();
      summary.sampled_score = node.sampled_score();
      summary.log_sum_exp_at_temperature = node.log_sum_exp_at_temperature();
      summary.sampled_logit = node.sampled_logit();
      if (node.candidates_size() != per_node) {
        return Malformed(
            kWhat, absl::StrCat("sequences[", i, "].nodes[", n, "] has ", node.candidates_size(),
                                " candidates; ", per_node, " were asked for"));
      }
      for (const v1::Candidate& c : node.candidates()) {
        out.candidates.push_back({.token_id = c.token_id(), .logit = c.logit()});
      }
    }
    if (!request.return_logits && in.logits_size() > 0) {
      return Malformed(kWhat, absl::StrCat("sequences[", i, "] has logits nobody asked for"));
    }
    if (nodes > 0 && in.logits_size() % nodes != 0) {
      return Malformed(kWhat, absl::StrCat("sequences[", i, "] has ", in.logits_size(),
                                           " logits, not a multiple of its ", nodes, " rows"));
    }
    out.logits.assign(in.logits().begin(), in.logits().end());
    // Only rank 0 sends hidden states; the others send none.
    if (in.hidden_states_size() != 0 &&
        in.hidden_states_size() != static_cast<int>(input.hidden_state_layers.size())) {
      return Malformed(kWhat, absl::StrCat("sequences[", i, "] has ", in.hidden_states_size(),
                                           " hidden-state layers; ",
                                           input.hidden_state_layers.size(), " were asked for"));
    }
    for (int l = 0; l < in.hidden_states_size(); ++l) {
      const v1::LayerHiddenStates& layer = in.hidden_states(l);
      if (layer.layer() != input.hidden_state_layers[l]) {
        return Malformed(kWhat, absl::StrCat("sequences[", i, "].hidden_states[", l, "] is layer ",
                                             layer.layer(), "; layer ",
                                             input.hidden_state_layers[l], " was asked for"));
      }
      const int64_t bytes = static_cast<int64_t>(layer.bf16_data().size());
      if (nodes == 0 ? bytes != 0 : bytes % (2 * static_cast<int64_t>(nodes)) != 0) {
        return Malformed(kWhat, absl::StrCat("sequences[", i, "].hidden_states[", l, "] has ",
                                             bytes, " bytes, not 2 x ", nodes, " rows x hidden"));
      }
      absl::StatusOr<std::vector<float>> values =
          DecodeBf16(layer.bf16_data(), bytes / 2, "bf16_data");
      if (!values.ok()) return Malformed(kWhat, values.status().message());
      out.hidden_states.push_back({.layer = layer.layer(), .values = *std::move(values)});
    }
  }
  return result;
}

void RankDescriptionToProto(const coordinator::RankDescription& d, v1::DescribeResponse* proto) {
  proto->set_rank(d.rank);
  proto->set_world_size(d.world_size);
  proto->set_group_epoch(d.group_epoch);
  proto->set_model_type(d.model_type);
  proto->set_vocab_size(static_cast<int32_t>(d.vocab_size));
  proto->set_vocab_begin(static_cast<int32_t>(d.vocab_begin));
  proto->set_vocab_end(static_cast<int32_t>(d.vocab_end));
  proto->set_num_layers(static_cast<int32_t>(d.num_layers));
  proto->set_hidden_size(static_cast<int32_t>(d.hidden_size));
  proto->set_max_position_embeddings(static_cast<int32_t>(d.max_position_embeddings));
  proto->mutable_eos_token_ids()->Add(d.eos_token_ids.begin(), d.eos_token_ids.end());
  proto->set_backend(d.backend);
  proto->set_kv_pages_total(d.kv_pages_total);
  proto->set_kv_pages_free(d.kv_pages_free);
  proto->set_kv_page_size(d.kv_page_size);
}

coordinator::RankDescription RankDescriptionFromProto(const v1::DescribeResponse& proto) {
  coordinator::RankDescription d;
  d.rank = proto.rank();
  d.world_size = proto.world_size();
  d.group_epoch = proto.group_epoch();
  d.model_type = proto.model_type();
  d.vocab_size = proto.vocab_size();
  d.vocab_begin = proto.vocab_begin();
  d.vocab_end = proto.vocab_end();
  d.num_layers = proto.num_layers();
  d.hidden_size = proto.hidden_size();
  d.max_position_embeddings = proto.max_position_embeddings();
  d.eos_token_ids = ToVector(proto.eos_token_ids());
  d.backend = proto.backend();
  d.kv_pages_total = proto.kv_pages_total();
  d.kv_pages_free = proto.kv_pages_free();
  d.kv_page_size = proto.kv_page_size();
  return d;
}

// ---------------------------------------------------------------------------------------------
// Verifier API.

v1::FinishReason FinishReasonToProto(coordinator::FinishReason reason) {
  switch (reason) {
    case coordinator::FinishReason::kNone:
      return v1::FINISH_REASON_UNSPECIFIED;
    case coordinator::FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case coordinator::FinishReason::kStopToken:
      return v1::FINISH_REASON_STOP_TOKEN;
    case coordinator::FinishReason::kMaxNewTokens:
      return v1::FINISH_REASON_MAX_NEW_TOKENS;
    case coordinator::FinishReason::kMaxContext:
      return v1::FINISH_REASON_MAX_CONTEXT;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

absl::StatusOr<coordinator::FinishReason> FinishReasonFromProto(int reason) {
  switch (reason) {
    case v1::FINISH_REASON_UNSPECIFIED:
      return coordinator::FinishReason::kNone;
    case v1::FINISH_REASON_EOS:
      return coordinator::FinishReason::kEos;
    case v1::FINISH_REASON_STOP_TOKEN:
      return coordinator::FinishReason::kStopToken;
    case v1::FINISH_REASON_MAX_NEW_TOKENS:
      return coordinator::FinishReason::kMaxNewTokens;
    case v1::FINISH_REASON_MAX_CONTEXT:
      return coordinator::FinishReason::kMaxContext;
    default:
      return absl::InvalidArgumentError(absl::StrCat("finish_reason ", reason, " is unknown"));
  }
}

absl::StatusOr<coordinator::SessionId> SessionIdFromProto(absl::string_view hex) {
  absl::StatusOr<coordinator::SessionId> id = coordinator::SessionId::FromHex(hex);
  if (!id.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("session_id: ", id.status().message()));
  }
  return id;
}

void ModelInfoToProto(const coordinator::ModelInfo& info, v1::GetModelInfoResponse* proto) {
  proto->set_model_name(info.model_name);
  proto->set_model_type(info.model_type);
  proto->set_vocab_size(static_cast<int32_t>(info.vocab_size));
  proto->set_max_context_length(static_cast<int32_t>(info.max_context_length));
  proto->set_max_draft_nodes(info.max_draft_nodes);
  proto->set_world_size(info.world_size);
  proto->set_backend(info.backend);
  proto->mutable_eos_token_ids()->Add(info.eos_token_ids.begin(), info.eos_token_ids.end());
  proto->set_num_layers(static_cast<int32_t>(info.num_layers));
  proto->set_hidden_size(static_cast<int32_t>(info.hidden_size));
}

coordinator::ModelInfo ModelInfoFromProto(const v1::GetModelInfoResponse& proto) {
  coordinator::ModelInfo info;
  info.model_name = proto.model_name();
  info.model_type = proto.model_type();
  info.vocab_size = proto.vocab_size();
  info.max_context_length = proto.max_context_length();
  info.max_draft_nodes = proto.max_draft_nodes();
  info.world_size = proto.world_size();
  info.backend = proto.backend();
  info.eos_token_ids = ToVector(proto.eos_token_ids());
  info.num_layers = proto.num_layers();
  info.hidden_size = proto.hidden_size();
  return info;
}

absl::StatusOr<coordinator::CreateSessionInput> CreateSessionInputFromProto(
    const v1::CreateSessionRequest& proto, const coordinator::ModelInfo& info) {
  TV_RETURN_IF_ERROR(ValidateSampling(proto.sampling()));
  const v1::StoppingCriteria& stopping = proto.stopping();
  if (stopping.max_new_tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stopping.max_new_tokens must be >= 0 (0: no limit), got ", stopping.max_new_tokens()));
  }
  if (stopping.stop_token_ids_size() > kMaxStopTokenIds) {
    return absl::InvalidArgumentError(absl::StrCat("stopping.stop_token_ids has ",
                                                   stopping.stop_token_ids_size(),
                                                   " entries; at most ", kMaxStopTokenIds));
  }
  for (int i = 0; i < stopping.stop_token_ids_size(); ++i) {
    const int32_t token = stopping.stop_token_ids(i);
    if (token < 0 || token >= info.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stopping.stop_token_ids[", i, "] = ", token,
                                                     " is outside the vocabulary [0, ",
                                                     info.vocab_size, ")"));
    }
  }
  coordinator::CreateSessionInput input;
  // Emptiness, token ids and the length against the context are the engine's to check.
  input.prompt_token_ids = ToVector(proto.prompt_token_ids());
  input.sampling = {.temperature = proto.sampling().temperature(),
                    .seed = proto.sampling().seed(),
                    .top_k = proto.sampling().top_k(),
                    .top_p = proto.sampling().top_p()};
  input.stopping.max_new_tokens = stopping.max_new_tokens();
  input.stopping.stop_token_ids = ToVector(stopping.stop_token_ids());
  input.stopping.ignore_eos = stopping.ignore_eos();
  input.return_logprobs = proto.return_logprobs();
  return input;
}

void CreateSessionOutputToProto(const coordinator::CreateSessionOutput& output,
                                v1::CreateSessionResponse* proto) {
  proto->set_session_id(output.session_id.ToHex());
  proto->set_pending_token_id(output.pending_token_id);
  proto->set_context_length(static_cast<int32_t>(output.context_length));
  proto->set_pending_logprob(output.pending_logprob);
  proto->set_finish_reason(FinishReasonToProto(output.finish_reason));
}

absl::StatusOr<coordinator::VerifyInput> VerifyInputFromProto(const v1::VerifyRequest& proto,
                                                              const coordinator::ModelInfo& info) {
  TV_ASSIGN_OR_RETURN(coordinator::SessionId id, SessionIdFromProto(proto.session_id()));
  const v1::DraftTree& tree = proto.tree();
  if (tree.token_ids_size() != tree.parents_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree.token_ids has ", tree.token_ids_size(), " entries but tree.parents has ",
                     tree.parents_size(), "; every draft node needs one token id and one parent"));
  }
  if (tree.token_ids_size() > info.max_draft_nodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tree has ", tree.token_ids_size(), " draft nodes; the limit is ", info.max_draft_nodes));
  }
  TV_RETURN_IF_ERROR(ValidateHiddenStateLayers(proto.hidden_state_layers(), info.num_layers,
                                               "hidden_state_layers"));
  coordinator::VerifyInput input;
  input.session_id = id;
  // Parents' order and token ids against the vocabulary are the engine's to check.
  input.draft_token_ids = ToVector(tree.token_ids());
  input.draft_parents = ToVector(tree.parents());
  input.return_logprobs = proto.return_logprobs();
  input.return_timings = proto.return_timings();
  input.hidden_state_layers = ToVector(proto.hidden_state_layers());
  return input;
}

void VerifyOutputToProto(const coordinator::VerifyOutput& output, absl::string_view session_id,
                         v1::VerifyResponse* proto) {
  proto->set_session_id(std::string(session_id));
  proto->mutable_accepted_node_indices()->Add(output.accepted_node_indices.begin(),
                                              output.accepted_node_indices.end());
  proto->mutable_emitted_token_ids()->Add(output.emitted_token_ids.begin(),
                                          output.emitted_token_ids.end());
  proto->set_pending_token_id(output.pending_token_id);
  proto->set_context_length(static_cast<int32_t>(output.context_length));
  proto->mutable_logprobs()->Add(output.logprobs.begin(), output.logprobs.end());
  proto->set_finish_reason(FinishReasonToProto(output.finish_reason));
  // The engine fills timings only when asked; every step is part of a batch of at least one.
  if (output.timings.batch_sequences > 0) {
    v1::StepTimings* t = proto->mutable_timings();
    t->set_validate_seconds(output.timings.validate_seconds);
    t->set_queue_seconds(output.timings.queue_seconds);
    t->set_fanout_seconds(output.timings.fanout_seconds);
    t->set_reduce_seconds(output.timings.reduce_seconds);
    t->set_accept_seconds(output.timings.accept_seconds);
    t->set_batch_sequences(output.timings.batch_sequences);
  }
  for (const coordinator::HiddenStateRows& rows : output.hidden_states) {
    v1::HiddenStates* h = proto->add_hidden_states();
    h->set_layer(rows.layer);
    h->add_shape(static_cast<int32_t>(rows.rows));
    h->add_shape(static_cast<int32_t>(rows.hidden_size));
    h->set_bf16_data(EncodeBf16(rows.values));
  }
}

void CreateSessionInputToProto(const coordinator::CreateSessionInput& input,
                               v1::CreateSessionRequest* proto) {
  proto->mutable_prompt_token_ids()->Add(input.prompt_token_ids.begin(),
                                         input.prompt_token_ids.end());
  v1::SamplingParams* sampling = proto->mutable_sampling();
  sampling->set_temperature(input.sampling.temperature);
  sampling->set_seed(input.sampling.seed);
  sampling->set_top_k(input.sampling.top_k);
  sampling->set_top_p(input.sampling.top_p);
  v1::StoppingCriteria* stopping = proto->mutable_stopping();
  stopping->set_max_new_tokens(input.stopping.max_new_tokens);
  stopping->mutable_stop_token_ids()->Add(input.stopping.stop_token_ids.begin(),
                                          input.stopping.stop_token_ids.end());
  stopping->set_ignore_eos(input.stopping.ignore_eos);
  proto->set_return_logprobs(input.return_logprobs);
}

absl::StatusOr<coordinator::CreateSessionOutput> CreateSessionOutputFromProto(
    const v1::CreateSessionResponse& proto) {
  constexpr absl::string_view kWhat = "CreateSessionResponse";
  coordinator::CreateSessionOutput output;
  absl::StatusOr<coordinator::SessionId> id = coordinator::SessionId::FromHex(proto.session_id());
  if (!id.ok()) return Malformed(kWhat, id.status().message());
  absl::StatusOr<coordinator::FinishReason> reason = FinishReasonFromProto(proto.finish_reason());
  if (!reason.ok()) return Malformed(kWhat, reason.status().message());
  output.session_id = *id;
  output.pending_token_id = proto.pending_token_id();
  output.context_length = proto.context_length();
  output.pending_logprob = proto.pending_logprob();
  output.finish_reason = *reason;
  return output;
}

void VerifyInputToProto(const coordinator::VerifyInput& input, v1::VerifyRequest* proto) {
  proto->set_session_id(input.session_id.ToHex());
  proto->mutable_tree()->mutable_token_ids()->Add(input.draft_token_ids.begin(),
                                                  input.draft_token_ids.end());
  proto->mutable_tree()->mutable_parents()->Add(input.draft_parents.begin(),
                                                input.draft_parents.end());
  proto->set_return_logprobs(input.return_logprobs);
  proto->set_return_timings(input.return_timings);
  proto->mutable_hidden_state_layers()->Add(input.hidden_state_layers.begin(),
                                            input.hidden_state_layers.end());
}

absl::StatusOr<coordinator::VerifyOutput> VerifyOutputFromProto(const v1::VerifyResponse& proto) {
  constexpr absl::string_view kWhat = "VerifyResponse";
  coordinator::VerifyOutput output;
  absl::StatusOr<coordinator::FinishReason> reason = FinishReasonFromProto(proto.finish_reason());
  if (!reason.ok()) return Malformed(kWhat, reason.status().message());
  output.accepted_node_indices = ToVector(proto.accepted_node_indices());
  output.emitted_token_ids = ToVector(proto.emitted_token_ids());
  output.pending_token_id = proto.pending_token_id();
  output.context_length = proto.context_length();
  output.logprobs.assign(proto.logprobs().begin(), proto.logprobs().end());
  output.finish_reason = *reason;
  if (proto.has_timings()) {
    const v1::StepTimings& t = proto.timings();
    output.timings = {.validate_seconds = t.validate_seconds(),
                      .queue_seconds = t.queue_seconds(),
                      .fanout_seconds = t.fanout_seconds(),
                      .reduce_seconds = t.reduce_seconds(),
                      .accept_seconds = t.accept_seconds(),
                      .batch_sequences = t.batch_sequences()};
  }
  for (int l = 0; l < proto.hidden_states_size(); ++l) {
    const v1::HiddenStates& h = proto.hidden_states(l);
    if (h.shape_size() != 2 || h.shape(0) < 0 || h.shape(1) < 0) {
      return Malformed(kWhat, absl::StrCat("hidden_states[", l, "].shape must be [rows, hidden]"));
    }
    absl::StatusOr<std::vector<float>> values =
        DecodeBf16(h.bf16_data(), int64_t{h.shape(0)} * h.shape(1),
                   absl::StrCat("hidden_states[", l, "].bf16_data"));
    if (!values.ok()) return Malformed(kWhat, values.status().message());
    output.hidden_states.push_back({.layer = h.layer(),
                                    .rows = h.shape(0),
                                    .hidden_size = h.shape(1),
                                    .values = *std::move(values)});
  }
  return output;
}

}  // namespace treeverify::services
