// MoE experts on the GPU: grouping, gate/up, down, combine (cuda/moe.h has the plan).
//
// Roofline per layer at verify sizes: the active experts' weights, 3 * hidden * intermediate * 2
// bytes each (11 MB per Kimi-K2 expert slice under TP8 split inside, 88 MB per whole expert),
// read once per group of up to 32 tokens; activations are a rounding error beside them. The expert
// kernels: moe_expert_tma_kernel.cuh (TMA and tensor cores, sm_90 and later, packed experts),
// moe_expert_simt_kernel.cuh (CUDA cores: odd shapes, unpacked experts, devices before sm_90).
// At prefill sizes (kGemmMinTokens and more) the projections are compute: a grouped GEMM
// (moe_expert_gemm_kernel.cuh) reads each expert's weights once per 64 of its tokens. The
// grouping: moe_grouping.cuh.
#include <algorithm>

#include "element_convert.cuh"
#include "moe_expert_gemm_kernel.cuh"
#include "moe_expert_simt_kernel.cuh"
#include "moe_expert_tma_kernel.cuh"
#include "moe_grouping_kernels.cuh"
#include "moe_workspace.cuh"
#include "programmatic_launch.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/kernels/cuda/moe_tiles.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cuda {
namespace {

using moe::Carve;
using moe::DownKernel;
using moe::ExpertGemmKernel;
using moe::ExpertTmaKernel;
using moe::GateUpKernel;
using moe::GroupKernel;
using moe::kGroupThreads;
using moe::kThreads;
using moe::kWarps;
using moe::Workspace;

// From this many tokens the expert projections run as a grouped GEMM (a prefill chunk's batch);
// below, as weight streams (a verify step's). At 512 tokens of Kimi-K2's top-8 of 384 experts an
// expert has ~11 tokens: one group of the streaming kernel, one 64-pair tile here.
constexpr int64_t kGemmMinTokens = 512;

// out[t] = sum over the token's local experts, in its top-k order (ascending id), of weight *
// output (its down parts added in part order); then + shared. Block (token, 256 hidden dims). A
// thread's loads go out a chunk of kCombineChunk pairs at a time before any add (the loop with a
// branch per pair waited for one L2 round trip after another: bench/NOTES.md, step 128); the adds
// keep their order, so the bits are the loop's.
constexpr int kCombineChunk = 8;
__global__ void CombineKernel(MoeExpertsParamsOf<Bf16, Bf16> p, Workspace w, int32_t down_parts) {
  WaitForPredecessorGrid();
  AllowDependentGridLaunch();
  const int64_t token = blockIdx.y;
  const int64_t h = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (h >= p.hidden) return;
  const int32_t* ids = p.topk_ids + token * p.top_k;
  const float* weights = p.topk_weights + token * p.top_k;
  const int64_t part_stride = int64_t{p.tokens} * p.top_k * p.hidden;
  const float shared = p.shared_out != nullptr ? p.shared_out[token * p.hidden + h] : 0.0f;
  float sum = 0.0f;
  for (int32_t first = 0; first < p.top_k; first += kCombineChunk) {
    bool local[kCombineChunk];
    float weight[kCombineChunk], value[kCombineChunk];
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i) {
      const int32_t j = first + i;
      const int32_t expert = j < p.top_k ? ids[j] - p.first_expert : -1;
      local[i] = expert >= 0 && expert < p.num_local_experts;
      weight[i] = local[i] ? weights[j] : 0.0f;
      value[i] = local[i] ? w.expert_out[(token * p.top_k + j) * p.hidden + h] : 0.0f;
    }
    for (int32_t part = 1; part < down_parts; ++part) {
      float more[kCombineChunk];
#pragma unroll
      for (int i = 0; i < kCombineChunk; ++i) {
        more[i] =
            local[i]
                ? w.expert_out[part * part_stride + (token * p.top_k + first + i) * p.hidden + h]
                : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kCombineChunk; ++i) value[i] = __fadd_rn(value[i], more[i]);
    }
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i) {
      if (local[i]) sum = __fadd_rn(sum, __fmul_rn(value[i], weight[i]));
    }
  }
  if (p.shared_out != nullptr) sum = __fadd_rn(sum, shared);
  p.out[token * p.hidden + h] = sum;
}

