// NVML's view of a GPU's memory traffic, for the worker's metrics: the memory utilization NVML
// reports (the fraction of the last sample period in which device memory was read or written)
// and, on GPUs with GPM (Hopper and later), the DRAM bandwidth utilization (bytes moved against
// the theoretical peak). Sampled on a thread of its own every `period`; the callback gets each
// sample. NVML is loaded at run time (libnvidia-ml.so.1, the driver's): nothing links against
// it, and a machine without it gets FAILED_PRECONDITION.
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<NvmlSampler> nvml,
//                       NvmlSampler::Start(device_ordinal, absl::Seconds(1), [&](NvmlSample s) {
//                         if (s.memory_utilization)
//                         metrics.SetGpuMemoryUtilization(*s.memory_utilization);
//                       }));
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace treeverify::worker {

struct NvmlSample {
  std::optional<double> memory_utilization;          // 0..1; absent when NVML did not answer
  std::optional<double> dram_bandwidth_utilization;  // 0..1; absent without GPM
};

class NvmlSampler {
 public:
  // The CUDA device `device_ordinal` (as CUDA numbers it: NVML is asked by its PCI bus id).
  static absl::StatusOr<std::unique_ptr<NvmlSampler>> Start(
      int device_ordinal, absl::Duration period, std::function<void(const NvmlSample&)> on_sample);
  ~NvmlSampler();  // stops the thread (within a period)

  // Whether the GPU reports GPM metrics (else samples have no DRAM bandwidth utilization).
  bool has_gpm() const;

 private:
  class Library;  // the NVML entry points, loaded once
  NvmlSampler() = default;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace treeverify::worker
