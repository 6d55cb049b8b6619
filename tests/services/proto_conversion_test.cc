// Proto <-> struct translation of both APIs: round trips that keep every field, bf16 rounding and
// byte order, and each validation error, with its code and a message naming the field.
#include "treeverify/services/proto_conversion.h"

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/philox.h"
#include "treeverify/services/status_conversion.h"
#include "treeverify/worker/safetensors.h"

namespace treeverify::services {
namespace {

using testing::ElementsAre;
using testing::ElementsAreArray;
using testing::HasSubstr;

MATCHER_P2(StatusIs, code, substring, "") {
  if (arg.code() == code && absl::StrContains(arg.message(), substring)) return true;
  *result_listener << "status is " << arg;
  return false;
}

// Values that bf16 holds exactly, so round trips compare equal.
std::vector<float> Bf16Values(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> values(n);
  for (float& v : values) v = worker::Bf16ToFloat(worker::FloatToBf16(normal(rng)));
  return values;
}

coordinator::ModelInfo TinyInfo() {
  coordinator::ModelInfo info;
  info.model_name = "tiny";
  info.model_type = "deepseek_v3";
  info.vocab_size = 512;
  info.max_context_length = 1024;
  info.max_draft_nodes = 8;
  info.world_size = 2;
  info.backend = "cpu";
  info.eos_token_ids = {1, 2};
  info.num_layers = 3;
  info.hidden_size = 64;
  return info;
}

// ---------------------------------------------------------------------------------------------
// Status and bf16.

TEST(StatusConversionTest, KeepsEveryCodeAndMessage) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), code == 0 ? "" : "why");
    const grpc::Status grpc_status = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(grpc_status.error_code()), code);
    EXPECT_EQ(ToAbslStatus(grpc_status), status);
    EXPECT_EQ(StatusFromCode(code, status.message()), status);
  }
  EXPECT_THAT(StatusFromCode(99, "odd"), StatusIs(absl::StatusCode::kUnknown, "99"));
}

TEST(Bf16Test, LittleEndianRoundToNearestEven) {
  // 1.0 is 0x3F80; 1 + 2^-8 lies halfway between 1.0 and 1 + 2^-7 and rounds to the even 1.0;
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 and rounds up.
  const std::string bytes =
      EncodeBf16({1.0f, 1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8), -2.0f});
  ASSERT_EQ(bytes.size(), 8u);
  EXPECT_EQ(static_cast<uint8_t>(bytes[0]), 0x80);
  EXPECT_EQ(static_cast<uint8_t>(bytes[1]), 0x3f);
  absl::StatusOr<std::vector<float>> decoded = DecodeBf16(bytes, 4, "data");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_THAT(*decoded, ElementsAre(1.0f, 1.0f, 1.0f + std::ldexp(1.0f, -6), -2.0f));

  const std::vector<float> values = Bf16Values(101, 1);
  decoded = DecodeBf16(EncodeBf16(values), 101, "data");
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, values);
  EXPECT_THAT(DecodeBf16("abc", 2, "hidden.bf16_data").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "hidden.bf16_data has 3 bytes"));
}

// ---------------------------------------------------------------------------------------------
// Worker protocol.

worker::ForwardRequest SampleForwardRequest() {
  worker::ForwardRequest request;
  request.return_logits = true;
  worker::SegmentInput tree;
  tree.sequence_id = 7;
  tree.commit_nodes = std::vector<int32_t>{0, 2};
  tree.expected_committed_length = 19;
  tree.token_ids = {5, 9, 11, 4};
  tree.parents = {-1, 0, 0, 1};
  tree.sampling = {.temperature = 0.8f, .seed = 1234567890123ull, .candidates = 3};
  tree.hidden_state_layers = {3, 0};
  request.segments.push_back(tree);
  worker::SegmentInput commit_only;  // a new sequence's empty segment: nothing optional set
  commit_only.sequence_id = 8;
  request.segments.push_back(commit_only);
  return request;
}

