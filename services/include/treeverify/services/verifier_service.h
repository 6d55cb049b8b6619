// The public Verifier gRPC service over a coordinator::VerifyEngine. Thin: it validates and
// translates each request (proto_conversion.h), hands it to the engine, and finishes the call
// from the engine's callback, so no gRPC thread ever waits for the ranks.
//
// VerifyStream handles one request at a time: read a request, run it, write its response, read
// the next. A request that fails ends the stream with that request's status (the session itself
// is unharmed by a refused request; the client opens a new stream). A client that half-closes
// ends it with OK.
//
// The server starts before the ranks have joined; until SetEngine, and once the engine stops
// serving, calls fail with UNAVAILABLE.
//
//   VerifierService verifier;
//   ... start the server, wait for the ranks, build the engine ...
//   verifier.SetEngine(engine.get());
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>

#include "treeverify/coordinator/verify_engine.h"
#include "treeverify/v1/verifier.grpc.pb.h"

namespace treeverify::services {

class VerifierService final : public v1::Verifier::CallbackService {
 public:
  explicit VerifierService(coordinator::VerifyEngine* engine = nullptr) : engine_(engine) {}

  // From now on calls go to `engine`, which must outlive every call (shut the server down before
  // destroying the engine). Call at most once.
  void SetEngine(coordinator::VerifyEngine* engine) { engine_.store(engine); }

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::GetModelInfoResponse* response) override;
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::CreateSessionResponse* response) override;
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* context,
                                   const v1::VerifyRequest* request,
                                   v1::VerifyResponse* response) override;
  grpc::ServerBidiReactor<v1::VerifyRequest, v1::VerifyResponse>* VerifyStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;

 private:
  class StreamReactor;

  // The engine when it takes new work; otherwise nullptr and the status to answer with.
  coordinator::VerifyEngine* ServingEngine(grpc::Status* refusal) const;

  std::atomic<coordinator::VerifyEngine*> engine_;
};

}  // namespace treeverify::services
