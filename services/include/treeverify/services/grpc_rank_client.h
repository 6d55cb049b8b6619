// The coordinator's RankClient for a rank in another process: the Worker service over gRPC.
//
// Calls are synchronous with a deadline of the given timeout. A rank that cannot be reached in
// time gives UNAVAILABLE or DEADLINE_EXCEEDED (the codes pass through unchanged; the message
// names the rank's address); a response that does not fit the request is INTERNAL.
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<GrpcRankClient> rank,
//                       GrpcRankClient::Create("10.0.0.7:50061", {}));
//   TV_ASSIGN_OR_RETURN(coordinator::RankDescription d, rank->Describe(absl::Seconds(10)));
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "treeverify/coordinator/rank_client.h"
#include "treeverify/services/client_channel.h"
#include "treeverify/v1/worker.grpc.pb.h"

namespace treeverify::services {

struct GrpcRankClientOptions {
  // Largest message sent or received (a Forward of a big batch with logits is large).
  int64_t max_message_bytes = kDefaultMaxMessageBytes;
};

class GrpcRankClient final : public coordinator::RankClient {
 public:
  // Does not connect yet: the first call does.
  static absl::StatusOr<std::unique_ptr<GrpcRankClient>> Create(
      const std::string& address, const GrpcRankClientOptions& options);

  absl::StatusOr<coordinator::RankDescription> Describe(absl::Duration timeout) override;
  absl::StatusOr<worker::ForwardResult> Forward(const worker::ForwardRequest& request,
                                                absl::Duration timeout) override;
  absl::StatusOr<int64_t> Release(absl::Span<const uint64_t> sequence_ids,
                                  absl::Duration timeout) override;

  const std::string& address() const { return address_; }

 private:
  GrpcRankClient(std::string address, std::unique_ptr<v1::Worker::Stub> stub)
      : address_(std::move(address)), stub_(std::move(stub)) {}
  // The call's status, with the rank's address in the message.
  absl::Status CallStatus(const grpc::Status& status, absl::string_view method) const;

  const std::string address_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

}  // namespace treeverify::services
