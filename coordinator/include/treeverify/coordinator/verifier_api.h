// The Verifier API in plain structs, as a client sees it. VerifyEngine implements it in-process
// and services' VerifierClient over gRPC, so drafting loops (tools/) run against either.
#pragma once

#include "absl/status/statusor.h"
#include "treeverify/coordinator/verify_types.h"

namespace treeverify::coordinator {

class VerifierApi {
 public:
  virtual ~VerifierApi() = default;
  virtual absl::StatusOr<ModelInfo> GetModelInfo() = 0;
  virtual absl::StatusOr<CreateSessionOutput> CreateSession(CreateSessionInput input) = 0;
  virtual absl::StatusOr<VerifyOutput> Verify(VerifyInput input) = 0;
  virtual absl::Status CloseSession(const SessionId& id) = 0;
};

}  // namespace treeverify::coordinator
