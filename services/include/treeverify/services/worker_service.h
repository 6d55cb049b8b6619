// The Worker gRPC service of one tensor-parallel rank, over a worker::ModelRunner.
//
// Forward, Release and Describe run on one dedicated executor thread, in arrival order: the
// runner is not thread safe, and the ranks must enter their collectives in the same order (the
// coordinator sends every rank the same calls in the same order). Requests are validated on the
// gRPC thread first, so a malformed one fails at once on every rank alike and never reaches a
// collective. Only rank 0 returns hidden states (every rank holds the same values).
//
// The server starts before the model is loaded (the rank must announce where it listens); until
// SetRunner every call fails with UNAVAILABLE.
//
//   WorkerService service({.group_epoch = 1});
//   ... start the server, form the group, load the runner ...
//   service.SetRunner(runner.get());
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "treeverify/monitoring/metrics.h"
#include "treeverify/services/serial_executor.h"
#include "treeverify/v1/worker.grpc.pb.h"
#include "treeverify/worker/model_runner.h"

namespace treeverify::services {

struct WorkerServiceOptions {
  // Reported by Describe.
  int64_t group_epoch = 0;
  std::string backend = "cpu";
  // Recorded after every forward (worker_metrics.h); not owned, outlives the service. Null: none.
  monitoring::WorkerMetrics* metrics = nullptr;
};

class WorkerService final : public v1::Worker::CallbackService {
 public:
  explicit WorkerService(WorkerServiceOptions options);
  // Finishes the calls already queued on the executor (the server must be shut down first).
  ~WorkerService() override;

  // From now on calls go to `runner`, which must outlive the service. Call at most once.
  void SetRunner(worker::ModelRunner* runner);

  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* context,
                                     const v1::DescribeRequest* request,
                                     v1::DescribeResponse* response) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;

 private:
  const WorkerServiceOptions options_;
  std::atomic<worker::ModelRunner*> runner_{nullptr};
  SerialExecutor executor_;
};

}  // namespace treeverify::services
