// The paged latent KV cache of one rank: one 576-wide row (latent + rope) per token per layer,
// in pages of page_size rows that all layers allocate together. This class is the bookkeeping
// (pages, page tables, committed lengths), on the host for every backend; the rows live in its
// KvStorage (host or device memory), which applies the row moves of a commit.
//
// A sequence has a committed prefix (positions [0, committed_length)) and, during a step, a
// segment of new rows right after it (tree nodes or a prefill chunk). Commit keeps the accepted
// segment rows, moved to contiguous positions, and frees the rest; Release frees everything. A
// full pool fails only the sequence that asked (RESOURCE_EXHAUSTED) and changes nothing else.
//
//   TV_RETURN_IF_ERROR(cache->ReserveSegment(seq, nodes));
//   ... write rows at cache->SegmentSlots(seq), run attention with cache->page_table(seq) ...
//   TV_RETURN_IF_ERROR(cache->Commit(seq, {0, 2, 5}));
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "treeverify/worker/kv_storage.h"

namespace treeverify::worker {

class KvCache {
 public:
  // The storage must hold rows of exactly this shape.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheOptions& options,
                                                         std::unique_ptr<KvStorage> storage);

  const KvCacheOptions& options() const { return options_; }
  bool Contains(uint64_t seq_id) const { return sequences_.contains(seq_id); }
  // 0 for an unknown sequence.
  int64_t committed_length(uint64_t seq_id) const;
  int64_t segment_length(uint64_t seq_id) const;

  // Makes room for `count` new rows after the committed prefix (a new sequence starts empty).
  // Replaces any uncommitted segment. RESOURCE_EXHAUSTED when the pool cannot hold them; the
  // sequence is then left as it was.
  absl::Status ReserveSegment(uint64_t seq_id, int64_t count);
  // Global slots (page * page_size + row) of the segment's rows, in node order.
  std::vector<int64_t> SegmentSlots(uint64_t seq_id) const;
  // Pages of the sequence in position order.
  const std::vector<int32_t>& page_table(uint64_t seq_id) const;

  // Keeps segment rows `accepted_nodes` (strictly ascending node indices) as the next committed
  // positions, in that order, and drops the rest of the segment.
  absl::Status Commit(uint64_t seq_id, absl::Span<const int32_t> accepted_nodes);
  // Frees all pages of the sequence and forgets it. NOT_FOUND for an unknown id.
  absl::Status Release(uint64_t seq_id);

  int64_t free_pages() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t used_pages() const { return options_.num_pages - free_pages(); }

 private:
  struct Sequence {
    int64_t committed_length = 0;
    int64_t segment_length = 0;
    std::vector<int32_t> pages;
  };
  KvCache(const KvCacheOptions& options, std::unique_ptr<KvStorage> storage);
  int64_t PagesFor(int64_t rows) const;
  // Global slot of a position of the sequence; the position must lie in its pages.
  int64_t SlotOf(const Sequence& sequence, int64_t position) const;
  // Frees the pages beyond those that `rows` rows need.
  void ShrinkTo(Sequence& sequence, int64_t rows);

  KvCacheOptions options_;
  std::unique_ptr<KvStorage> storage_;
  std::vector<int32_t> free_list_;
  std::unordered_map<uint64_t, Sequence> sequences_;
};

}  // namespace treeverify::worker
