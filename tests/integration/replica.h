// One model replica as real processes on loopback, for the integration tests: a
// treeverify-coordinator and W treeverify-worker ranks, each on a free port (127.0.0.1:0, the
// address read from its "listening on" line), started the way services/README.md describes, and
// a VerifierClient connected once the coordinator reports SERVING. Every wait has a deadline; the
// destructor (or Stop) kills every process the replica started and reaps it.
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<Replica> replica,
//                       Replica::Start({.world_size = 2, .model_dir = TinyModelDir()}));
//   TV_ASSIGN_OR_RETURN(auto session, replica->client().CreateSession({.prompt_token_ids = {5}}));
//   replica->worker(1).Signal(SIGKILL);  // lose a rank
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "child_process.h"
#include "treeverify/coordinator/rank_client.h"
#include "treeverify/services/verifier_client.h"

namespace treeverify::integration {

// A tiny-v3 checkpoint (tools::PresetSpec("tiny-v3")), written once per test process into a
// temporary directory that is removed when the tests end.
const std::string& TinyModelDir();
// tests/golden/<name> in the source tree (deepseek_v3_tiny, kimi_k2_tiny, deepseek_v2_lite_tiny).
std::string GoldenModelDir(const std::string& name);
// Where this test process keeps its logs and checkpoints.
const std::string& ScratchDir();

struct ReplicaOptions {
  int world_size = 1;
  std::string model_dir;  // empty: TinyModelDir()
  // Appended to the coordinator's / every worker's command line ("--max-context", "32", ...).
  std::vector<std::string> coordinator_flags;
  std::vector<std::string> worker_flags;
  // Every process also serves Prometheus metrics on a free port (--metrics-listen 127.0.0.1:0):
  // metrics_addresses() has them.
  bool metrics = false;
  // Start-up: every process listening, the group formed, the coordinator SERVING.
  absl::Duration start_timeout = absl::Seconds(90);
  // Deadline of each call of client() (a CreateSession prefills its prompt).
  absl::Duration call_timeout = absl::Seconds(60);
};

class Replica {
 public:
  // On failure every process started so far is killed, and the status carries their stderr.
  static absl::StatusOr<std::unique_ptr<Replica>> Start(const ReplicaOptions& options);
  ~Replica();  // Stop()

  services::VerifierClient& client() { return *client_; }
  // Another connection to the coordinator, e.g. with other call deadlines.
  absl::StatusOr<std::unique_ptr<services::VerifierClient>> NewClient(
      absl::Duration call_timeout) const;

  int world_size() const { return static_cast<int>(workers_.size()); }
  const std::string& coordinator_address() const { return coordinator_address_; }
  const std::vector<std::string>& worker_addresses() const { return worker_addresses_; }
  // With ReplicaOptions::metrics: host:port of the coordinator's /metrics, then each rank's.
  const std::vector<std::string>& metrics_addresses() const { return metrics_addresses_; }
  ChildProcess& coordinator() { return *coordinator_; }
  ChildProcess& worker(int rank) { return *workers_[rank]; }
  pid_t coordinator_pid() const { return coordinator_->pid(); }
  std::vector<pid_t> worker_pids() const;

  // The Worker service's Describe of one rank (kv_pages_free / kv_pages_total ...).
  absl::StatusOr<coordinator::RankDescription> DescribeWorker(int rank,
                                                              absl::Duration timeout) const;
  // Polls every rank's Describe until all its KV pages are free; DEADLINE_EXCEEDED naming the
  // ranks still holding pages after `timeout`.
  absl::Status WaitForAllKvPagesFree(absl::Duration timeout) const;

  // Kills every process of the replica (whole process groups) and reaps them. Idempotent.
  void Stop();
  // The tail of every process's stderr, each under its name (for failure messages).
  std::string Logs(size_t bytes_per_process = 3000) const;

 private:
  Replica() = default;

  std::unique_ptr<ChildProcess> coordinator_;
  std::vector<std::unique_ptr<ChildProcess>> workers_;
  std::string coordinator_address_;
  std::vector<std::string> worker_addresses_;
  std::vector<std::string> metrics_addresses_;
  std::unique_ptr<services::VerifierClient> client_;
};

}  // namespace treeverify::integration
