// Every Prometheus metric family treeverify exports, registered in one file (metrics.cc), with
// the methods that record them. Names follow Prometheus' conventions: the `treeverify_` prefix,
// base units (seconds, bytes, ratios 0..1), `_total` on counters, and bounded labels only (phase,
// rank, method, code, depth; never a session). Ratios (acceptance, DRAM utilization) are left to
// PromQL over counters, so they aggregate across ranks and replicas (monitoring/README.md).
//
//   auto registry = std::make_shared<prometheus::Registry>();
//   SetBuildInfo(*registry, {.component = "coordinator", .backend = "cpu"});
//   CoordinatorMetrics metrics(*registry);
//   metrics.ObserveVerifyStep(step);
//   TV_ASSIGN_OR_RETURN(auto server, MetricsServer::Start("127.0.0.1:0", registry));
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace treeverify::monitoring {

// The project's version (CMake's PROJECT_VERSION).
const char* Version();

// treeverify_build_info{version, component, backend, device} = 1.
struct BuildInfo {
  std::string component;  // "coordinator" or "worker"
  std::string backend;    // "cpu" or "cuda" (the coordinator: its ranks')
  std::string device;     // what computes: a GPU's name, or "cpu"
};
void SetBuildInfo(prometheus::Registry& registry, const BuildInfo& info);

// Latency histograms' buckets: 50 us to 10 s, about three a decade.
const std::vector<double>& LatencyBuckets();

// Draft-tree depths with a label of their own; deeper ones share the last label ("16+").
inline constexpr int kDepthLabels = 16;
// The depth label of a tree depth >= 1.
std::string DepthLabel(int depth);

// The coordinator's verify phases, in order; they add up to the whole step.
inline constexpr std::array<const char*, 5> kStepPhases = {"validate", "queue", "fanout", "reduce",
                                                           "accept"};

// One Verify that succeeded, as the coordinator saw it.
struct VerifyStep {
  std::array<double, kStepPhases.size()> phase_seconds{};  // in kStepPhases' order
  int32_t draft_nodes = 0;      // nodes of the draft tree (the pending token not counted)
  int32_t draft_depth = 0;      // the tree's depth (0: no draft)
  int32_t accepted_nodes = 0;   // draft nodes accepted: the accepted path's depth
  int32_t emitted_tokens = 0;   // tokens the client got (stopping may emit fewer)
  int32_t batch_sequences = 0;  // sequences in the forward that served it
};

class CoordinatorMetrics {
 public:
  explicit CoordinatorMetrics(prometheus::Registry& registry);

  // A public RPC finished with `code` (method: the Verifier method's name).
  void CountRequest(absl::string_view method, absl::StatusCode code);
  void ObserveVerifyStep(const VerifyStep& step);
  // Tokens a CreateSession emitted (its prefill's first token, unless the prompt already stops).
  void CountEmittedTokens(int64_t tokens);
  // One Forward the coordinator sent to its ranks: sequences and rows in it.
  void ObserveForward(int32_t sequences, int64_t rows);
  void SetActiveSessions(int64_t sessions);
  // Whether rank `rank` answers (1) or was lost (0), and whether the replica serves.
  void SetRankUp(int rank, bool up);
  void SetServing(bool serving);

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  std::array<prometheus::Histogram*, kStepPhases.size()> phase_seconds_{};
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& accepted_per_step_;
  prometheus::Histogram& draft_nodes_per_step_;
  prometheus::Counter& drafts_;
  prometheus::Counter& draft_tokens_;
  prometheus::Counter& accepted_tokens_;
  std::array<prometheus::Counter*, kDepthLabels> accepted_by_depth_{};
  std::array<prometheus::Counter*, kDepthLabels> drafts_by_depth_{};
  prometheus::Counter& emitted_tokens_;
  prometheus::Histogram& batch_sequences_;
  prometheus::Histogram& batch_rows_;
  prometheus::Gauge& active_sessions_;
  prometheus::Family<prometheus::Gauge>& rank_up_;
  prometheus::Gauge& serving_;
};

// The worker's forward phases, in order (worker::StepPhase's).
inline constexpr std::array<const char*, 6> kForwardPhases = {
    "embed", "attention", "moe", "allreduce", "lm_head", "kv_commit"};

// One forward of a worker, phase by phase: time and the DRAM bytes the phase must move.
struct ForwardStep {
  std::array<double, kForwardPhases.size()> phase_seconds{};  // in kForwardPhases' order
  std::array<double, kForwardPhases.size()> phase_bytes{};    // modeled DRAM bytes
  double total_seconds = 0.0;
  int64_t rows = 0;
};

// What the MLA planner chose for a step's attention (GPU workers).
struct AttentionPlan {
  int32_t nsplit = 0;
  double waves = 0.0;
};

class WorkerMetrics {
 public:
  // Every series carries rank="<rank>".
  WorkerMetrics(prometheus::Registry& registry, int rank);

  void ObserveForward(const ForwardStep& step);
  // The copy bandwidth measured at start-up (bytes / s): DRAM utilization's denominator.
  void SetCopyBandwidth(double bytes_per_second);
  void SetAttentionPlan(const AttentionPlan& plan);
  void SetKvPages(int64_t used, int64_t free);
  // NVML's memory utilization (0..1) and, where the GPU has GPM, its DRAM bandwidth utilization.
  void SetGpuMemoryUtilization(double ratio);
  void SetGpuDramUtilization(double ratio);

 private:
  std::array<prometheus::Histogram*, kForwardPhases.size()> phase_seconds_{};
  std::array<prometheus::Counter*, kForwardPhases.size()> busy_seconds_{};
  std::array<prometheus::Counter*, kForwardPhases.size()> dram_bytes_{};
  prometheus::Histogram& forward_seconds_;
  prometheus::Counter& forwards_;
  prometheus::Counter& rows_;
  prometheus::Gauge& copy_bandwidth_;
  prometheus::Gauge& last_utilization_;
  prometheus::Family<prometheus::Gauge>& kv_pages_;
  prometheus::Family<prometheus::Gauge>& nsplit_;
  prometheus::Family<prometheus::Gauge>& waves_;
  prometheus::Family<prometheus::Gauge>& gpu_memory_utilization_;
  prometheus::Family<prometheus::Gauge>& gpu_dram_utilization_;
  const std::string rank_label_;
};

}  // namespace treeverify::monitoring
