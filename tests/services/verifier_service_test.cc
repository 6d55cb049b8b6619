// The Verifier service end to end in one process: a server on 127.0.0.1:0 over a VerifyEngine
// whose ranks are in-process ModelRunners of the tiny-v3 checkpoint (TP 2), driven through
// VerifierClient. Greedy steps give LocalModel's greedy tokens; error codes; the stream; health
// and reflection.
#include "treeverify/services/verifier_service.h"

#include <grpcpp/generic/generic_stub.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "treeverify/coordinator/verify_engine.h"
#include "treeverify/monitoring/metrics.h"
#include "treeverify/services/server_bootstrap.h"
#include "treeverify/services/verifier_client.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/worker/safetensors.h"

namespace treeverify::services {
namespace {

using coordinator::CreateSessionInput;
using coordinator::VerifyInput;
using coordinator::VerifyOutput;
using testing::ElementsAreArray;
using testing::HasSubstr;

constexpr int kWorldSize = 2;
const std::vector<int32_t> kPrompt = {5, 17, 301, 42, 5, 17, 88};

std::string ModelDir() {
  static const std::string* dir = [] {
    auto* path = new std::string(testing::TempDir() + "/verifier_service_test_" +
                                 std::to_string(::getpid()));
    auto spec = tools::PresetSpec("tiny-v3");
    EXPECT_TRUE(spec.ok()) << spec.status();
    const absl::Status written = tools::WriteCheckpoint(*path, *spec);
    EXPECT_TRUE(written.ok()) << written;
    return path;
  }();
  return *dir;
}

std::unique_ptr<tools::LocalModel> MakeModel(int world_size) {
  auto model =
      tools::LocalModel::Create(ModelDir(), {.world_size = world_size, .kv_page_size = 16});
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

// A server, its engine and the engine's in-process ranks. Destroyed server first.
struct Replica {
  std::unique_ptr<tools::LocalModel> model;
  std::unique_ptr<coordinator::VerifyEngine> engine;
  std::unique_ptr<VerifierService> service;
  std::unique_ptr<GrpcServer> server;

  ~Replica() {
    if (server != nullptr) server->Shutdown(absl::Seconds(5));
  }
};

std::unique_ptr<Replica> MakeReplica(int world_size,
                                     monitoring::CoordinatorMetrics* metrics = nullptr) {
  auto replica = std::make_unique<Replica>();
  replica->model = MakeModel(world_size);
  coordinator::VerifyEngineOptions options;
  options.model_name = "tiny-v3";
  auto engine = coordinator::VerifyEngine::Create(options, replica->model->RankClients());
  EXPECT_TRUE(engine.ok()) << engine.status();
  replica->engine = *std::move(engine);
  replica->service = std::make_unique<VerifierService>(replica->engine.get(), metrics);
  auto server = GrpcServer::Start(
      {.listen_address = "127.0.0.1:0", .health_services = {"treeverify.v1.Verifier"}},
      {replica->service.get()});
  EXPECT_TRUE(server.ok()) << server.status();
  replica->server = *std::move(server);
  replica->server->SetServing(true);
  return replica;
}

std::unique_ptr<VerifierClient> Connect(const GrpcServer& server) {
  auto client = VerifierClient::Connect(server.address(), absl::Seconds(10));
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

class VerifierServiceTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    replica_ = MakeReplica(kWorldSize).release();
    // The reference: plain greedy decoding on a model of its own.
    auto reference = MakeModel(kWorldSize);
    auto generation = reference->GenerateGreedy(1, kPrompt, 12);
    ASSERT_TRUE(generation.ok()) << generation.status();
    greedy_ = new tools::Generation(*generation);
  }
  static void TearDownTestSuite() {
    delete replica_;
    delete greedy_;
  }
  void SetUp() override {
    client_ = Connect(*replica_->server);
    ASSERT_NE(client_, nullptr);
  }

  coordinator::CreateSessionOutput NewSession(bool return_logprobs = false) {
    CreateSessionInput input;
    input.prompt_token_ids = kPrompt;
    input.stopping.ignore_eos = true;  // a random model may emit its EOS at any step
    input.return_logprobs = return_logprobs;
    auto created = client_->CreateSession(input);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? *created : coordinator::CreateSessionOutput{};
  }

  static Replica* replica_;
  static tools::Generation* greedy_;
  std::unique_ptr<VerifierClient> client_;
};

Replica* VerifierServiceTest::replica_ = nullptr;
tools::Generation* VerifierServiceTest::greedy_ = nullptr;

TEST_F(VerifierServiceTest, GetModelInfo) {
  auto info = client_->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->model_name, "tiny-v3");
  EXPECT_EQ(info->model_type, "deepseek_v3");
  EXPECT_EQ(info->vocab_size, 512);
  EXPECT_EQ(info->max_context_length, 1024);
  EXPECT_EQ(info->max_draft_nodes, 255);
  EXPECT_EQ(info->world_size, kWorldSize);
  EXPECT_EQ(info->backend, "cpu");
  EXPECT_THAT(info->eos_token_ids, ElementsAreArray({1}));
  EXPECT_EQ(info->num_layers, 3);
  EXPECT_EQ(info->hidden_size, 64);
}

// Empty trees are plain decode steps: token for token LocalModel's greedy decoding.
TEST_F(VerifierServiceTest, EmptyTreesGiveGreedyDecoding) {
  const coordinator::CreateSessionOutput session = NewSession(/*return_logprobs=*/true);
  EXPECT_EQ(session.context_length, static_cast<int64_t>(kPrompt.size()));
  EXPECT_EQ(session.session_id.ToHex().size(), 32u);
  std::vector<int32_t> tokens = {session.pending_token_id};
  std::vector<float> logprobs = {session.pending_logprob};
  for (int step = 0; step < 7; ++step) {
    auto out = client_->Verify({.session_id = session.session_id, .return_logprobs = true});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->emitted_token_ids.size(), 1u);
    EXPECT_TRUE(out->accepted_node_indices.empty());
    EXPECT_EQ(out->pending_token_id, out->emitted_token_ids[0]);
    EXPECT_EQ(out->context_length, static_cast<int64_t>(kPrompt.size()) + step + 1);
    tokens.push_back(out->emitted_token_ids[0]);
    logprobs.push_back(out->logprobs.at(0));
  }
  const std::vector<int32_t> expected(greedy_->tokens.begin(), greedy_->tokens.begin() + 8);
  EXPECT_EQ(tokens, expected);
  for (size_t i = 0; i < logprobs.size(); ++i) {
    EXPECT_NEAR(logprobs[i], greedy_->logprobs[i], 1e-5) << "token " << i;
  }
  EXPECT_TRUE(client_->CloseSession(session.session_id).ok());
}

