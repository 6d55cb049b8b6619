#include <algorithm>
#include <array>
#include <bit>
#include <numeric>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "mla_verify_combine_kernel.cuh"
#include "mla_verify_common.cuh"
#include "mla_verify_mma_kernel.cuh"
#include "mla_verify_rows64_kernel.cuh"
#include "mla_verify_simt_kernel.cuh"
#include "mla_verify_wgmma_kernel.cuh"
#include "programmatic_launch.h"
#include "tensor_map.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/mla_verify_attention.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kRowTiles[] = {8, 16, 24, 32};  // the wgmma kernel's instantiations (N of wgmma)
// kAuto takes the narrow kernel for sequences of at most one narrow row tile. Each row tile
// re-reads the keys: at H=8, Q=9 (72 rows) three narrow tiles of 24 and two wide tiles of 64 ran
// within 2 % of each other at batch 1 from L=16k (narrow 13 % faster at 4k), but the narrow ones
// lost 5-15 % at batch 8 and 32 (bench/NOTES.md, step 17).
constexpr int64_t kMaxAutoNarrowRows = 32;
// Packed rows per sequence under which a launch is memory-bound: the ridge of the H200's roofline
// (about 205 FLOP per byte of KV, 1.9 FLOP per byte per row) is near 110 rows.
constexpr int64_t kMemoryBoundRows = 110;

// Which of this module's kernel bodies the image loaded for the current GPU holds. The kernels
// compile their bodies under the same tests as this probe (sm_90a features for wgmma, sm_80 for
// mma.sync) and trap or do nothing otherwise, and cudaFuncAttributes cannot tell those images
// apart: binaryVersion is 90 for sm_90 and sm_90a code alike, and for PTX of an older target
// compiled on load. The probe's static shared memory, which cudaFuncGetAttributes reports
// without a launch (so also while a graph is captured), says which test its code passed.
enum class KernelImage { kNone = 0, kPortable = 1, kMmaSync = 2, kSm90a = 3 };

__global__ void KernelImageProbe(int never) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kUnits = static_cast<int>(KernelImage::kSm90a);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kUnits = static_cast<int>(KernelImage::kMmaSync);
#else
  constexpr int kUnits = static_cast<int>(KernelImage::kPortable);
#endif
  __shared__ uint4 marker[kUnits];  // 16 bytes per unit
  if (never != 0) {                 // never true: keeps the array, which the attributes report
    volatile uint32_t* words = reinterpret_cast<volatile uint32_t*>(marker);
    words[never % (4 * kUnits)] = words[(never + 1) % (4 * kUnits)];
  }
}

KernelImage LoadedKernelImage() {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&KernelImageProbe)) !=
      cudaSuccess) {
    cudaGetLastError();  // no image for this GPU in this binary
    return KernelImage::kNone;
  }
  return static_cast<KernelImage>(attributes.sharedSizeBytes / sizeof(uint4));
}

// The wgmma kernels share one signature; the narrow one is instantiated per row tile.
using WgmmaKernelFn = void (*)(mla::WgmmaArgs, CUtensorMap, CUtensorMap);

struct WgmmaVariant {
  WgmmaKernelFn kernel;
  int64_t smem_bytes;
};

template <int kRows>
WgmmaVariant Narrow() {
  return {&mla::MlaVerifyWgmmaKernel<kRows>, mla::WgmmaSmem<kRows>::kBytes};
}

WgmmaVariant WgmmaVariantFor(MlaVerifyKernel kernel, int rows, bool merge_in_grid = false) {
  if (kernel == MlaVerifyKernel::kWgmmaWide) {
    return {merge_in_grid ? &mla::MlaVerifyRows64Kernel<true> : &mla::MlaVerifyRows64Kernel<false>,
            mla::Rows64Smem::kBytes};
  }
  switch (rows) {
    case 8:
      return Narrow<8>();
    case 16:
      return Narrow<16>();
    case 24:
      return Narrow<24>();
    default:
      return Narrow<32>();
  }
}

