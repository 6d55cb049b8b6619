// treeverify-coordinator: one model replica's coordinator. Serves the public Verifier API and the
// Rendezvous service its ranks use to form their group; waits for every rank to Join, then
// builds the VerifyEngine over gRPC rank clients and reports SERVING. See services/README.md.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "prometheus/registry.h"
#include "treeverify/coordinator/verify_engine.h"
#include "treeverify/kernels/status.h"
#include "treeverify/monitoring/metrics.h"
#include "treeverify/monitoring/metrics_server.h"
#include "treeverify/services/engine_metrics.h"
#include "treeverify/services/grpc_rank_client.h"
#include "treeverify/services/metrics_endpoint.h"
#include "treeverify/services/process_main.h"
#include "treeverify/services/rendezvous_service.h"
#include "treeverify/services/server_bootstrap.h"
#include "treeverify/services/signal_waiter.h"
#include "treeverify/services/verifier_service.h"
#include "treeverify/v1/verifier.grpc.pb.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "Address of the Verifier and Rendezvous services (host:port; port 0 picks a free one, "
          "printed on stdout)");
ABSL_FLAG(int32_t, world_size, 1, "Tensor-parallel ranks of the replica (workers that must Join)");
ABSL_FLAG(std::string, model_name, "",
          "Model name reported by GetModelInfo (default: the model type the ranks report)");
ABSL_FLAG(int32_t, max_draft_nodes, 255, "Largest draft tree accepted (at most 255)");
ABSL_FLAG(int64_t, max_context, 0, "Largest context of a session (0: the model's)");
ABSL_FLAG(int64_t, batch_window_us, 300,
          "How long a Verify waits for other sessions' trees to share its forward");
ABSL_FLAG(int64_t, max_batch_rows, 4096, "Rows of one forward (at least 256)");
ABSL_FLAG(int32_t, prefill_chunk, 0,
          "Prompt rows per prefill forward (1..8192); 0: by the ranks' backend (256 on CPUs, 4096 "
          "on GPUs, which prefill long chunks in the MHA form: docs/gpu-worker.md)");
ABSL_FLAG(int64_t, max_sessions, 1024, "Live sessions (more: RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, session_ttl_s, 600, "Idle seconds after which a session expires");
ABSL_FLAG(int64_t, rank_timeout_s, 60, "Deadline of every call to a rank");
ABSL_FLAG(int64_t, join_timeout_s, 300, "How long to wait for every rank to Join at start-up");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20, "Largest gRPC message, both ways");
ABSL_FLAG(int32_t, max_concurrent_streams, 256, "Concurrent calls per client connection");
ABSL_FLAG(
    std::string, metrics_listen, "",
    "Address of the Prometheus /metrics endpoint (host:port; port 0 picks a free one, printed "
    "on stdout); empty: no endpoint");
ABSL_FLAG(std::string, health_listen, "",
          "Address of a plaintext port serving only grpc.health.v1, for Kubernetes' gRPC probes "
          "(host:port; port 0 picks one, printed on stdout): readiness on the main service, "
          "liveness on 'treeverify.liveness'; empty: no such port");
ABSL_FLAG(int64_t, shutdown_grace_s, 10,
          "On SIGTERM/SIGINT, how long in-flight calls may take before they are cancelled");

