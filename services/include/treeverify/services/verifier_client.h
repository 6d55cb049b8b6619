// A synchronous client of the public Verifier API, for treeverify-cli and the tests: the
// coordinator library's plain structs in and out (it is a coordinator::VerifierApi, like the
// in-process VerifyEngine, so drafting loops run against either), gRPC errors as absl::Status
// with the same code and message.
//
//   TV_ASSIGN_OR_RETURN(auto client, VerifierClient::Connect("127.0.0.1:50051",
//   absl::Seconds(10))); TV_RETURN_IF_ERROR(client->WaitUntilServing(absl::Seconds(60)));
//   TV_ASSIGN_OR_RETURN(coordinator::CreateSessionOutput session,
//                       client->CreateSession({.prompt_token_ids = {1, 2, 3}}));
//   TV_ASSIGN_OR_RETURN(auto stream, client->OpenStream());
//   TV_ASSIGN_OR_RETURN(coordinator::VerifyOutput step,
//                       stream->Step({.session_id = session.session_id}));
//   TV_RETURN_IF_ERROR(stream->Finish());
//   TV_RETURN_IF_ERROR(client->CloseSession(session.session_id));
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "treeverify/coordinator/verifier_api.h"
#include "treeverify/coordinator/verify_types.h"
#include "treeverify/services/client_channel.h"
#include "treeverify/v1/verifier.grpc.pb.h"

namespace treeverify::services {

struct VerifierClientOptions {
  int64_t max_message_bytes = kDefaultMaxMessageBytes;
  // Deadline of each unary call (a CreateSession prefills its whole prompt).
  absl::Duration call_timeout = absl::Seconds(120);
};

// One VerifyStream call: each Step writes a request and reads its response. Not thread safe.
class VerifierStream {
 public:
  // Cancels the call if Finish was not called.
  ~VerifierStream();

  // After an error the stream is over, and the error is the status the server ended it with
  // (a request's own error ends the stream: the session itself stays usable).
  absl::StatusOr<coordinator::VerifyOutput> Step(const coordinator::VerifyInput& input);
  // Half-closes the stream and returns its final status. Idempotent.
  absl::Status Finish();

 private:
  friend class VerifierClient;
  VerifierStream() = default;

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::VerifyRequest, v1::VerifyResponse>> stream_;
  bool finished_ = false;
  absl::Status final_status_;
};

class VerifierClient final : public coordinator::VerifierApi {
 public:
  // Waits up to `timeout` for the connection; UNAVAILABLE if the server cannot be reached.
  static absl::StatusOr<std::unique_ptr<VerifierClient>> Connect(
      const std::string& address, absl::Duration timeout,
      const VerifierClientOptions& options = {});

  absl::StatusOr<coordinator::ModelInfo> GetModelInfo() override;
  absl::StatusOr<coordinator::CreateSessionOutput> CreateSession(
      coordinator::CreateSessionInput input) override;
  absl::StatusOr<coordinator::VerifyOutput> Verify(coordinator::VerifyInput input) override;
  absl::Status CloseSession(const coordinator::SessionId& id) override;
  absl::StatusOr<std::unique_ptr<VerifierStream>> OpenStream();

  // grpc.health.v1.Health/Check for `service` ("" is the whole server): true when SERVING.
  // NOT_FOUND for a service the server does not report on.
  absl::StatusOr<bool> CheckHealth(const std::string& service = "");
  // Polls the Verifier's health until it is SERVING; DEADLINE_EXCEEDED after `timeout`.
  absl::Status WaitUntilServing(absl::Duration timeout);

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  v1::Verifier::Stub& stub() { return *stub_; }

 private:
  VerifierClient(std::shared_ptr<grpc::Channel> channel, const VerifierClientOptions& options);

  const VerifierClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Verifier::Stub> stub_;
};

}  // namespace treeverify::services
