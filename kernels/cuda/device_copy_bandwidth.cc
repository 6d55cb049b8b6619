// DeviceCopyBandwidth: MeasureCopyBandwidth once per device and process (copy_bandwidth.h).
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "treeverify/kernels/cuda/copy_bandwidth.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {

absl::StatusOr<double> DeviceCopyBandwidth(cudaStream_t stream) {
  static absl::Mutex mutex(absl::kConstInit);
  static std::map<int, double>* measured ABSL_GUARDED_BY(mutex) = new std::map<int, double>();
  int device = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  absl::MutexLock lock(&mutex);  // held through a first measurement: one at a time per process
  if (const auto it = measured->find(device); it != measured->end()) return it->second;
  TV_ASSIGN_OR_RETURN(const double bytes_per_second,
                      MeasureCopyBandwidth(int64_t{1} << 30, stream));
  measured->emplace(device, bytes_per_second);
  return bytes_per_second;
}

}  // namespace treeverify::kernels::cuda
