#include "treeverify/worker/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {

namespace cuda = kernels::cuda;

namespace {

constexpr char kUniqueIdKey[] = "nccl_unique_id";

// NCCL's result as a Status: what went wrong, with the communicator's last error message when
// it has one. Failures of the system or of a peer are UNAVAILABLE (the group must re-form);
// misuse and NCCL's own faults are INTERNAL.
absl::Status NcclStatus(ncclResult_t result, absl::string_view what, ncclComm_t comm) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", ncclGetErrorString(result));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, " (", last, ")");
  switch (result) {
    case ncclSystemError:
    case ncclRemoteError:
    case ncclUnhandledCudaError:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

// Waits between polls of a communicator or an event: spinning (yielding the core) for the first
// millisecond, which covers a healthy verify step's collectives, then sleeping 50 us, so that a
// wait for a slow peer does not hold a core.
class Poller {
 public:
  void Pause() {
    if (absl::Now() - start_ < absl::Milliseconds(1)) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(50));
    }
  }

 private:
  absl::Time start_ = absl::Now();
};

}  // namespace

absl::Status NcclOptions::Validate() const {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclOptions: rank must be in [0, world_size ", world_size, "), got ", rank));
  }
  if (device_ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclOptions.device_ordinal must be >= 0, got ", device_ordinal));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("NcclOptions.timeout must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclOptions& options, RendezvousStore* store) {
  TV_RETURN_IF_ERROR(options.Validate());
  if (options.world_size > 1 && store == nullptr) {
    return absl::InvalidArgumentError("NcclCommunicator: a group of several ranks needs a store");
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices <= options.device_ordinal) {
    cudaGetLastError();  // not sticky: clear it
    return absl::FailedPreconditionError(absl::StrCat(
        "NcclCommunicator: no GPU ", options.device_ordinal, " (", devices, " visible)"));
  }
  TV_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device_ordinal));

  ncclUniqueId id;
  const std::string key = options.key_prefix + kUniqueIdKey;
  if (options.rank == 0) {
    TV_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr));
    if (options.world_size > 1) {
      TV_RETURN_IF_ERROR(store->Set(key, std::string(id.internal, sizeof(id.internal))));
    }
  } else {
    absl::StatusOr<std::vector<std::string>> values = store->Get({key}, options.timeout);
    if (!values.ok()) {
      return absl::Status(
          values.status().code(),
          absl::StrCat("NcclCommunicator rank ", options.rank,
                       ": waiting for rank 0's unique id: ", values.status().message()));
    }
    if ((*values)[0].size() != sizeof(id.internal)) {
      return absl::InternalError(absl::StrCat("NcclCommunicator: the value under \"", key,
                                              "\" has ", (*values)[0].size(), " bytes, not ",
                                              sizeof(id.internal), " (not an NCCL unique id)"));
    }
    std::memcpy(id.internal, (*values)[0].data(), sizeof(id.internal));
  }

  // Non-blocking, so that a rank that never joins is a deadline here rather than a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t started =
      ncclCommInitRankConfig(&comm, options.world_size, id, options.rank, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    const absl::Status status = NcclStatus(started, "ncclCommInitRankConfig", comm);
    if (comm != nullptr) ncclCommAbort(comm);
    return status;
  }
  cudaStream_t host_stream = nullptr;
  if (const cudaError_t error = cudaStreamCreateWithFlags(&host_stream, cudaStreamNonBlocking);
      error != cudaSuccess) {
    ncclCommAbort(comm);
    return cuda::CudaStatus(error, "cudaStreamCreateWithFlags");
  }
  std::unique_ptr<NcclCommunicator> communicator(new NcclCommunicator(options, comm, host_stream));
  absl::Status joined = communicator->AwaitCommunicator("forming the group", deadline);
  if (!joined.ok()) {
    return absl::Status(joined.code(), absl::StrCat("NcclCommunicator rank ", options.rank, " of ",
                                                    options.world_size, " (unique id under \"", key,
                                                    "\"): ", joined.message()));
  }
  TV_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&communicator->done_, cudaEventDisableTiming));
  return communicator;
}

NcclCommunicator::NcclCommunicator(const NcclOptions& options, ncclComm* comm,
                                   cudaStream_t host_stream)
    : options_(options), comm_(comm), host_stream_(host_stream) {}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) {
    // Finalize flushes what was issued; it involves the peers, so it is bounded too (shorter:
    // a process going down should not wait long), and an abort ends whatever is left.
    const ncclResult_t started = ncclCommFinalize(comm_);
    bool finalized = started == ncclSuccess || started == ncclInProgress;
    const absl::Time deadline = absl::Now() + std::min(options_.timeout, absl::Seconds(10));
    Poller poller;
    ncclResult_t state = ncclInProgress;
    while (finalized && state == ncclInProgress) {
      finalized = ncclCommGetAsyncError(comm_, &state) == ncclSuccess && absl::Now() <= deadline;
      if (state == ncclInProgress) poller.Pause();
    }
    if (finalized && state == ncclSuccess) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
  }
  if (gathered_ != nullptr) cudaFree(gathered_);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (host_stream_ != nullptr) cudaStreamDestroy(host_stream_);
}

