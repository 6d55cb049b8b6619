// The coordinator's Rendezvous service over loopback gRPC: write-once keys per group epoch, Gets
// that wait (bounded by their timeout and deadline) without holding a gRPC thread, Join's checks,
// and shutdown releasing parked Gets.
#include "treeverify/services/rendezvous_service.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/services/client_channel.h"
#include "treeverify/services/grpc_rendezvous_store.h"
#include "treeverify/services/server_bootstrap.h"

namespace treeverify::services {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;

class RendezvousServiceTest : public testing::Test {
 protected:
  void SetUp() override {
    rendezvous_ = std::make_unique<RendezvousService>(RendezvousServiceOptions{.world_size = 2},
                                                      [this](const JoinedRank& joined) {
                                                        absl::MutexLock lock(&joins_mutex_);
                                                        joins_.push_back(joined);
                                                      });
    auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"}, {rendezvous_.get()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    auto channel = CreateClientChannel(server_->address());
    ASSERT_TRUE(channel.ok());
    channel_ = *channel;
  }
  void TearDown() override {
    rendezvous_->Shutdown();
    server_->Shutdown(absl::Seconds(5));
  }

  std::unique_ptr<RendezvousService> rendezvous_;
  std::unique_ptr<GrpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  absl::Mutex joins_mutex_;
  std::vector<JoinedRank> joins_ ABSL_GUARDED_BY(joins_mutex_);
};

TEST_F(RendezvousServiceTest, KeysAreWriteOncePerEpoch) {
  GrpcRendezvousStore epoch1(channel_, 1);
  GrpcRendezvousStore epoch2(channel_, 2);
  ASSERT_TRUE(epoch1.Set("rank_0", "addr-a").ok());
  EXPECT_TRUE(epoch1.Set("rank_0", "addr-a").ok());  // a retried Set is harmless
  EXPECT_EQ(epoch1.Set("rank_0", "addr-b").code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(epoch2.Set("rank_0", "addr-b").ok());  // another epoch, another namespace
  auto values = epoch1.Get({"rank_0"}, absl::ZeroDuration());
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre("addr-a"));
  values = epoch2.Get({"rank_0"}, absl::ZeroDuration());
  ASSERT_TRUE(values.ok());
  EXPECT_THAT(*values, ElementsAre("addr-b"));
  EXPECT_EQ(rendezvous_->store().Get({"epoch/1/rank_0"}, absl::ZeroDuration())->at(0), "addr-a");
}

TEST_F(RendezvousServiceTest, GetTimesOutNamingTheMissingKeys) {
  GrpcRendezvousStore store(channel_, 1);
  ASSERT_TRUE(store.Set("present", "x").ok());
  const absl::Time start = absl::Now();
  auto values = store.Get({"present", "absent"}, absl::Milliseconds(300));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(values.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(values.status().message(), HasSubstr("group epoch 1 still missing"));
  EXPECT_THAT(values.status().message(), HasSubstr("absent"));
  EXPECT_THAT(values.status().message(), testing::Not(HasSubstr("present")));
  EXPECT_GE(waited, absl::Milliseconds(290));
  EXPECT_LT(waited, absl::Seconds(3));
}

TEST_F(RendezvousServiceTest, ParkedGetWakesWhenTheKeyIsSet) {
  GrpcRendezvousStore store(channel_, 4);
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(200));
    GrpcRendezvousStore other(channel_, 4);
    EXPECT_TRUE(other.Set("late", "value").ok());
  });
  const absl::Time start = absl::Now();
  auto values = store.Get({"late"}, absl::Seconds(20));
  const absl::Duration waited = absl::Now() - start;
  setter.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre("value"));
  EXPECT_LT(waited, absl::Seconds(5));
}

