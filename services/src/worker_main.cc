// treeverify-worker: one tensor-parallel rank. Serves the Worker API, forms the collective group
// with the other ranks through the coordinator's Rendezvous service (Gloo over TCP on CPUs, NCCL
// on GPUs),
// loads its shard of the model and announces itself to the coordinator with Join. See
// services/README.md.
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "prometheus/registry.h"
#include "treeverify/kernels/status.h"
#include "treeverify/monitoring/metrics.h"
#include "treeverify/monitoring/metrics_server.h"
#include "treeverify/services/client_channel.h"
#include "treeverify/services/grpc_rendezvous_store.h"
#include "treeverify/services/metrics_endpoint.h"
#include "treeverify/services/process_main.h"
#include "treeverify/services/server_bootstrap.h"
#include "treeverify/services/signal_waiter.h"
#include "treeverify/services/worker_service.h"
#include "treeverify/v1/worker.grpc.pb.h"
#include "treeverify/worker/gloo_communicator.h"
#include "treeverify/worker/model_runner.h"
#ifdef TREEVERIFY_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "treeverify/worker/cuda_forward.h"
#include "treeverify/worker/nccl_communicator.h"
#include "treeverify/worker/nvml_sampler.h"
#endif

ABSL_FLAG(int32_t, rank, -1, "This worker's rank in [0, world size)");
ABSL_FLAG(int32_t, world_size, 1, "Tensor-parallel ranks of the replica");
ABSL_FLAG(std::string, coordinator, "", "The coordinator's address (host:port)");
ABSL_FLAG(std::string, model, "", "Checkpoint directory (config.json + safetensors)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "Address of the Worker service (port 0 picks a free one, printed on stdout). Its host "
          "is also where the Gloo group connects and what the coordinator is told; a wildcard "
          "host (0.0.0.0) announces this machine's host name");
ABSL_FLAG(std::string, backend, "cpu",
          "cpu, or cuda: the forward on a GPU (builds with a CUDA toolkit only)");
ABSL_FLAG(int32_t, gpu, -1,
          "With --backend cuda, the device ordinal (among those CUDA_VISIBLE_DEVICES shows); -1: "
          "the rank modulo the number of visible GPUs (one rank per GPU on one machine)");
ABSL_FLAG(int64_t, kv_pages, 1024, "KV cache pages of this rank");
ABSL_FLAG(int32_t, kv_page_size, 64, "Tokens per KV cache page");
ABSL_FLAG(std::string, expert_sharding, "split",
          "split: every rank holds 1/W of every expert; whole: whole experts per rank");
ABSL_FLAG(int64_t, collective_timeout_s, 60,
          "Bounds every collective and forming the group (a lost peer is an error, not a hang)");
ABSL_FLAG(int64_t, group_epoch, 1, "Group epoch to form (a re-formed group takes a new one)");
ABSL_FLAG(int64_t, connect_timeout_s, 60, "How long to wait for the coordinator at start-up");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20, "Largest gRPC message, both ways");
ABSL_FLAG(
    std::string, metrics_listen, "",
    "Address of the Prometheus /metrics endpoint (host:port; port 0 picks a free one, printed "
    "on stdout); empty: no endpoint. On GPUs it also turns the step's phase accounting on");
ABSL_FLAG(std::string, health_listen, "",
          "Address of a plaintext port serving only grpc.health.v1, for Kubernetes' gRPC probes "
          "(host:port; port 0 picks one, printed on stdout): readiness on the main service, "
          "liveness on 'treeverify.liveness'; empty: no such port");
ABSL_FLAG(int64_t, shutdown_grace_s, 10,
          "On SIGTERM/SIGINT, how long in-flight calls may take before they are cancelled");

namespace treeverify::services {
namespace {

constexpr char kProgram[] = "treeverify-worker";

absl::Status Context(absl::Status status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

std::string HostName() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name)) != 0) return "localhost";
  return name;
}

#ifdef TREEVERIFY_HAVE_CUDA
// --gpu, or by default the rank modulo the visible GPUs. Without a GPU, 0: the forward or the
// group then fails with FAILED_PRECONDITION naming the missing device.
int GpuOfRank(int rank) {
  const int flag = absl::GetFlag(FLAGS_gpu);
  if (flag >= 0) return flag;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
    cudaGetLastError();
    return 0;
  }
  return rank % count;
}
#endif

// What computes, for treeverify_build_info: the GPU's name, or "cpu".
std::string DeviceName(const std::string& backend, int rank) {
#ifdef TREEVERIFY_HAVE_CUDA
  if (backend == "cuda") {
    absl::StatusOr<kernels::cuda::DeviceInfo> device = kernels::cuda::QueryDevice(GpuOfRank(rank));
    return device.ok() ? device->name : "unknown GPU";
  }
#endif
  (void)rank;
  return backend == "cuda" ? "unknown GPU" : "cpu";
}