// The row tile that pads the packed rows least, then the larger one (fewer re-reads of the KV).
int ChooseRowTile(int64_t packed_rows) {
  int best = kRowTiles[0];
  int64_t best_padded = INT64_MAX;
  for (int tile : kRowTiles) {
    const int64_t padded = (packed_rows + tile - 1) / tile * tile;
    if (padded <= best_padded) {
      best = tile;
      best_padded = padded;
    }
  }
  return best;
}

// Sequences are a grid dimension (y or z: at most 65535); heads and rope dims are bounded far
// above any model's so that sizes stay in 32 bits (DeepSeek-V3: 128 heads, 64 rope dims).
constexpr int32_t kMaxSeqs = 65535;
constexpr int32_t kMaxHeads = 4096;
constexpr int32_t kMaxRopeDim = 512;

absl::Status ValidateShape(const MlaVerifyShape& s) {
  if (s.num_seqs <= 0 || s.num_seqs > kMaxSeqs || s.max_rows_per_seq <= 0 ||
      s.max_rows_per_seq > kMaxSegmentRows || s.row_capacity < s.max_rows_per_seq ||
      s.num_heads <= 0 || s.num_heads > kMaxHeads || s.latent_dim <= 0 || s.latent_dim % 4 != 0 ||
      s.latent_dim > mla::kSimtMaxLatentPerLane * 32 || s.rope_dim < 0 ||
      s.rope_dim > kMaxRopeDim || s.page_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA verify shape: num_seqs ", s.num_seqs, " (1..", kMaxSeqs, "), max_rows_per_seq ",
        s.max_rows_per_seq, " (1..", kMaxSegmentRows, "), row_capacity ", s.row_capacity,
        ", num_heads ", s.num_heads, " (1..", kMaxHeads, "), latent_dim ", s.latent_dim,
        " (a multiple of 4 up to ", mla::kSimtMaxLatentPerLane * 32, "), rope_dim ", s.rope_dim,
        " (0..", kMaxRopeDim, "), page_size ", s.page_size));
  }
  if (s.min_live_seqs < 0 || s.min_live_seqs > s.num_seqs ||
      (s.min_live_seqs > 0 && s.num_seqs - s.min_live_seqs >= kMaxLiveCounts)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA verify shape: min_live_seqs ", s.min_live_seqs, " of num_seqs ", s.num_seqs,
        " (0: all live; else at most ", kMaxLiveCounts, " live counts up to num_seqs)"));
  }
  return absl::OkStatus();
}

// Whether a launch of `s` may have padding sequences (and reads its live count on the device).
bool HasPaddingSequences(const MlaVerifyShape& s) {
  return s.min_live_seqs > 0 && s.min_live_seqs < s.num_seqs;
}

// What a plan fixed that a launch must keep: everything but row_capacity (the q / out buffers may
// grow; the tensor maps are made per launch).
bool SamePlannedShape(const MlaVerifyShape& a, const MlaVerifyShape& b) {
  return a.num_seqs == b.num_seqs && a.min_live_seqs == b.min_live_seqs &&
         a.max_rows_per_seq == b.max_rows_per_seq && a.num_heads == b.num_heads &&
         a.latent_dim == b.latent_dim && a.rope_dim == b.rope_dim && a.page_size == b.page_size;
}

