// What the VerifyEngine reports as it works, for metrics: services/ records it into Prometheus
// (monitoring/), tests count it. Every call comes from the engine's dispatch thread and must not
// block; the default implementations ignore everything.
//
//   class Counter : public EngineObserver {
//     void OnVerifyStep(const VerifyStepReport& step) override { accepted += step.accepted_nodes; }
//   };
//   options.observer = &counter;  // outlives the engine
#pragma once

#include <cstdint>

#include "treeverify/coordinator/verify_types.h"

namespace treeverify::coordinator {

// One Verify that succeeded.
struct VerifyStepReport {
  // Its phases, which add up to the step: arrival to validated, validated to the forward's
  // dispatch, the forward on every rank, the answers to the token selection's end, acceptance
  // and stopping to the reply.
  StepTimings timings;
  int32_t draft_nodes = 0;     // nodes of the draft tree
  int32_t draft_depth = 0;     // its depth (0: no draft)
  int32_t accepted_nodes = 0;  // draft nodes the target accepted: the accepted path's depth
  int32_t emitted_tokens = 0;  // tokens the reply carries (stopping may cut them)
};

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void OnVerifyStep(const VerifyStepReport& /*step*/) {}
  // A session was created: its reply carries one token (the first after the prompt).
  virtual void OnSessionCreated() {}
  // A Forward every rank answered: its sequences and rows.
  virtual void OnForward(int32_t /*sequences*/, int64_t /*rows*/) {}
  // Rank `rank` failed (the replica stops serving).
  virtual void OnRankLost(int /*rank*/) {}
};

}  // namespace treeverify::coordinator
