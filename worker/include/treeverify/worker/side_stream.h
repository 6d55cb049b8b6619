// A second stream for work that may run beside the main stream's, forked from and joined back to
// it by events: eagerly the side stream waits for the fork and the main stream for the join; in a
// stream capture the same calls make the side work a parallel branch of the graph (the capture
// follows the fork event onto the side stream and ends only once it is joined back).
//
//   TV_RETURN_IF_ERROR(side.Fork(main));
//   absl::Status on_side = Launch(..., side.stream());
//   absl::Status on_main = Launch(..., main);
//   TV_RETURN_IF_ERROR(side.Join(main));  // always, also when a launch failed
//
// Small latency-bound kernels fill few multiprocessors, so two chains of them that do not depend
// on each other (a layer's query path and its KV path) take about the longer chain's time.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"

namespace treeverify::worker {

class SideStream {
 public:
  // On the current device: a non-blocking stream and two events without timing.
  static absl::StatusOr<std::unique_ptr<SideStream>> Create();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t stream() const { return stream_; }
  // Work enqueued on stream() after Fork runs after what `main` has enqueued before it.
  absl::Status Fork(cudaStream_t main);
  // Work enqueued on `main` after Join runs after what stream() has enqueued before it.
  absl::Status Join(cudaStream_t main);
  // An event that completes with what stream() has enqueued so far, for work on another stream
  // that reads the side work's output to wait on (cudaStreamWaitEvent) just before it reads, so
  // that the work before it need not wait. Valid until the next ReadyEvent or Join; Join must
  // still follow (it is what ends the side branch of a capture on every path).
  absl::StatusOr<cudaEvent_t> ReadyEvent();
  // Waits for the side stream's work (a failed step's leftovers, before buffers are freed).
  absl::Status Synchronize();

 private:
  SideStream(cudaStream_t stream, cudaEvent_t fork, cudaEvent_t join)
      : stream_(stream), fork_(fork), join_(join) {}

  cudaStream_t stream_;
  cudaEvent_t fork_;
  cudaEvent_t join_;
};

}  // namespace treeverify::worker