TEST(ForwardConversionTest, RequestRoundTrip) {
  const worker::ForwardRequest request = SampleForwardRequest();
  v1::ForwardRequest proto;
  ForwardRequestToProto(request, &proto);
  absl::StatusOr<worker::ForwardRequest> back =
      ForwardRequestFromProto(proto, ForwardLimits{.num_layers = 3});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->return_logits);
  ASSERT_EQ(back->segments.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const worker::SegmentInput& a = request.segments[i];
    const worker::SegmentInput& b = back->segments[i];
    EXPECT_EQ(b.sequence_id, a.sequence_id);
    EXPECT_EQ(b.commit_nodes, a.commit_nodes);
    EXPECT_EQ(b.expected_committed_length, a.expected_committed_length);
    EXPECT_EQ(b.token_ids, a.token_ids);
    EXPECT_EQ(b.parents, a.parents);
    EXPECT_EQ(b.sampling.temperature, a.sampling.temperature);
    EXPECT_EQ(b.sampling.seed, a.sampling.seed);
    EXPECT_EQ(b.sampling.candidates, a.sampling.candidates);
    EXPECT_EQ(b.hidden_state_layers, a.hidden_state_layers);
  }
  // A commit of nothing is still a commit.
  worker::ForwardRequest empty_commit;
  empty_commit.segments.push_back({.sequence_id = 3, .commit_nodes = std::vector<int32_t>{}});
  proto.Clear();
  ForwardRequestToProto(empty_commit, &proto);
  back = ForwardRequestFromProto(proto, ForwardLimits{.num_layers = 3});
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->segments[0].commit_nodes.has_value());
}

TEST(ForwardConversionTest, RequestValidation) {
  const ForwardLimits limits{.num_layers = 3, .max_sequences = 4};
  auto expect_invalid = [&](auto mutate, const std::string& message) {
    v1::ForwardRequest proto;
    ForwardRequestToProto(SampleForwardRequest(), &proto);
    mutate(proto);
    EXPECT_THAT(ForwardRequestFromProto(proto, limits).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, message));
  };
  expect_invalid(
      [](v1::ForwardRequest& p) {
        for (int i = 0; i < 3; ++i) p.add_sequences()->set_sequence_id(100 + i);
      },
      "sequences has 5 entries; at most 4");
  expect_invalid([](v1::ForwardRequest& p) { p.mutable_sequences(1)->set_sequence_id(7); },
                 "sequences[1].sequence_id 7 appears twice");
  expect_invalid([](v1::ForwardRequest& p) { p.mutable_sequences(0)->add_parents(0); },
                 "sequences[0].token_ids has 4 entries but sequences[0].parents has 5");
  expect_invalid(
      [](v1::ForwardRequest& p) {
        for (int i = 0; i < worker::kMaxChainRows; ++i) {
          p.mutable_sequences(1)->add_token_ids(1);
          p.mutable_sequences(1)->add_parents(i - 1);
        }
        p.mutable_sequences(1)->add_token_ids(1);
        p.mutable_sequences(1)->add_parents(-1);
      },
      "sequences[1] has 8193 rows; at most 8192");
  expect_invalid([](v1::ForwardRequest& p) { p.mutable_sequences(1)->add_commit_nodes(0); },
                 "sequences[1].commit_nodes is set but sequences[1].has_commit is false");
  expect_invalid(
      [](v1::ForwardRequest& p) {
        for (int i = 0; i < worker::kMaxChainRows; ++i) p.mutable_sequences(0)->add_commit_nodes(i);
      },
      "sequences[0].commit_nodes has 8194 entries");
  for (float t : {-0.5f, 101.0f, std::numeric_limits<float>::quiet_NaN()}) {
    expect_invalid(
        [t](v1::ForwardRequest& p) {
          p.mutable_sequences(0)->mutable_sampling()->set_temperature(t);
        },
        "sequences[0].sampling.temperature must be in [0, 100]");
  }
  for (int32_t c : {-1, kernels::kMaxSummaryCandidates + 1}) {
    expect_invalid(
        [c](v1::ForwardRequest& p) {
          p.mutable_sequences(0)->mutable_sampling()->set_candidates(c);
        },
        "sequences[0].sampling.candidates must be in [0, 1024]");
  }
  expect_invalid([](v1::ForwardRequest& p) { p.mutable_sequences(1)->add_hidden_state_layers(4); },
                 "sequences[1].hidden_state_layers[0] = 4 is not a layer in [0, 3]");
  expect_invalid([](v1::ForwardRequest& p) { p.mutable_sequences(0)->add_hidden_state_layers(0); },
                 "sequences[0].hidden_state_layers[2] repeats layer 0");
}

