#include "treeverify/worker/nvml_sampler.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace treeverify::worker {
namespace {

// The few NVML declarations used here, as the NVML API reference gives them (the header ships
// with the CUDA toolkit's NVML development package, which the build machine need not have).
using NvmlReturn = int;  // nvmlReturn_t; 0 is NVML_SUCCESS
constexpr NvmlReturn kNvmlSuccess = 0;
using NvmlDevice = struct NvmlDeviceOpaque*;
using NvmlGpmSample = struct NvmlGpmSampleOpaque*;
struct NvmlUtilization {  // nvmlUtilization_t
  unsigned int gpu;
  unsigned int memory;  // percent of the sample period with device memory read or written
};
struct NvmlGpmSupport {  // nvmlGpmSupport_t
  unsigned int version;
  unsigned int is_supported_device;
};
constexpr unsigned int kNvmlGpmSupportVersion = 1;
struct NvmlGpmMetric {  // nvmlGpmMetric_t
  unsigned int metric_id;
  NvmlReturn nvml_return;
  double value;
  struct {
    char* short_name;
    char* long_name;
    char* unit;
  } metric_info;
};
// nvmlGpmMetricsGet_t with room for more metrics than NVML defines: NVML reads numMetrics
// entries, so a larger array than its NVML_GPM_METRIC_MAX is harmless.
struct NvmlGpmMetricsGet {
  unsigned int version;
  unsigned int num_metrics;
  NvmlGpmSample sample1;
  NvmlGpmSample sample2;
  NvmlGpmMetric metrics[256];
};
constexpr unsigned int kNvmlGpmMetricsGetVersion = 1;
constexpr unsigned int kNvmlGpmMetricDramBandwidthUtil = 10;  // NVML_GPM_METRIC_DRAM_BW_UTIL, %

}  // namespace

class NvmlSampler::Library {
 public:
  // Loaded and initialized once per process; FAILED_PRECONDITION without the driver's NVML.
  static absl::StatusOr<const Library*> Get() {
    static const absl::StatusOr<const Library*> library = Load();
    return library;
  }

  NvmlReturn (*init)();
  NvmlReturn (*device_by_pci_bus_id)(const char*, NvmlDevice*);
  NvmlReturn (*utilization)(NvmlDevice, NvmlUtilization*);
  NvmlReturn (*gpm_query_support)(NvmlDevice, NvmlGpmSupport*);
  NvmlReturn (*gpm_sample_alloc)(NvmlGpmSample*);
  NvmlReturn (*gpm_sample_free)(NvmlGpmSample);
  NvmlReturn (*gpm_sample_get)(NvmlDevice, NvmlGpmSample);
  NvmlReturn (*gpm_metrics_get)(NvmlGpmMetricsGet*);
  const char* (*error_string)(NvmlReturn);

  absl::Status Check(NvmlReturn result, const char* what) const {
    if (result == kNvmlSuccess) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("NVML ", what, ": ", error_string(result)));
  }

 private:
  static absl::StatusOr<const Library*> Load() {
    void* handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("NVML is not available (libnvidia-ml.so.1: ", dlerror(), ")"));
    }
    auto* library = new Library();  // for the process's life, as the library handle
    bool found = true;
    auto symbol = [&](auto& function, const char* name) {
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(handle, name));
      found = found && function != nullptr;
    };
    symbol(library->init, "nvmlInit_v2");
    symbol(library->device_by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    symbol(library->utilization, "nvmlDeviceGetUtilizationRates");
    symbol(library->error_string, "nvmlErrorString");
    if (!found) return absl::FailedPreconditionError("NVML lacks its basic entry points");
    // GPM is younger than the rest: without it, samples carry no DRAM bandwidth utilization.
    symbol(library->gpm_query_support, "nvmlGpmQueryDeviceSupport");
    symbol(library->gpm_sample_alloc, "nvmlGpmSampleAlloc");
    symbol(library->gpm_sample_free, "nvmlGpmSampleFree");
    symbol(library->gpm_sample_get, "nvmlGpmSampleGet");
    symbol(library->gpm_metrics_get, "nvmlGpmMetricsGet");
    if (!found) library->gpm_query_support = nullptr;
    if (absl::Status status = library->Check(library->init(), "init"); !status.ok()) {
      return status;
    }
    return library;
  }
};

