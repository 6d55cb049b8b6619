// The metric families as a scrape shows them: names and units by Prometheus' conventions, the
// values each recording method leaves, and the series that exist only where they mean something.
#include "treeverify/monitoring/metrics.h"

#include <cmath>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "treeverify/monitoring/process_collector.h"

namespace treeverify::monitoring {
namespace {

std::string Scrape(const prometheus::Collectable& collectable) {
  return prometheus::TextSerializer().Serialize(collectable.Collect());
}

// Every sample of a scrape: "name{labels}" (as written) -> value.
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> samples;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    EXPECT_TRUE(absl::SimpleAtod(line.substr(space + 1), &value)) << line;
    samples[line.substr(0, space)] = value;
  }
  return samples;
}

TEST(MetricsTest, FamiliesFollowPrometheusNaming) {
  prometheus::Registry registry;
  SetBuildInfo(registry, {.component = "coordinator", .backend = "cpu", .device = "cpu"});
  CoordinatorMetrics coordinator(registry);
  WorkerMetrics worker(registry, 0);
  worker.SetAttentionPlan({.nsplit = 4, .waves = 1.0});
  worker.SetGpuMemoryUtilization(0.5);
  worker.SetGpuDramUtilization(0.5);
  worker.SetKvPages(1, 2);
  coordinator.SetRankUp(0, true);
  coordinator.CountRequest("Verify", absl::StatusCode::kOk);
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    SCOPED_TRACE(family.name);
    EXPECT_TRUE(absl::StartsWith(family.name, "treeverify_"));
    EXPECT_FALSE(family.help.empty());
    const bool counter = family.type == prometheus::MetricType::Counter;
    EXPECT_EQ(absl::EndsWith(family.name, "_total"), counter);
    // Bounded labels only: none names a session or sequence.
    for (const prometheus::ClientMetric& metric : family.metric) {
      for (const prometheus::ClientMetric::Label& label : metric.label) {
        EXPECT_FALSE(absl::StrContains(label.name, "session")) << label.name;
        EXPECT_FALSE(absl::StrContains(label.name, "sequence")) << label.name;
      }
    }
  }
  const std::map<std::string, double> samples = Samples(Scrape(registry));
  EXPECT_EQ(
      samples.at(std::string("treeverify_build_info{backend=\"cpu\",component=\"coordinator\","
                             "device=\"cpu\",version=\"") +
                 Version() + "\"}"),
      1);
}

TEST(MetricsTest, LatencyBucketsSpanFiftyMicrosecondsToTenSeconds) {
  const std::vector<double>& buckets = LatencyBuckets();
  EXPECT_DOUBLE_EQ(buckets.front(), 50e-6);
  EXPECT_DOUBLE_EQ(buckets.back(), 10.0);
  for (size_t i = 1; i < buckets.size(); ++i) EXPECT_GT(buckets[i], buckets[i - 1]);
}

TEST(MetricsTest, VerifyStepsAddUpAndCountAcceptanceByDepth) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  // A tree of 20 nodes reaching depth 18, of which a path of 17 was accepted; then one of depth
  // 2 with one accepted; then plain decoding (no draft).
  metrics.ObserveVerifyStep({.phase_seconds = {1e-4, 2e-4, 3e-3, 4e-4, 5e-4},
                             .draft_nodes = 20,
                             .draft_depth = 18,
                             .accepted_nodes = 17,
                             .emitted_tokens = 18,
                             .batch_sequences = 1});
  metrics.ObserveVerifyStep({.phase_seconds = {1e-4, 1e-4, 1e-3, 1e-4, 1e-4},
                             .draft_nodes = 3,
                             .draft_depth = 2,
                             .accepted_nodes = 1,
                             .emitted_tokens = 2,
                             .batch_sequences = 2});
  metrics.ObserveVerifyStep(
      {.phase_seconds = {1e-4, 1e-4, 1e-3, 1e-4, 1e-4}, .emitted_tokens = 1, .batch_sequences = 1});
  metrics.CountEmittedTokens(1);
  const std::map<std::string, double> s = Samples(Scrape(registry));
  EXPECT_EQ(s.at("treeverify_drafts_total"), 2);
  EXPECT_EQ(s.at("treeverify_draft_tokens_total"), 23);
  EXPECT_EQ(s.at("treeverify_accepted_tokens_total"), 18);
  EXPECT_EQ(s.at("treeverify_emitted_tokens_total"), 22);
  EXPECT_EQ(s.at("treeverify_accepted_tokens_by_depth_total{depth=\"1\"}"), 2);
  EXPECT_EQ(s.at("treeverify_accepted_tokens_by_depth_total{depth=\"2\"}"), 1);
  EXPECT_EQ(s.at("treeverify_accepted_tokens_by_depth_total{depth=\"15\"}"), 1);
  EXPECT_EQ(s.at("treeverify_accepted_tokens_by_depth_total{depth=\"16+\"}"), 2);  // 16, 17
  EXPECT_EQ(s.at("treeverify_drafts_by_depth_total{depth=\"1\"}"), 2);
  EXPECT_EQ(s.at("treeverify_drafts_by_depth_total{depth=\"3\"}"), 1);
  EXPECT_EQ(s.at("treeverify_drafts_by_depth_total{depth=\"16+\"}"), 3);  // 16, 17, 18
  // The phases add up to the step: their sums' total is the step histogram's sum.
  double phase_sum = 0;
  for (const char* phase : kStepPhases) {
    EXPECT_EQ(s.at(std::string("treeverify_step_phase_seconds_count{phase=\"") + phase + "\"}"), 3);
    phase_sum += s.at(std::string("treeverify_step_phase_seconds_sum{phase=\"") + phase + "\"}");
  }
  EXPECT_EQ(s.at("treeverify_step_seconds_count"), 3);
  EXPECT_NEAR(s.at("treeverify_step_seconds_sum"), phase_sum, 1e-12);
  EXPECT_EQ(s.at("treeverify_accepted_tokens_per_step_count"), 2);  // drafts only
  EXPECT_EQ(s.at("treeverify_draft_nodes_per_step_bucket{le=\"0\"}"), 1);
}

