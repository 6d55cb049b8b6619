// Every metric family treeverify exports is registered here, and only here.
#include "treeverify/monitoring/metrics.h"

#include <algorithm>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#ifndef TREEVERIFY_VERSION
#error "TREEVERIFY_VERSION must be defined by the build"
#endif

namespace treeverify::monitoring {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

// A status code's canonical name (INVALID_ARGUMENT): absl's codes are gRPC's.
std::string CodeLabel(absl::StatusCode code) { return absl::StatusCodeToString(code); }

// Counts of tokens or nodes: 0 and powers of two up to a tree's 255 nodes.
const std::vector<double>& TokenBuckets() {
  static const std::vector<double> buckets = {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 255};
  return buckets;
}

const std::vector<double>& SequenceBuckets() {
  static const std::vector<double> buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  return buckets;
}

const std::vector<double>& RowBuckets() {
  static const std::vector<double> buckets = {1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192};
  return buckets;
}

}  // namespace

const char* Version() { return TREEVERIFY_VERSION; }

void SetBuildInfo(prometheus::Registry& registry, const BuildInfo& info) {
  BuildGauge()
      .Name("treeverify_build_info")
      .Help("Always 1; the labels say which build and what it runs on")
      .Register(registry)
      .Add({{"version", Version()},
            {"component", info.component},
            {"backend", info.backend},
            {"device", info.device}})
      .Set(1);
}

const std::vector<double>& LatencyBuckets() {
  static const std::vector<double> buckets = {50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3,
                                              5e-3,  10e-3,  20e-3,  50e-3,  0.1,  0.2,
                                              0.5,   1.0,    2.0,    5.0,    10.0};
  return buckets;
}

std::string DepthLabel(int depth) {
  return depth >= kDepthLabels ? absl::StrCat(kDepthLabels, "+") : absl::StrCat(depth);
}

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry)
    : requests_(BuildCounter()
                    .Name("treeverify_requests_total")
                    .Help("Verifier API calls finished, by method and gRPC status code")
                    .Register(registry)),
      step_seconds_(BuildHistogram()
                        .Name("treeverify_step_seconds")
                        .Help("A Verify from its arrival to its answer (the phases' sum)")
                        .Register(registry)
                        .Add({}, LatencyBuckets())),
      accepted_per_step_(BuildHistogram()
                             .Name("treeverify_accepted_tokens_per_step")
                             .Help("Draft tokens accepted by one Verify")
                             .Register(registry)
                             .Add({}, TokenBuckets())),
      draft_nodes_per_step_(BuildHistogram()
                                .Name("treeverify_draft_nodes_per_step")
                                .Help("Nodes of the draft tree of one Verify")
                                .Register(registry)
                                .Add({}, TokenBuckets())),
      drafts_(BuildCounter()
                  .Name("treeverify_drafts_total")
                  .Help("Verify steps that carried a draft (vLLM's num_drafts)")
                  .Register(registry)
                  .Add({})),
      draft_tokens_(BuildCounter()
                        .Name("treeverify_draft_tokens_total")
                        .Help("Draft tree nodes sent for verification")
                        .Register(registry)
                        .Add({})),
      accepted_tokens_(BuildCounter()
                           .Name("treeverify_accepted_tokens_total")
                           .Help("Draft tokens the target model accepted")
                           .Register(registry)
                           .Add({})),
      emitted_tokens_(BuildCounter()
                          .Name("treeverify_emitted_tokens_total")
                          .Help("Tokens returned to clients (accepted drafts plus the target's)")
                          .Register(registry)
                          .Add({})),
      batch_sequences_(BuildHistogram()
                           .Name("treeverify_batch_sequences")
                           .Help("Sequences in one Forward sent to the ranks")
                           .Register(registry)
                           .Add({}, SequenceBuckets())),
      batch_rows_(BuildHistogram()
                      .Name("treeverify_batch_rows")
                      .Help("Rows (tree nodes and prompt tokens) in one Forward")
                      .Register(registry)
                      .Add({}, RowBuckets())),
      active_sessions_(BuildGauge()
                           .Name("treeverify_active_sessions")
                           .Help("Live sessions")
                           .Register(registry)
                           .Add({})),
      rank_up_(BuildGauge()
                   .Name("treeverify_rank_up")
                   .Help("1 while the rank answers, 0 once the coordinator lost it")
                   .Register(registry)),
      serving_(BuildGauge()
                   .Name("treeverify_serving")
                   .Help("1 while the replica serves Verify calls")
                   .Register(registry)
                   .Add({})) {
  auto& phases = BuildHistogram()
                     .Name("treeverify_step_phase_seconds")
                     .Help(
                         "A Verify's phases (validate, queue, fanout, reduce, accept; they add "
                         "up to treeverify_step_seconds)")
                     .Register(registry);
  for (size_t p = 0; p < kStepPhases.size(); ++p) {
    phase_seconds_[p] = &phases.Add({{"phase", kStepPhases[p]}}, LatencyBuckets());
  }
  auto& by_depth = BuildCounter()
                       .Name("treeverify_accepted_tokens_by_depth_total")
                       .Help("Draft tokens accepted at each tree depth (16+: deeper)")
                       .Register(registry);
  auto& drafts_by_depth = BuildCounter()
                              .Name("treeverify_drafts_by_depth_total")
                              .Help("Drafts whose tree reaches each depth (16+: each deeper level)")
                              .Register(registry);
  for (int d = 1; d <= kDepthLabels; ++d) {
    accepted_by_depth_[d - 1] = &by_depth.Add({{"depth", DepthLabel(d)}});
    drafts_by_depth_[d - 1] = &drafts_by_depth.Add({{"depth", DepthLabel(d)}});
  }
}

