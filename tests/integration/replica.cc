#include "replica.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/status.h"
#include "treeverify/services/grpc_rank_client.h"
#include "treeverify/tools/checkpoint_generator.h"

#ifndef TREEVERIFY_COORDINATOR_BINARY
#error "TREEVERIFY_COORDINATOR_BINARY must name the treeverify-coordinator executable"
#endif
#ifndef TREEVERIFY_WORKER_BINARY
#error "TREEVERIFY_WORKER_BINARY must name the treeverify-worker executable"
#endif

namespace treeverify::integration {
namespace {

// Several processes share the machine's cores: OpenMP threads that spin while waiting, or one
// OpenMP team per core in every worker, would make everything crawl.
// The build's path of a file, unless the environment names another: a bundle of these tests
// copied to the GPU machine (scripts/gpu-check.sh) finds the binaries and the source tree there.
std::string FromEnvironmentOr(const char* variable, const char* built) {
  const char* value = std::getenv(variable);
  return value != nullptr && value[0] != '\0' ? value : built;
}

const std::vector<std::pair<std::string, std::string>>& ProcessEnvironment() {
  static const auto* env = new std::vector<std::pair<std::string, std::string>>{
      {"OMP_NUM_THREADS", "1"}, {"OMP_WAIT_POLICY", "PASSIVE"}};
  return *env;
}

// Removes the scratch directory once every test of this process ran.
class ScratchCleanup final : public testing::Environment {
 public:
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(ScratchDir(), ignored);
  }
};
[[maybe_unused]] testing::Environment* const kScratchCleanup =
    testing::AddGlobalTestEnvironment(new ScratchCleanup);

// "... listening on HOST:PORT" -> "HOST:PORT"; with another marker, "... metrics on
// http://HOST:PORT/metrics" -> "HOST:PORT".
absl::StatusOr<std::string> ListenAddress(const std::string& line,
                                          const std::string& marker = "listening on ") {
  const size_t at = line.rfind(marker);
  if (at == std::string::npos) {
    return absl::InternalError(absl::StrCat("no address in '", line, "'"));
  }
  absl::string_view address = absl::string_view(line).substr(at + marker.size());
  address = absl::StripTrailingAsciiWhitespace(address);
  if (absl::ConsumeSuffix(&address, "/metrics")) absl::ConsumePrefix(&address, "http://");
  return std::string(address);
}

// The metrics line comes first on a process's stdout (the endpoint starts before the server).
absl::Status ReadMetricsAddress(ChildProcess& process, absl::Time deadline,
                                std::vector<std::string>& addresses) {
  TV_ASSIGN_OR_RETURN(const std::string line, process.ReadLineContaining("metrics on ", deadline));
  TV_ASSIGN_OR_RETURN(std::string address, ListenAddress(line, "metrics on "));
  addresses.push_back(std::move(address));
  return absl::OkStatus();
}

std::atomic<int> next_replica_id{0};

}  // namespace

const std::string& ScratchDir() {
  static const std::string* dir = [] {
    auto* path =
        new std::string(absl::StrCat(testing::TempDir(), "treeverify_integration_", ::getpid()));
    std::filesystem::create_directories(*path);
    return path;
  }();
  return *dir;
}

const std::string& TinyModelDir() {
  static const std::string* dir = [] {
    auto* path = new std::string(ScratchDir() + "/tiny-v3");
    absl::StatusOr<tools::CheckpointSpec> spec = tools::PresetSpec("tiny-v3");
    EXPECT_TRUE(spec.ok()) << spec.status();
    if (spec.ok()) {
      const absl::Status written = tools::WriteCheckpoint(*path, *spec);
      EXPECT_TRUE(written.ok()) << written;
    }
    return path;
  }();
  return *dir;
}

std::string GoldenModelDir(const std::string& name) {
  return absl::StrCat(FromEnvironmentOr("TREEVERIFY_SOURCE_DIR", TREEVERIFY_SOURCE_DIR),
                      "/tests/golden/", name);
}

