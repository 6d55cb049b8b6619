#include "treeverify/services/verifier_service.h"

#include <string>
#include <utility>

#include "treeverify/services/proto_conversion.h"
#include "treeverify/services/status_conversion.h"

namespace treeverify::services {
namespace {

grpc::Status NotReady() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "the model replica is not ready: waiting for its ranks to join; retry");
}

grpc::Status NotServing() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "the model replica is not serving (a rank was lost or the coordinator is "
                      "shutting down); retry on another replica");
}

}  // namespace

void VerifierService::Count(const char* method, const grpc::Status& status) const {
  if (metrics_ != nullptr) {
    metrics_->CountRequest(method, static_cast<absl::StatusCode>(status.error_code()));
  }
}

void VerifierService::Finish(grpc::ServerUnaryReactor* reactor, const char* method,
                             const grpc::Status& status) const {
  Count(method, status);
  reactor->Finish(status);
}

coordinator::VerifyEngine* VerifierService::ServingEngine(grpc::Status* refusal) const {
  coordinator::VerifyEngine* engine = engine_.load();
  if (engine == nullptr) {
    *refusal = NotReady();
    return nullptr;
  }
  if (!engine->serving()) {
    *refusal = NotServing();
    return nullptr;
  }
  return engine;
}

grpc::ServerUnaryReactor* VerifierService::GetModelInfo(grpc::CallbackServerContext* context,
                                                        const v1::GetModelInfoRequest* /*request*/,
                                                        v1::GetModelInfoResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The model's description stays true while the replica drains or has lost a rank.
  coordinator::VerifyEngine* engine = engine_.load();
  if (engine == nullptr) {
    Finish(reactor, "GetModelInfo", NotReady());
    return reactor;
  }
  ModelInfoToProto(engine->info(), response);
  Finish(reactor, "GetModelInfo", grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* VerifierService::CreateSession(grpc::CallbackServerContext* context,
                                                         const v1::CreateSessionRequest* request,
                                                         v1::CreateSessionResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status refusal;
  coordinator::VerifyEngine* engine = ServingEngine(&refusal);
  if (engine == nullptr) {
    Finish(reactor, "CreateSession", refusal);
    return reactor;
  }
  absl::StatusOr<coordinator::CreateSessionInput> input =
      CreateSessionInputFromProto(*request, engine->info());
  if (!input.ok()) {
    Finish(reactor, "CreateSession", ToGrpcStatus(input.status()));
    return reactor;
  }
  engine->CreateSessionAsync(
      *std::move(input),
      [this, reactor, response](absl::StatusOr<coordinator::CreateSessionOutput> output) {
        if (!output.ok()) return Finish(reactor, "CreateSession", ToGrpcStatus(output.status()));
        CreateSessionOutputToProto(*output, response);
        Finish(reactor, "CreateSession", grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerUnaryReactor* VerifierService::Verify(grpc::CallbackServerContext* context,
                                                  const v1::VerifyRequest* request,
                                                  v1::VerifyResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status refusal;
  coordinator::VerifyEngine* engine = ServingEngine(&refusal);
  if (engine == nullptr) {
    Finish(reactor, "Verify", refusal);
    return reactor;
  }
  absl::StatusOr<coordinator::VerifyInput> input = VerifyInputFromProto(*request, engine->info());
  if (!input.ok()) {
    Finish(reactor, "Verify", ToGrpcStatus(input.status()));
    return reactor;
  }
  engine->VerifyAsync(*std::move(input),
                      [this, reactor, response, session_id = request->session_id()](
                          absl::StatusOr<coordinator::VerifyOutput> output) {
                        if (!output.ok())
                          return Finish(reactor, "Verify", ToGrpcStatus(output.status()));
                        VerifyOutputToProto(*output, session_id, response);
                        Finish(reactor, "Verify", grpc::Status::OK);
                      });
  return reactor;
}

grpc::ServerUnaryReactor* VerifierService::CloseSession(grpc::CallbackServerContext* context,
                                                        const v1::CloseSessionRequest* request,
                                                        v1::CloseSessionResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Closing only queues the release of the session's cache: allowed while the replica drains.
  coordinator::VerifyEngine* engine = engine_.load();
  if (engine == nullptr) {
    Finish(reactor, "CloseSession", NotReady());
    return reactor;
  }
  absl::StatusOr<coordinator::SessionId> id = SessionIdFromProto(request->session_id());
  if (!id.ok()) {
    Finish(reactor, "CloseSession", ToGrpcStatus(id.status()));
    return reactor;
  }
  Finish(reactor, "CloseSession", ToGrpcStatus(engine->CloseSession(*id)));
  return reactor;
}

// One VerifyStream call. Exactly one operation is outstanding at any time (a read, a verify in
// the engine, or a write), so the request and response buffers are never shared, and Finish is
// called exactly once, after which gRPC calls OnDone and the reactor deletes itself.
class VerifierService::StreamReactor final
    : public grpc::ServerBidiReactor<v1::VerifyRequest, v1::VerifyResponse> {
 public:
  explicit StreamReactor(const VerifierService* service) : service_(service) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The client half-closed (or the call is gone): every request so far was answered.
      Finish(grpc::Status::OK);
      return;
    }
    grpc::Status refusal;
    coordinator::VerifyEngine* engine = service_->ServingEngine(&refusal);
    if (engine == nullptr) {
      FinishRequest(refusal);
      return;
    }
    absl::StatusOr<coordinator::VerifyInput> input = VerifyInputFromProto(request_, engine->info());
    if (!input.ok()) {
      FinishRequest(ToGrpcStatus(input.status()));
      return;
    }
    engine->VerifyAsync(*std::move(input),
                        [this](absl::StatusOr<coordinator::VerifyOutput> output) {
                          if (!output.ok()) return FinishRequest(ToGrpcStatus(output.status()));
                          service_->Count("Verify", grpc::Status::OK);
                          response_.Clear();
                          VerifyOutputToProto(*output, request_.session_id(), &response_);
                          StartWrite(&response_);
                        });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream broke while answering"));
      return;
    }
    request_.Clear();
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  // A request that fails ends the stream with its status, counted as a Verify's.
  void FinishRequest(const grpc::Status& status) {
    service_->Count("Verify", status);
    Finish(status);
  }

  const VerifierService* service_;
  v1::VerifyRequest request_;
  v1::VerifyResponse response_;
};

grpc::ServerBidiReactor<v1::VerifyRequest, v1::VerifyResponse>* VerifierService::VerifyStream(
    grpc::CallbackServerContext* /*context*/) {
  return new StreamReactor(this);
}

}  // namespace treeverify::services