namespace treeverify::services {
namespace {

constexpr char kProgram[] = "treeverify-coordinator";
// On shutdown, how long the server stays up after the engine refuses new work (at most the grace
// period): long enough for calls already sent to reach a handler.
constexpr absl::Duration kRefusalWindow = absl::Milliseconds(200);

absl::Status Fail(absl::Status status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

absl::StatusOr<coordinator::VerifyEngineOptions> EngineOptionsFromFlags() {
  coordinator::VerifyEngineOptions options;
  options.model_name = absl::GetFlag(FLAGS_model_name);
  options.max_draft_nodes = absl::GetFlag(FLAGS_max_draft_nodes);
  options.max_context_length = absl::GetFlag(FLAGS_max_context);
  options.batch_window = absl::Microseconds(absl::GetFlag(FLAGS_batch_window_us));
  options.max_batch_rows = absl::GetFlag(FLAGS_max_batch_rows);
  options.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  options.rank_timeout = absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_s));
  options.sessions.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.sessions.idle_ttl = absl::Seconds(absl::GetFlag(FLAGS_session_ttl_s));
  if (absl::Status status = options.Validate(); !status.ok()) return status;
  return options;
}

// Runs the coordinator until a signal; errors are start-up failures.
absl::Status Run(SignalWaiter& signals) {
  const int world_size = absl::GetFlag(FLAGS_world_size);
  absl::StatusOr<coordinator::VerifyEngineOptions> engine_options = EngineOptionsFromFlags();
  if (!engine_options.ok()) return Fail(engine_options.status(), "invalid flags");
  RendezvousServiceOptions rendezvous_options{.world_size = world_size};
  if (absl::Status status = rendezvous_options.Validate(); !status.ok()) {
    return Fail(status, "invalid flags");
  }
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);

  // Metrics first: an operator sees the process, and the replica not serving yet, while the
  // ranks join.
  auto registry = std::make_shared<prometheus::Registry>();
  monitoring::CoordinatorMetrics metrics(*registry);
  EngineMetrics engine_metrics(metrics);
  metrics.SetServing(false);
  TV_ASSIGN_OR_RETURN(
      std::unique_ptr<monitoring::MetricsServer> metrics_server,
      StartMetricsEndpoint(kProgram, absl::GetFlag(FLAGS_metrics_listen), registry));
  engine_options->observer = &engine_metrics;

