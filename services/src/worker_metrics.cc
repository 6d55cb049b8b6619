#include "treeverify/services/worker_metrics.h"

#include <optional>

#include "treeverify/worker/step_accounting.h"

namespace treeverify::services {

void RecordForward(const worker::ModelRunner& runner, monitoring::WorkerMetrics& metrics) {
  metrics.SetKvPages(runner.kv_cache().used_pages(), runner.kv_cache().free_pages());
  const std::optional<worker::StepAccount> account = runner.last_step_account();
  if (!account.has_value()) return;  // a backend that keeps no account
  static_assert(monitoring::kForwardPhases.size() == worker::kStepPhases);
  monitoring::ForwardStep step;
  for (int p = 0; p < worker::kStepPhases; ++p) {
    step.phase_seconds[p] = account->phases[p].seconds;
    step.phase_bytes[p] = account->phases[p].modeled_bytes;
  }
  step.total_seconds = account->total_seconds;
  step.rows = account->rows;
  metrics.SetCopyBandwidth(account->copy_bytes_per_second);
  metrics.ObserveForward(step);
  if (account->attention_nsplit > 0) {
    metrics.SetAttentionPlan(
        {.nsplit = account->attention_nsplit, .waves = account->attention_waves});
  }
}

}  // namespace treeverify::services
