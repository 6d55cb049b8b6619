#include "treeverify/worker/cuda_kv_storage.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/cuda/kv_cache_ops.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {

absl::StatusOr<std::unique_ptr<CudaKvStorage>> CudaKvStorage::Create(const KvCacheOptions& options,
                                                                     cudaStream_t stream) {
  TV_RETURN_IF_ERROR(options.Validate());
  TV_ASSIGN_OR_RETURN(DeviceArray<kernels::cuda::Bf16> rows,
                      DeviceArray<kernels::cuda::Bf16>::Allocate(
                          options.num_layers * options.num_slots() * options.row_dim));
  TV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(rows.get(), 0, rows.bytes(), stream));
  return std::unique_ptr<CudaKvStorage>(new CudaKvStorage(options, stream, std::move(rows)));
}

CudaKvStorage::CudaKvStorage(const KvCacheOptions& options, cudaStream_t stream,
                             DeviceArray<kernels::cuda::Bf16> rows)
    : options_(options), stream_(stream), rows_(std::move(rows)) {}

absl::Status CudaKvStorage::MoveRows(absl::Span<const int64_t> src_slots,
                                     absl::Span<const int64_t> dst_slots) {
  // Checked here: the device copy cannot report a slot out of range.
  TV_RETURN_IF_ERROR(CheckRowMoves(src_slots, dst_slots, options_.num_slots()));
  const int64_t count = static_cast<int64_t>(src_slots.size());
  if (count == 0) return absl::OkStatus();
  if (first_move_ != nullptr && moves_ == 0) {
    TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(first_move_, stream_));
  }
  if (move_slots_.size() < 2 * count) {
    // Earlier moves may still be reading the old list: the stream finishes them first.
    TV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    TV_ASSIGN_OR_RETURN(move_slots_, DeviceArray<int64_t>::Allocate(2 * count));
  }
  std::vector<int64_t> lists(src_slots.begin(), src_slots.end());
  lists.insert(lists.end(), dst_slots.begin(), dst_slots.end());
  // From pageable memory: the call returns once `lists` has been staged, so it may go.
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(move_slots_.get(), lists.data(),
                                          lists.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                          stream_));
  TV_RETURN_IF_ERROR(kernels::cuda::KvCopy({.src_slots = move_slots_.get(),
                                            .dst_slots = move_slots_.get() + count,
                                            .cache = rows_.get(),
                                            .count = count,
                                            .row_dim = options_.row_dim,
                                            .num_slots = options_.num_slots(),
                                            .num_layers = options_.num_layers},
                                           stream_));
  if (first_move_ != nullptr) {
    moves_ += count;
    TV_CUDA_RETURN_IF_ERROR(cudaEventRecord(last_move_, stream_));
  }
  return absl::OkStatus();
}

CudaKvStorage::~CudaKvStorage() {
  if (first_move_ != nullptr) cudaEventDestroy(first_move_);
  if (last_move_ != nullptr) cudaEventDestroy(last_move_);
}

absl::Status CudaKvStorage::EnableAccounting() {
  if (first_move_ != nullptr) return absl::OkStatus();
  TV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&first_move_));
  TV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&last_move_));
  return absl::OkStatus();
}

absl::StatusOr<CudaKvStorage::Commits> CudaKvStorage::TakeCommits() {
  Commits commits;
  if (first_move_ == nullptr || moves_ == 0) return commits;
  TV_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(last_move_));
  float ms = 0.0f;
  TV_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, first_move_, last_move_));
  commits.seconds = ms * 1e-3;
  commits.moves = std::exchange(moves_, 0);
  return commits;
}

}  // namespace treeverify::worker
