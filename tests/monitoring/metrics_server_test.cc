// The /metrics endpoint over real HTTP: treeverify's families and the process metrics in one
// scrape, a free port when asked for port 0, and clear errors for bad addresses.
#include "treeverify/monitoring/metrics_server.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "http_get.h"
#include "prometheus/registry.h"
#include "treeverify/monitoring/metrics.h"

namespace treeverify::monitoring {
namespace {

TEST(MetricsServerTest, ServesTheRegistryAndTheProcessMetrics) {
  auto registry = std::make_shared<prometheus::Registry>();
  SetBuildInfo(*registry, {.component = "worker", .backend = "cpu", .device = "cpu"});
  WorkerMetrics worker(*registry, 1);
  worker.SetKvPages(7, 9);
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(absl::StartsWith((*server)->address(), "127.0.0.1:"));
  EXPECT_FALSE(absl::EndsWith((*server)->address(), ":0"));
  absl::StatusOr<std::string> body = testing_http::HttpGet((*server)->address(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_TRUE(absl::StrContains(*body, "treeverify_build_info{"));
  EXPECT_TRUE(absl::StrContains(*body, "treeverify_kv_pages{rank=\"1\",state=\"used\"} 7"));
  EXPECT_TRUE(absl::StrContains(*body, "process_cpu_seconds_total "));
  EXPECT_TRUE(absl::StrContains(*body, "process_start_time_seconds "));

  // The same port again cannot be bound: UNAVAILABLE naming the address.
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start((*server)->address(), registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), (*server)->address()));
}

// Only GET /metrics is served; the server stops at once when destroyed.
TEST(MetricsServerTest, OtherPathsAreNotFoundAndStoppingIsPrompt) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::StatusOr<std::string> other = testing_http::HttpGet((*server)->address(), "/");
  EXPECT_FALSE(other.ok());
  EXPECT_TRUE(absl::StrContains(other.status().message(), "HTTP 404")) << other.status();
  // Several scrapes in a row, as Prometheus makes them.
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(testing_http::HttpGet((*server)->address(), "/metrics").ok());
  }
  const std::string address = (*server)->address();
  const auto start = std::chrono::steady_clock::now();
  server->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_FALSE(testing_http::HttpGet(address, "/metrics").ok());  // nobody listens any more
}

TEST(MetricsServerTest, AnAddressWithoutAPortIsAnInvalidArgument) {
  auto registry = std::make_shared<prometheus::Registry>();
  for (const char* address : {"127.0.0.1", "127.0.0.1:", ""}) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start(address, registry);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
  }
}

}  // namespace
}  // namespace treeverify::monitoring
