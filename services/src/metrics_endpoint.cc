#include "treeverify/services/metrics_endpoint.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace treeverify::services {

absl::StatusOr<std::unique_ptr<monitoring::MetricsServer>> StartMetricsEndpoint(
    absl::string_view program, const std::string& address,
    std::shared_ptr<prometheus::Registry> registry) {
  if (address.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<monitoring::MetricsServer>> server =
      monitoring::MetricsServer::Start(address, std::move(registry));
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("--metrics-listen: ", server.status().message()));
  }
  std::printf("%.*s metrics on http://%s/metrics\n", static_cast<int>(program.size()),
              program.data(), (*server)->address().c_str());
  std::fflush(stdout);
  return server;
}

}  // namespace treeverify::services