// A result for SampleForwardRequest(): sequence 7 ran (sampling, 3 candidates per node, two
// hidden-state layers, logits of a 5-token shard); sequence 8 failed.
worker::ForwardResult SampleForwardResult(const worker::ForwardRequest& request) {
  const worker::SegmentInput& tree = request.segments[0];
  worker::ForwardResult result;
  worker::SegmentOutput& out = result.segments.emplace_back();
  out.committed_length = 19;
  const std::vector<int64_t> depth = {0, 1, 1, 2};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (size_t n = 0; n < tree.token_ids.size(); ++n) {
    kernels::NodeSummary s;
    s.max_logit = normal(rng);
    s.argmax = static_cast<int32_t>(n * 3);
    s.log_sum_exp = s.max_logit + 1.5f;
    s.sampled_token = static_cast<int32_t>(100 + n);
    s.sampled_logit = normal(rng);
    s.sampled_score =
        kernels::GumbelMaxScore(s.sampled_logit, tree.sampling.temperature, tree.sampling.seed,
                                out.committed_length + depth[n] + 1, s.sampled_token);
    s.log_sum_exp_at_temperature = s.max_logit + 2.5f;
    out.summaries.push_back(s);
    for (int k = 0; k < tree.sampling.candidates; ++k) {
      out.candidates.push_back(
          {.token_id = static_cast<int32_t>(200 + 10 * n + k), .logit = normal(rng)});
    }
  }
  out.candidates.back() = {.token_id = -1, .logit = -std::numeric_limits<float>::infinity()};
  for (size_t i = 0; i < tree.token_ids.size() * 5; ++i) out.logits.push_back(normal(rng));
  out.hidden_states.push_back({.layer = 3, .values = Bf16Values(4 * 8, 4)});
  out.hidden_states.push_back({.layer = 0, .values = Bf16Values(4 * 8, 5)});
  worker::SegmentOutput& failed = result.segments.emplace_back();
  failed.status = absl::ResourceExhaustedError("KV cache full: 0 pages free");
  failed.committed_length = 0;
  return result;
}

TEST(ForwardConversionTest, ResultRoundTrip) {
  const worker::ForwardRequest request = SampleForwardRequest();
  const worker::ForwardResult result = SampleForwardResult(request);
  for (bool rank0 : {true, false}) {
    SCOPED_TRACE(rank0 ? "rank 0" : "another rank");
    v1::ForwardResponse proto;
    ForwardResultToProto(result, /*include_hidden_states=*/rank0, &proto);
    absl::StatusOr<worker::ForwardResult> back = ForwardResultFromProto(proto, request);
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_EQ(back->segments.size(), 2u);
    const worker::SegmentOutput& a = result.segments[0];
    const worker::SegmentOutput& b = back->segments[0];
    EXPECT_TRUE(b.status.ok());
    EXPECT_EQ(b.committed_length, a.committed_length);
    ASSERT_EQ(b.summaries.size(), a.summaries.size());
    for (size_t n = 0; n < a.summaries.size(); ++n) {
      EXPECT_EQ(b.summaries[n].max_logit, a.summaries[n].max_logit);
      EXPECT_EQ(b.summaries[n].argmax, a.summaries[n].argmax);
      EXPECT_EQ(b.summaries[n].log_sum_exp, a.summaries[n].log_sum_exp);
      EXPECT_EQ(b.summaries[n].sampled_token, a.summaries[n].sampled_token);
      EXPECT_EQ(b.summaries[n].sampled_score, a.summaries[n].sampled_score);
      // Carried or recovered from the score: either way exactly the rank's logit.
      EXPECT_EQ(b.summaries[n].sampled_logit, a.summaries[n].sampled_logit) << "node " << n;
      EXPECT_EQ(b.summaries[n].log_sum_exp_at_temperature,
                a.summaries[n].log_sum_exp_at_temperature);
    }
    ASSERT_EQ(b.candidates.size(), a.candidates.size());
    for (size_t k = 0; k < a.candidates.size(); ++k) {
      EXPECT_EQ(b.candidates[k].token_id, a.candidates[k].token_id);
      EXPECT_EQ(b.candidates[k].logit, a.candidates[k].logit);
    }
    EXPECT_EQ(b.logits, a.logits);
    if (rank0) {
      ASSERT_EQ(b.hidden_states.size(), 2u);
      for (size_t l = 0; l < 2; ++l) {
        EXPECT_EQ(b.hidden_states[l].layer, a.hidden_states[l].layer);
        EXPECT_EQ(b.hidden_states[l].values, a.hidden_states[l].values);
      }
    } else {
      EXPECT_TRUE(b.hidden_states.empty());
    }
    EXPECT_EQ(back->segments[1].status, result.segments[1].status);
  }
}

