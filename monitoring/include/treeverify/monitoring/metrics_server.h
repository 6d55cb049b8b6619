// The `/metrics` endpoint of a process (`--metrics-listen ADDR`): one registry of treeverify's
// families plus the standard process metrics, served over HTTP by prometheus-cpp's exposer.
//
//   auto registry = std::make_shared<prometheus::Registry>();
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> server,
//                       MetricsServer::Start("127.0.0.1:0", registry));
//   std::printf("metrics on http://%s/metrics\n", server->address().c_str());
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace treeverify::monitoring {

class ProcessCollector;

class MetricsServer {
 public:
  // Listens on `address` (host:port; port 0 picks a free one). INVALID_ARGUMENT for an address
  // without a port, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsServer();  // stops serving (prometheus-cpp's exposer takes about 2 s to stop)

  // host:port as bound (the port picked when asked for 0).
  const std::string& address() const { return address_; }

 private:
  MetricsServer() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ProcessCollector> process_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string address_;
};

}  // namespace treeverify::monitoring
