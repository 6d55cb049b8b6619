// The forward on the CPU, in fp32: the oracle for every other backend. Batch invariant (a row's
// result does not depend on what else is in the batch, DESIGN.md), so a tree node computes
// exactly what the same node computes in a chain.
//
//   TV_ASSIGN_OR_RETURN(auto backend, CpuForward::Create(*weights, *cpu_rows, communicator));
//   TV_RETURN_IF_ERROR(backend->Run(inputs, outputs));
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/worker/communicator.h"
#include "treeverify/worker/forward_backend.h"
#include "treeverify/worker/kv_storage.h"
#include "treeverify/worker/model_weights.h"
#include "treeverify/worker/step_accounting.h"

namespace treeverify::worker {

// The factory ModelRunner uses unless told otherwise: host rows and a CpuForward over them.
absl::StatusOr<ForwardParts> MakeCpuForward(const ModelWeights& weights,
                                            const KvCacheOptions& cache,
                                            Communicator* communicator);

class CpuForward final : public ForwardBackend {
 public:
  // weights, kv_rows and communicator must outlive the backend; kv_rows must have the model's
  // layers and row width.
  static absl::StatusOr<std::unique_ptr<CpuForward>> Create(const ModelWeights& weights,
                                                            CpuKvStorage& kv_rows,
                                                            Communicator* communicator);

  absl::Status Run(const BatchInputs& inputs, ForwardOutputs& outputs) override;
  // Every step's account (step_accounting.h): wall time per phase against the fp32 bytes model
  // and the host's copy bandwidth. The KV commit runs in the runner before the step, outside it.
  std::optional<StepAccount> last_step_account() const override { return last_account_; }

 private:
  class PhaseClock;  // charges wall time to the step's phases
  CpuForward(const ModelWeights& weights, CpuKvStorage& kv_rows, Communicator* communicator);
  absl::Status RunLayers(const BatchInputs& batch, std::vector<float>& hidden,
                         ForwardOutputs& outputs, PhaseClock& clock);
  // Fills and keeps the step's account (the phases' times are in it already).
  void Account(const BatchInputs& batch, StepAccount& account);
  absl::Status Attention(int64_t layer, const BatchInputs& batch, const std::vector<float>& normed,
                         std::vector<float>& out);
  absl::Status Mlp(int64_t layer, const BatchInputs& batch, const std::vector<float>& normed,
                   std::vector<float>& out);

  const ModelWeights& weights_;
  CpuKvStorage& kv_rows_;
  Communicator* communicator_;
  std::vector<float> rope_inv_freq_;
  float rope_attention_factor_ = 1.0f;
  float softmax_scale_ = 1.0f;
  double copy_bytes_per_second_ = 0.0;
  std::vector<int32_t> active_experts_;  // of the running step, per layer
  std::optional<StepAccount> last_account_;
};

}  // namespace treeverify::worker
