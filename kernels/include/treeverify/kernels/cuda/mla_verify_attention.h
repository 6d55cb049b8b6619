// MLA tree-verify attention on the GPU: the CPU backend's params struct with bf16 device buffers,
// a planner that picks the kernel, the row tile and the split count (NSPLIT) from the launch
// shape, and a launcher that CUDA-graph capture can record once per shape.
//
//   MlaVerifyShape shape{.num_seqs = 1, .max_rows_per_seq = 9, .row_capacity = 9,
//                        .num_heads = 8, .latent_dim = 512, .rope_dim = 64, .page_size = 64};
//   absl::StatusOr<MlaVerifyPlan> plan = PlanMlaVerify(shape, device, {});
//   // workspace: device memory allocated once, as large as the largest workspace_bytes of the
//   // plans it serves (not necessarily the largest shape's: fewer splits need less)
//   PrepareMlaVerifyWorkspace(workspace, workspace_bytes, stream);  // once, after allocating
//   MlaVerifyAttention(params, shape, *plan, workspace, workspace_bytes, stream);
//
// The plan depends on the shape only, never on the context lengths (they live on the device): each
// block derives its key range from committed_lengths, so one captured launch serves every step of a
// growing context. Key ranges are whole 64-key tiles; a sequence with T keys (prefix plus its own
// tree nodes) has at most NSPLIT splits, every one but the last at least min_split_keys long (so a
// short sequence has one), whose partial results are merged by log-sum-exp (nothing to merge when
// NSPLIT is 1): by the split blocks themselves when the launch is one wave, else by a second
// kernel. docs/cuda-attention.md has the details.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/device.h"
#include "treeverify/kernels/mla_verify_attention.h"

