#include "treeverify/worker/side_stream.h"

#include "treeverify/kernels/cuda/cuda_status.h"

namespace treeverify::worker {

absl::StatusOr<std::unique_ptr<SideStream>> SideStream::Create() {
  cudaStream_t stream = nullptr;
  TV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  cudaError_t created = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  if (created == cudaSuccess) created = cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
  if (created != cudaSuccess) {
    if (fork != nullptr) cudaEventDestroy(fork);
    cudaStreamDestroy(stream);
    return kernels::cuda::CudaStatus(created, "SideStream: cudaEventCreateWithFlags");
  }
  return std::unique_ptr<SideStream>(new SideStream(stream, fork, join));
}

SideStream::~SideStream() {
  cudaStreamSynchronize(stream_);
  cudaEventDestroy(join_);
  cudaEventDestroy(fork_);
  cudaStreamDestroy(stream_);
}

absl::Status SideStream::Fork(cudaStream_t main) {
  TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_, main));
  return kernels::cuda::CudaStatus(cudaStreamWaitEvent(stream_, fork_, 0),
                                   "SideStream::Fork: cudaStreamWaitEvent");
}

absl::Status SideStream::Join(cudaStream_t main) {
  TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(join_, stream_));
  return kernels::cuda::CudaStatus(cudaStreamWaitEvent(main, join_, 0),
                                   "SideStream::Join: cudaStreamWaitEvent");
}

absl::StatusOr<cudaEvent_t> SideStream::ReadyEvent() {
  TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(join_, stream_));
  return join_;
}

absl::Status SideStream::Synchronize() {
  return kernels::cuda::CudaStatus(cudaStreamSynchronize(stream_),
                                   "SideStream: cudaStreamSynchronize");
}

}  // namespace treeverify::worker
