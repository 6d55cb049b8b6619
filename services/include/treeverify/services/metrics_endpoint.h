// The `--metrics-listen` endpoint of a server main: started before anything slow (joining,
// loading), and its address printed on stdout as "<program> metrics on http://ADDR/metrics", the
// line operators and scripts/demo.sh read (port 0 picks a free port).
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<monitoring::MetricsServer> metrics_server,
//                       StartMetricsEndpoint("treeverify-coordinator", flag, registry));
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/registry.h"
#include "treeverify/monitoring/metrics_server.h"

namespace treeverify::services {

// nullptr when `address` is empty (no endpoint asked for); the server's error, prefixed with
// "--metrics-listen: ", when it cannot start.
absl::StatusOr<std::unique_ptr<monitoring::MetricsServer>> StartMetricsEndpoint(
    absl::string_view program, const std::string& address,
    std::shared_ptr<prometheus::Registry> registry);

}  // namespace treeverify::services