absl::StatusOr<worker::ModelRunnerOptions> RunnerOptionsFromFlags() {
  worker::ModelRunnerOptions options;
  options.rank = absl::GetFlag(FLAGS_rank);
  options.world_size = absl::GetFlag(FLAGS_world_size);
  options.kv_pages = absl::GetFlag(FLAGS_kv_pages);
  options.kv_page_size = absl::GetFlag(FLAGS_kv_page_size);
  const std::string sharding = absl::GetFlag(FLAGS_expert_sharding);
  if (sharding == "split") {
    options.expert_sharding = worker::ExpertSharding::kSplitInside;
  } else if (sharding == "whole") {
    options.expert_sharding = worker::ExpertSharding::kWholeExperts;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--expert-sharding must be split or whole, got '", sharding, "'"));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rank must be in [0, --world-size = ", options.world_size, "), got ", options.rank));
  }
  if (absl::Status status = options.Validate(); !status.ok()) return status;
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "cuda") {
#ifdef TREEVERIFY_HAVE_CUDA
    // The phase accounting feeds the metrics; without an endpoint it would only cost time.
    const worker::CudaForwardOptions cuda{
        .device_ordinal = GpuOfRank(options.rank),
        .account_steps = !absl::GetFlag(FLAGS_metrics_listen).empty()};
    if (absl::Status status = cuda.Validate(); !status.ok()) return status;
    options.forward_factory = [cuda](const worker::ModelWeights& weights,
                                     const worker::KvCacheOptions& cache,
                                     worker::Communicator* communicator) {
      return worker::MakeCudaForward(weights, cache, communicator, cuda);
    };
#else
    return absl::FailedPreconditionError(
        "--backend cuda: this treeverify-worker was built without a CUDA toolkit; rebuild "
        "where nvcc is found (TREEVERIFY_CUDA=ON) or run --backend cpu");
#endif
  } else if (backend != "cpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be cpu or cuda, got '", backend, "'"));
  }
  return options;
}

// The ranks' collective group: NCCL between GPUs (--backend cuda), Gloo over TCP between CPU
// processes. Either way the ranks meet through the coordinator's rendezvous store, under keys
// of this group epoch.
absl::StatusOr<std::unique_ptr<worker::Communicator>> FormGroup(
    const std::string& backend, int rank, int world_size, const std::string& host,
    absl::Duration timeout, int64_t group_epoch, worker::RendezvousStore& store,
    const std::string& program) {
  const char* library = backend == "cuda" ? "NCCL" : "Gloo";
  std::fprintf(stderr, "%s: forming the %s group of %d (epoch %lld)\n", program.c_str(), library,
               world_size, static_cast<long long>(group_epoch));
  absl::StatusOr<std::unique_ptr<worker::Communicator>> communicator;
#ifdef TREEVERIFY_HAVE_CUDA
  if (backend == "cuda") {
    communicator =
        worker::NcclCommunicator::Create({.rank = rank,
                                          .world_size = world_size,
                                          .device_ordinal = GpuOfRank(rank),
                                          .timeout = timeout,
                                          .key_prefix = absl::StrCat("nccl/", group_epoch, "/")},
                                         &store);
  }
#endif
  if (backend != "cuda") {
    communicator =
        worker::GlooCommunicator::Create({.rank = rank,
                                          .world_size = world_size,
                                          .interface_address = host,
                                          .timeout = timeout,
                                          .key_prefix = absl::StrCat("gloo/", group_epoch, "/")},
                                         &store);
  }
  if (!communicator.ok()) {
    return Context(communicator.status(), absl::StrCat("forming the ", library, " group"));
  }
  return communicator;
}

