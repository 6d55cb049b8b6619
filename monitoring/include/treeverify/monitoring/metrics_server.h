// The `/metrics` endpoint of a process (`--metrics-listen ADDR`): one registry of treeverify's
// families plus the standard process metrics, in Prometheus' text format over HTTP/1.1.
//
// Our own small server, not prometheus-cpp's exposer: the exposer's civetweb starts its threads
// with 100 KB stacks, which glibc refuses in a process whose static TLS is larger (cuBLASLt's
// alone is 94 KB: a GPU worker), and it takes about 2 s to stop. One thread answers the scrapes,
// one connection at a time (Prometheus scrapes every few seconds).
//
//   auto registry = std::make_shared<prometheus::Registry>();
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> server,
//                       MetricsServer::Start("127.0.0.1:0", registry));
//   std::printf("metrics on http://%s/metrics\n", server->address().c_str());
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace treeverify::monitoring {

class ProcessCollector;

class MetricsServer {
 public:
  // Listens on `address` (host:port; port 0 picks a free one). INVALID_ARGUMENT for an address
  // without a port, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);
  // Stops serving: within the poll interval, or a second into a scrape in progress (each
  // connection gets at most 5 s).
  ~MetricsServer();

  // host:port as bound (the port picked when asked for 0).
  const std::string& address() const { return address_; }

  // The page a scrape gets: every family of the registry and the process metrics.
  std::string Scrape() const;

 private:
  MetricsServer() = default;
  void Serve();
  void Answer(int connection) const;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ProcessCollector> process_;
  std::string address_;
  int listener_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace treeverify::monitoring