absl::Status NcclCommunicator::CheckUsable() const {
  if (failure_.ok()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("the NCCL group failed earlier: ", failure_.message()));
}

absl::Status NcclCommunicator::Fail(absl::Status status) {
  if (comm_ != nullptr) ncclCommAbort(std::exchange(comm_, nullptr));
  if (failure_.ok()) failure_ = status;
  return status;
}

absl::Status NcclCommunicator::AwaitCommunicator(absl::string_view what, absl::Time deadline) {
  Poller poller;
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) return Fail(NcclStatus(queried, "ncclCommGetAsyncError", comm_));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return Fail(NcclStatus(state, what, comm_));
    if (absl::Now() > deadline) {
      return Fail(absl::DeadlineExceededError(
          absl::StrCat(what, ": not done within ", absl::FormatDuration(options_.timeout),
                       " (a rank that never joined, failed or stalled); the communicator is "
                       "aborted")));
    }
    poller.Pause();
  }
}

absl::Status NcclCommunicator::EnqueueAllReduceSum(float* data, int64_t count,
                                                   CUstream_st* stream) {
  TV_RETURN_IF_ERROR(CheckUsable());
  if (count == 0) return absl::OkStatus();
  const ncclResult_t result =
      ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_, stream);
  if (result == ncclInProgress) {
    return AwaitCommunicator("enqueuing ncclAllReduce", absl::Now() + options_.timeout);
  }
  if (result != ncclSuccess) return Fail(NcclStatus(result, "ncclAllReduce", comm_));
  return absl::OkStatus();
}

absl::Status NcclCommunicator::WaitForStream(CUstream_st* stream) {
  TV_RETURN_IF_ERROR(CheckUsable());
  TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream));
  const absl::Time deadline = absl::Now() + options_.timeout;
  Poller poller;
  while (true) {
    const cudaError_t queried = cudaEventQuery(done_);
    if (queried == cudaSuccess) return absl::OkStatus();
    if (queried != cudaErrorNotReady) return Fail(cuda::CudaStatus(queried, "cudaEventQuery"));
    ncclResult_t state = ncclSuccess;
    const ncclResult_t polled = ncclCommGetAsyncError(comm_, &state);
    if (polled != ncclSuccess) return Fail(NcclStatus(polled, "ncclCommGetAsyncError", comm_));
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(NcclStatus(state, "a collective on the stream", comm_));
    }
    if (absl::Now() > deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "the stream's collectives did not complete within ",
          absl::FormatDuration(options_.timeout),
          " (a peer rank failed, stalled or is running a different step); the NCCL group is "
          "aborted")));
    }
    poller.Pause();
  }
}

absl::Status NcclCommunicator::AllReduceSum(absl::Span<float> data) {
  if (options_.world_size == 1) return absl::OkStatus();
  TV_RETURN_IF_ERROR(CheckUsable());
  const int64_t count = static_cast<int64_t>(data.size());
  if (count == 0) return absl::OkStatus();
  const int64_t world = options_.world_size;
  if (count > gathered_count_) {
    if (gathered_ != nullptr) cudaFree(std::exchange(gathered_, nullptr));
    gathered_count_ = 0;
    TV_CUDA_RETURN_IF_ERROR(
        cudaMalloc(reinterpret_cast<void**>(&gathered_), world * count * sizeof(float)));
    gathered_count_ = count;
  }
  // Each rank's input at its own offset, gathered in place: [world, count].
  float* own = gathered_ + options_.rank * count;
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(own, data.data(), count * sizeof(float),
                                          cudaMemcpyHostToDevice, host_stream_));
  const ncclResult_t result =
      ncclAllGather(own, gathered_, static_cast<size_t>(count), ncclFloat32, comm_, host_stream_);
  if (result == ncclInProgress) {
    TV_RETURN_IF_ERROR(
        AwaitCommunicator("enqueuing ncclAllGather", absl::Now() + options_.timeout));
  } else if (result != ncclSuccess) {
    return Fail(NcclStatus(result, "ncclAllGather", comm_));
  }
  gathered_host_.resize(world * count);
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(gathered_host_.data(), gathered_,
                                          world * count * sizeof(float), cudaMemcpyDeviceToHost,
                                          host_stream_));
  TV_RETURN_IF_ERROR(WaitForStream(host_stream_));
  for (int64_t i = 0; i < count; ++i) {
    float sum = gathered_host_[i];
    for (int64_t r = 1; r < world; ++r) sum += gathered_host_[r * count + i];
    data[i] = sum;
  }
  return absl::OkStatus();
}

}  // namespace treeverify::worker
