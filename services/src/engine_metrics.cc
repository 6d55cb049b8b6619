#include "treeverify/services/engine_metrics.h"

namespace treeverify::services {

void EngineMetrics::OnVerifyStep(const coordinator::VerifyStepReport& step) {
  const coordinator::StepTimings& t = step.timings;
  metrics_.ObserveVerifyStep(
      {.phase_seconds = {t.validate_seconds, t.queue_seconds, t.fanout_seconds, t.reduce_seconds,
                         t.accept_seconds},
       .draft_nodes = step.draft_nodes,
       .draft_depth = step.draft_depth,
       .accepted_nodes = step.accepted_nodes,
       .emitted_tokens = step.emitted_tokens,
       .batch_sequences = t.batch_sequences});
}

}  // namespace treeverify::services
