// A Communicator for GPU ranks: NCCL, one process (or thread) per GPU, with a watchdog.
//
// The ranks meet through a RendezvousStore (hosted by the coordinator): rank 0 makes the NCCL
// unique id and publishes it under `key_prefix + "nccl_unique_id"`, the others read it. The
// communicator is non-blocking, so every wait (forming the group, enqueuing a collective, waiting
// for a stream) polls NCCL's asynchronous error and the clock in the waiting thread: an error or
// a timeout aborts the communicator (ncclCommAbort, which also ends its kernels still on the
// device) and becomes a Status, never a hang. Failure is final, as with Gloo: the group re-forms
// under a new epoch prefix (the workers restart with a new --group-epoch), and a GPU forward
// drops the CUDA graphs that captured the aborted communicator.
//
// The device collectives run on the caller's stream and may be captured into CUDA graphs; their
// additions are in NCCL's order. AllReduceSum on host memory keeps the interface's rank order
// (an all-gather, then the sum on the host).
//
//   NcclOptions options{.rank = rank, .world_size = 8, .key_prefix = "nccl/3/"};
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> nccl,
//                       NcclCommunicator::Create(options, store));
//   DeviceCollectives* collectives = nccl->device_collectives();
//   TV_RETURN_IF_ERROR(collectives->EnqueueAllReduceSum(hidden, rows * 7168, stream));
//   TV_RETURN_IF_ERROR(collectives->WaitForStream(stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "treeverify/worker/communicator.h"
#include "treeverify/worker/rendezvous_store.h"

struct ncclComm;

namespace treeverify::worker {

struct NcclOptions {
  int rank = 0;
  int world_size = 1;
  // The GPU of this rank (an ordinal among those CUDA_VISIBLE_DEVICES shows). Every rank of a
  // group needs a GPU of its own: NCCL refuses two ranks on one device.
  int device_ordinal = 0;
  // Bounds forming the group (waiting for the unique id, then for every rank to join) and every
  // wait for a collective.
  absl::Duration timeout = absl::Seconds(60);
  // Prepended to the store key, e.g. "nccl/3/": groups with different prefixes never meet.
  std::string key_prefix;

  absl::Status Validate() const;
};

// Not thread safe: each rank calls collectives from one thread at a time, in the same order on
// every rank.
class NcclCommunicator final : public Communicator, public DeviceCollectives {
 public:
  // World size 1 needs no store (it may be nullptr). INVALID_ARGUMENT for bad options;
  // FAILED_PRECONDITION without the GPU; DEADLINE_EXCEEDED when the unique id or a peer does not
  // show up within the timeout (the half-formed communicator is aborted); ALREADY_EXISTS when
  // the prefix was used by an earlier group; UNAVAILABLE or INTERNAL for NCCL's other errors.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const NcclOptions& options,
                                                                  RendezvousStore* store);
  // Finalizes the communicator (flushing its work, bounded by the timeout) or, when that fails
  // or the group is already broken, aborts it.
  ~NcclCommunicator() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  // Through the device: all-gather, copy back, sum in rank order. Bit-identical to the host
  // communicators' results for the same inputs.
  absl::Status AllReduceSum(absl::Span<float> data) override;
  DeviceCollectives* device_collectives() override { return this; }

  // DeviceCollectives. After any failure every later call fails with UNAVAILABLE, naming the
  // first failure.
  absl::Status EnqueueAllReduceSum(float* data, int64_t count, CUstream_st* stream) override;
  absl::Status WaitForStream(CUstream_st* stream) override;

  // OK while the group is usable; otherwise its first failure.
  absl::Status health() const { return failure_; }

 private:
  NcclCommunicator(const NcclOptions& options, ncclComm* comm, cudaStream_t host_stream);
  // Polls the communicator until it leaves ncclInProgress; DEADLINE_EXCEEDED after `deadline`.
  // Any failure aborts the communicator and is kept in failure_.
  absl::Status AwaitCommunicator(absl::string_view what, absl::Time deadline);
  absl::Status Fail(absl::Status status);
  // UNAVAILABLE, naming the first failure, once the group has failed.
  absl::Status CheckUsable() const;

  const NcclOptions options_;
  ncclComm* comm_ = nullptr;            // nullptr once aborted
  cudaStream_t host_stream_ = nullptr;  // AllReduceSum's copies and all-gather
  cudaEvent_t done_ = nullptr;          // WaitForStream's marker
  float* gathered_ = nullptr;           // device [world_size, gathered_count_]
  int64_t gathered_count_ = 0;
  std::vector<float> gathered_host_;
  absl::Status failure_;
};

}  // namespace treeverify::worker
