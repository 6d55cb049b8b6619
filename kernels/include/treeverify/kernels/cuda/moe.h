// Mixture of experts on the GPU with the CPU backend's params structs (device pointers).
//
// Routing: one block per token, the CPU op's rules step by step (sigmoid or softmax in double
// rounded to fp32, group limiting with its masks, top-k ties to the lower id, ids ascending, the
// normalization sum in double in ascending id order), so the ids match the CPU's for the same
// logits and the weights match to the last bit or so.
//
// Experts: everything the host does not know (which experts are active, how many tokens each
// has) stays in device memory, so one launch sequence serves any routing and a CUDA graph can
// replay it:
//   1. grouping (one block; three kernels over chunks of entries for prefill batches): each local
//      expert's (token, slot) pairs in token order, and the list of active experts; at verify
//      sizes MoeRoutingAndGrouping does it in the routing's kernel, by its last block;
//   2. gate and up: silu(gate . x) * (up . x) for the expert's tokens (tensor cores on sm_80 and
//      later where the reductions come in 32-element chunks, CUDA cores otherwise);
//   3. down: the expert's output per (token, slot);
//   4. combine (a block per token and 256 columns): sum of the weighted outputs in ascending
//      expert id, then the shared experts' output.
// From 512 tokens on (prefill chunks, or verify batches as large), steps 2 and 3 are a grouped
// GEMM over tiles of 64 pairs of one expert (mma.sync, cp.async stages), the tiles listed by the
// grouping. Otherwise, on sm_90 and later with the experts as tiles (params.packed_*,
// moe_tiles.h), steps 2 and 3 stream only the active experts' weights through shared memory, a
// bulk copy per tile (a producer warp, eight mma warps, persistent blocks claiming (active expert,
// row tile, block part) items one at a time), each row once per group of up to 32 tokens; without
// tiles or before sm_90, CUDA-core kernels. At verify sizes (a few tokens per expert) the phase is
// a weight-streaming problem: its floor is the active experts' bytes over the copy bandwidth. No
// sum depends on scheduling: the global atomics only hand out work items and count arrivals, and
// each item's sums are one block's in a fixed order, so the bytes do not depend on which block
// took it.
//
//   int64_t bytes = MoeExpertsWorkspaceBytes(tokens, top_k, num_local_experts, intermediate,
//                                            hidden);  // allocated once, zeroed
//   TV_ASSIGN_OR_RETURN(MoeGrouping grouping, MoeRoutingAndGrouping(routing_params,
//                                             expert_params, workspace, bytes, stream));
//   TV_RETURN_IF_ERROR(MoeExperts(expert_params, workspace, bytes, stream, nullptr, nullptr,
//                                 grouping));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/kernels/moe.h"

namespace treeverify::kernels::cuda {

absl::Status MoeRouting(const MoeRoutingParams& params, cudaStream_t stream);

// Whether MoeExperts' weight stream reads experts of these sizes as tiles (moe_tiles.h) on a
// device of this compute capability: sm_90 and later, hidden and intermediate multiples of 8 (the
// token rows' 16-byte pieces). Where not, the experts go as pointer arrays.
inline bool MoeTilesReadable(int64_t hidden, int64_t intermediate, int compute_major) {
  return compute_major >= 9 && hidden % 8 == 0 && intermediate % 8 == 0;
}

// Device memory MoeExperts needs for these sizes (256-byte aligned pieces). Zero it once when
// allocating: MoeRoutingAndGrouping counts its blocks in it, and leaves the count zero.
int64_t MoeExpertsWorkspaceBytes(int64_t tokens, int32_t top_k, int32_t num_local_experts,
                                 int64_t intermediate, int64_t hidden);

// Who grouped the experts' (token, slot) pairs by expert.
enum class MoeGrouping {
  kInExperts,  // MoeExperts does, as its first kernel(s)
  kInRouting,  // MoeRoutingAndGrouping did, into the workspace MoeExperts is given
};

// MoeRouting and, at a verify step's sizes (the staged grouping's shared memory beside the
// routing's within a block's default 48 KB: 128 entries and 384 local experts take 2 KB), the
// grouping MoeExperts would begin with, by the last routing block to finish: one dependent kernel
// fewer before the expert streams. `experts` must read the routing's ids (same topk_ids, tokens
// and top_k) and the workspace is the one it will be given. The blocks count themselves in the
// workspace: it must be zeroed when allocated, and used by one stream's work at a time (the
// last block zeroes the count again; a kernel that faults leaves the context unusable anyway).
// Returns kInRouting where it grouped, kInExperts where it only routed (a prefill batch): pass it
// on to MoeExperts.
absl::StatusOr<MoeGrouping> MoeRoutingAndGrouping(const MoeRoutingParams& routing,
                                                  const MoeExpertsParamsOf<Bf16, Bf16>& experts,
                                                  void* workspace, int64_t workspace_bytes,
                                                  cudaStream_t stream,
                                                  int32_t* active_count = nullptr);

// The experts come as tiles (packed_gate and packed_down: moe_tiles.h's layouts, each allocation
// 16-byte aligned; packed_up = packed_gate + one tile, gate and up interleaved), read by the weight
// stream on sm_90 and later where hidden and intermediate are multiples of 8, and by the grouped
// GEMM; or as pointer arrays (gate_proj, up_proj and down_proj: device arrays of device pointers to
// row-major matrices, each 16-byte aligned), read by the grouped GEMM and the CUDA-core kernels.
// Given both, they must describe the same matrices (neither can be checked from the host). Or,
// alone, as one quantized format's records (int4_* or fp8_*: moe_records.h), on sm_90 and later,
// read by the weight stream (dequantized in registers) and the grouped GEMM (dequantized per
// stage in shared memory).
// workspace holds at least MoeExpertsWorkspaceBytes(...) bytes, 256-byte aligned. If active_count
// (device memory) is set, the number of local experts with tokens is written there (step
// accounting). If shared_ready is set, shared_out may still be being written on another stream
// until that event completes: the combine, its only reader, waits for it (and only the combine).
// With kInRouting the pairs are already grouped in the workspace (and active_count written there,
// if asked).
absl::Status MoeExperts(const MoeExpertsParamsOf<Bf16, Bf16>& params, void* workspace,
                        int64_t workspace_bytes, cudaStream_t stream,
                        int32_t* active_count = nullptr, cudaEvent_t shared_ready = nullptr,
                        MoeGrouping grouping = MoeGrouping::kInExperts);

}  // namespace treeverify::kernels::cuda