bool Aligned(const void* pointer, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

// The wgmma kernels run on sm_90 built with sm_90a code, at the production dims, with pages whose
// size is a multiple of 8 keys (TMA boxes of gcd(64, page_size) keys stay inside one page).
bool WgmmaApplies(const MlaVerifyShape& s, const DeviceInfo& device) {
  if (device.compute_capability_major != 9 || device.compute_capability_minor != 0 ||
      s.latent_dim != mla::kWgmmaLatent || s.rope_dim != mla::kWgmmaRope || s.page_size % 8 != 0) {
    return false;
  }
  return LoadedKernelImage() == KernelImage::kSm90a;
}

// The mma.sync kernel runs on sm_80 and later where the binary has code for the GPU, at the
// production dims (any page size: it looks up every key row).
bool MmaApplies(const MlaVerifyShape& s, const DeviceInfo& device) {
  if (device.compute_capability_major < 8 || s.latent_dim != mla::kMlaLatent ||
      s.rope_dim != mla::kMlaRope) {
    return false;
  }
  const KernelImage image = LoadedKernelImage();
  return image == KernelImage::kMmaSync || image == KernelImage::kSm90a;
}

// The merge kernel's block for `nsplit` splits. Up to 8 splits: a group of 16 threads per split
// (2, 4 or 8 groups, at least a warp). More: 16 groups that load the splits g, g + 16, ... each.
// For bf16 partials (the wide kernel) a group loads ceil(nsplit / 16) splits: its merges have
// hundreds of blocks, and with the groups' slots in powers of two they were bound by issuing
// instructions for slots past NSPLIT (ncu: 7.5 us for 66 splits at H=8 Q=9, 10 us for 132 at
// H=64 Q=1; exact counts took H=64 Q=1 L=16k from 22.3 to 19.3 us a launch). For fp32 partials
// (the narrow kernel, at most 32 rows: a few dozen merge blocks at batch 1) the slots stay powers
// of two: at 16 x 16 a block needs 136 registers and the blocks spread one per multiprocessor;
// at 16 x 9 they took 72, shared multiprocessors with each other and with running split blocks,
// and H=8 Q=1 L=16k went from 13.7 to 14.8 us (bench/NOTES.md, step 43).
using CombineKernelFn = void (*)(MlaVerifyParamsBf16, mla::PartialLayout, int32_t);
struct CombineVariant {
  CombineKernelFn kernel;
  int threads;
};

template <int kGroups, int kPerGroup, typename Partial>
constexpr CombineVariant Combine() {
  return {&mla::MlaVerifyCombineKernel<kGroups, kPerGroup, Partial>,
          kGroups * mla::kCombineThreadsPerGroup};
}

constexpr int kCombineGroups = 16;  // for more than 8 splits
static_assert(kCombineGroups * kCombineGroups == mla::kMaxSplits);

template <typename Partial, int... kLess>  // kLess = splits per group - 1
constexpr std::array<CombineVariant, sizeof...(kLess)> SixteenGroups(
    std::integer_sequence<int, kLess...>) {
  return {Combine<kCombineGroups, kLess + 1, Partial>()...};
}

template <typename Partial>
CombineVariant CombineVariantFor(int32_t nsplit) {
  static constexpr CombineVariant kFewSplits[] = {
      Combine<2, 1, Partial>(), Combine<4, 1, Partial>(), Combine<8, 1, Partial>()};
  nsplit = std::clamp(nsplit, 2, mla::kMaxSplits);
  if (nsplit <= 8) return kFewSplits[std::bit_width(static_cast<unsigned>(nsplit - 1)) - 1];
  const int per_group = mla::CeilDiv(nsplit, kCombineGroups);
  if constexpr (std::is_same_v<Partial, float>) {
    static constexpr CombineVariant kPowersOfTwo[] = {
        Combine<kCombineGroups, 1, Partial>(), Combine<kCombineGroups, 2, Partial>(),
        Combine<kCombineGroups, 4, Partial>(), Combine<kCombineGroups, 8, Partial>(),
        Combine<kCombineGroups, 16, Partial>()};
    return kPowersOfTwo[std::bit_width(static_cast<unsigned>(per_group - 1))];
  } else {
    static constexpr auto kExact =
        SixteenGroups<Partial>(std::make_integer_sequence<int, kCombineGroups>{});
    return kExact[per_group - 1];
  }
}

// Whether `kernel` leaves its partial outputs in bf16 (else fp32): the wide kernel does, its
// 64-row partials being the heaviest (bench/NOTES.md, step 35); for the narrow kernel bf16 was
// slower at every NSPLIT (step 39). The kernels write, and the merge kernel reads, accordingly.
bool Bf16Partials(MlaVerifyKernel kernel) { return kernel == MlaVerifyKernel::kWgmmaWide; }

int32_t ChooseSplits(int64_t base_blocks, int64_t capacity, const MlaVerifyOptions& options) {
  if (options.forced_nsplit > 0) return std::min(options.forced_nsplit, mla::kMaxSplits);
  return ChooseSplitCount(base_blocks, capacity);
}

// Whether the split blocks merge their results themselves (MlaVerifyPlan::merge_in_grid): only
// where they are all resident at once, and with a counter pair per (sequence, row tile) in the
// workspace's fixed counter area. By measurement (bench/NOTES.md, step 56) the planner takes it
// for the wide kernel up to kMaxSplitsMergedInGrid splits: 2-17 % faster at NSPLIT 2..33 (H=8
// Q=64, H=64 Q=9, batch 8), 1-2.5 us slower at 44..132, where both merges are bound by reading
// the partial results back and the merge kernel has more loads in flight; for the narrow kernel
// 0.7-1.8 us slower at every NSPLIT tried.
constexpr int32_t kMaxSplitsMergedInGrid = 40;

absl::StatusOr<bool> ChooseMergeInGrid(const MlaVerifyPlan& plan, const MlaVerifyShape& shape,
                                       int64_t capacity, MlaVerifyOptions::Merge merge) {
  if (plan.nsplit == 1 || merge == MlaVerifyOptions::Merge::kSeparateKernel) return false;
  // With padding sequences, the blocks that find no keys leave without waiting: what must be
  // resident at once are the live ones, at every live count.
  int64_t live_blocks = plan.blocks;
  if (!plan.live_nsplit.empty()) {
    live_blocks = 0;
    for (size_t i = 0; i < plan.live_nsplit.size(); ++i) {
      live_blocks = std::max(live_blocks, (shape.min_live_seqs + static_cast<int64_t>(i)) *
                                              plan.row_tiles * plan.live_nsplit[i]);
    }
  }
  const bool possible =
      plan.kernel == MlaVerifyKernel::kWgmmaWide && live_blocks <= capacity &&
      static_cast<int64_t>(shape.num_seqs) * plan.row_tiles <= mla::kMaxMergeGroups;
  if (merge == MlaVerifyOptions::Merge::kInGrid) {
    if (!possible) {
      return absl::FailedPreconditionError(
          absl::StrCat("MLA verify: the in-grid merge needs the wide kernel with its ", plan.blocks,
                       " blocks resident at once (", capacity, " slots) in at most ",
                       mla::kMaxMergeGroups, " (sequence, row tile) groups"));
    }
    return true;
  }
  return possible && plan.nsplit <= kMaxSplitsMergedInGrid;
}

// Launches `kernel` on `stream`, as a programmatic dependent launch when `overlap` is set (the
// kernel then waits for its predecessor itself, see grid_dependency.cuh).
template <typename... Params, typename... Args>
absl::Status Launch(void (*kernel)(Params...), dim3 grid, int threads, int64_t smem,
                    cudaStream_t stream, bool overlap, const char* what, Args&&... args) {
  return LaunchKernel(kernel, grid, dim3(static_cast<unsigned>(threads)), smem, stream, overlap,
                      what, std::forward<Args>(args)...);
}

}  // namespace

