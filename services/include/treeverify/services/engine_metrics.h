// The coordinator's Prometheus metrics fed by its engine: a coordinator::EngineObserver that
// records every step, created session, forward and lost rank into monitoring::CoordinatorMetrics.
//
//   monitoring::CoordinatorMetrics metrics(*registry);
//   EngineMetrics observer(metrics);
//   engine_options.observer = &observer;
#pragma once

#include "treeverify/coordinator/engine_observer.h"
#include "treeverify/monitoring/metrics.h"

namespace treeverify::services {

class EngineMetrics final : public coordinator::EngineObserver {
 public:
  explicit EngineMetrics(monitoring::CoordinatorMetrics& metrics) : metrics_(metrics) {}

  void OnVerifyStep(const coordinator::VerifyStepReport& step) override;
  void OnSessionCreated() override { metrics_.CountEmittedTokens(1); }
  void OnForward(int32_t sequences, int64_t rows) override {
    metrics_.ObserveForward(sequences, rows);
  }
  void OnRankLost(int rank) override { metrics_.SetRankUp(rank, false); }

 private:
  monitoring::CoordinatorMetrics& metrics_;
};

}  // namespace treeverify::services
