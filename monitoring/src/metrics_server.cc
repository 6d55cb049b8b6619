#include "treeverify/monitoring/metrics_server.h"

#include <exception>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "prometheus/exposer.h"
#include "treeverify/monitoring/process_collector.h"

namespace treeverify::monitoring {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' needs host:port (port 0 picks one)"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->registry_ = std::move(registry);
  server->process_ = std::make_shared<ProcessCollector>();
  try {
    // One thread: a scrape every few seconds needs no more.
    server->exposer_ = std::make_unique<prometheus::Exposer>(address, 1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  server->exposer_->RegisterCollectable(server->registry_);
  server->exposer_->RegisterCollectable(server->process_);
  const std::vector<int> ports = server->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address));
  }
  server->address_ = absl::StrCat(address.substr(0, colon), ":", ports.front());
  return server;
}

MetricsServer::~MetricsServer() = default;

}  // namespace treeverify::monitoring