TEST(ForwardConversionTest, ResultThatDoesNotFitTheRequestIsInternal) {
  const worker::ForwardRequest request = SampleForwardRequest();
  const worker::ForwardResult result = SampleForwardResult(request);
  auto expect_internal = [&](auto mutate, const std::string& message) {
    v1::ForwardResponse proto;
    ForwardResultToProto(result, true, &proto);
    mutate(proto);
    EXPECT_THAT(ForwardResultFromProto(proto, request).status(),
                StatusIs(absl::StatusCode::kInternal, message));
  };
  expect_internal([](v1::ForwardResponse& p) { p.mutable_sequences()->RemoveLast(); },
                  "1 sequences for a request of 2");
  expect_internal(
      [](v1::ForwardResponse& p) { p.mutable_sequences(0)->mutable_nodes()->RemoveLast(); },
      "3 node summaries for 4 rows");
  expect_internal(
      [](v1::ForwardResponse& p) {
        p.mutable_sequences(0)->mutable_nodes(1)->mutable_candidates()->RemoveLast();
      },
      "nodes[1] has 2 candidates; 3 were asked for");
  expect_internal([](v1::ForwardResponse& p) { p.mutable_sequences(0)->add_logits(1.0f); },
                  "21 logits, not a multiple of its 4 rows");
  expect_internal(
      [](v1::ForwardResponse& p) {
        p.mutable_sequences(0)->mutable_hidden_states(0)->set_layer(1);
      },
      "hidden_states[0] is layer 1; layer 3 was asked for");
  expect_internal(
      [](v1::ForwardResponse& p) {
        p.mutable_sequences(0)->mutable_hidden_states(1)->mutable_bf16_data()->append("x");
      },
      "hidden_states[1] has 65 bytes");
  expect_internal(
      [](v1::ForwardResponse& p) { p.mutable_sequences(0)->mutable_hidden_states()->RemoveLast(); },
      "1 hidden-state layers; 2 were asked for");
}

TEST(ForwardConversionTest, RankDescriptionRoundTrip) {
  coordinator::RankDescription d;
  d.rank = 1;
  d.world_size = 2;
  d.group_epoch = 5;
  d.model_type = "kimi_k2";
  d.vocab_size = 512;
  d.vocab_begin = 256;
  d.vocab_end = 512;
  d.num_layers = 3;
  d.hidden_size = 64;
  d.max_position_embeddings = 1024;
  d.eos_token_ids = {1, 7};
  d.backend = "cpu";
  d.kv_pages_total = 1024;
  d.kv_pages_free = 1000;
  d.kv_page_size = 64;
  v1::DescribeResponse proto;
  RankDescriptionToProto(d, &proto);
  const coordinator::RankDescription b = RankDescriptionFromProto(proto);
  EXPECT_EQ(b.rank, d.rank);
  EXPECT_EQ(b.world_size, d.world_size);
  EXPECT_EQ(b.group_epoch, d.group_epoch);
  EXPECT_EQ(b.model_type, d.model_type);
  EXPECT_EQ(b.vocab_size, d.vocab_size);
  EXPECT_EQ(b.vocab_begin, d.vocab_begin);
  EXPECT_EQ(b.vocab_end, d.vocab_end);
  EXPECT_EQ(b.num_layers, d.num_layers);
  EXPECT_EQ(b.hidden_size, d.hidden_size);
  EXPECT_EQ(b.max_position_embeddings, d.max_position_embeddings);
  EXPECT_EQ(b.eos_token_ids, d.eos_token_ids);
  EXPECT_EQ(b.backend, d.backend);
  EXPECT_EQ(b.kv_pages_total, d.kv_pages_total);
  EXPECT_EQ(b.kv_pages_free, d.kv_pages_free);
  EXPECT_EQ(b.kv_page_size, d.kv_page_size);
}

