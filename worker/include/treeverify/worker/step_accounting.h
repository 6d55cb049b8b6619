// How a verify step spends its time, phase by phase, against the bytes each phase must move: a
// backend's account of how close it comes to the memory bandwidth (DRAM utilization = modeled
// bytes / time / the measured copy bandwidth). GPU time on the GPU backend, wall time on the CPU
// backend. docs/gpu-worker.md gives the bytes model.
//
//   std::optional<StepAccount> step = runner->last_step_account();
//   double moe_utilization = step->Utilization(StepPhase::kMoe);
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "treeverify/worker/model_config.h"
#include "treeverify/worker/sharding_plan.h"

namespace treeverify::worker {

enum class StepPhase : int {
  kEmbed,      // the step's inputs to the device and the embedding gather
  kAttention,  // every layer's input norm through o_proj, KV append and MLA included
  kMoe,        // every layer's post-attention norm and MLP: routed experts, shared, dense
  kAllReduce,  // the tensor-parallel all-reduces
  kLmHead,     // the final norm, the LM head and the per-node summaries' device part
  kKvCommit,   // compaction of the previous step's accepted rows
};
inline constexpr int kStepPhases = 6;
const char* StepPhaseName(StepPhase phase);

struct PhaseAccount {
  double seconds = 0.0;        // GPU time (CUDA backend) or wall time (CPU backend)
  double modeled_bytes = 0.0;  // DRAM bytes the phase must move (0: not a DRAM-bound phase)
};

// How a step's device work ran: launched one by one (a layout's first step, or graphs off),
// captured into a CUDA graph (its second) or replayed from one.
enum class StepLaunch { kEager, kCapture, kReplay };

struct StepAccount {
  std::array<PhaseAccount, kStepPhases> phases{};
  double total_seconds = 0.0;          // the phases' sum
  double copy_bytes_per_second = 0.0;  // the device's (or the host's) measured copy bandwidth
  int64_t rows = 0;                    // tree nodes in the step
  int64_t padded_rows = 0;             // rows the device ran: up to the step layout's bucket
  int32_t sequences = 0;               // sequences in the step
  int32_t padded_sequences = 0;        // sequences the device ran: up to the layout's bucket
  StepLaunch launch = StepLaunch::kEager;
  // The attention took the prefill path (the MHA form, cuda_forward.h): compute bound, so its
  // bytes are a floor far below its time.
  bool prefill = false;
  std::vector<int32_t> active_experts;  // per layer (0 for dense layers)
  // What the MLA planner chose for the step's tree attention (GPU backend; 0 elsewhere).
  int32_t attention_nsplit = 0;
  double attention_waves = 0.0;

  const PhaseAccount& phase(StepPhase p) const { return phases[static_cast<int>(p)]; }
  PhaseAccount& phase(StepPhase p) { return phases[static_cast<int>(p)]; }
  double total_bytes() const;
  // Achieved bandwidth (bytes / s) and DRAM utilization (its fraction of the copy bandwidth).
  double Bandwidth(StepPhase p) const;
  double Utilization(StepPhase p) const;
  double TotalBandwidth() const;
  double TotalUtilization() const;
};

// What the bytes model needs to know of a step.
struct StepShape {
  int64_t rows = 0;                     // new rows (tree nodes) of all sequences
  std::vector<int64_t> keys;            // per sequence: committed + its new rows
  std::vector<int32_t> active_experts;  // per layer: local experts with tokens (MoE layers)
  int64_t committed_moves = 0;          // rows moved by the commit before the step
  // Bytes per weight and per KV element: bf16 on the GPU backend, fp32 on the CPU backend.
  double weight_bytes = 2.0;
  double kv_bytes = 2.0;
  // The routed experts' bytes per weight as stored: weight_bytes, or 9/16 for INT4 groups of 32
  // (half a byte and a bf16 scale per 32 weights), or about 1 for FP8 (a byte and an fp32 scale
  // per 128 x 128).
  double expert_weight_bytes = 2.0;
  // The dense projections' (attention, dense MLP, shared experts): weight_bytes, or about 1 for
  // FP8 (DeepSeek-V3's; its W_UK and W_UV stay bf16 at dims that cut blocks, counted as FP8 here).
  double projection_weight_bytes = 2.0;
};

// Fills the modeled_bytes of every phase.
void ModelStepBytes(const ModelConfig& config, const ShardingPlan& plan, const StepShape& shape,
                    StepAccount& account);

}  // namespace treeverify::worker