// A tree holding the true continuation on one branch and a wrong token on another: the true
// branch is accepted whole, plus the bonus token.
TEST_F(VerifierServiceTest, TreeWithTheContinuationIsAccepted) {
  const coordinator::CreateSessionOutput session = NewSession();
  ASSERT_EQ(session.pending_token_id, greedy_->tokens[0]);
  const std::vector<int32_t>& g = greedy_->tokens;
  const int32_t wrong = (g[1] + 1) % 512;
  VerifyInput input{.session_id = session.session_id,
                    .draft_token_ids = {wrong, g[1], g[2], g[3]},
                    .draft_parents = {-1, -1, 1, 2},
                    .return_timings = true};
  auto out = client_->Verify(input);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(out->accepted_node_indices, ElementsAreArray({1, 2, 3}));
  EXPECT_THAT(out->emitted_token_ids, ElementsAreArray({g[1], g[2], g[3], g[4]}));
  EXPECT_EQ(out->context_length, static_cast<int64_t>(kPrompt.size()) + 4);
  EXPECT_GE(out->timings.batch_sequences, 1);
  EXPECT_GT(out->timings.fanout_seconds, 0.0);
  EXPECT_TRUE(client_->CloseSession(session.session_id).ok());
}

// Hidden states come back as bf16 with their shape: one row per committed input of the step.
TEST_F(VerifierServiceTest, HiddenStatesOfRequestedLayers) {
  const coordinator::CreateSessionOutput session = NewSession();
  const std::vector<int32_t>& g = greedy_->tokens;
  auto out = client_->Verify({.session_id = session.session_id,
                              .draft_token_ids = {g[1]},
                              .draft_parents = {-1},
                              .hidden_state_layers = {3, 0}});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->emitted_token_ids.size(), 2u);
  ASSERT_EQ(out->hidden_states.size(), 2u);
  EXPECT_EQ(out->hidden_states[0].layer, 3);
  EXPECT_EQ(out->hidden_states[1].layer, 0);
  for (const coordinator::HiddenStateRows& rows : out->hidden_states) {
    EXPECT_EQ(rows.rows, 2);
    EXPECT_EQ(rows.hidden_size, 64);
    ASSERT_EQ(rows.values.size(), 2u * 64u);
    float norm = 0;
    for (float v : rows.values) {
      EXPECT_EQ(v, worker::Bf16ToFloat(worker::FloatToBf16(v)));  // bf16 values
      norm += v * v;
    }
    EXPECT_GT(norm, 0.0f);
  }
  EXPECT_TRUE(client_->CloseSession(session.session_id).ok());
}