const char* MlaVerifyKernelName(MlaVerifyKernel kernel) {
  switch (kernel) {
    case MlaVerifyKernel::kAuto:
      return "auto";
    case MlaVerifyKernel::kWgmmaNarrow:
      return "wgmma-narrow";
    case MlaVerifyKernel::kWgmmaWide:
      return "wgmma-wide";
    case MlaVerifyKernel::kMma:
      return "mma";
    case MlaVerifyKernel::kSimt:
      return "simt";
  }
  return "unknown";
}

std::string MlaVerifyPlan::ToString() const {
  const std::string live = live_nsplit.empty()
                               ? ""
                               : absl::StrCat(" live=", shape.min_live_seqs, "..", shape.num_seqs,
                                              " live_nsplit=", absl::StrJoin(live_nsplit, ","));
  return absl::StrCat(
      absl::StrFormat(
          "kernel=%s row_tile=%d row_tiles=%d nsplit=%d blocks=%d blocks_per_sm=%d waves=%.2f "
          "min_split_keys=%d smem=%d workspace=%d overlap=%d stagger=%d merge=%s",
          MlaVerifyKernelName(kernel), row_tile, row_tiles, nsplit, blocks, blocks_per_sm, waves,
          min_split_keys, smem_bytes, workspace_bytes, overlap_predecessor ? 1 : 0,
          stagger_first_tiles ? 1 : 0, nsplit == 1 ? "none" : (merge_in_grid ? "grid" : "kernel")),
      live);
}

