// The host's memory copy bandwidth, measured once per process: the CPU backend's DRAM
// utilization's denominator (as DeviceCopyBandwidth is the GPU backend's). Counted as the GPU's
// is: bytes read plus bytes written per second, the copy spread over the OpenMP threads the
// backend's kernels use.
//
//   const double bytes_per_second = HostCopyBandwidth();
#pragma once

namespace treeverify::worker {

double HostCopyBandwidth();

}  // namespace treeverify::worker
