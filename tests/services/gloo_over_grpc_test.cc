// Two Gloo ranks (threads) form their group through the coordinator's Rendezvous service over
// loopback gRPC (GrpcRendezvousStore), join, and all-reduce: the sum is exact and in rank order.
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/services/client_channel.h"
#include "treeverify/services/grpc_rendezvous_store.h"
#include "treeverify/services/rendezvous_service.h"
#include "treeverify/services/server_bootstrap.h"
#include "treeverify/worker/gloo_communicator.h"

namespace treeverify::services {
namespace {

TEST(GlooOverGrpcTest, TwoRanksFormAGroupAndAllReduce) {
  constexpr int kWorldSize = 2;
  constexpr int64_t kEpoch = 3;
  RendezvousService rendezvous({.world_size = kWorldSize});
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"}, {&rendezvous});
  ASSERT_TRUE(server.ok()) << server.status();

  const unsigned seed = 20240611;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> inputs(kWorldSize, std::vector<float>(733));
  for (auto& input : inputs) {
    for (float& v : input) v = normal(rng);
  }
  std::vector<std::vector<float>> outputs = inputs;
  std::vector<absl::Status> statuses(kWorldSize);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorldSize; ++r) {
    ranks.emplace_back([&, r] {
      statuses[r] = [&]() -> absl::Status {
        absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
            CreateClientChannel((*server)->address());
        if (!channel.ok()) return channel.status();
        GrpcRendezvousStore store(*channel, kEpoch);
        absl::StatusOr<std::unique_ptr<worker::GlooCommunicator>> communicator =
            worker::GlooCommunicator::Create({.rank = r,
                                              .world_size = kWorldSize,
                                              .interface_address = "127.0.0.1",
                                              .timeout = absl::Seconds(20),
                                              .key_prefix = "gloo/"},
                                             &store);
        if (!communicator.ok()) return communicator.status();
        if (absl::Status s = (*communicator)->AllReduceSum(absl::MakeSpan(outputs[r])); !s.ok()) {
          return s;
        }
        return store.Join(r, kWorldSize, absl::StrCat("127.0.0.1:", 7000 + r));
      }();
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < kWorldSize; ++r)
    ASSERT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
  for (size_t i = 0; i < inputs[0].size(); ++i) {
    const float expected = inputs[0][i] + inputs[1][i];  // rank order
    EXPECT_EQ(outputs[0][i], expected) << i;
    EXPECT_EQ(outputs[1][i], expected) << i;
  }
  // The group's keys live under the epoch's namespace.
  EXPECT_TRUE(rendezvous.store().ErasePrefix("epoch/3/gloo/") > 0);

  absl::StatusOr<RendezvousGroup> group = rendezvous.WaitForGroup(absl::Seconds(5));
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->group_epoch, kEpoch);
  EXPECT_THAT(group->addresses, testing::ElementsAre("127.0.0.1:7000", "127.0.0.1:7001"));
  (*server)->Shutdown(absl::Seconds(5));
}

}  // namespace
}  // namespace treeverify::services