namespace treeverify::kernels::cuda {

using MlaVerifyParamsBf16 = MlaVerifyParams<__nv_bfloat16>;

// Keys per tile: the unit of split ranges, of loads and of the tree mask.
inline constexpr int kMlaKeyTile = 64;
// The most live-sequence counts one plan covers (MlaVerifyShape::min_live_seqs).
inline constexpr int kMaxLiveCounts = 64;

// What a launch looks like, known on the host before the lengths are: a CUDA graph is captured
// per shape.
struct MlaVerifyShape {
  int32_t num_seqs = 0;
  // The fewest sequences that carry rows; those after them are padding (no rows, no keys), as in
  // a CUDA graph captured for a bucket of sequence counts. 0 (or num_seqs): every sequence is live.
  // Below num_seqs, each launch reads its live count from the device (MlaVerifyAttention's
  // `live_seqs`) and takes the NSPLIT an exact launch of that many sequences would: the same
  // results, and the multiprocessors spread over the live sequences only. At most kMaxLiveCounts
  // counts from min_live_seqs to num_seqs.
  int32_t min_live_seqs = 0;
  int32_t max_rows_per_seq = 0;  // tree tokens of the largest segment (row_offsets gaps)
  int32_t row_capacity = 0;      // rows the q / out buffers hold (>= row_offsets[num_seqs])
  int32_t num_heads = 0;
  int32_t latent_dim = 0;
  int32_t rope_dim = 0;
  int32_t page_size = 0;
};

enum class MlaVerifyKernel {
  kAuto,         // (options only) let the planner choose
  kWgmmaNarrow,  // sm_90a, 512 + 64 dims: row tiles of 8..32 packed rows as wgmma's N
  kWgmmaWide,    // sm_90a, 512 + 64 dims: 64-row tiles, two warpgroups split the value dims
  kMma,          // sm_80 and later without wgmma (sm_120, sm_100), 512 + 64 dims: mma.sync
  kSimt,         // any GPU, latent <= 512 (a multiple of 4): one block per (row, split)
};
const char* MlaVerifyKernelName(MlaVerifyKernel kernel);

// Entries per block of MlaVerifyOptions::timestamps.
inline constexpr int kMlaVerifyTimestampsPerBlock = 7;

struct MlaVerifyOptions {
  // No split but a sequence's last covers fewer keys; 0: the planner's (64, one key tile, or 128
  // where a tensor-core launch has several row tiles).
  int32_t min_split_keys = 0;
  int32_t forced_nsplit = 0;  // > 0: use this NSPLIT (benchmarks sweep it)
  // kAuto: narrow row tiles up to 32 packed rows per sequence, wide ones above; kSimt where wgmma
  // cannot run. Anything else forces that kernel (benchmarks, tests); kSimt always runs.
  MlaVerifyKernel kernel = MlaVerifyKernel::kAuto;
  // Launch the split kernel with programmatic dependent launch, so that it starts streaming the
  // committed prefix while the previous kernel in the stream finishes. Contract: the page table,
  // lengths, row offsets, masks and the cache's committed prefix are complete before the previous
  // kernel starts (host copies before the graph, or kernels further back); the queries and the
  // tree nodes' own keys may come from the previous kernel. (The merge kernel always overlaps the
  // split kernel's tail; that is internal to the op.)
  bool overlap_predecessor = false;
  // Who merges the splits: kAuto as MlaVerifyPlan::merge_in_grid says; the others force it
  // (benchmarks, tests). kInGrid needs the wide kernel in one wave (else FAILED_PRECONDITION).
  enum class Merge { kAuto, kSeparateKernel, kInGrid };
  Merge merge = Merge::kAuto;
  // Profiling aid for the wgmma kernels (null in production): a device buffer of
  // kMlaVerifyTimestampsPerBlock * plan.blocks uint64 that each block fills with %globaltimer at
  // its start, when its first key tile has landed, after its last tile, at its end (ns), its
  // multiprocessor id, and under the in-grid merge when it arrives with its partial result and when
  // the group releases it.
  uint64_t* timestamps = nullptr;
};

// The planner's choice, reported to metrics.
struct MlaVerifyPlan {
  MlaVerifyShape shape;    // planned for: a launch must have the same (row_capacity may differ)
  int device_ordinal = 0;  // planned on, and launched on: the current device then
  MlaVerifyKernel kernel = MlaVerifyKernel::kSimt;
  int32_t row_tile = 1;  // packed (node, head) rows per block
  int32_t row_tiles = 1;
  // The grid's splits per sequence: NSPLIT, or with padding sequences the most that any live
  // count takes (live_nsplit).
  int32_t nsplit = 1;
  // With padding sequences (shape.min_live_seqs below num_seqs): NSPLIT for min_live_seqs + i
  // live sequences, each what an exact launch of that many would plan. Empty otherwise.
  std::vector<int32_t> live_nsplit;
  int32_t blocks = 0;         // of the split kernel
  int32_t blocks_per_sm = 0;  // occupancy API
  double waves = 0;           // blocks / (multiprocessors * blocks_per_sm)
  int32_t min_split_keys = 0;
  int64_t smem_bytes = 0;
  int64_t workspace_bytes = 0;  // partial outputs and log-sum-exps; 0 when nsplit == 1
  bool overlap_predecessor = false;
  // The split blocks merge their results themselves (no second kernel): set for wide-kernel
  // launches of 2..40 splits whose blocks are all resident at once (waves <= 1), where the
  // blocks of a (sequence, row tile) wait for each other at a counter in the workspace
  // (bench/NOTES.md, step 56). Needs the workspace prepared (PrepareMlaVerifyWorkspace) and no
  // other work that holds multiprocessors until this launch ends (true of kernels in one
  // stream).
  bool merge_in_grid = false;
  // Memory-bound shapes (packed rows per sequence under the roofline's ridge): a block requests
  // its second key tile only once its first has landed, so that the first computes while the
  // second lands (bench/NOTES.md, step 38).
  bool stagger_first_tiles = false;
  uint64_t* timestamps = nullptr;  // MlaVerifyOptions::timestamps
  std::string ToString() const;
};

// The planner's NSPLIT for `base_blocks` blocks per split (row tiles x sequences) on `capacity`
// resident block slots (multiprocessors x blocks per multiprocessor): the count that finishes
// the blocks' waves soonest, each block paying a small fixed cost (at most 256). Host code, no
// GPU needed.
int32_t ChooseSplitCount(int64_t base_blocks, int64_t capacity);

// Plans on `device`, which must be the current device (FAILED_PRECONDITION otherwise): the kernel
// images, attributes and occupancy it reads are the current device's.
absl::StatusOr<MlaVerifyPlan> PlanMlaVerify(const MlaVerifyShape& shape, const DeviceInfo& device,
                                            const MlaVerifyOptions& options);

// Zeroes the in-grid merge's counters at the front of a workspace of `bytes` (256-byte aligned),
// on `stream`: once after allocating it, or after anything but MlaVerifyAttention wrote it.
// Every launch leaves them zeroed, so plans of any shape can share the workspace afterwards.
absl::Status PrepareMlaVerifyWorkspace(void* workspace, int64_t bytes, cudaStream_t stream);

// Runs the plan on `stream`, on the device it was planned on. `workspace` holds workspace_bytes
// (at least plan.workspace_bytes, 256-byte aligned) and was prepared by
// PrepareMlaVerifyWorkspace. INVALID_ARGUMENT, before any device work: an invalid shape, one the
// plan was not made for, params that do not match it, unset or misaligned buffers (q, kv_cache and
// out 16-byte aligned), too small a workspace. The device-side inputs (lengths, page table, masks)
// are trusted as the CPU backend validates them, except that every kernel reads a page index
// outside the cache as a page of zeros rather than fault.
// `live_seqs` (device, one int32; for a shape with padding sequences, min_live_seqs below
// num_seqs, and ignored otherwise): how many of the launch's sequences carry rows, read when the
// kernels run, so that one captured launch serves every count from min_live_seqs to num_seqs.
absl::Status MlaVerifyAttention(const MlaVerifyParamsBf16& params, const MlaVerifyShape& shape,
                                const MlaVerifyPlan& plan, void* workspace, int64_t workspace_bytes,
                                cudaStream_t stream, const int32_t* live_seqs = nullptr);

}  // namespace treeverify::kernels::cuda