absl::StatusOr<std::unique_ptr<Replica>> Replica::Start(const ReplicaOptions& options) {
  if (options.world_size < 1) return absl::InvalidArgumentError("world_size must be >= 1");
  const absl::Time deadline = absl::Now() + options.start_timeout;
  const std::string model_dir = options.model_dir.empty() ? TinyModelDir() : options.model_dir;
  const std::string log_prefix =
      absl::StrCat(ScratchDir(), "/replica", next_replica_id.fetch_add(1), "_");
  std::unique_ptr<Replica> replica(new Replica);
  auto failed = [&replica](const absl::Status& status) {
    absl::Status with_logs(status.code(), absl::StrCat(status.message(), "\n", replica->Logs()));
    replica->Stop();
    return with_logs;
  };

  ChildProcessOptions coordinator{
      .argv = {FromEnvironmentOr("TREEVERIFY_COORDINATOR_BINARY", TREEVERIFY_COORDINATOR_BINARY),
               "--listen", "127.0.0.1:0", "--world-size", std::to_string(options.world_size),
               "--join-timeout-s", std::to_string(absl::ToInt64Seconds(options.start_timeout))},
      .environment = ProcessEnvironment(),
      .stderr_path = log_prefix + "coordinator.log",
      .name = "coordinator"};
  coordinator.argv.insert(coordinator.argv.end(), options.coordinator_flags.begin(),
                          options.coordinator_flags.end());
  if (options.metrics)
    coordinator.argv.insert(coordinator.argv.end(), {"--metrics-listen", "127.0.0.1:0"});
  absl::StatusOr<std::unique_ptr<ChildProcess>> started = ChildProcess::Start(coordinator);
  if (!started.ok()) return started.status();
  replica->coordinator_ = *std::move(started);
  if (options.metrics) {
    if (absl::Status read =
            ReadMetricsAddress(*replica->coordinator_, deadline, replica->metrics_addresses_);
        !read.ok()) {
      return failed(read);
    }
  }
  absl::StatusOr<std::string> line =
      replica->coordinator_->ReadLineContaining("listening on", deadline);
  if (!line.ok()) return failed(line.status());
  absl::StatusOr<std::string> address = ListenAddress(*line);
  if (!address.ok()) return failed(address.status());
  replica->coordinator_address_ = *address;

  for (int rank = 0; rank < options.world_size; ++rank) {
    ChildProcessOptions worker{
        .argv = {FromEnvironmentOr("TREEVERIFY_WORKER_BINARY", TREEVERIFY_WORKER_BINARY), "--rank",
                 std::to_string(rank), "--world-size", std::to_string(options.world_size),
                 "--coordinator", replica->coordinator_address_, "--model", model_dir, "--listen",
                 "127.0.0.1:0", "--connect-timeout-s", "30"},
        .environment = ProcessEnvironment(),
        .stderr_path = absl::StrCat(log_prefix, "worker", rank, ".log"),
        .name = absl::StrCat("worker rank ", rank)};
    worker.argv.insert(worker.argv.end(), options.worker_flags.begin(), options.worker_flags.end());
    if (options.metrics) worker.argv.insert(worker.argv.end(), {"--metrics-listen", "127.0.0.1:0"});
    started = ChildProcess::Start(worker);
    if (!started.ok()) return failed(started.status());
    replica->workers_.push_back(*std::move(started));
  }
  for (auto& worker : replica->workers_) {
    if (options.metrics) {
      if (absl::Status read = ReadMetricsAddress(*worker, deadline, replica->metrics_addresses_);
          !read.ok()) {
        return failed(read);
      }
    }
    line = worker->ReadLineContaining("listening on", deadline);
    if (!line.ok()) return failed(line.status());
    address = ListenAddress(*line);
    if (!address.ok()) return failed(address.status());
    replica->worker_addresses_.push_back(*address);
  }

  absl::StatusOr<std::unique_ptr<services::VerifierClient>> client =
      replica->NewClient(options.call_timeout);
  if (!client.ok()) return failed(client.status());
  replica->client_ = *std::move(client);
  if (absl::Status serving =
          replica->client_->WaitUntilServing(std::max(deadline - absl::Now(), absl::Seconds(1)));
      !serving.ok()) {
    return failed(serving);
  }
  return replica;
}

Replica::~Replica() { Stop(); }

absl::StatusOr<std::unique_ptr<services::VerifierClient>> Replica::NewClient(
    absl::Duration call_timeout) const {
  return services::VerifierClient::Connect(coordinator_address_, absl::Seconds(10),
                                           {.call_timeout = call_timeout});
}

std::vector<pid_t> Replica::worker_pids() const {
  std::vector<pid_t> pids;
  for (const auto& worker : workers_) pids.push_back(worker->pid());
  return pids;
}

absl::StatusOr<coordinator::RankDescription> Replica::DescribeWorker(int rank,
                                                                     absl::Duration timeout) const {
  absl::StatusOr<std::unique_ptr<services::GrpcRankClient>> client =
      services::GrpcRankClient::Create(worker_addresses_.at(rank), {});
  if (!client.ok()) return client.status();
  return (*client)->Describe(timeout);
}

absl::Status Replica::WaitForAllKvPagesFree(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::vector<std::string> holding;
    for (int rank = 0; rank < static_cast<int>(worker_addresses_.size()); ++rank) {
      absl::StatusOr<coordinator::RankDescription> d =
          DescribeWorker(rank, std::max(deadline - absl::Now(), absl::Seconds(1)));
      if (!d.ok()) return d.status();
      if (d->kv_pages_free != d->kv_pages_total) {
        holding.push_back(absl::StrCat("rank ", rank, ": ", d->kv_pages_free, " of ",
                                       d->kv_pages_total, " pages free"));
      }
    }
    if (holding.empty()) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("KV pages still in use after ",
                                                      absl::FormatDuration(timeout), ": ",
                                                      absl::StrJoin(holding, "; ")));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

void Replica::Stop() {
  client_.reset();
  // Workers first: a coordinator killed first would leave them nothing to notice anyway, but
  // this order keeps the logs of a failing test free of "coordinator gone" noise.
  for (auto& worker : workers_) {
    if (worker != nullptr) worker->Kill();
  }
  if (coordinator_ != nullptr) coordinator_->Kill();
}

std::string Replica::Logs(size_t bytes_per_process) const {
  std::string logs;
  auto add = [&](const ChildProcess* process) {
    if (process == nullptr) return;
    absl::StrAppend(&logs, "----- ", process->name(), " (pid ", process->pid(), ") stderr -----\n",
                    process->StderrTail(bytes_per_process), "\n");
  };
  add(coordinator_.get());
  for (const auto& worker : workers_) add(worker.get());
  return logs;
}

}  // namespace treeverify::integration
