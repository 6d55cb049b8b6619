// Where the rows of the paged latent KV cache live. KvCache keeps the bookkeeping (pages, page
// tables, what is committed) on the host for every backend; a KvStorage holds the rows
// themselves (host memory for the CPU backend, device memory for the GPU one) and applies the
// row moves a commit asks for.
//
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<CpuKvStorage> rows, CpuKvStorage::Create(options));
//   CpuKvStorage* cpu_rows = rows.get();  // the CPU forward reads and writes through this
//   TV_ASSIGN_OR_RETURN(auto cache, KvCache::Create(options, std::move(rows)));
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace treeverify::worker {

struct KvCacheOptions {
  int64_t num_pages = 0;
  int32_t page_size = 64;
  int64_t num_layers = 0;
  int64_t row_dim = 0;  // kv_lora_rank + qk_rope_head_dim
  absl::Status Validate() const;

  int64_t num_slots() const { return num_pages * page_size; }
};

class KvStorage {
 public:
  virtual ~KvStorage() = default;
  // The shape the rows were allocated for.
  virtual const KvCacheOptions& options() const = 0;
  // In every layer, row dst_slots[k] becomes what row src_slots[k] held before any move. No
  // source may be the destination of an earlier move (a commit's compaction never is), so
  // copying in order k = 0, 1, ... and gathering every source before writing agree; an
  // implementation may do either. Slots must be in [0, num_slots).
  virtual absl::Status MoveRows(absl::Span<const int64_t> src_slots,
                                absl::Span<const int64_t> dst_slots) = 0;
};

// MoveRows' argument check, for every implementation: as many sources as destinations, every
// slot in [0, num_slots). INVALID_ARGUMENT naming the first bad move.
absl::Status CheckRowMoves(absl::Span<const int64_t> src_slots, absl::Span<const int64_t> dst_slots,
                           int64_t num_slots);

// Rows in host memory, fp32, all layers in one block: [num_layers, num_slots, row_dim].
class CpuKvStorage final : public KvStorage {
 public:
  static absl::StatusOr<std::unique_ptr<CpuKvStorage>> Create(const KvCacheOptions& options);

  const KvCacheOptions& options() const override { return options_; }
  absl::Status MoveRows(absl::Span<const int64_t> src_slots,
                        absl::Span<const int64_t> dst_slots) override;

  // One layer's rows: [num_slots, row_dim]; layer l + 1 follows layer l.
  float* layer_data(int64_t layer) { return rows_.data() + layer * layer_elements_; }
  const float* layer_data(int64_t layer) const { return rows_.data() + layer * layer_elements_; }

 private:
  explicit CpuKvStorage(const KvCacheOptions& options);
  KvCacheOptions options_;
  int64_t layer_elements_ = 0;
  std::vector<float> rows_;
};

}  // namespace treeverify::worker
