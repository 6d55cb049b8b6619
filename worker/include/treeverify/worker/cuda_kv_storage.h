// The KV rows in device memory, bf16 as the MLA op reads them: [num_layers, num_slots, row_dim]
// in one allocation. Row moves (a commit's compaction) run on the forward's stream, in list
// order (kernels::cuda::KvCopy), after everything queued before them.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/worker/device_array.h"
#include "treeverify/worker/kv_storage.h"

namespace treeverify::worker {

class CudaKvStorage final : public KvStorage {
 public:
  // Zeroed rows on the current device; `stream` (which must outlive the storage's use) orders
  // the moves with the forward.
  static absl::StatusOr<std::unique_ptr<CudaKvStorage>> Create(const KvCacheOptions& options,
                                                               cudaStream_t stream);

  const KvCacheOptions& options() const override { return options_; }
  absl::Status MoveRows(absl::Span<const int64_t> src_slots,
                        absl::Span<const int64_t> dst_slots) override;

  // With accounting on, the moves since the last TakeCommits() are timed (on the stream): their
  // GPU seconds (once the stream has passed them) and how many rows moved.
  struct Commits {
    double seconds = 0.0;
    int64_t moves = 0;
  };
  absl::Status EnableAccounting();
  absl::StatusOr<Commits> TakeCommits();

  // One layer's rows: [num_slots, row_dim].
  kernels::cuda::Bf16* layer_data(int64_t layer) const {
    return rows_.get() + layer * options_.num_slots() * options_.row_dim;
  }

 private:
  CudaKvStorage(const KvCacheOptions& options, cudaStream_t stream,
                DeviceArray<kernels::cuda::Bf16> rows);
  KvCacheOptions options_;
  cudaStream_t stream_;
  DeviceArray<kernels::cuda::Bf16> rows_;
  DeviceArray<int64_t> move_slots_;  // [2, capacity]: sources, then destinations
  // Accounting: events before the first and after the last move since TakeCommits.
  cudaEvent_t first_move_ = nullptr;
  cudaEvent_t last_move_ = nullptr;
  int64_t moves_ = 0;

 public:
  ~CudaKvStorage() override;
};

}  // namespace treeverify::worker