TEST(MetricsTest, RequestsByMethodAndCode) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  metrics.CountRequest("Verify", absl::StatusCode::kOk);
  metrics.CountRequest("Verify", absl::StatusCode::kOk);
  metrics.CountRequest("Verify", absl::StatusCode::kInvalidArgument);
  metrics.CountRequest("CreateSession", absl::StatusCode::kResourceExhausted);
  metrics.ObserveForward(3, 40);
  metrics.SetActiveSessions(5);
  metrics.SetRankUp(0, true);
  metrics.SetRankUp(1, false);
  metrics.SetServing(false);
  const std::map<std::string, double> s = Samples(Scrape(registry));
  EXPECT_EQ(s.at("treeverify_requests_total{code=\"OK\",method=\"Verify\"}"), 2);
  EXPECT_EQ(s.at("treeverify_requests_total{code=\"INVALID_ARGUMENT\",method=\"Verify\"}"), 1);
  EXPECT_EQ(s.at("treeverify_requests_total{code=\"RESOURCE_EXHAUSTED\",method=\"CreateSession\"}"),
            1);
  EXPECT_EQ(s.at("treeverify_batch_sequences_sum"), 3);
  EXPECT_EQ(s.at("treeverify_batch_rows_sum"), 40);
  EXPECT_EQ(s.at("treeverify_active_sessions"), 5);
  EXPECT_EQ(s.at("treeverify_rank_up{rank=\"0\"}"), 1);
  EXPECT_EQ(s.at("treeverify_rank_up{rank=\"1\"}"), 0);
  EXPECT_EQ(s.at("treeverify_serving"), 0);
}

TEST(MetricsTest, ForwardPhasesCountBusyTimeAndModeledBytes) {
  prometheus::Registry registry;
  WorkerMetrics metrics(registry, 3);
  metrics.SetCopyBandwidth(1e12);
  ForwardStep step;
  step.phase_seconds = {1e-5, 2e-4, 3e-4, 0, 1e-4, 1e-5};
  step.phase_bytes = {1e3, 1e8, 2e8, 0, 5e7, 0};
  step.total_seconds = 6.2e-4;
  step.rows = 9;
  metrics.ObserveForward(step);
  metrics.ObserveForward(step);
  metrics.SetKvPages(10, 90);
  const std::map<std::string, double> s = Samples(Scrape(registry));
  EXPECT_EQ(s.at("treeverify_forwards_total{rank=\"3\"}"), 2);
  EXPECT_EQ(s.at("treeverify_forward_rows_total{rank=\"3\"}"), 18);
  EXPECT_NEAR(s.at("treeverify_forward_busy_seconds_total{phase=\"moe\",rank=\"3\"}"), 6e-4, 1e-12);
  EXPECT_EQ(s.at("treeverify_forward_dram_bytes_total{phase=\"attention\",rank=\"3\"}"), 2e8);
  EXPECT_EQ(s.at("treeverify_forward_phase_seconds_count{phase=\"lm_head\",rank=\"3\"}"), 2);
  EXPECT_EQ(s.at("treeverify_forward_seconds_count{rank=\"3\"}"), 2);
  EXPECT_EQ(s.at("treeverify_copy_bandwidth_bytes_per_second{rank=\"3\"}"), 1e12);
  // The last forward's utilization: 3.50001e8 bytes in 6.2e-4 s at 1e12 B/s.
  EXPECT_NEAR(s.at("treeverify_forward_dram_utilization{rank=\"3\"}"), 3.50001e8 / 6.2e-4 / 1e12,
              1e-9);
  EXPECT_EQ(s.at("treeverify_kv_pages{rank=\"3\",state=\"used\"}"), 10);
  EXPECT_EQ(s.at("treeverify_kv_pages{rank=\"3\",state=\"free\"}"), 90);
  // A CPU worker sets no GPU series: none exists.
  for (const auto& [name, value] : s) {
    EXPECT_FALSE(absl::StartsWith(name, "treeverify_gpu_")) << name;
    EXPECT_FALSE(absl::StartsWith(name, "treeverify_attention_")) << name;
  }
}

TEST(ProcessCollectorTest, ReadsThisProcess) {
  ProcessCollector collector;
  const std::map<std::string, double> s = Samples(Scrape(collector));
  EXPECT_GE(s.at("process_cpu_seconds_total"), 0);
  EXPECT_GT(s.at("process_resident_memory_bytes"), 1 << 20);
  EXPECT_GT(s.at("process_virtual_memory_bytes"), s.at("process_resident_memory_bytes"));
  EXPECT_GE(s.at("process_open_fds"), 3);  // stdin, stdout, stderr
  EXPECT_GE(s.at("process_max_fds"), s.at("process_open_fds"));
  // Started within the last day, and not in the future.
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(s.at("process_start_time_seconds"), now + 2);
  EXPECT_GT(s.at("process_start_time_seconds"), now - 86400);
}

}  // namespace
}  // namespace treeverify::monitoring