  RendezvousService rendezvous(rendezvous_options, [](const JoinedRank& joined) {
    std::fprintf(stderr, "%s: rank %d joined (group epoch %lld), serving Worker at %s\n", kProgram,
                 joined.rank, static_cast<long long>(joined.group_epoch), joined.address.c_str());
  });
  VerifierService verifier(nullptr, &metrics);
  absl::StatusOr<std::unique_ptr<GrpcServer>> started =
      GrpcServer::Start({.listen_address = absl::GetFlag(FLAGS_listen),
                         .max_message_bytes = max_message_bytes,
                         .max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams),
                         .health_services = {std::string(v1::Verifier::service_full_name())},
                         .health_listen_address = absl::GetFlag(FLAGS_health_listen)},
                        {&rendezvous, &verifier});
  if (!started.ok()) return started.status();
  GrpcServer& server = **started;
  if (!server.health_address().empty()) {
    std::printf("%s health on %s\n", kProgram, server.health_address().c_str());
  }
  std::printf("%s listening on %s\n", kProgram, server.address().c_str());
  std::fflush(stdout);

  // Every exit path below drains like a signal does: nothing is served after Run returns.
  std::unique_ptr<coordinator::VerifyEngine> engine;
  auto shut_down = [&] {
    const absl::Duration grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
    // In-flight work ends within the grace period or, at worst, when its rank calls time out. A
    // drain that outlives both is a bug: do not hang a pod's termination on it.
    const absl::Duration limit = grace + engine_options->rank_timeout + absl::Seconds(15);
    absl::Notification drained;
    std::thread watchdog([&drained, limit] {
      if (!drained.WaitForNotificationWithTimeout(limit)) {
        std::fprintf(stderr, "%s: shutdown did not finish in time; exiting\n", kProgram);
        std::fflush(stderr);
        std::_Exit(1);
      }
    });
    server.SetServing(false);
    rendezvous.Shutdown();
    if (engine != nullptr) {
      engine->Shutdown();  // refuses new work (UNAVAILABLE); queued work completes
      // Calls already on their way reach a handler, which answers UNAVAILABLE (retryable). A
      // call the server has not handed to a handler when it shuts down is answered CANCELLED
      // instead (grpc/grpc#41785), which clients take for their own cancellation.
      absl::SleepFor(std::min(grace, kRefusalWindow));
    }
    server.Shutdown(grace);
    engine.reset();
    drained.Notify();
    watchdog.join();
  };

  // Wait for the ranks, in slices so that a signal is noticed.
  std::fprintf(stderr, "%s: waiting up to %llds for %d rank(s) to join\n", kProgram,
               static_cast<long long>(absl::GetFlag(FLAGS_join_timeout_s)), world_size);
  const absl::Time join_deadline = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s));
  absl::StatusOr<RendezvousGroup> group;
  while (true) {
    if (signals.received()) {
      shut_down();
      return absl::OkStatus();
    }
    const absl::Duration left = join_deadline - absl::Now();
    // The last slice waits for the rest of the join timeout, so its error names that.
    group = rendezvous.WaitForGroup(left <= absl::Milliseconds(200)
                                        ? std::max(left, absl::ZeroDuration())
                                        : absl::Milliseconds(200));
    if (group.ok()) break;
    if (left <= absl::Milliseconds(200)) {
      shut_down();
      return absl::DeadlineExceededError(
          absl::StrCat("after --join-timeout-s ", absl::GetFlag(FLAGS_join_timeout_s), ": ",
                       group.status().message(), "; are the workers started with --coordinator ",
                       server.address(), " and --world-size ", world_size, "?"));
    }
  }

  std::vector<std::unique_ptr<coordinator::RankClient>> ranks;
  for (const std::string& address : group->addresses) {
    absl::StatusOr<std::unique_ptr<GrpcRankClient>> rank =
        GrpcRankClient::Create(address, {.max_message_bytes = max_message_bytes});
    if (!rank.ok()) {
      shut_down();
      return rank.status();
    }
    ranks.push_back(*std::move(rank));
  }
  if (engine_options->model_name.empty()) {
    absl::StatusOr<coordinator::RankDescription> rank0 =
        ranks[0]->Describe(engine_options->rank_timeout);
    engine_options->model_name = rank0.ok() ? rank0->model_type : "model";
  }
  absl::StatusOr<std::unique_ptr<coordinator::VerifyEngine>> created =
      coordinator::VerifyEngine::Create(*engine_options, std::move(ranks));
  if (!created.ok()) {
    shut_down();
    return Fail(created.status(), "building the engine over the ranks");
  }
  engine = *std::move(created);
  const coordinator::ModelInfo& info = engine->info();
  // Before any call can reach the engine: a rank it loses from then on stays at 0.
  for (int rank = 0; rank < info.world_size; ++rank) metrics.SetRankUp(rank, true);
  verifier.SetEngine(engine.get());
  server.SetServing(true);
  monitoring::SetBuildInfo(*registry,
                           {.component = "coordinator", .backend = info.backend, .device = "cpu"});
  metrics.SetServing(true);
  std::fprintf(stderr,
               "%s: SERVING %s (%s, vocab %lld, %d %s rank(s), group epoch %lld, max context %lld, "
               "prefill chunks of %d)\n",
               kProgram, info.model_name.c_str(), info.model_type.c_str(),
               static_cast<long long>(info.vocab_size), info.world_size, info.backend.c_str(),
               static_cast<long long>(group->group_epoch),
               static_cast<long long>(info.max_context_length), info.prefill_chunk);

  // Watch the engine: a lost rank makes the replica NOT_SERVING (the process stays up).
  bool serving = true;
  while (!signals.WaitFor(absl::Milliseconds(200))) {
    metrics.SetActiveSessions(engine->active_sessions());
    if (serving && !engine->serving()) {
      serving = false;
      server.SetServing(false);
      metrics.SetServing(false);
      std::fprintf(stderr, "%s: a rank was lost; NOT_SERVING\n", kProgram);
    }
  }
  metrics.SetServing(false);
  std::fprintf(stderr, "%s: draining\n", kProgram);
  shut_down();
  return absl::OkStatus();
}

}  // namespace
}  // namespace treeverify::services

int main(int argc, char** argv) {
  return treeverify::services::ProcessMain(
      argc, argv, treeverify::services::kProgram,
      "treeverify-coordinator --world-size W [--listen 127.0.0.1:50051] [flags]\n"
      "Serves the Verifier API once W treeverify-worker ranks joined. Flags may be written\n"
      "with dashes or underscores.",
      treeverify::services::Run);
}