// Slots per block of the weight-streaming kernel and blocks per multiprocessor: two blocks where
// each then has at least 3 slots (sm_90 and sm_100: bf16 5 slots of 20 KB, INT4 3 of 34 KB, FP8 4
// of 25 KB), else one (bf16 on sm_120's 100 KB of shared memory: 4 slots). Two blocks let one
// block's stores overlap the other's stream.
struct TmaPlan {
  int stages = 0;
  int blocks_per_multiprocessor = 0;
};
template <class Stage>
absl::StatusOr<TmaPlan> PlanTmaKernels(int device) {
  int per_multiprocessor = 0, per_block = 0, reserved = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &per_multiprocessor, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  const int slot_bytes = moe::TmaSmemBytes<Stage>(1) - moe::TmaSmemBytes<Stage>(0);
  auto stages_with = [&](int blocks) {
    const int budget = std::min(per_block, per_multiprocessor / blocks - reserved);
    return std::min(Stage::kMaxSlots, (budget - moe::TmaSmemBytes<Stage>(0)) / slot_bytes);
  };
  if (stages_with(2) >= 3) return TmaPlan{stages_with(2), 2};
  if (stages_with(1) >= 2) return TmaPlan{stages_with(1), 1};
  return absl::FailedPreconditionError(
      absl::StrCat("cuda::MoeExperts: ", per_block, " bytes of shared memory per block hold fewer",
                   " than two weight-streaming slots of ", slot_bytes));
}

// Gate/up (and FinishGateUp where its reduction is parted) then down, on packed experts in the
// stages of `UpStage` and `DownStage` (moe_expert_tma_kernel.cuh); the number of down's parts, for
// the combine to add.
template <class UpStage, class DownStage>
absl::StatusOr<int32_t> LaunchExpertTmaKernels(const MoeExpertsParamsOf<Bf16, Bf16>& p,
                                               const Workspace& w, int device, int multiprocessors,
                                               int64_t most_active, cudaStream_t stream) {
  using moe::ExpertWalk;
  const int32_t parts =
      moe::GateUpParts(p.tokens, p.top_k, p.intermediate, p.hidden, UpStage::kColumns);
  const int64_t up_rows = ExpertWalk::RowsPerTile(true), down_rows = ExpertWalk::RowsPerTile(false);
  const int64_t up_items = most_active * ((p.intermediate + up_rows - 1) / up_rows) * parts;
  const int32_t down_parts =
      moe::DownParts(p.tokens, p.top_k, p.intermediate, p.hidden, DownStage::kColumns);
  const int64_t down_items = most_active * ((p.hidden + down_rows - 1) / down_rows) * down_parts;
  // The walk counts items in 32 bits, with claims up to twice the items.
  if (std::max(up_items, down_items) > 0x3fffffff) {
    return absl::InvalidArgumentError(absl::StrCat("cuda::MoeExperts: ", p.num_local_experts,
                                                   " local experts of ", p.hidden, " x ",
                                                   p.intermediate, " make more than 2^30 items"));
  }
  static_assert(UpStage::kGateUp && !DownStage::kGateUp && UpStage::kBytes == DownStage::kBytes);
  TV_ASSIGN_OR_RETURN(const TmaPlan plan, PlanTmaKernels<UpStage>(device));
  const int smem = moe::TmaSmemBytes<UpStage>(plan.stages);
  for (auto* kernel : {ExpertTmaKernel<UpStage>, ExpertTmaKernel<DownStage>}) {
    TV_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  // Persistent blocks, as many as are resident at once, claiming items until none are left.
  int resident = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &resident, ExpertTmaKernel<UpStage>, moe::kTmaThreads, smem));
  const int64_t blocks =
      std::max(1, std::min(resident, plan.blocks_per_multiprocessor)) * int64_t{multiprocessors};
  // Each a programmatic dependent of the one before (programmatic_launch.h): launch and set-up
  // overlap.
  const bool overlap = WaitsForPredecessor(ExpertTmaKernel<UpStage>);
  TV_RETURN_IF_ERROR(LaunchKernel(ExpertTmaKernel<UpStage>,
                                  dim3(static_cast<unsigned>(std::min(blocks, up_items))),
                                  dim3(moe::kTmaThreads), smem, stream, overlap,
                                  "MoeExperts gate/up stream", p, w, parts, plan.stages));
  if (parts > 1) {
    const int64_t values = p.tokens * p.top_k * p.intermediate;
    TV_RETURN_IF_ERROR(LaunchKernel(moe::FinishGateUp,
                                    dim3(static_cast<unsigned>((values + 255) / 256)), dim3(256), 0,
                                    stream, overlap, "MoeExperts FinishGateUp", p, w, parts));
  }
  TV_RETURN_IF_ERROR(LaunchKernel(ExpertTmaKernel<DownStage>,
                                  dim3(static_cast<unsigned>(std::min(blocks, down_items))),
                                  dim3(moe::kTmaThreads), smem, stream, overlap,
                                  "MoeExperts down stream", p, w, down_parts, plan.stages));
  return down_parts;
}