struct NvmlSampler::State {
  const Library* nvml = nullptr;
  NvmlDevice device = nullptr;
  bool gpm = false;
  NvmlGpmSample samples[2] = {nullptr, nullptr};
  absl::Duration period;
  std::function<void(const NvmlSample&)> on_sample;
  absl::Notification stop;
  std::thread thread;

  ~State() {
    for (NvmlGpmSample sample : samples) {
      if (sample != nullptr) nvml->gpm_sample_free(sample);
    }
  }

  // `gpm` is settled before the thread starts (with the first GPM sample in samples[0]).
  void Run() {
    int current = 0;  // the GPM sample taken last
    while (!stop.WaitForNotificationWithTimeout(period)) {
      NvmlSample sample;
      NvmlUtilization utilization{};
      if (nvml->utilization(device, &utilization) == kNvmlSuccess) {
        sample.memory_utilization = utilization.memory / 100.0;
      }
      if (gpm && nvml->gpm_sample_get(device, samples[1 - current]) == kNvmlSuccess) {
        NvmlGpmMetricsGet request{};
        request.version = kNvmlGpmMetricsGetVersion;
        request.num_metrics = 1;
        request.sample1 = samples[current];
        request.sample2 = samples[1 - current];
        request.metrics[0].metric_id = kNvmlGpmMetricDramBandwidthUtil;
        if (nvml->gpm_metrics_get(&request) == kNvmlSuccess &&
            request.metrics[0].nvml_return == kNvmlSuccess) {
          sample.dram_bandwidth_utilization = request.metrics[0].value / 100.0;
        }
        current = 1 - current;
      }
      on_sample(sample);
    }
  }
};

absl::StatusOr<std::unique_ptr<NvmlSampler>> NvmlSampler::Start(
    int device_ordinal, absl::Duration period, std::function<void(const NvmlSample&)> on_sample) {
  absl::StatusOr<const Library*> nvml = Library::Get();
  if (!nvml.ok()) return nvml.status();
  char bus_id[64] = {};
  if (const cudaError_t error = cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_ordinal);
      error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("NVML sampler: no PCI bus id for CUDA device ", device_ordinal, ": ",
                     cudaGetErrorString(error)));
  }
  std::unique_ptr<NvmlSampler> sampler(new NvmlSampler());
  sampler->state_ = std::make_unique<State>();
  State& state = *sampler->state_;
  state.nvml = *nvml;
  state.period = period;
  state.on_sample = std::move(on_sample);
  if (absl::Status status = state.nvml->Check(
          state.nvml->device_by_pci_bus_id(bus_id, &state.device), "device by PCI bus id");
      !status.ok()) {
    return status;
  }
  if (state.nvml->gpm_query_support != nullptr) {
    NvmlGpmSupport support{.version = kNvmlGpmSupportVersion, .is_supported_device = 0};
    state.gpm = state.nvml->gpm_query_support(state.device, &support) == kNvmlSuccess &&
                support.is_supported_device != 0 &&
                state.nvml->gpm_sample_alloc(&state.samples[0]) == kNvmlSuccess &&
                state.nvml->gpm_sample_alloc(&state.samples[1]) == kNvmlSuccess &&
                state.nvml->gpm_sample_get(state.device, state.samples[0]) == kNvmlSuccess;
  }
  state.thread = std::thread([&state] { state.Run(); });
  return sampler;
}

NvmlSampler::~NvmlSampler() {
  if (state_ == nullptr) return;
  state_->stop.Notify();
  if (state_->thread.joinable()) state_->thread.join();
}

bool NvmlSampler::has_gpm() const { return state_->gpm; }

}  // namespace treeverify::worker