void CoordinatorMetrics::CountRequest(absl::string_view method, absl::StatusCode code) {
  requests_.Add({{"method", std::string(method)}, {"code", CodeLabel(code)}}).Increment();
}

void CoordinatorMetrics::ObserveVerifyStep(const VerifyStep& step) {
  double total = 0;
  for (size_t p = 0; p < kStepPhases.size(); ++p) {
    phase_seconds_[p]->Observe(step.phase_seconds[p]);
    total += step.phase_seconds[p];
  }
  step_seconds_.Observe(total);
  draft_nodes_per_step_.Observe(step.draft_nodes);
  emitted_tokens_.Increment(step.emitted_tokens);
  if (step.draft_nodes == 0) return;  // plain decoding: no draft to accept or reject
  drafts_.Increment();
  draft_tokens_.Increment(step.draft_nodes);
  accepted_tokens_.Increment(step.accepted_nodes);
  accepted_per_step_.Observe(step.accepted_nodes);
  for (int d = 1; d <= step.draft_depth; ++d) {
    drafts_by_depth_[std::min(d, kDepthLabels) - 1]->Increment();
  }
  for (int d = 1; d <= step.accepted_nodes; ++d) {
    accepted_by_depth_[std::min(d, kDepthLabels) - 1]->Increment();
  }
}

void CoordinatorMetrics::CountEmittedTokens(int64_t tokens) {
  emitted_tokens_.Increment(static_cast<double>(tokens));
}

void CoordinatorMetrics::ObserveForward(int32_t sequences, int64_t rows) {
  batch_sequences_.Observe(sequences);
  batch_rows_.Observe(static_cast<double>(rows));
}

void CoordinatorMetrics::SetActiveSessions(int64_t sessions) {
  active_sessions_.Set(static_cast<double>(sessions));
}

void CoordinatorMetrics::SetRankUp(int rank, bool up) {
  rank_up_.Add({{"rank", absl::StrCat(rank)}}).Set(up ? 1 : 0);
}

void CoordinatorMetrics::SetServing(bool serving) { serving_.Set(serving ? 1 : 0); }