// ---------------------------------------------------------------------------------------------
// Verifier API.

TEST(VerifierConversionTest, ModelInfoRoundTrip) {
  const coordinator::ModelInfo info = TinyInfo();
  v1::GetModelInfoResponse proto;
  ModelInfoToProto(info, &proto);
  const coordinator::ModelInfo b = ModelInfoFromProto(proto);
  EXPECT_EQ(b.model_name, info.model_name);
  EXPECT_EQ(b.model_type, info.model_type);
  EXPECT_EQ(b.vocab_size, info.vocab_size);
  EXPECT_EQ(b.max_context_length, info.max_context_length);
  EXPECT_EQ(b.max_draft_nodes, info.max_draft_nodes);
  EXPECT_EQ(b.world_size, info.world_size);
  EXPECT_EQ(b.backend, info.backend);
  EXPECT_EQ(b.eos_token_ids, info.eos_token_ids);
  EXPECT_EQ(b.num_layers, info.num_layers);
  EXPECT_EQ(b.hidden_size, info.hidden_size);
}

TEST(VerifierConversionTest, FinishReasonsRoundTrip) {
  for (coordinator::FinishReason reason :
       {coordinator::FinishReason::kNone, coordinator::FinishReason::kEos,
        coordinator::FinishReason::kStopToken, coordinator::FinishReason::kMaxNewTokens,
        coordinator::FinishReason::kMaxContext}) {
    absl::StatusOr<coordinator::FinishReason> back =
        FinishReasonFromProto(FinishReasonToProto(reason));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, reason);
  }
  EXPECT_EQ(FinishReasonToProto(coordinator::FinishReason::kEos), v1::FINISH_REASON_EOS);
  EXPECT_THAT(FinishReasonFromProto(17).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "finish_reason 17"));
}

coordinator::CreateSessionInput SampleCreateSession() {
  coordinator::CreateSessionInput input;
  input.prompt_token_ids = {3, 4, 5, 6};
  input.sampling = {.temperature = 0.7f, .seed = 99, .top_k = 20, .top_p = 0.9f};
  input.stopping.max_new_tokens = 32;
  input.stopping.stop_token_ids = {9, 10};
  input.stopping.ignore_eos = true;
  input.return_logprobs = true;
  return input;
}

TEST(VerifierConversionTest, CreateSessionRoundTrip) {
  const coordinator::CreateSessionInput input = SampleCreateSession();
  v1::CreateSessionRequest proto;
  CreateSessionInputToProto(input, &proto);
  absl::StatusOr<coordinator::CreateSessionInput> back =
      CreateSessionInputFromProto(proto, TinyInfo());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->prompt_token_ids, input.prompt_token_ids);
  EXPECT_EQ(back->sampling.temperature, input.sampling.temperature);
  EXPECT_EQ(back->sampling.seed, input.sampling.seed);
  EXPECT_EQ(back->sampling.top_k, input.sampling.top_k);
  EXPECT_EQ(back->sampling.top_p, input.sampling.top_p);
  EXPECT_EQ(back->stopping.max_new_tokens, input.stopping.max_new_tokens);
  EXPECT_EQ(back->stopping.stop_token_ids, input.stopping.stop_token_ids);
  EXPECT_EQ(back->stopping.ignore_eos, input.stopping.ignore_eos);
  EXPECT_EQ(back->return_logprobs, input.return_logprobs);

  coordinator::CreateSessionOutput output;
  output.session_id = {.high = 0x0123456789abcdefull, .low = 0xfedcba9876543210ull};
  output.pending_token_id = 77;
  output.context_length = 4;
  output.pending_logprob = -0.25f;
  output.finish_reason = coordinator::FinishReason::kStopToken;
  v1::CreateSessionResponse response;
  CreateSessionOutputToProto(output, &response);
  EXPECT_EQ(response.session_id(), "0123456789abcdeffedcba9876543210");
  absl::StatusOr<coordinator::CreateSessionOutput> decoded = CreateSessionOutputFromProto(response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->session_id, output.session_id);
  EXPECT_EQ(decoded->pending_token_id, 77);
  EXPECT_EQ(decoded->context_length, 4);
  EXPECT_EQ(decoded->pending_logprob, -0.25f);
  EXPECT_EQ(decoded->finish_reason, coordinator::FinishReason::kStopToken);
  response.set_session_id("nope");
  EXPECT_EQ(CreateSessionOutputFromProto(response).status().code(), absl::StatusCode::kInternal);
}

