// What the MLA verify kernels share: how a sequence's keys are cut into splits, and where a split
// leaves its partial result for the combine kernel.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "treeverify/kernels/cuda/mla_verify_attention.h"

namespace treeverify::kernels::cuda::mla {

// The production dims (DeepSeek-V3, Kimi-K2) the tensor-core kernels are built for.
inline constexpr int kMlaLatent = 512;
inline constexpr int kMlaRope = 64;

// A split's (or a row's) natural-log sum-exp from its max score in the log2 domain and its sum of
// exp2(score - max); -inf when nothing was visible.
__device__ inline float NaturalLse(float max_log2, float sum) {
  return sum > 0.f ? (max_log2 + log2f(sum)) * 0.6931471805599453f : -INFINITY;
}

// A sequence's keys: its committed prefix followed by its own tree nodes.
struct SequenceSpan {
  int32_t rows;       // tree nodes (segment rows) of the sequence
  int32_t committed;  // prefix keys
  int32_t row_begin;  // first segment row in q / out
  __host__ __device__ int32_t keys() const { return committed + rows; }
};

__device__ inline SequenceSpan LoadSequence(const MlaVerifyParamsBf16& p, int seq) {
  const int32_t begin = p.row_offsets[seq];
  return {p.row_offsets[seq + 1] - begin, p.committed_lengths[seq], begin};
}

// Splits of a sequence with `keys` keys: at most nsplit, each a run of whole key tiles. Every
// split but the last has the same number of tiles, the fewest that nsplit splits allow but never
// fewer than min_split_keys needs; the last holds what remains (one split when the sequence is
// shorter). So there are only as many splits as that size needs: more splits at the same longest
// split would add partial results, not speed (seen: 128 splits of 2-3 tiles ran 21.2 us where 86
// of 3 ran 17.9, H=8 Q=1 L=16k); and a tree's few keys past a prefix of whole tiles (4096 + 9)
// add a short last split instead of doubling every split's tiles (bench/NOTES.md, step 68). The
// boundaries depend on the sequence's length and NSPLIT only, never on the batch.
struct SplitTiles {
  int32_t begin;
  int32_t end;  // exclusive; begin == end: the split has no keys
};

inline constexpr int kMaxSplits = 256;  // the most splits a plan has (the merges' layouts)

__host__ __device__ inline int32_t CeilDiv(int32_t a, int32_t b) { return (a + b - 1) / b; }

__host__ __device__ inline int32_t TilesPerSplit(int32_t keys, int32_t nsplit,
                                                 int32_t min_split_keys) {
  const int32_t tiles = CeilDiv(keys, kMlaKeyTile);
  const int32_t fewest = CeilDiv(tiles, nsplit > 0 ? nsplit : 1);
  // (m - 1) / 64 + 1 rather than CeilDiv: no overflow near INT32_MAX; and never more than the
  // sequence's tiles (one split), so that split * tiles_per_split stays in range.
  int32_t shortest = ((min_split_keys > 0 ? min_split_keys : 1) - 1) / kMlaKeyTile + 1;
  shortest = shortest < tiles ? shortest : (tiles > 1 ? tiles : 1);
  return fewest > shortest ? fewest : shortest;
}

// The splits that have keys; the others (split >= NumSplits) are empty.
__host__ __device__ inline int32_t NumSplits(int32_t keys, int32_t nsplit, int32_t min_split_keys) {
  return CeilDiv(CeilDiv(keys, kMlaKeyTile), TilesPerSplit(keys, nsplit, min_split_keys));
}

__host__ __device__ inline SplitTiles SplitRange(int32_t keys, int32_t nsplit,
                                                 int32_t min_split_keys, int32_t split) {
  const int32_t tiles = CeilDiv(keys, kMlaKeyTile);
  const int32_t per_split = TilesPerSplit(keys, nsplit, min_split_keys);
  const int64_t begin = static_cast<int64_t>(split) * per_split;
  if (begin >= tiles) return {tiles, tiles};
  const int64_t end = begin + per_split;
  return {static_cast<int32_t>(begin), end < tiles ? static_cast<int32_t>(end) : tiles};
}

// Where split results go: lse [num_seqs][nsplit][max_rows] in fp32 and outputs normalized by the
// split's own sum [num_seqs][nsplit][max_rows][latent_dim], rows being packed (node, head) rows.
// (A split block writes its rows' LSEs side by side: [row][split] would make each a partial-sector
// store, and cost a launch with a merge kernel 1-5 us, bench/NOTES.md step 56.)
// The outputs are fp32 (out_bytes 4) or bf16 (2), by kernel: the wide kernel's 64-row partials
// are as many bytes as the keys at batch 1 (132 splits x 64 rows x 2 KB in fp32 against 19 MB of
// keys at 16k), and bf16 halves that round trip; a normalized partial is a convex combination of
// values, so bf16 adds one rounding of 2^-9 relative to them, like the final output's own
// (bench/NOTES.md, steps 33 and 35).
// In front of them, at a fixed offset whatever the plan (so that plans sharing a workspace agree
// on it), the counters of the in-grid merge (mla_verify_grid_merge.cuh): two words per (sequence,
// row tile), zeroed once by PrepareMlaVerifyWorkspace and left zeroed by every launch.
inline constexpr int64_t kMergeCounterBytes = 16384;
inline constexpr int kMaxMergeGroups = static_cast<int>(kMergeCounterBytes / 8);

// NSPLIT of a launch whose last sequences may be padding (a CUDA graph captured for a bucket of
// sequence counts, MlaVerifyShape::min_live_seqs): it follows the number of live sequences, read
// on the device, so that the live ones get the multiprocessors a padding sequence would otherwise
// take (NSPLIT is planned from the number of sequences, their lengths being unknown to the host).
// For n live sequences it is the NSPLIT an exact launch of n would have: the same split boundaries,
// the same bytes. The grid is sized for the live count that takes the most splits; the blocks of
// splits past a launch's NSPLIT, and of padding sequences, find no keys and leave.
struct LiveSplits {
  const int32_t* live_seqs = nullptr;  // device; null: every sequence is live (NSPLIT = nsplit)
  int32_t min_live = 1;
  int32_t max_live = 1;
  int16_t nsplit[kMaxLiveCounts] = {};  // NSPLIT for min_live + i live sequences
};

struct PartialLayout {
  float* lse = nullptr;
  void* out = nullptr;
  int32_t nsplit = 1;    // the grid's splits per sequence: the layout's stride
  int32_t max_rows = 0;  // max_rows_per_seq * num_heads
  int32_t latent_dim = 0;
  uint32_t* merge_counters = nullptr;
  LiveSplits live;