// Gate/up then down as the grouped GEMM over the grouping's tiles of 64 pairs, the weights read
// as `kWeights` says.
template <moe::GemmWeights kWeights>
absl::Status LaunchExpertGemmKernels(const MoeExpertsParamsOf<Bf16, Bf16>& p, const Workspace& w,
                                     int64_t max_tiles, cudaStream_t stream) {
  constexpr int kSmem = moe::kGemmSmemBytes<kWeights>;
  TV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(ExpertGemmKernel<true, kWeights>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  TV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(ExpertGemmKernel<false, kWeights>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int64_t up_blocks = max_tiles * (p.intermediate / (moe::kGemmWeightRows / 2));
  const int64_t down_blocks = max_tiles * (p.hidden / moe::kGemmWeightRows);
  if (up_blocks > 0x7fffffff || down_blocks > 0x7fffffff) {
    return absl::InvalidArgumentError("cuda::MoeExperts: too many tiles for one grid");
  }
  ExpertGemmKernel<true, kWeights>
      <<<static_cast<unsigned>(up_blocks), moe::kGemmThreads, kSmem, stream>>>(
          p, w, static_cast<int32_t>(max_tiles));
  TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  ExpertGemmKernel<false, kWeights>
      <<<static_cast<unsigned>(down_blocks), moe::kGemmThreads, kSmem, stream>>>(
          p, w, static_cast<int32_t>(max_tiles));
  return CudaStatus(cudaGetLastError(), "MoeExperts grouped GEMM launch");
}

}  // namespace

// Enough for any step of up to `tokens`: the partial sums of parted reductions exist only for
// steps of few pairs (ReductionParts), so a smaller step may need more than `tokens` does.
int64_t MoeExpertsWorkspaceBytes(int64_t tokens, int32_t top_k, int32_t num_local_experts,
                                 int64_t intermediate, int64_t hidden) {
  int64_t bytes = Carve(nullptr, tokens, top_k, num_local_experts, intermediate, hidden).bytes;
  const int64_t most_parted = std::min<int64_t>(tokens, moe::kMaxPartedPairs / top_k);
  if (most_parted > 0) {
    bytes = std::max(
        bytes, Carve(nullptr, most_parted, top_k, num_local_experts, intermediate, hidden).bytes);
  }
  return bytes;
}

absl::Status MoeExperts(const MoeExpertsParamsOf<Bf16, Bf16>& p, void* workspace,
                        int64_t workspace_bytes, cudaStream_t stream, int32_t* active_count,
                        cudaEvent_t shared_ready, MoeGrouping grouping) {
  if (p.hidden <= 0 || p.intermediate <= 0 || p.top_k <= 0 || p.first_expert < 0 ||
      p.num_local_experts <= 0 || p.tokens < 0 || p.tokens > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeExperts: tokens=", p.tokens, " (at most 65535)", " top_k=", p.top_k,
                     " hidden=", p.hidden, " intermediate=", p.intermediate, " experts [",
                     p.first_expert, ", +", p.num_local_experts, ")"));
  }
  if (p.tokens == 0) return absl::OkStatus();
  const int packed =
      (p.packed_gate != nullptr) + (p.packed_up != nullptr) + (p.packed_down != nullptr);
  const int given = (p.gate_proj != nullptr) + (p.up_proj != nullptr) + (p.down_proj != nullptr);
  const int int4 = (p.int4_gate_up != nullptr) + (p.int4_down != nullptr);
  const int fp8 = (p.fp8_gate_up != nullptr) + (p.fp8_down != nullptr);
  const bool tiled = packed == 3, pointers = given == 3;
  const bool quantized = (int4 == 2) != (fp8 == 2);  // one format's records
  if (p.x == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr || p.out == nullptr ||
      (packed != 0 && packed != 3) || (given != 0 && given != 3) || (int4 != 0 && int4 != 2) ||
      (fp8 != 0 && fp8 != 2) || (int4 == 2 && fp8 == 2) || (quantized && (tiled || pointers)) ||
      (!tiled && !pointers && !quantized)) {
    return absl::InvalidArgumentError(
        "cuda::MoeExperts: x, topk_ids, topk_weights, out and the experts (all three packed "
        "tiles, or all three pointer arrays, or both; or the two record arrays of one quantized "
        "format alone) must be non-null");
  }
  const uint8_t* records[2] = {int4 == 2 ? p.int4_gate_up : p.fp8_gate_up,
                               int4 == 2 ? p.int4_down : p.fp8_down};
  if (quantized && (reinterpret_cast<uintptr_t>(records[0]) % 16 != 0 ||
                    reinterpret_cast<uintptr_t>(records[1]) % 16 != 0)) {
    return absl::InvalidArgumentError(
        "cuda::MoeExperts: the quantized experts' records must be 16-byte aligned");
  }
  if (tiled &&
      (p.packed_up != p.packed_gate + GateUpTileLayout(p.intermediate, p.hidden).TileElements() ||
       reinterpret_cast<uintptr_t>(p.packed_gate) % 16 != 0 ||
       reinterpret_cast<uintptr_t>(p.packed_down) % 16 != 0)) {
    return absl::InvalidArgumentError(
        "cuda::MoeExperts: the tiles are 16-byte aligned and the up tiles interleaved with the "
        "gate tiles: packed_up must be packed_gate + one tile (moe_tiles.h)");
  }
  const Workspace w =
      Carve(workspace, p.tokens, p.top_k, p.num_local_experts, p.intermediate, p.hidden);
  if (workspace == nullptr || workspace_bytes < w.bytes ||
      reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeExperts: needs a 256-byte aligned "
                     "workspace of ",
                     w.bytes, " bytes, got ", workspace_bytes));
  }
  const bool x_vectorized = p.hidden % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  const bool down_vectorized = p.intermediate % 8 == 0;
  int device = 0, multiprocessors = 0, compute_major = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&compute_major, cudaDevAttrComputeCapabilityMajor, device));
  // Enough blocks to cover the machine several times; the items they loop over depend on the
  // routing, read on the device.
  const int max_blocks = multiprocessors * 8;

  // The weight stream where the experts come as tiles, on sm_90 and later (bulk copies) with
  // token rows of whole 16-byte pieces (every production shape); the CUDA-core kernels, which
  // read the pointer arrays, otherwise.
  const bool tma_path = (tiled || quantized) &&
                        MoeTilesReadable(p.hidden, p.intermediate, compute_major) &&
                        reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  if (!tma_path && !pointers) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MoeExperts: packed tiles and quantized records are read on sm_90 and "
                     "later with hidden and intermediate multiples of 8 and x 16-byte aligned "
                     "(compute capability ",
                     compute_major, ", hidden ", p.hidden, ", intermediate ", p.intermediate,
                     "); otherwise the pointer arrays are needed"));
  }
  const int64_t entries = p.tokens * p.top_k;
  if (grouping == MoeGrouping::kInRouting) {
    // MoeRoutingAndGrouping grouped the pairs into this workspace.
  } else if (entries <= moe::kStagedEntries) {
    const int64_t smem = moe::GroupKernelSmemBytes(entries, p.num_local_experts);
    // Beyond the default 48 KB, static (the scans' 256 bytes) and dynamic together, thousands of
    // local experts need the opt-in (up to the device's per-block limit; past it the launch fails
    // and says so).
    if (smem + 1024 > 48 * 1024) {
      TV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          GroupKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    TV_RETURN_IF_ERROR(LaunchKernel(GroupKernel, dim3(1), dim3(kGroupThreads), smem, stream,
                                    WaitsForPredecessor(GroupKernel), "MoeExperts grouping",
                                    p.topk_ids, p.tokens, p.top_k, p.first_expert,
                                    p.num_local_experts, w, active_count));
  } else {
    const int64_t chunks = moe::GroupChunks(entries);
    const size_t histogram_bytes = p.num_local_experts * sizeof(int32_t);
    const size_t warp_count_bytes = (moe::kGroupChunk / 32) * histogram_bytes;
    if (warp_count_bytes > 48 * 1024 || chunks > 0x7fffffff) {
      return absl::InvalidArgumentError(absl::StrCat("cuda::MoeExperts: ", p.num_local_experts,
                                                     " local experts (at most 1536 for ", entries,
                                                     " entries)"));
    }
    moe::GroupChunksCount<<<static_cast<unsigned>(chunks), moe::kGroupChunk, histogram_bytes,
                            stream>>>(p.topk_ids, entries, p.first_expert, p.num_local_experts, w);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    moe::GroupChunksScan<<<1, kGroupThreads, 0, stream>>>(static_cast<int32_t>(chunks),
                                                          p.num_local_experts, w, active_count);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    moe::GroupChunksPlace<<<static_cast<unsigned>(chunks), moe::kGroupChunk, warp_count_bytes,
                            stream>>>(p.topk_ids, entries, p.top_k, p.first_expert,
                                      p.num_local_experts, w);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  const int64_t most_active = std::min<int64_t>(p.num_local_experts, p.tokens * p.top_k);
  int32_t down_parts = 1;  // the weight stream's may split down's reduction
  // Many tokens per expert (prefill): the grouped GEMM, which reads each expert's weights once
  // per 64 of its tokens rather than per 32 (quantized records dequantized per stage).
  const bool gemm = p.tokens >= kGemmMinTokens && moe::GemmFits(p.hidden, p.intermediate) &&
                    reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  if (gemm) {
    using moe::GemmWeights;
    const int64_t max_tiles = moe::MaxGemmTiles(entries, p.num_local_experts);
    if (int4 == 2) {
      TV_RETURN_IF_ERROR(LaunchExpertGemmKernels<GemmWeights::kInt4>(p, w, max_tiles, stream));
    } else if (fp8 == 2) {
      TV_RETURN_IF_ERROR(LaunchExpertGemmKernels<GemmWeights::kFp8>(p, w, max_tiles, stream));
    } else {
      TV_RETURN_IF_ERROR(LaunchExpertGemmKernels<GemmWeights::kBf16>(p, w, max_tiles, stream));
    }
  } else if (int4 == 2) {
    TV_ASSIGN_OR_RETURN(down_parts,
                        (LaunchExpertTmaKernels<moe::Int4Stage<true>, moe::Int4Stage<false>>(
                            p, w, device, multiprocessors, most_active, stream)));
  } else if (fp8 == 2) {
    TV_ASSIGN_OR_RETURN(down_parts,
                        (LaunchExpertTmaKernels<moe::Fp8Stage<true>, moe::Fp8Stage<false>>(
                            p, w, device, multiprocessors, most_active, stream)));
  } else if (tma_path) {
    TV_ASSIGN_OR_RETURN(down_parts,
                        (LaunchExpertTmaKernels<moe::Bf16Stage<true>, moe::Bf16Stage<false>>(
                            p, w, device, multiprocessors, most_active, stream)));
  } else {
    const int32_t up_tiles = static_cast<int32_t>((p.intermediate + kWarps - 1) / kWarps);
    const unsigned up_blocks =
        static_cast<unsigned>(std::min<int64_t>(max_blocks, most_active * up_tiles));
    GateUpKernel<8><<<up_blocks, kThreads, 0, stream>>>(p, w, up_tiles, x_vectorized);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const int64_t down_rows_per_tile = kWarps * moe::kDownRowsPerWarp;
    const int32_t down_tiles =
        static_cast<int32_t>((p.hidden + down_rows_per_tile - 1) / down_rows_per_tile);
    const unsigned down_blocks =
        static_cast<unsigned>(std::min<int64_t>(max_blocks, most_active * down_tiles));
    DownKernel<8><<<down_blocks, kThreads, 0, stream>>>(p, w, down_tiles, down_vectorized);
    TV_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  const dim3 combine_grid(static_cast<unsigned>((p.hidden + 255) / 256),
                          static_cast<unsigned>(p.tokens));
  // With an event to wait for, the combine is an ordinary launch, not the down stream's
  // programmatic dependent: the cross-stream wait stands between the two.
  if (shared_ready != nullptr) {
    TV_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, shared_ready, 0));
  }
  return LaunchKernel(CombineKernel, combine_grid, dim3(256), 0, stream,
                      shared_ready == nullptr && WaitsForPredecessor(CombineKernel),
                      "MoeExperts combine", p, w, down_parts);
}

}  // namespace treeverify::kernels::cuda
