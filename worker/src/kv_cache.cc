#include "treeverify/worker/kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheOptions& options,
                                                         std::unique_ptr<KvStorage> storage) {
  TV_RETURN_IF_ERROR(options.Validate());
  if (storage == nullptr) return absl::InvalidArgumentError("KvCache::Create: no row storage");
  const KvCacheOptions& held = storage->options();
  if (held.num_pages != options.num_pages || held.page_size != options.page_size ||
      held.num_layers != options.num_layers || held.row_dim != options.row_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCache::Create: the row storage holds ", held.num_layers, " layers x ",
                     held.num_pages, " pages x ", held.page_size, " rows x ", held.row_dim,
                     " values, the cache wants ", options.num_layers, " x ", options.num_pages,
                     " x ", options.page_size, " x ", options.row_dim));
  }
  return std::unique_ptr<KvCache>(new KvCache(options, std::move(storage)));
}

KvCache::KvCache(const KvCacheOptions& options, std::unique_ptr<KvStorage> storage)
    : options_(options), storage_(std::move(storage)) {
  // The free list is a stack. Lowest ids on top, so a fresh cache hands out pages 0, 1, 2, ...;
  // every rank replays the same requests and so makes the same choices.
  free_list_.reserve(options.num_pages);
  for (int64_t page = options.num_pages - 1; page >= 0; --page) {
    free_list_.push_back(static_cast<int32_t>(page));
  }
}

int64_t KvCache::committed_length(uint64_t seq_id) const {
  auto it = sequences_.find(seq_id);
  return it == sequences_.end() ? 0 : it->second.committed_length;
}

int64_t KvCache::segment_length(uint64_t seq_id) const {
  auto it = sequences_.find(seq_id);
  return it == sequences_.end() ? 0 : it->second.segment_length;
}

int64_t KvCache::PagesFor(int64_t rows) const {
  return (rows + options_.page_size - 1) / options_.page_size;
}

int64_t KvCache::SlotOf(const Sequence& sequence, int64_t position) const {
  return int64_t{sequence.pages[position / options_.page_size]} * options_.page_size +
         position % options_.page_size;
}

void KvCache::ShrinkTo(Sequence& sequence, int64_t rows) {
  // Pushing from the back of the page table puts its first freed page on top of the stack, so
  // growing again right after gets the same pages back in the same order.
  const size_t keep = static_cast<size_t>(PagesFor(rows));
  while (sequence.pages.size() > keep) {
    free_list_.push_back(sequence.pages.back());
    sequence.pages.pop_back();
  }
}

absl::Status KvCache::ReserveSegment(uint64_t seq_id, int64_t count) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ReserveSegment: sequence 0x%016x asks for %d rows; the count must be >= 0",
                        seq_id, count));
  }
  auto it = sequences_.find(seq_id);
  const int64_t committed = it == sequences_.end() ? 0 : it->second.committed_length;
  const int64_t held_pages =
      it == sequences_.end() ? 0 : static_cast<int64_t>(it->second.pages.size());
  // committed <= capacity, so bounding count keeps committed + count from overflowing.
  const int64_t capacity_rows = options_.num_pages * options_.page_size;
  if (count > capacity_rows - committed) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV cache too small: sequence 0x%016x needs %d committed + %d new rows, the cache holds "
        "%d rows in all",
        seq_id, committed, count, capacity_rows));
  }
  // Decide before touching anything, so a failure leaves the sequence (and its old segment) as
  // it was. The pages of the old segment count as available: they are reused or freed.
  const int64_t needed_pages = PagesFor(committed + count);
  if (needed_pages - held_pages > free_pages()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("KV cache full: sequence 0x%016x needs %d more pages, %d free", seq_id,
                        needed_pages - held_pages, free_pages()));
  }
  // Resizing straight to the new length hands out exactly the pages that dropping the old
  // segment first and then growing would (see ShrinkTo), without churning the free list.
  Sequence& sequence = sequences_[seq_id];
  ShrinkTo(sequence, committed + count);
  while (static_cast<int64_t>(sequence.pages.size()) < needed_pages) {
    sequence.pages.push_back(free_list_.back());
    free_list_.pop_back();
  }
  sequence.segment_length = count;
  return absl::OkStatus();
}

std::vector<int64_t> KvCache::SegmentSlots(uint64_t seq_id) const {
  std::vector<int64_t> slots;
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return slots;
  const Sequence& sequence = it->second;
  slots.reserve(sequence.segment_length);
  for (int64_t node = 0; node < sequence.segment_length; ++node) {
    slots.push_back(SlotOf(sequence, sequence.committed_length + node));
  }
  return slots;
}

const std::vector<int32_t>& KvCache::page_table(uint64_t seq_id) const {
  static const auto* const kNoPages = new std::vector<int32_t>();
  auto it = sequences_.find(seq_id);
  return it == sequences_.end() ? *kNoPages : it->second.pages;
}

absl::Status KvCache::Commit(uint64_t seq_id, absl::Span<const int32_t> accepted_nodes) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrFormat("Commit: no KV cache sequence 0x%016x", seq_id));
  }
  Sequence& sequence = it->second;
  for (size_t k = 0; k < accepted_nodes.size(); ++k) {
    const int32_t node = accepted_nodes[k];
    if (node < 0 || node >= sequence.segment_length) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Commit: sequence 0x%016x accepts node %d (index %d), outside its segment of %d rows",
          seq_id, node, k, sequence.segment_length));
    }
    if (k > 0 && node <= accepted_nodes[k - 1]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Commit: sequence 0x%016x accepted nodes must be strictly ascending, got %d after %d "
          "(index %d)",
          seq_id, node, accepted_nodes[k - 1], k));
    }
  }

  // Node accepted_nodes[k] moves to position committed + k. Ascending indices mean
  // accepted_nodes[k] >= k: no move reads a row an earlier move wrote, as MoveRows requires.
  const int64_t committed = sequence.committed_length;
  std::vector<int64_t> src_slots, dst_slots;
  for (size_t k = 0; k < accepted_nodes.size(); ++k) {
    const int64_t node = accepted_nodes[k];
    if (node == static_cast<int64_t>(k)) continue;  // already in place
    src_slots.push_back(SlotOf(sequence, committed + node));
    dst_slots.push_back(SlotOf(sequence, committed + static_cast<int64_t>(k)));
  }
  if (!src_slots.empty()) TV_RETURN_IF_ERROR(storage_->MoveRows(src_slots, dst_slots));
  sequence.committed_length += static_cast<int64_t>(accepted_nodes.size());
  sequence.segment_length = 0;
  ShrinkTo(sequence, sequence.committed_length);
  return absl::OkStatus();
}

absl::Status KvCache::Release(uint64_t seq_id) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrFormat("Release: no KV cache sequence 0x%016x", seq_id));
  }
  ShrinkTo(it->second, 0);
  sequences_.erase(it);
  return absl::OkStatus();
}

}  // namespace treeverify::worker
