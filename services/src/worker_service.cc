#include "treeverify/services/worker_service.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "treeverify/coordinator/rank_client.h"
#include "treeverify/services/proto_conversion.h"
#include "treeverify/services/status_conversion.h"
#include "treeverify/services/worker_metrics.h"

namespace treeverify::services {
namespace {

// A Release names sequences the coordinator created; far more than any cache holds is an error.
constexpr int kMaxReleaseIds = 1 << 20;

grpc::Status NotLoaded() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "this rank is still forming its group or loading the model; retry");
}

}  // namespace

WorkerService::WorkerService(WorkerServiceOptions options) : options_(std::move(options)) {}

WorkerService::~WorkerService() = default;

void WorkerService::SetRunner(worker::ModelRunner* runner) { runner_.store(runner); }

grpc::ServerUnaryReactor* WorkerService::Describe(grpc::CallbackServerContext* context,
                                                  const v1::DescribeRequest* /*request*/,
                                                  v1::DescribeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  worker::ModelRunner* runner = runner_.load();
  if (runner == nullptr) {
    reactor->Finish(NotLoaded());
    return reactor;
  }
  // On the executor: the free page count changes under a running Forward.
  executor_.Post([this, runner, reactor, response] {
    coordinator::RankDescription description = coordinator::DescribeRunner(*runner);
    description.group_epoch = options_.group_epoch;
    description.backend = options_.backend;
    RankDescriptionToProto(description, response);
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Forward(grpc::CallbackServerContext* context,
                                                 const v1::ForwardRequest* request,
                                                 v1::ForwardResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  worker::ModelRunner* runner = runner_.load();
  if (runner == nullptr) {
    reactor->Finish(NotLoaded());
    return reactor;
  }
  absl::StatusOr<worker::ForwardRequest> translated = ForwardRequestFromProto(
      *request, ForwardLimits{.num_layers = runner->config().num_hidden_layers});
  if (!translated.ok()) {
    reactor->Finish(ToGrpcStatus(translated.status()));
    return reactor;
  }
  // Runs even if the caller gave up meanwhile: the other ranks run it too, and skipping it here
  // would leave them waiting in a collective.
  executor_.Post([this, runner, reactor, response, forward = *std::move(translated)] {
    const absl::Time start = absl::Now();
    absl::StatusOr<worker::ForwardResult> result = runner->Forward(forward);
    if (!result.ok()) {
      reactor->Finish(ToGrpcStatus(result.status()));
      return;
    }
    if (options_.metrics != nullptr) RecordForward(*runner, *options_.metrics);
    ForwardResultToProto(*result, /*include_hidden_states=*/runner->plan().rank == 0, response);
    response->set_forward_seconds(absl::ToDoubleSeconds(absl::Now() - start));
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Release(grpc::CallbackServerContext* context,
                                                 const v1::ReleaseRequest* request,
                                                 v1::ReleaseResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  worker::ModelRunner* runner = runner_.load();
  if (runner == nullptr) {
    reactor->Finish(NotLoaded());
    return reactor;
  }
  if (request->sequence_ids_size() > kMaxReleaseIds) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 absl::StrCat("sequence_ids has ", request->sequence_ids_size(),
                                              " entries; at most ", kMaxReleaseIds)));
    return reactor;
  }
  std::vector<uint64_t> ids(request->sequence_ids().begin(), request->sequence_ids().end());
  executor_.Post([runner, reactor, response, ids = std::move(ids)] {
    absl::Status first_error;
    for (uint64_t id : ids) {
      // Idempotent, as InProcessRankClient: a sequence whose prefill never reached this rank is
      // unknown here.
      absl::Status status = runner->Release(id);
      if (!status.ok() && !absl::IsNotFound(status) && first_error.ok()) first_error = status;
    }
    response->set_kv_pages_free(runner->kv_cache().free_pages());
    reactor->Finish(ToGrpcStatus(first_error));
  });
  return reactor;
}

}  // namespace treeverify::services
