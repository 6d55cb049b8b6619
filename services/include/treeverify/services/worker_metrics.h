// A worker's Prometheus metrics after each forward: its runner's step account (phase times and
// modeled bytes, the copy bandwidth, the MLA plan) and its KV cache's pages, recorded into
// monitoring::WorkerMetrics. Called on the worker's executor thread, after the forward.
//
//   monitoring::WorkerMetrics metrics(*registry, rank);
//   RecordForward(*runner, metrics);
#pragma once

#include "treeverify/monitoring/metrics.h"
#include "treeverify/worker/model_runner.h"

namespace treeverify::services {

void RecordForward(const worker::ModelRunner& runner, monitoring::WorkerMetrics& metrics);

}  // namespace treeverify::services
