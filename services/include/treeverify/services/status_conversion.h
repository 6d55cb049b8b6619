// absl::Status <-> grpc::Status. Both use the canonical google.rpc codes, so a conversion keeps
// the code and the message as they are: a client sees exactly the error the library produced.
//
//   return ToGrpcStatus(engine_status);                 // in a service
//   return ToAbslStatus(stub->Forward(&context, request, &response));  // in a client
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace treeverify::services {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status ToAbslStatus(const grpc::Status& status);

// A google.rpc code carried as an int32 in a proto field (ForwardSequenceResult.status_code):
// codes outside 0..16 become UNKNOWN, with the original number in the message.
absl::Status StatusFromCode(int32_t code, absl::string_view message);

}  // namespace treeverify::services