WorkerMetrics::WorkerMetrics(prometheus::Registry& registry, int rank)
    : forward_seconds_(BuildHistogram()
                           .Name("treeverify_forward_seconds")
                           .Help("A worker's forward (the phases' sum)")
                           .Register(registry)
                           .Add({{"rank", absl::StrCat(rank)}}, LatencyBuckets())),
      forwards_(BuildCounter()
                    .Name("treeverify_forwards_total")
                    .Help("Forwards a worker ran")
                    .Register(registry)
                    .Add({{"rank", absl::StrCat(rank)}})),
      rows_(BuildCounter()
                .Name("treeverify_forward_rows_total")
                .Help("Rows (tree nodes, prompt tokens) a worker's forwards computed")
                .Register(registry)
                .Add({{"rank", absl::StrCat(rank)}})),
      copy_bandwidth_(BuildGauge()
                          .Name("treeverify_copy_bandwidth_bytes_per_second")
                          .Help("Device memory copy bandwidth measured at start-up (the DRAM "
                                "utilization's denominator)")
                          .Register(registry)
                          .Add({{"rank", absl::StrCat(rank)}})),
      last_utilization_(BuildGauge()
                            .Name("treeverify_forward_dram_utilization")
                            .Help("The last forward's modeled DRAM bytes / its time / the copy "
                                  "bandwidth (rates of the counters aggregate better)")
                            .Register(registry)
                            .Add({{"rank", absl::StrCat(rank)}})),
      kv_pages_(BuildGauge()
                    .Name("treeverify_kv_pages")
                    .Help("KV cache pages by state (used, free)")
                    .Register(registry)),
      // The GPU-only series appear once set: a CPU worker exports none of them.
      nsplit_(BuildGauge()
                  .Name("treeverify_attention_nsplit")
                  .Help("Key splits per sequence the MLA planner chose for the last step")
                  .Register(registry)),
      waves_(BuildGauge()
                 .Name("treeverify_attention_waves")
                 .Help("Waves of blocks of the last step's MLA launch")
                 .Register(registry)),
      gpu_memory_utilization_(BuildGauge()
                                  .Name("treeverify_gpu_memory_utilization_ratio")
                                  .Help("NVML's memory utilization: the fraction of time device "
                                        "memory was read or written")
                                  .Register(registry)),
      gpu_dram_utilization_(BuildGauge()
                                .Name("treeverify_gpu_dram_bandwidth_utilization_ratio")
                                .Help("NVML GPM's DRAM bandwidth utilization, where the GPU has it")
                                .Register(registry)),
      rank_label_(absl::StrCat(rank)) {
  const std::string& rank_label = rank_label_;
  auto& phases = BuildHistogram()
                     .Name("treeverify_forward_phase_seconds")
                     .Help(
                         "A worker's forward by phase (they add up to "
                         "treeverify_forward_seconds)")
                     .Register(registry);
  auto& busy = BuildCounter()
                   .Name("treeverify_forward_busy_seconds_total")
                   .Help("Seconds a worker's forwards spent in each phase")
                   .Register(registry);
  auto& bytes = BuildCounter()
                    .Name("treeverify_forward_dram_bytes_total")
                    .Help(
                        "DRAM bytes each phase must move, by the bytes model "
                        "(docs/gpu-worker.md): rate / busy rate / copy bandwidth = utilization")
                    .Register(registry);
  for (size_t p = 0; p < kForwardPhases.size(); ++p) {
    const prometheus::Labels labels = {{"rank", rank_label}, {"phase", kForwardPhases[p]}};
    phase_seconds_[p] = &phases.Add(labels, LatencyBuckets());
    busy_seconds_[p] = &busy.Add(labels);
    dram_bytes_[p] = &bytes.Add(labels);
  }
}

void WorkerMetrics::ObserveForward(const ForwardStep& step) {
  double bytes = 0;
  for (size_t p = 0; p < kForwardPhases.size(); ++p) {
    phase_seconds_[p]->Observe(step.phase_seconds[p]);
    busy_seconds_[p]->Increment(step.phase_seconds[p]);
    dram_bytes_[p]->Increment(step.phase_bytes[p]);
    bytes += step.phase_bytes[p];
  }
  forward_seconds_.Observe(step.total_seconds);
  forwards_.Increment();
  rows_.Increment(static_cast<double>(step.rows));
  const double bandwidth = copy_bandwidth_.Value();
  if (step.total_seconds > 0 && bandwidth > 0) {
    last_utilization_.Set(bytes / step.total_seconds / bandwidth);
  }
}

void WorkerMetrics::SetCopyBandwidth(double bytes_per_second) {
  copy_bandwidth_.Set(bytes_per_second);
}

void WorkerMetrics::SetAttentionPlan(const AttentionPlan& plan) {
  nsplit_.Add({{"rank", rank_label_}}).Set(plan.nsplit);
  waves_.Add({{"rank", rank_label_}}).Set(plan.waves);
}

void WorkerMetrics::SetKvPages(int64_t used, int64_t free) {
  kv_pages_.Add({{"rank", rank_label_}, {"state", "used"}}).Set(static_cast<double>(used));
  kv_pages_.Add({{"rank", rank_label_}, {"state", "free"}}).Set(static_cast<double>(free));
}

void WorkerMetrics::SetGpuMemoryUtilization(double ratio) {
  gpu_memory_utilization_.Add({{"rank", rank_label_}}).Set(ratio);
}

void WorkerMetrics::SetGpuDramUtilization(double ratio) {
  gpu_dram_utilization_.Add({{"rank", rank_label_}}).Set(ratio);
}

}  // namespace treeverify::monitoring
