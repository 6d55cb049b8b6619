// Channels and call deadlines as every treeverify client sets them up: plaintext for now (TLS
// arrives with the security work), message size limits both ways, deadlines from durations.
//
//   TV_ASSIGN_OR_RETURN(auto channel, CreateClientChannel("127.0.0.1:50051"));
//   TV_RETURN_IF_ERROR(WaitForChannel(*channel, "127.0.0.1:50051", absl::Seconds(10)));
//   grpc::ClientContext context;
//   SetTimeout(context, absl::Seconds(5));
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace treeverify::services {

inline constexpr int64_t kDefaultMaxMessageBytes = int64_t{64} << 20;

// INVALID_ARGUMENT for an empty address or a size limit outside [1 KiB, 2 GiB).
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateClientChannel(
    const std::string& address, int64_t max_message_bytes = kDefaultMaxMessageBytes);

// Connects and waits until the channel is ready; UNAVAILABLE naming `address` after `timeout`.
absl::Status WaitForChannel(grpc::Channel& channel, absl::string_view address,
                            absl::Duration timeout);

// A deadline `timeout` from now; none for an infinite timeout.
void SetTimeout(grpc::ClientContext& context, absl::Duration timeout);

// INVALID_ARGUMENT unless 1 KiB <= bytes < 2 GiB (gRPC takes an int).
absl::Status ValidateMaxMessageBytes(int64_t bytes);

}  // namespace treeverify::services