int32_t ChooseSplitCount(int64_t base_blocks, int64_t capacity) {
  // The cost model, in units of one block's pass over a whole sequence: with n splits a block
  // costs 1/n of a pass plus a fixed part: start, first tile and epilogue (1 %: about 5 us
  // against the 500 us a 64-row block takes over 16k keys), and with n > 1 also writing its
  // partial and its share of the merge (2 %). Blocks run in waves of `capacity`, so n splits
  // cost ceil(base_blocks * n / capacity) waves of one block each; the fewest splits of the
  // lowest cost win. Few base blocks get one full wave (n = capacity / base_blocks, as at batch
  // 1); between that and many waves, a few nearly full waves instead of one wave with idle
  // multiprocessors or a second wave that is mostly empty (bench/NOTES.md, step 32).
  constexpr double kBlockFixedCost = 0.01;
  constexpr double kPartialCost = 0.02;
  base_blocks = std::max<int64_t>(base_blocks, 1);
  capacity = std::max<int64_t>(capacity, 1);
  int32_t best = 1;
  double best_cost = 0;
  for (int32_t n = 1; n <= mla::kMaxSplits; ++n) {
    const int64_t waves = (base_blocks * n + capacity - 1) / capacity;
    const double block_cost = 1.0 / n + kBlockFixedCost + (n > 1 ? kPartialCost : 0.0);
    const double cost = static_cast<double>(waves) * block_cost;
    if (n == 1 || cost < best_cost * (1 - 1e-9)) {
      best = n;
      best_cost = cost;
    }
  }
  return best;
}

