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
// serving, calls fail with UNAVAILABLE. With metrics, every call is counted by method and status
// code as it finishes (each request of a VerifyStream as a Verify).
//
//   VerifierService verifier;
//   ... start the server, wait for the ranks, build the engine ...
//   verifier.SetEngine(engine.get());
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>

#include "treeverify/coordinator/verify_engine.h"
#include "treeverify/monitoring/metrics.h"
#include "treeverify/v1/verifier.grpc.pb.h"

namespace treeverify::services {

class VerifierService final : public v1::Verifier::CallbackService {
 public:
  // `metrics` (optional) outlives the service.
  explicit VerifierService(coordinator::VerifyEngine* engine = nullptr,
                           monitoring::CoordinatorMetrics* metrics = nullptr)
      : engine_(engine), metrics_(metrics) {}

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
  // Counts a finished request (when there are metrics).
  void Count(const char* method, const grpc::Status& status) const;
  // Counts a unary call's status, then finishes it.
  void Finish(grpc::ServerUnaryReactor* reactor, const char* method,
              const grpc::Status& status) const;

  std::atomic<coordinator::VerifyEngine*> engine_;
  monitoring::CoordinatorMetrics* const metrics_;
};

}  // namespace treeverify::services