TEST_F(RendezvousServiceTest, ManyParkedGetsDoNotHoldTheServer) {
  // More waiting Gets than gRPC has callback threads; Set must still get through.
  constexpr int kWaiters = 40;
  std::vector<std::thread> waiters;
  std::vector<absl::Status> statuses(kWaiters);
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&, i] {
      GrpcRendezvousStore store(channel_, 5);
      statuses[i] = store.Get({"go"}, absl::Seconds(20)).status();
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  GrpcRendezvousStore store(channel_, 5);
  EXPECT_TRUE(store.Set("go", "now").ok());
  for (std::thread& t : waiters) t.join();
  for (const absl::Status& status : statuses) EXPECT_TRUE(status.ok()) << status;
}

TEST_F(RendezvousServiceTest, GetIsBoundedByItsDeadline) {
  auto stub = v1::Rendezvous::NewStub(channel_);
  v1::GetRequest request;
  request.set_group_epoch(1);
  request.add_keys("never");
  request.set_timeout_seconds(600);
  grpc::ClientContext context;
  SetTimeout(context, absl::Milliseconds(300));
  v1::GetResponse response;
  const absl::Time start = absl::Now();
  const grpc::Status status = stub->Get(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST_F(RendezvousServiceTest, RequestsAreValidated) {
  auto stub = v1::Rendezvous::NewStub(channel_);
  auto get = [&](int64_t epoch, std::vector<std::string> keys, double timeout) {
    v1::GetRequest request;
    request.set_group_epoch(epoch);
    for (const std::string& key : keys) request.add_keys(key);
    request.set_timeout_seconds(timeout);
    grpc::ClientContext context;
    v1::GetResponse response;
    return stub->Get(&context, request, &response);
  };
  EXPECT_EQ(get(-1, {"k"}, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(get(1, {}, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(get(1, {""}, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(get(1, {"k"}, -1).error_message(), HasSubstr("timeout_seconds must be >= 0"));
  v1::SetRequest set;
  set.set_group_epoch(1);
  set.set_key("big");
  set.set_value(std::string((1 << 20) + 1, 'x'));
  grpc::ClientContext context;
  v1::SetResponse set_response;
  EXPECT_EQ(stub->Set(&context, set, &set_response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(RendezvousServiceTest, JoinChecksTheReplicaAndCompletesTheGroup) {
  GrpcRendezvousStore store(channel_, 7);
  absl::Status wrong_size = store.Join(0, 3, "127.0.0.1:1");
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong_size.message(), HasSubstr("--world-size 2"));
  EXPECT_EQ(store.Join(2, 2, "127.0.0.1:1").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Join(-1, 2, "127.0.0.1:1").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Join(0, 2, "").code(), absl::StatusCode::kInvalidArgument);
  {
    absl::MutexLock lock(&joins_mutex_);
    EXPECT_TRUE(joins_.empty());
  }

  ASSERT_TRUE(store.Join(1, 2, "127.0.0.1:1001").ok());
  auto incomplete = rendezvous_->WaitForGroup(absl::Milliseconds(100));
  EXPECT_EQ(incomplete.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(incomplete.status().message(), HasSubstr("rank 0 of 2 has not joined"));

  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(100));
    GrpcRendezvousStore other(channel_, 7);
    EXPECT_TRUE(other.Join(0, 2, "127.0.0.1:1000").ok());
  });
  auto group = rendezvous_->WaitForGroup(absl::Seconds(10));
  late.join();
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->group_epoch, 7);
  EXPECT_THAT(group->addresses, ElementsAre("127.0.0.1:1000", "127.0.0.1:1001"));
  absl::MutexLock lock(&joins_mutex_);
  ASSERT_EQ(joins_.size(), 2u);
  EXPECT_EQ(joins_[0].rank, 1);
  EXPECT_EQ(joins_[1].address, "127.0.0.1:1000");
}

TEST_F(RendezvousServiceTest, ShutdownReleasesParkedGets) {
  absl::Status status;
  std::thread waiter([&] {
    GrpcRendezvousStore store(channel_, 1);
    status = store.Get({"never"}, absl::Seconds(60)).status();
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  rendezvous_->Shutdown();
  waiter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(rendezvous_->WaitForGroup(absl::Seconds(10)).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace treeverify::services
