// The standard process metrics every Prometheus client library exports (process_cpu_seconds_total,
// process_resident_memory_bytes, process_virtual_memory_bytes, process_open_fds,
// process_max_fds, process_start_time_seconds), read from Linux's /proc/self at each scrape.
// prometheus-cpp has none of its own.
//
//   auto process = std::make_shared<ProcessCollector>();
//   exposer.RegisterCollectable(process);
#pragma once

#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace treeverify::monitoring {

class ProcessCollector final : public prometheus::Collectable {
 public:
  ProcessCollector();
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  double start_time_seconds_ = 0;  // since the Unix epoch, from /proc/self/stat and the boot time
};

}  // namespace treeverify::monitoring
