// Collective operations between the tensor-parallel ranks of one model replica.
//
// On host memory every reduction is an all-gather followed by a sum in rank order, so its result
// does not depend on timing or on how the batch is split: the CPU backend stays batch invariant.
// The in-process implementation runs W ranks as threads of one process (tests, the CLI); Gloo
// (CPU processes) and NCCL (GPUs, nccl_communicator.h) implement the same interface. NCCL also
// offers DeviceCollectives: reductions of device memory in a CUDA stream's order.
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<InProcessGroup> group, InProcessGroup::Create(2));
//   std::thread([&] { group->communicator(1)->AllReduceSum(buffer1); });
//   group->communicator(0)->AllReduceSum(buffer0);
#pragma once

#include <barrier>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

struct CUstream_st;  // cudaStream_t, without the CUDA headers

namespace treeverify::worker {

// Collectives on device memory, ordered on the caller's CUDA stream: what a GPU forward uses
// instead of copying through the host. Each rank calls them from one thread, in the same order
// and with the same counts on every rank.
class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  // Enqueues data := the sum over ranks of data (count fp32 values in device memory) on
  // `stream`. May be captured into a CUDA graph. Every rank gets the same bits; the order of the
  // additions is the library's, not necessarily rank order.
  virtual absl::Status EnqueueAllReduceSum(float* data, int64_t count, CUstream_st* stream) = 0;
  // Waits until `stream` has run everything enqueued on it. A peer that fails or does not keep
  // up within the collective timeout is an error, never a hang.
  virtual absl::Status WaitForStream(CUstream_st* stream) = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // In place: data becomes the sum over ranks, added in rank order. Every rank passes the same
  // length.
  virtual absl::Status AllReduceSum(absl::Span<float> data) = 0;
  // The device collectives of this group, or nullptr when it has none (host communicators).
  virtual DeviceCollectives* device_collectives() { return nullptr; }
};

// World size 1: every collective is the identity.
class SoloCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  absl::Status AllReduceSum(absl::Span<float>) override { return absl::OkStatus(); }
};

// W ranks as threads sharing memory. Each rank must call collectives from its own thread, in
// the same order on every rank.
class InProcessGroup {
 public:
  // INVALID_ARGUMENT unless world_size >= 1.
  static absl::StatusOr<std::unique_ptr<InProcessGroup>> Create(int world_size);
  // rank in [0, world_size()).
  Communicator* communicator(int rank) { return members_.at(rank).get(); }
  int world_size() const { return static_cast<int>(members_.size()); }

 private:
  class Member;
  explicit InProcessGroup(int world_size);
  std::barrier<> barrier_;
  std::vector<absl::Span<float>> buffers_;
  std::vector<std::vector<float>> scratch_;
  // Held as the interface: Member is incomplete here, and communicator() returns the base.
  std::vector<std::unique_ptr<Communicator>> members_;
};

}  // namespace treeverify::worker
