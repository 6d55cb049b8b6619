// The device's copy bandwidth, measured: the ceiling that DRAM utilization figures are held
// against (bytes a step must move / its time / this). A 16-byte-load copy kernel, four loads in
// flight per thread over a grid-stride loop, and cudaMemcpyAsync; the faster of the two, counting
// bytes read plus bytes written, median of several runs.
//
//   TV_ASSIGN_OR_RETURN(double bytes_per_s, MeasureCopyBandwidth(int64_t{1} << 30, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace treeverify::kernels::cuda {

// Allocates two buffers of `bytes` (at least 64 MB, so the L2 does not serve them) for the
// duration of the measurement.
absl::StatusOr<double> MeasureCopyBandwidth(int64_t bytes, cudaStream_t stream);

// The current device's copy bandwidth as this process first measured it (1 GiB buffers, on
// `stream`), measured on the first call for each device. A property of the device, so one figure
// per process: a second measurement after another worker's gigabytes were freed read 3.8 TB/s
// in about half the runs where the first read 4.2 (bench/NOTES.md, step 128), which would have
// flattered that worker's DRAM utilization by 10 %. Thread-safe.
absl::StatusOr<double> DeviceCopyBandwidth(cudaStream_t stream);

// The copy kernel itself (one launch, graph-capturable), for benchmarks that time it their way:
// `bytes` a multiple of 16, both pointers 16-byte aligned.
absl::Status CopyWith16ByteLoads(const void* src, void* dst, int64_t bytes, cudaStream_t stream);

}  // namespace treeverify::kernels::cuda