absl::Status Run(SignalWaiter& signals) {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  absl::StatusOr<worker::ModelRunnerOptions> runner_options = RunnerOptionsFromFlags();
  if (!runner_options.ok()) return Context(runner_options.status(), "invalid flags");
  const std::string coordinator_address = absl::GetFlag(FLAGS_coordinator);
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (coordinator_address.empty() || model_dir.empty()) {
    return absl::InvalidArgumentError("--coordinator HOST:PORT and --model DIR are required");
  }
  const int64_t group_epoch = absl::GetFlag(FLAGS_group_epoch);
  if (group_epoch < 0) return absl::InvalidArgumentError("--group-epoch must be >= 0");
  const absl::Duration collective_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  const int rank = runner_options->rank;
  const int world_size = runner_options->world_size;
  const std::string program = absl::StrCat(kProgram, " rank ", rank);

  // Metrics first: the process is visible while it joins and loads.
  auto registry = std::make_shared<prometheus::Registry>();
  monitoring::SetBuildInfo(
      *registry, {.component = "worker", .backend = backend, .device = DeviceName(backend, rank)});
  monitoring::WorkerMetrics metrics(*registry, rank);
  TV_ASSIGN_OR_RETURN(std::unique_ptr<monitoring::MetricsServer> metrics_server,
                      StartMetricsEndpoint(program, absl::GetFlag(FLAGS_metrics_listen), registry));

  // The server first: the rank must know its port to announce it.
  WorkerService service({.group_epoch = group_epoch, .backend = backend, .metrics = &metrics});
  absl::StatusOr<std::unique_ptr<GrpcServer>> started =
      GrpcServer::Start({.listen_address = absl::GetFlag(FLAGS_listen),
                         .max_message_bytes = max_message_bytes,
                         .health_services = {std::string(v1::Worker::service_full_name())},
                         .health_listen_address = absl::GetFlag(FLAGS_health_listen)},
                        {&service});
  if (!started.ok()) return started.status();
  GrpcServer& server = **started;
  if (!server.health_address().empty()) {
    std::printf("%s health on %s\n", program.c_str(), server.health_address().c_str());
  }
  std::printf("%s listening on %s\n", program.c_str(), server.address().c_str());
  std::fflush(stdout);
  absl::StatusOr<HostPort> listen = ParseHostPort(server.address());
  if (!listen.ok()) return listen.status();
  const std::string host = IsWildcardHost(listen->host) ? HostName() : listen->host;
  const std::string advertised = JoinHostPort(host, server.port());

  // Nothing to drain until the rank serves: a signal during start-up exits at once.
  signals.SetExitImmediately(true);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      CreateClientChannel(coordinator_address, max_message_bytes);
  if (!channel.ok()) return Context(channel.status(), "--coordinator");
  if (absl::Status status = WaitForChannel(**channel, coordinator_address,
                                           absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s)));
      !status.ok()) {
    return Context(status, "the coordinator is unreachable (--connect-timeout-s)");
  }
  GrpcRendezvousStore store(*channel, group_epoch);
  absl::StatusOr<std::unique_ptr<worker::Communicator>> communicator =
      FormGroup(backend, rank, world_size, host, collective_timeout, group_epoch, store, program);
  if (!communicator.ok()) return communicator.status();
  std::fprintf(stderr, "%s: loading %s\n", program.c_str(), model_dir.c_str());
  absl::StatusOr<std::unique_ptr<worker::ModelRunner>> runner =
      worker::ModelRunner::Create(model_dir, *runner_options, communicator->get());
  if (!runner.ok()) return Context(runner.status(), "loading the model");
  service.SetRunner(runner->get());
#ifdef TREEVERIFY_HAVE_CUDA
  // NVML's view of the GPU beside the bytes model's (a missing NVML leaves those gauges out).
  std::unique_ptr<worker::NvmlSampler> nvml;
  if (metrics_server != nullptr && backend == "cuda") {
    absl::StatusOr<std::unique_ptr<worker::NvmlSampler>> sampler = worker::NvmlSampler::Start(
        GpuOfRank(rank), absl::Seconds(1), [&metrics](const worker::NvmlSample& sample) {
          if (sample.memory_utilization) {
            metrics.SetGpuMemoryUtilization(*sample.memory_utilization);
          }
          if (sample.dram_bandwidth_utilization) {
            metrics.SetGpuDramUtilization(*sample.dram_bandwidth_utilization);
          }
        });
    if (sampler.ok()) {
      nvml = *std::move(sampler);
    } else {
      std::fprintf(stderr, "%s: no NVML metrics: %s\n", program.c_str(),
                   sampler.status().ToString().c_str());
    }
  }
#endif
  server.SetServing(true);
  if (absl::Status status = store.Join(rank, world_size, advertised); !status.ok()) {
    server.Shutdown(absl::ZeroDuration());  // before the runner goes away
    return Context(status, "joining the coordinator");
  }
  std::fprintf(stderr, "%s: joined; serving Worker at %s\n", program.c_str(), advertised.c_str());
  signals.SetExitImmediately(false);

  signals.WaitFor(absl::InfiniteDuration());
  std::fprintf(stderr, "%s: draining\n", program.c_str());
  server.Shutdown(absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s)));
  return absl::OkStatus();
}

}  // namespace
}  // namespace treeverify::services

int main(int argc, char** argv) {
  return treeverify::services::ProcessMain(
      argc, argv, treeverify::services::kProgram,
      "treeverify-worker --rank R --world-size W --coordinator HOST:PORT --model DIR\n"
      "    [--listen ADDR] [--backend cpu|cuda] [--gpu N] [--kv-pages N] [--kv-page-size 64]\n"
      "    [--expert-sharding split|whole] [--collective-timeout-s 60] [--group-epoch 1]\n"
      "    [--metrics-listen HOST:PORT] [--health-listen HOST:PORT]\n"
      "One tensor-parallel rank. Flags may be written with dashes or underscores.",
      treeverify::services::Run);
}