TEST_F(VerifierServiceTest, ErrorCodes) {
  // A well-formed id that names no session.
  const coordinator::SessionId unknown{.high = 0x1234, .low = 0x5678};
  EXPECT_EQ(client_->Verify({.session_id = unknown}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->CloseSession(unknown).code(), absl::StatusCode::kNotFound);

  // A malformed id, sent raw.
  for (const std::string& bad_id : {std::string("not-a-session"), std::string(32, 'z')}) {
    grpc::ClientContext context;
    v1::VerifyRequest request;
    request.set_session_id(bad_id);
    v1::VerifyResponse response;
    const grpc::Status status = client_->stub().Verify(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad_id;
    EXPECT_THAT(status.error_message(), HasSubstr("session_id"));
    grpc::ClientContext close_context;
    v1::CloseSessionRequest close;
    close.set_session_id(bad_id);
    v1::CloseSessionResponse closed;
    EXPECT_EQ(client_->stub().CloseSession(&close_context, close, &closed).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }

  // Bad trees and bad requests fail alone; the session goes on where it was.
  const coordinator::CreateSessionOutput session = NewSession();
  const std::vector<VerifyInput> bad = {
      {.session_id = session.session_id, .draft_token_ids = {3, 4}, .draft_parents = {-1, 1}},
      {.session_id = session.session_id, .draft_token_ids = {3, 512}, .draft_parents = {-1, 0}},
      {.session_id = session.session_id, .draft_token_ids = {3}, .draft_parents = {-1, 0}},
      {.session_id = session.session_id, .hidden_state_layers = {4}},
  };
  for (const VerifyInput& input : bad) {
    auto out = client_->Verify(input);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  }
  auto out = client_->Verify({.session_id = session.session_id});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(out->emitted_token_ids, ElementsAreArray({greedy_->tokens[1]}));

  // Bad CreateSession requests.
  CreateSessionInput hot{.prompt_token_ids = kPrompt};
  hot.sampling.temperature = 150.0f;
  EXPECT_EQ(client_->CreateSession(hot).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->CreateSession({}).status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_TRUE(client_->CloseSession(session.session_id).ok());
  EXPECT_EQ(client_->Verify({.session_id = session.session_id}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(VerifierServiceTest, StreamRunsStepsAndEndsAtAnError) {
  const coordinator::CreateSessionOutput session = NewSession();
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<int32_t> tokens = {session.pending_token_id};
  for (int step = 0; step < 4; ++step) {
    auto out = (*stream)->Step({.session_id = session.session_id});
    ASSERT_TRUE(out.ok()) << out.status();
    tokens.insert(tokens.end(), out->emitted_token_ids.begin(), out->emitted_token_ids.end());
  }
  EXPECT_TRUE((*stream)->Finish().ok());
  EXPECT_EQ(tokens, std::vector<int32_t>(greedy_->tokens.begin(), greedy_->tokens.begin() + 5));

  // A bad request ends its stream with its own status; the session is unharmed.
  stream = client_->OpenStream();
  ASSERT_TRUE(stream.ok());
  auto bad = (*stream)->Step(
      {.session_id = session.session_id, .draft_token_ids = {1}, .draft_parents = {0}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_EQ((*stream)->Finish().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*stream)->Step({.session_id = session.session_id}).status().code(),
            absl::StatusCode::kFailedPrecondition);

  stream = client_->OpenStream();
  ASSERT_TRUE(stream.ok());
  const std::vector<int32_t>& g = greedy_->tokens;
  auto out = (*stream)->Step(
      {.session_id = session.session_id, .draft_token_ids = {g[5]}, .draft_parents = {-1}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(out->emitted_token_ids, ElementsAreArray({g[5], g[6]}));
  EXPECT_TRUE((*stream)->Finish().ok());
  EXPECT_TRUE(client_->CloseSession(session.session_id).ok());
}

TEST_F(VerifierServiceTest, HealthReportsServing) {
  auto overall = client_->CheckHealth("");
  ASSERT_TRUE(overall.ok()) << overall.status();
  EXPECT_TRUE(*overall);
  auto verifier = client_->CheckHealth("treeverify.v1.Verifier");
  ASSERT_TRUE(verifier.ok()) << verifier.status();
  EXPECT_TRUE(*verifier);
  EXPECT_TRUE(client_->WaitUntilServing(absl::Seconds(1)).ok());
  EXPECT_EQ(client_->CheckHealth("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

// ServerReflectionInfo with list_services, encoded by hand (the installed gRPC ships no
// generated reflection code): the response names every service.
std::string ListServices(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](intptr_t expected) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  EXPECT_TRUE(step(1));
  // ServerReflectionRequest { string list_services = 7; } with "*".
  const std::string request("\x3a\x01*", 3);
  grpc::Slice slice(request);
  grpc::ByteBuffer buffer(&slice, 1);
  call->Write(buffer, reinterpret_cast<void*>(2));
  EXPECT_TRUE(step(2));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  EXPECT_TRUE(step(3));
  call->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

TEST_F(VerifierServiceTest, ReflectionListsTheVerifier) {
  const std::string services = ListServices(client_->channel());
  EXPECT_THAT(services, HasSubstr("treeverify.v1.Verifier"));
  EXPECT_THAT(services, HasSubstr("grpc.health.v1.Health"));
}

// Before the ranks joined, and once the engine stops, calls are UNAVAILABLE.
// Every finished call is counted by method and status code; each request of a stream as a Verify.
TEST(VerifierServiceMetricsTest, RequestsAreCountedByMethodAndCode) {
  prometheus::Registry registry;
  monitoring::CoordinatorMetrics metrics(registry);
  std::unique_ptr<Replica> replica = MakeReplica(1, &metrics);
  std::unique_ptr<VerifierClient> client = Connect(*replica->server);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->GetModelInfo().ok());
  auto session = client->CreateSession({.prompt_token_ids = kPrompt});
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(client->Verify({.session_id = session->session_id}).ok());
  auto stream = client->OpenStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Step({.session_id = session->session_id}).ok());
  ASSERT_TRUE((*stream)->Step({.session_id = session->session_id}).ok());
  EXPECT_EQ(
      (*stream)
          ->Step({.session_id = session->session_id, .draft_token_ids = {1}, .draft_parents = {0}})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Verify({.session_id = {.high = 1, .low = 2}}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(client->CloseSession(session->session_id).ok());
  EXPECT_EQ(client->CreateSession({}).status().code(), absl::StatusCode::kInvalidArgument);

  const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
  for (const char* sample : {
           "treeverify_requests_total{code=\"OK\",method=\"GetModelInfo\"} 1",
           "treeverify_requests_total{code=\"OK\",method=\"CreateSession\"} 1",
           "treeverify_requests_total{code=\"INVALID_ARGUMENT\",method=\"CreateSession\"} 1",
           "treeverify_requests_total{code=\"OK\",method=\"Verify\"} 3",
           "treeverify_requests_total{code=\"INVALID_ARGUMENT\",method=\"Verify\"} 1",
           "treeverify_requests_total{code=\"NOT_FOUND\",method=\"Verify\"} 1",
           "treeverify_requests_total{code=\"OK\",method=\"CloseSession\"} 1",
       }) {
    EXPECT_THAT(text, HasSubstr(sample));
  }
}

TEST(VerifierServiceLifecycleTest, UnavailableBeforeTheEngineAndAfterShutdown) {
  auto model = MakeModel(1);
  auto engine = coordinator::VerifyEngine::Create({}, model->RankClients());
  ASSERT_TRUE(engine.ok()) << engine.status();
  VerifierService service;
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"}, {&service});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->GetModelInfo().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client->CreateSession({.prompt_token_ids = kPrompt}).status().code(),
            absl::StatusCode::kUnavailable);
  auto health = client->CheckHealth("");
  ASSERT_TRUE(health.ok());
  EXPECT_FALSE(*health);

  service.SetEngine(engine->get());
  auto session = client->CreateSession({.prompt_token_ids = kPrompt});
  ASSERT_TRUE(session.ok()) << session.status();

  (*engine)->Shutdown();
  EXPECT_EQ(client->Verify({.session_id = session->session_id}).status().code(),
            absl::StatusCode::kUnavailable);
  auto stream = client->OpenStream();
  ASSERT_TRUE(stream.ok());
  EXPECT_EQ((*stream)->Step({.session_id = session->session_id}).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(client->GetModelInfo().ok());  // the description stays true while draining
  (*server)->Shutdown(absl::Seconds(5));
}

}  // namespace
}  // namespace treeverify::services
