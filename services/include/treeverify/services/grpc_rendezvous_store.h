// A worker::RendezvousStore in another process: the coordinator's Rendezvous service, for one
// group epoch (the service keeps each epoch's keys apart). Also announces the rank with Join
// once its group formed.
//
// Calls wait for the channel to become ready within their deadline, so a worker may start before
// the coordinator listens.
//
//   TV_ASSIGN_OR_RETURN(auto channel, CreateClientChannel("coordinator:50051"));
//   GrpcRendezvousStore store(channel, /*group_epoch=*/1);
//   TV_ASSIGN_OR_RETURN(auto communicator, worker::GlooCommunicator::Create(gloo, &store));
//   TV_RETURN_IF_ERROR(store.Join(rank, world_size, "10.0.0.7:50061"));
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "treeverify/v1/worker.grpc.pb.h"
#include "treeverify/worker/rendezvous_store.h"

namespace treeverify::services {

struct GrpcRendezvousStoreOptions {
  // Deadline of Set and Join.
  absl::Duration call_timeout = absl::Seconds(30);
  // A Get's deadline is its timeout plus this, so the service's own answer (with the missing
  // keys named) arrives before the deadline cuts the call.
  absl::Duration get_slack = absl::Seconds(5);
};

class GrpcRendezvousStore final : public worker::RendezvousStore {
 public:
  GrpcRendezvousStore(std::shared_ptr<grpc::Channel> channel, int64_t group_epoch,
                      const GrpcRendezvousStoreOptions& options = {});

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout) override;

  // Tells the coordinator that `rank` of `world_size` joined this epoch's group and serves
  // Worker at `address`.
  absl::Status Join(int rank, int world_size, const std::string& address);

  int64_t group_epoch() const { return group_epoch_; }

 private:
  const int64_t group_epoch_;
  const GrpcRendezvousStoreOptions options_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
};

}  // namespace treeverify::services
