// The Worker protocol end to end in one process: two WorkerServices (TP 2, an in-process group
// between their executor threads) served on loopback, and a VerifyEngine reaching them through
// GrpcRankClient. Every step equals the same step of an engine over in-process ranks, field for
// field (sampling, top-k/top-p, log-probs, hidden states after bf16), so nothing is lost on the
// wire.
#include "treeverify/services/worker_service.h"

#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "treeverify/coordinator/verify_engine.h"
#include "treeverify/monitoring/metrics.h"
#include "treeverify/services/grpc_rank_client.h"
#include "treeverify/services/server_bootstrap.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/worker/safetensors.h"

namespace treeverify::services {
namespace {

using coordinator::SamplingParams;
using coordinator::VerifyEngine;
using coordinator::VerifyInput;
using coordinator::VerifyOutput;

constexpr int kWorldSize = 2;
constexpr int64_t kGroupEpoch = 9;
constexpr int64_t kKvPages = 256;

std::string ModelDir() {
  static const std::string* dir = [] {
    auto* path =
        new std::string(testing::TempDir() + "/worker_service_test_" + std::to_string(::getpid()));
    auto spec = tools::PresetSpec("tiny-v3");
    EXPECT_TRUE(spec.ok()) << spec.status();
    const absl::Status written = tools::WriteCheckpoint(*path, *spec);
    EXPECT_TRUE(written.ok()) << written;
    return path;
  }();
  return *dir;
}

// W ranks, each a ModelRunner behind its own WorkerService and server. Members are destroyed
// bottom up: servers stop before the services and runners they use.
struct GrpcRanks {
  std::unique_ptr<worker::InProcessGroup> group;
  std::vector<std::unique_ptr<worker::ModelRunner>> runners;
  std::vector<std::unique_ptr<WorkerService>> services;
  std::vector<std::unique_ptr<GrpcServer>> servers;

  std::vector<std::unique_ptr<coordinator::RankClient>> Clients() {
    std::vector<std::unique_ptr<coordinator::RankClient>> clients;
    for (const auto& server : servers) {
      auto client = GrpcRankClient::Create(server->address(), {});
      EXPECT_TRUE(client.ok()) << client.status();
      clients.push_back(*std::move(client));
    }
    return clients;
  }
};

// `metrics`: one per rank, or empty for none.
std::unique_ptr<GrpcRanks> MakeGrpcRanks(bool set_runners = true,
                                         std::vector<monitoring::WorkerMetrics*> metrics = {}) {
  auto ranks = std::make_unique<GrpcRanks>();
  auto group = worker::InProcessGroup::Create(kWorldSize);
  EXPECT_TRUE(group.ok()) << group.status();
  ranks->group = *std::move(group);
  ranks->runners.resize(kWorldSize);
  std::vector<std::thread> loaders;
  for (int r = 0; r < kWorldSize; ++r) {
    loaders.emplace_back([&, r] {
      auto runner = worker::ModelRunner::Create(
          ModelDir(),
          {.rank = r, .world_size = kWorldSize, .kv_page_size = 16, .kv_pages = kKvPages},
          ranks->group->communicator(r));
      EXPECT_TRUE(runner.ok()) << runner.status();
      if (runner.ok()) ranks->runners[r] = *std::move(runner);
    });
  }
  for (std::thread& t : loaders) t.join();
  for (int r = 0; r < kWorldSize; ++r) {
    ranks->services.push_back(std::make_unique<WorkerService>(WorkerServiceOptions{
        .group_epoch = kGroupEpoch, .metrics = metrics.empty() ? nullptr : metrics[r]}));
    if (set_runners) ranks->services[r]->SetRunner(ranks->runners[r].get());
    auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"}, {ranks->services[r].get()});
    EXPECT_TRUE(server.ok()) << server.status();
    ranks->servers.push_back(*std::move(server));
  }
  return ranks;
}

TEST(WorkerServiceTest, DescribeReportsTheRank) {
  auto ranks = MakeGrpcRanks();
  auto clients = ranks->Clients();
  for (int r = 0; r < kWorldSize; ++r) {
    auto d = clients[r]->Describe(absl::Seconds(10));
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->rank, r);
    EXPECT_EQ(d->world_size, kWorldSize);
    EXPECT_EQ(d->group_epoch, kGroupEpoch);
    EXPECT_EQ(d->backend, "cpu");
    EXPECT_EQ(d->model_type, "deepseek_v3");
    EXPECT_EQ(d->vocab_size, 512);
    EXPECT_EQ(d->vocab_begin, 256 * r);
    EXPECT_EQ(d->vocab_end, 256 * (r + 1));
    EXPECT_EQ(d->kv_pages_total, kKvPages);
    EXPECT_EQ(d->kv_pages_free, kKvPages);
    EXPECT_EQ(d->kv_page_size, 16);
  }
  // Unknown sequences release as a no-op.
  const std::vector<uint64_t> unknown = {12345};
  auto free_pages = clients[0]->Release(unknown, absl::Seconds(10));
  ASSERT_TRUE(free_pages.ok()) << free_pages.status();
  EXPECT_EQ(*free_pages, kKvPages);
}

// With metrics, every forward is recorded on its rank: its phases, their modeled bytes and the KV
// pages the sequence holds.
TEST(WorkerServiceTest, ForwardsAreRecordedInTheRanksMetrics) {
  prometheus::Registry registry;
  monitoring::WorkerMetrics rank0(registry, 0), rank1(registry, 1);
  auto ranks = MakeGrpcRanks(true, {&rank0, &rank1});
  auto engine = VerifyEngine::Create({}, ranks->Clients());
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto session = (*engine)->CreateSession({.prompt_token_ids = {5, 17, 301, 42, 5}});
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*engine)->Verify({.session_id = session->session_id}).ok());
  const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
  for (const char* rank : {"0", "1"}) {
    SCOPED_TRACE(rank);
    const std::string r = std::string("rank=\"") + rank + "\"";
    EXPECT_THAT(text, testing::HasSubstr("treeverify_forwards_total{" + r + "} 2"));
    EXPECT_THAT(text, testing::HasSubstr("treeverify_forward_seconds_count{" + r + "} 2"));
    EXPECT_THAT(text, testing::HasSubstr("treeverify_forward_phase_seconds_count{phase=\"moe\"," +
                                         r + "} 2"));
    EXPECT_THAT(text, testing::HasSubstr("treeverify_kv_pages{" + r + ",state=\"used\"} 1"));
    EXPECT_THAT(text, testing::HasSubstr("treeverify_kv_pages{" + r + ",state=\"free\"} " +
                                         std::to_string(kKvPages - 1)));
    EXPECT_THAT(text, testing::HasSubstr("treeverify_copy_bandwidth_bytes_per_second{" + r + "}"));
    EXPECT_THAT(text,
                testing::Not(testing::HasSubstr(
                    "treeverify_forward_dram_bytes_total{phase=\"attention\"," + r + "} 0\n")));
  }
}