  // NSPLIT for this launch's sequences (nsplit without padding sequences). A live count out of
  // range (a caller's bug) is clamped: a wrong split count, never an access outside the layout.
  __device__ int32_t LaunchSplits() const {
    if (live.live_seqs == nullptr) return nsplit;
    const int32_t read = *live.live_seqs;
    const int32_t n =
        read < live.min_live ? live.min_live : (read > live.max_live ? live.max_live : read);
    return live.nsplit[n - live.min_live];
  }

  __host__ __device__ int64_t Index(int seq, int split, int row) const {
    return (static_cast<int64_t>(seq) * nsplit + split) * max_rows + row;
  }
  // The output row of (seq, split, row), in the element type the launch chose.
  template <typename T>
  __host__ __device__ T* Out(int seq, int split, int row) const {
    return static_cast<T*>(out) + Index(seq, split, row) * latent_dim;
  }

  static int64_t Bytes(int32_t num_seqs, int32_t nsplit, int32_t max_rows, int32_t latent_dim,
                       int out_bytes) {
    const int64_t rows = static_cast<int64_t>(num_seqs) * nsplit * max_rows;
    return kMergeCounterBytes + AlignUp(rows * 4) + AlignUp(rows * latent_dim * out_bytes);
  }
  static PartialLayout At(void* workspace, int32_t num_seqs, int32_t nsplit, int32_t max_rows,
                          int32_t latent_dim) {
    const int64_t rows = static_cast<int64_t>(num_seqs) * nsplit * max_rows;
    char* base = static_cast<char*>(workspace);
    char* lse = base + kMergeCounterBytes;
    return {reinterpret_cast<float*>(lse),
            lse + AlignUp(rows * 4),
            nsplit,
            max_rows,
            latent_dim,
            reinterpret_cast<uint32_t*>(base),
            LiveSplits{}};
  }
  static int64_t AlignUp(int64_t bytes) { return (bytes + 255) / 256 * 256; }
};

// Whether a page index from a page table lies in the cache. The kernels read a page outside it (a
// caller's bug) as zeros rather than fault: a fault would end every session's work on the device.
__device__ inline bool PageInCache(const MlaVerifyParamsBf16& p, int32_t page) {
  return static_cast<uint32_t>(page) < static_cast<uint32_t>(p.num_pages);
}

// Whether a segment row (node) may see key `key` of its sequence: every prefix key, and the
// tree nodes set in its ancestor bitmask.
__device__ inline bool KeyVisible(const uint64_t* ancestor_mask, int32_t committed, int32_t node,
                                  int32_t key) {
  if (key < committed) return true;
  const int32_t j = key - committed;
  return (ancestor_mask[node * kAncestorMaskWords + (j >> 6)] >> (j & 63)) & 1;
}

}  // namespace treeverify::kernels::cuda::mla