TEST(VerifierConversionTest, CreateSessionValidation) {
  auto expect_invalid = [](auto mutate, const std::string& message) {
    v1::CreateSessionRequest proto;
    CreateSessionInputToProto(SampleCreateSession(), &proto);
    mutate(proto);
    EXPECT_THAT(CreateSessionInputFromProto(proto, TinyInfo()).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, message));
  };
  for (float t : {-0.1f, 100.5f, std::numeric_limits<float>::quiet_NaN()}) {
    expect_invalid([t](v1::CreateSessionRequest& p) { p.mutable_sampling()->set_temperature(t); },
                   "sampling.temperature must be in [0, 100]");
  }
  for (float top_p : {-0.5f, 1.5f}) {
    expect_invalid([top_p](v1::CreateSessionRequest& p) { p.mutable_sampling()->set_top_p(top_p); },
                   "sampling.top_p must be in [0, 1]");
  }
  // 64 candidates per rank, whatever the number of ranks.
  for (int32_t top_k : {-1, 65}) {
    expect_invalid([top_k](v1::CreateSessionRequest& p) { p.mutable_sampling()->set_top_k(top_k); },
                   "sampling.top_k must be in [0, 64]");
  }
  expect_invalid([](v1::CreateSessionRequest& p) { p.mutable_stopping()->set_max_new_tokens(-1); },
                 "stopping.max_new_tokens must be >= 0");
  expect_invalid([](v1::CreateSessionRequest& p) { p.mutable_stopping()->add_stop_token_ids(512); },
                 "stopping.stop_token_ids[2] = 512 is outside the vocabulary [0, 512)");
  expect_invalid([](v1::CreateSessionRequest& p) { p.mutable_stopping()->add_stop_token_ids(-3); },
                 "stopping.stop_token_ids[2] = -3");
  expect_invalid(
      [](v1::CreateSessionRequest& p) {
        for (int i = 0; i < kMaxStopTokenIds; ++i) p.mutable_stopping()->add_stop_token_ids(1);
      },
      "stopping.stop_token_ids has 1026 entries; at most 1024");
  // Within the bounds: accepted (the prompt's contents are the engine's to check).
  v1::CreateSessionRequest proto;
  proto.mutable_sampling()->set_temperature(100.0f);
  proto.mutable_sampling()->set_top_p(1.0f);
  proto.mutable_sampling()->set_top_k(64);
  EXPECT_TRUE(CreateSessionInputFromProto(proto, TinyInfo()).ok());
}