absl::StatusOr<MlaVerifyPlan> PlanMlaVerify(const MlaVerifyShape& shape, const DeviceInfo& device,
                                            const MlaVerifyOptions& options) {
  TV_RETURN_IF_ERROR(ValidateShape(shape));
  if (device.multiprocessors <= 0) {
    return absl::InvalidArgumentError("MLA verify plan: device without multiprocessors");
  }
  if (options.min_split_keys < 0) {
    return absl::InvalidArgumentError(absl::StrCat("MLA verify plan: min_split_keys ",
                                                   options.min_split_keys, " (0: the planner's)"));
  }
  int current = -1;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  if (current != device.ordinal) {
    // The kernel attributes and occupancy below are the current device's.
    return absl::FailedPreconditionError(absl::StrCat("MLA verify plan for device ", device.ordinal,
                                                      " made while device ", current,
                                                      " is current"));
  }
  MlaVerifyPlan plan;
  plan.shape = shape;
  plan.device_ordinal = device.ordinal;
  plan.overlap_predecessor = options.overlap_predecessor;
  plan.timestamps = options.timestamps;
  const int64_t packed_rows = static_cast<int64_t>(shape.max_rows_per_seq) * shape.num_heads;
  plan.stagger_first_tiles = packed_rows < kMemoryBoundRows;
  const void* kernel = nullptr;
  int threads = 0;
  MlaVerifyKernel choice = options.kernel;
  const bool wgmma = WgmmaApplies(shape, device);
  if (choice == MlaVerifyKernel::kMma && !MmaApplies(shape, device)) {
    return absl::FailedPreconditionError(
        "MLA verify: the mma kernel needs an sm_80 or later GPU with code for it and 512 + 64 "
        "dims");
  }
  if ((choice == MlaVerifyKernel::kWgmmaNarrow || choice == MlaVerifyKernel::kWgmmaWide) &&
      !wgmma) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MLA verify: the ", MlaVerifyKernelName(choice), " kernel needs sm_90a code on an sm_90 ",
        "GPU, 512 + 64 dims and pages of a multiple of 8 keys"));
  }
  if (choice == MlaVerifyKernel::kAuto) {
    if (wgmma) {
      choice = packed_rows <= kMaxAutoNarrowRows ? MlaVerifyKernel::kWgmmaNarrow
                                                 : MlaVerifyKernel::kWgmmaWide;
    } else {
      choice = MmaApplies(shape, device) ? MlaVerifyKernel::kMma : MlaVerifyKernel::kSimt;
    }
  }
  plan.kernel = choice;
  if (choice == MlaVerifyKernel::kWgmmaNarrow || choice == MlaVerifyKernel::kWgmmaWide) {
    plan.row_tile =
        choice == MlaVerifyKernel::kWgmmaWide ? mla::kRows64 : ChooseRowTile(packed_rows);
    const WgmmaVariant variant = WgmmaVariantFor(choice, plan.row_tile);
    plan.smem_bytes = variant.smem_bytes;
    kernel = reinterpret_cast<const void*>(variant.kernel);
    threads = mla::kWgmmaThreads;
  } else if (choice == MlaVerifyKernel::kMma) {
    plan.row_tile = mla::kMmaRows;
    plan.smem_bytes = mla::MmaSmem::kBytes;
    kernel = reinterpret_cast<const void*>(&mla::MlaVerifyMmaKernel);
    threads = mla::kMmaThreads;
  } else {
    plan.kernel = MlaVerifyKernel::kSimt;
    plan.row_tile = 1;
    plan.smem_bytes = mla::SimtSmemBytes(shape.latent_dim, shape.rope_dim);
    kernel = reinterpret_cast<const void*>(&mla::MlaVerifySimtKernel);
    threads = mla::kSimtThreads;
  }
  TV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(plan.smem_bytes)));
  if (plan.kernel == MlaVerifyKernel::kWgmmaWide) {  // its in-grid merge variant too
    TV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        WgmmaVariantFor(plan.kernel, plan.row_tile, /*merge_in_grid=*/true).kernel,
        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem_bytes)));
  }
  TV_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &plan.blocks_per_sm, kernel, threads, static_cast<size_t>(plan.smem_bytes)));
  if (plan.blocks_per_sm <= 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("MLA verify: ", MlaVerifyKernelName(plan.kernel), " kernel with ",
                     plan.smem_bytes, " bytes of shared memory does not fit a multiprocessor"));
  }
  plan.row_tiles = static_cast<int32_t>((packed_rows + plan.row_tile - 1) / plan.row_tile);
  // One key tile, or two where a tensor-core launch has several row tiles: each key tile is then
  // read by a block of every row tile, and each block loads its row tile's queries and writes a
  // partial, so splits of one tile load and write more than they stream (wgmma: 2-7 % slower than
  // splits of two at L = 4k, bench/NOTES.md step 68).
  const bool shared_key_tiles = plan.kernel != MlaVerifyKernel::kSimt && plan.row_tiles > 1;
  plan.min_split_keys = options.min_split_keys > 0 ? options.min_split_keys
                                                   : (shared_key_tiles ? 2 : 1) * kMlaKeyTile;
  const int64_t capacity = static_cast<int64_t>(device.multiprocessors) * plan.blocks_per_sm;
  if (HasPaddingSequences(shape)) {
    // Each live count's NSPLIT as its exact launch would plan it; the grid takes the most.
    plan.nsplit = 1;
    for (int32_t live = shape.min_live_seqs; live <= shape.num_seqs; ++live) {
      plan.live_nsplit.push_back(
          ChooseSplits(static_cast<int64_t>(plan.row_tiles) * live, capacity, options));
      plan.nsplit = std::max(plan.nsplit, plan.live_nsplit.back());
    }
  } else {
    plan.nsplit =
        ChooseSplits(static_cast<int64_t>(plan.row_tiles) * shape.num_seqs, capacity, options);
  }
  const int64_t base_blocks = static_cast<int64_t>(plan.row_tiles) * shape.num_seqs;
  const int64_t blocks = base_blocks * plan.nsplit;
  if (blocks > INT32_MAX || plan.row_tiles * static_cast<int64_t>(plan.nsplit) > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("MLA verify: ", blocks, " blocks"));
  }
  plan.blocks = static_cast<int32_t>(blocks);
  plan.waves = static_cast<double>(blocks) / static_cast<double>(capacity);
  TV_ASSIGN_OR_RETURN(plan.merge_in_grid, ChooseMergeInGrid(plan, shape, capacity, options.merge));
  plan.workspace_bytes = plan.nsplit > 1
                             ? mla::PartialLayout::Bytes(
                                   shape.num_seqs, plan.nsplit, static_cast<int32_t>(packed_rows),
                                   shape.latent_dim, Bf16Partials(plan.kernel) ? 2 : 4)
                             : 0;
  return plan;
}