TEST(WorkerServiceTest, UnavailableUntilTheRunnerIsSet) {
  auto ranks = MakeGrpcRanks(/*set_runners=*/false);
  auto clients = ranks->Clients();
  EXPECT_EQ(clients[0]->Describe(absl::Seconds(10)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(clients[1]->Forward({}, absl::Seconds(10)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(WorkerServiceTest, MalformedForwardFailsOnTheGrpcThread) {
  auto ranks = MakeGrpcRanks();
  auto clients = ranks->Clients();
  // Sent to one rank only: had it reached the runner, it would wait in a collective.
  worker::ForwardRequest request;
  request.segments.push_back({.sequence_id = 1, .token_ids = {1, 2}, .parents = {-1}});
  auto result = clients[1]->Forward(request, absl::Seconds(10));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), testing::HasSubstr("sequences[0].token_ids has 2"));
  request.segments[0] = {
      .sequence_id = 1, .token_ids = {1}, .parents = {-1}, .hidden_state_layers = {4}};
  EXPECT_EQ(clients[0]->Forward(request, absl::Seconds(10)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(WorkerServiceTest, EngineOverGrpcRanksEqualsInProcessRanks) {
  auto grpc_ranks = MakeGrpcRanks();
  auto grpc_engine = VerifyEngine::Create({}, grpc_ranks->Clients());
  ASSERT_TRUE(grpc_engine.ok()) << grpc_engine.status();
  auto local = tools::LocalModel::Create(
      ModelDir(), {.world_size = kWorldSize, .kv_page_size = 16, .kv_pages = kKvPages});
  ASSERT_TRUE(local.ok()) << local.status();
  auto local_engine = VerifyEngine::Create({}, (*local)->RankClients());
  ASSERT_TRUE(local_engine.ok()) << local_engine.status();
  VerifyEngine& remote = **grpc_engine;
  VerifyEngine& reference = **local_engine;

  const unsigned seed = 77;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const std::vector<int32_t> prompt = {9, 100, 201, 9, 100, 7, 300, 41};
  for (const SamplingParams& sampling :
       {SamplingParams{}, SamplingParams{.temperature = 0.8f, .seed = 42},
        SamplingParams{.temperature = 0.8f, .seed = 42, .top_k = 20, .top_p = 0.9f}}) {
    SCOPED_TRACE(testing::Message()
                 << "temperature " << sampling.temperature << " top_k " << sampling.top_k);
    coordinator::CreateSessionInput create{
        .prompt_token_ids = prompt, .sampling = sampling, .return_logprobs = true};
    create.stopping.ignore_eos = true;
    // Plain decoding on the reference: the continuation the trees are built from.
    auto plain = reference.CreateSession(create);
    ASSERT_TRUE(plain.ok()) << plain.status();
    std::vector<int32_t> oracle = {plain->pending_token_id};
    for (int step = 0; step < 14; ++step) {
      auto out = reference.Verify({.session_id = plain->session_id});
      ASSERT_TRUE(out.ok()) << out.status();
      oracle.push_back(out->emitted_token_ids.at(0));
    }
    ASSERT_TRUE(reference.CloseSession(plain->session_id).ok());

    auto a = reference.CreateSession(create);
    auto b = remote.CreateSession(create);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->pending_token_id, a->pending_token_id);
    EXPECT_EQ(b->pending_logprob, a->pending_logprob);
    size_t emitted = 1;
    int64_t accepted = 0;
    while (emitted + 6 < oracle.size()) {
      // A chain of the true next tokens (cut at a random depth by a wrong one) and a random
      // branch beside it.
      VerifyInput input;
      const int depth = std::uniform_int_distribution<int>(1, 4)(rng);
      for (int d = 0; d < depth; ++d) {
        input.draft_token_ids.push_back(oracle[emitted + d]);
        input.draft_parents.push_back(d == 0 ? -1 : d - 1);
      }
      input.draft_token_ids.push_back(std::uniform_int_distribution<int32_t>(0, 511)(rng));
      input.draft_parents.push_back(depth - 1);
      for (int extra = 0; extra < 3; ++extra) {
        const int32_t parent = std::uniform_int_distribution<int32_t>(
            -1, static_cast<int32_t>(input.draft_token_ids.size()) - 1)(rng);
        input.draft_token_ids.push_back(std::uniform_int_distribution<int32_t>(0, 511)(rng));
        input.draft_parents.push_back(parent);
      }
      input.return_logprobs = true;
      input.hidden_state_layers = {0, 3};
      input.session_id = a->session_id;
      auto expected = reference.Verify(input);
      input.session_id = b->session_id;
      auto actual = remote.Verify(input);
      ASSERT_TRUE(expected.ok()) << expected.status();
      ASSERT_TRUE(actual.ok()) << actual.status();
      EXPECT_EQ(actual->accepted_node_indices, expected->accepted_node_indices);
      ASSERT_EQ(actual->emitted_token_ids, expected->emitted_token_ids);
      EXPECT_EQ(actual->pending_token_id, expected->pending_token_id);
      EXPECT_EQ(actual->context_length, expected->context_length);
      EXPECT_EQ(actual->logprobs, expected->logprobs);
      ASSERT_EQ(actual->hidden_states.size(), 2u);
      for (size_t l = 0; l < 2; ++l) {
        const coordinator::HiddenStateRows& e = expected->hidden_states[l];
        const coordinator::HiddenStateRows& g = actual->hidden_states[l];
        EXPECT_EQ(g.layer, e.layer);
        EXPECT_EQ(g.rows, e.rows);
        ASSERT_EQ(g.values.size(), e.values.size());
        for (size_t i = 0; i < e.values.size(); ++i) {
          ASSERT_EQ(g.values[i], worker::Bf16ToFloat(worker::FloatToBf16(e.values[i]))) << i;
        }
      }
      // Lossless: the emitted tokens continue the plain decoding.
      for (size_t k = 0; k < actual->emitted_token_ids.size(); ++k) {
        ASSERT_EQ(actual->emitted_token_ids[k], oracle[emitted + k]) << "token " << emitted + k;
      }
      emitted += actual->emitted_token_ids.size();
      accepted += static_cast<int64_t>(actual->accepted_node_indices.size());
    }
    EXPECT_GT(accepted, 0);
    ASSERT_TRUE(reference.CloseSession(a->session_id).ok());
    ASSERT_TRUE(remote.CloseSession(b->session_id).ok());
  }

  // Closed sessions give every page back on every rank (the release runs on the dispatch thread).
  auto clients = grpc_ranks->Clients();
  for (int r = 0; r < kWorldSize; ++r) {
    int64_t free_pages = -1;
    for (int attempt = 0; attempt < 100 && free_pages != kKvPages; ++attempt) {
      auto d = clients[r]->Describe(absl::Seconds(10));
      ASSERT_TRUE(d.ok()) << d.status();
      free_pages = d->kv_pages_free;
      if (free_pages != kKvPages) absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(free_pages, kKvPages) << "rank " << r;
  }
  grpc_engine->reset();  // before the ranks' servers stop
}

}  // namespace
}  // namespace treeverify::services
