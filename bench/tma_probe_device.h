// What the TMA probes (phase_stream_probe, weight_layout_probe) start from: the device, checked
// to be sm_90 or later, a stream, and the copy bandwidth measured on it (the ceiling their rates
// are held against).
//
//   const treeverify::bench::TmaProbeDevice d = treeverify::bench::SetUpTmaProbeDevice();
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "probe_common.h"
#include "treeverify/kernels/cuda/copy_bandwidth.h"

namespace treeverify::bench {

struct TmaProbeDevice {
  cudaDeviceProp properties{};
  int multiprocessors = 0;
  cudaStream_t stream = nullptr;
  double copy_bytes_per_s = 0.0;
};

// Ends the probe (naming the call) if anything fails or the device has no TMA.
inline TmaProbeDevice SetUpTmaProbeDevice() {
  TmaProbeDevice d;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaGetDeviceProperties(&d.properties, device));
  Check(d.properties.major >= 9, __FILE__, __LINE__, "device", "needs sm_90 or later (TMA)");
  d.multiprocessors = d.properties.multiProcessorCount;
  CHECK_CUDA(cudaStreamCreate(&d.stream));
  const absl::StatusOr<double> copy =
      treeverify::kernels::cuda::MeasureCopyBandwidth(int64_t{1} << 30, d.stream);
  Check(copy.ok(), __FILE__, __LINE__, "MeasureCopyBandwidth", copy.status().ToString().c_str());
  d.copy_bytes_per_s = *copy;
  return d;
}

}  // namespace treeverify::bench