TEST(VerifierConversionTest, VerifyRequestRoundTripAndValidation) {
  coordinator::VerifyInput input;
  input.session_id = {.high = 1, .low = 2};
  input.draft_token_ids = {10, 11, 12};
  input.draft_parents = {-1, 0, -1};
  input.return_logprobs = true;
  input.return_timings = true;
  input.hidden_state_layers = {0, 3};
  v1::VerifyRequest proto;
  VerifyInputToProto(input, &proto);
  absl::StatusOr<coordinator::VerifyInput> back = VerifyInputFromProto(proto, TinyInfo());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->session_id, input.session_id);
  EXPECT_EQ(back->draft_token_ids, input.draft_token_ids);
  EXPECT_EQ(back->draft_parents, input.draft_parents);
  EXPECT_TRUE(back->return_logprobs);
  EXPECT_TRUE(back->return_timings);
  EXPECT_EQ(back->hidden_state_layers, input.hidden_state_layers);

  auto expect_invalid = [&](auto mutate, const std::string& message) {
    v1::VerifyRequest bad = proto;
    mutate(bad);
    EXPECT_THAT(VerifyInputFromProto(bad, TinyInfo()).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, message));
  };
  expect_invalid([](v1::VerifyRequest& p) { p.set_session_id("abc"); },
                 "session_id: session id must be 32 hex digits");
  expect_invalid([](v1::VerifyRequest& p) { p.set_session_id(std::string(32, 'g')); },
                 "session_id: session id has a non-hex character");
  expect_invalid([](v1::VerifyRequest& p) { p.mutable_tree()->add_parents(0); },
                 "tree.token_ids has 3 entries but tree.parents has 4");
  expect_invalid(
      [](v1::VerifyRequest& p) {
        for (int i = 0; i < 6; ++i) {
          p.mutable_tree()->add_token_ids(1);
          p.mutable_tree()->add_parents(-1);
        }
      },
      "tree has 9 draft nodes; the limit is 8");
  expect_invalid([](v1::VerifyRequest& p) { p.add_hidden_state_layers(4); },
                 "hidden_state_layers[2] = 4 is not a layer in [0, 3]");
  expect_invalid([](v1::VerifyRequest& p) { p.add_hidden_state_layers(-1); },
                 "hidden_state_layers[2] = -1");
  expect_invalid([](v1::VerifyRequest& p) { p.add_hidden_state_layers(3); },
                 "hidden_state_layers[2] repeats layer 3");
}

TEST(VerifierConversionTest, VerifyResponseRoundTrip) {
  coordinator::VerifyOutput output;
  output.accepted_node_indices = {0, 1};
  output.emitted_token_ids = {10, 11, 40};
  output.pending_token_id = 40;
  output.context_length = 23;
  output.logprobs = {-0.1f, -0.2f, -0.3f};
  output.finish_reason = coordinator::FinishReason::kMaxNewTokens;
  output.timings = {.validate_seconds = 1e-6,
                    .queue_seconds = 2e-4,
                    .fanout_seconds = 3e-3,
                    .reduce_seconds = 4e-6,
                    .accept_seconds = 5e-6,
                    .batch_sequences = 3};
  output.hidden_states.push_back(
      {.layer = 2, .rows = 3, .hidden_size = 4, .values = Bf16Values(12, 9)});
  v1::VerifyResponse proto;
  VerifyOutputToProto(output, "00000000000000010000000000000002", &proto);
  EXPECT_EQ(proto.session_id(), "00000000000000010000000000000002");
  EXPECT_THAT(proto.hidden_states(0).shape(), ElementsAre(3, 4));
  absl::StatusOr<coordinator::VerifyOutput> back = VerifyOutputFromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->accepted_node_indices, output.accepted_node_indices);
  EXPECT_EQ(back->emitted_token_ids, output.emitted_token_ids);
  EXPECT_EQ(back->pending_token_id, 40);
  EXPECT_EQ(back->context_length, 23);
  EXPECT_EQ(back->logprobs, output.logprobs);
  EXPECT_EQ(back->finish_reason, coordinator::FinishReason::kMaxNewTokens);
  EXPECT_EQ(back->timings.fanout_seconds, 3e-3);
  EXPECT_EQ(back->timings.batch_sequences, 3);
  ASSERT_EQ(back->hidden_states.size(), 1u);
  EXPECT_EQ(back->hidden_states[0].layer, 2);
  EXPECT_EQ(back->hidden_states[0].rows, 3);
  EXPECT_EQ(back->hidden_states[0].hidden_size, 4);
  EXPECT_EQ(back->hidden_states[0].values, output.hidden_states[0].values);

  // Timings appear only when the engine measured them.
  output.timings = {};
  proto.Clear();
  VerifyOutputToProto(output, "x", &proto);
  EXPECT_FALSE(proto.has_timings());

  proto.mutable_hidden_states(0)->clear_shape();
  EXPECT_THAT(VerifyOutputFromProto(proto).status(),
              StatusIs(absl::StatusCode::kInternal, "hidden_states[0].shape"));
}

}  // namespace
}  // namespace treeverify::services