absl::Status PrepareMlaVerifyWorkspace(void* workspace, int64_t bytes, cudaStream_t stream) {
  if (workspace == nullptr || bytes <= 0) return absl::OkStatus();  // plans of NSPLIT 1 only
  return CudaStatus(
      cudaMemsetAsync(workspace, 0, static_cast<size_t>(std::min(bytes, mla::kMergeCounterBytes)),
                      stream),
      "MLA verify workspace preparation");
}

absl::Status MlaVerifyAttention(const MlaVerifyParamsBf16& p, const MlaVerifyShape& shape,
                                const MlaVerifyPlan& plan, void* workspace, int64_t workspace_bytes,
                                cudaStream_t stream, const int32_t* live_seqs) {
  TV_RETURN_IF_ERROR(ValidateShape(shape));
  if (plan.blocks <= 0 || !SamePlannedShape(plan.shape, shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA verify: a plan for (num_seqs ", plan.shape.num_seqs, ", max_rows_per_seq ",
        plan.shape.max_rows_per_seq, ", heads ", plan.shape.num_heads, ", dims ",
        plan.shape.latent_dim, "+", plan.shape.rope_dim, ", page_size ", plan.shape.page_size,
        ") launched with (", shape.num_seqs, ", ", shape.max_rows_per_seq, ", ", shape.num_heads,
        ", ", shape.latent_dim, "+", shape.rope_dim, ", ", shape.page_size,
        "): plan each shape (PlanMlaVerify)"));
  }
  if (p.num_seqs != shape.num_seqs || p.num_heads != shape.num_heads ||
      p.latent_dim != shape.latent_dim || p.rope_dim != shape.rope_dim ||
      p.page_size != shape.page_size || p.num_pages <= 0 || p.max_pages_per_seq <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA verify: params (num_seqs ", p.num_seqs, ", heads ", p.num_heads, ", dims ",
        p.latent_dim, "+", p.rope_dim, ", page_size ", p.page_size, ", num_pages ", p.num_pages,
        ", max_pages_per_seq ", p.max_pages_per_seq, ") do not match the planned shape"));
  }
  if (p.q == nullptr || p.kv_cache == nullptr || p.page_table == nullptr ||
      p.committed_lengths == nullptr || p.row_offsets == nullptr || p.ancestor_mask == nullptr ||
      p.out == nullptr || p.lse == nullptr) {
    return absl::InvalidArgumentError("MLA verify: every params pointer must be set");
  }
  if (!Aligned(p.q, 16) || !Aligned(p.kv_cache, 16) || !Aligned(p.out, 16) || !Aligned(p.lse, 4)) {
    return absl::InvalidArgumentError(
        "MLA verify: q, kv_cache and out must be 16-byte aligned, lse 4-byte aligned");
  }
  if (plan.workspace_bytes > 0 && (workspace == nullptr || workspace_bytes < plan.workspace_bytes ||
                                   !Aligned(workspace, 256))) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLA verify: the plan needs ", plan.workspace_bytes,
                     " bytes of 256-byte aligned workspace; given ", workspace_bytes,
                     " bytes at 0x", absl::Hex(reinterpret_cast<uintptr_t>(workspace))));
  }
  if (HasPaddingSequences(shape) && live_seqs == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA verify: a shape with padding sequences (min_live_seqs ", shape.min_live_seqs, " of ",
        shape.num_seqs, ") needs the device's live count (live_seqs)"));
  }
  int current = -1;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  if (current != plan.device_ordinal) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MLA verify: a plan for device ", plan.device_ordinal, " launched on device ", current));
  }
  const int32_t packed_rows = shape.max_rows_per_seq * shape.num_heads;
  mla::PartialLayout partial =
      plan.nsplit > 1
          ? mla::PartialLayout::At(workspace, shape.num_seqs, plan.nsplit, packed_rows,
                                   shape.latent_dim)
          : mla::PartialLayout{nullptr, nullptr, 1, packed_rows, shape.latent_dim, nullptr, {}};
  if (HasPaddingSequences(shape) && plan.nsplit > 1) {
    partial.live.live_seqs = live_seqs;
    partial.live.min_live = shape.min_live_seqs;
    partial.live.max_live = shape.num_seqs;
    for (size_t i = 0; i < plan.live_nsplit.size(); ++i) {
      partial.live.nsplit[i] = static_cast<int16_t>(plan.live_nsplit[i]);
    }
  }
  const bool direct = plan.nsplit == 1;
  const dim3 grid(static_cast<unsigned>(plan.row_tiles * plan.nsplit),
                  static_cast<unsigned>(shape.num_seqs));

  if (plan.kernel == MlaVerifyKernel::kWgmmaNarrow || plan.kernel == MlaVerifyKernel::kWgmmaWide) {
    const int dims = shape.latent_dim + shape.rope_dim;
    const int32_t box_rows = std::gcd(kMlaKeyTile, shape.page_size);
    TV_ASSIGN_OR_RETURN(
        CUtensorMap kv_map,
        MakeBf16TensorMap2d(p.kv_cache, static_cast<int64_t>(p.num_pages) * p.page_size, dims, dims,
                            box_rows));
    TV_ASSIGN_OR_RETURN(
        CUtensorMap q_map,
        MakeBf16TensorMap2d(p.q, static_cast<int64_t>(shape.row_capacity) * shape.num_heads, dims,
                            dims, plan.row_tile));
    const mla::WgmmaArgs args{p,
                              partial,
                              plan.min_split_keys,
                              plan.row_tiles,
                              box_rows,
                              direct,
                              plan.merge_in_grid,
                              plan.stagger_first_tiles,
                              plan.timestamps};
    TV_RETURN_IF_ERROR(
        Launch(WgmmaVariantFor(plan.kernel, plan.row_tile, plan.merge_in_grid).kernel, grid,
               mla::kWgmmaThreads, plan.smem_bytes, stream, plan.overlap_predecessor,
               "MLA verify split kernel launch", args, kv_map, q_map));
  } else if (plan.kernel == MlaVerifyKernel::kMma) {
    TV_RETURN_IF_ERROR(Launch(mla::MlaVerifyMmaKernel, grid, mla::kMmaThreads, plan.smem_bytes,
                              stream, plan.overlap_predecessor, "MLA verify mma kernel launch", p,
                              partial, plan.min_split_keys, plan.row_tiles, direct));
  } else {
    const dim3 simt_grid(static_cast<unsigned>(packed_rows), static_cast<unsigned>(plan.nsplit),
                         static_cast<unsigned>(shape.num_seqs));
    TV_RETURN_IF_ERROR(Launch(mla::MlaVerifySimtKernel, simt_grid, mla::kSimtThreads,
                              plan.smem_bytes, stream, plan.overlap_predecessor,
                              "MLA verify portable kernel launch", p, partial, plan.min_split_keys,
                              direct));
  }
  if (!direct && !plan.merge_in_grid) {
    // Always a programmatic dependent launch: the merge kernel's blocks are queued while the
    // split kernel runs and wait for it on the device.
    const dim3 combine_grid(
        static_cast<unsigned>(packed_rows),
        static_cast<unsigned>(mla::CeilDiv(shape.latent_dim, mla::kCombineDims)),
        static_cast<unsigned>(shape.num_seqs));
    const CombineVariant combine = Bf16Partials(plan.kernel)
                                       ? CombineVariantFor<__nv_bfloat16>(plan.nsplit)
                                       : CombineVariantFor<float>(plan.nsplit);
    TV_RETURN_IF_ERROR(Launch(combine.kernel, combine_grid, combine.threads, 0, stream,
                              /*overlap=*/true, "MLA verify combine kernel launch", p, partial,
                              plan.min_split_keys));
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cuda
