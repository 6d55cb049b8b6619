// The shape of one sequence's new rows in a step: a tree (the pending token as root plus draft
// nodes) or a chain (a prefill chunk). parents[i] is an earlier node, or -1 when node i hangs
// directly on the committed prefix.
//
// A tree holds at most kernels::kMaxSegmentRows nodes (the width of its ancestor masks); a chain
// up to kMaxChainRows: each node sees every node before it, so a long chain goes to the
// attention as pieces of at most kMaxSegmentRows rows, each masked as a chain of its own
// (ChainMask) on top of the pieces before it.
//
//   TV_ASSIGN_OR_RETURN(SegmentTree tree, SegmentTree::Build(parents));
//   position of node i = committed_length + tree.depth[i]
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "treeverify/kernels/mla_verify_attention.h"

namespace treeverify::worker {

// The longest chain one step takes: a prefill chunk. The GPU's prefill path (the MHA form) pays
// for re-reading the context once per chunk, so long chunks are what make it worthwhile.
inline constexpr int32_t kMaxChainRows = 8192;

struct SegmentTree {
  std::vector<int32_t> depth;           // [nodes] 0 for nodes on the prefix
  std::vector<uint64_t> ancestor_mask;  // [nodes, kernels::kAncestorMaskWords] ancestors + self

  // INVALID_ARGUMENT unless 1 <= nodes <= kMaxSegmentRows and every parent is -1 or an earlier
  // node.
  static absl::StatusOr<SegmentTree> Build(absl::Span<const int32_t> parents);
  // A chain of n nodes: parents -1, 0, 1, ..., n-2.
  static std::vector<int32_t> ChainParents(int32_t n);
  // Whether parents are -1, 0, 1, ..., n-2 (n >= 1).
  static bool IsChain(absl::Span<const int32_t> parents);
  // The ancestor masks of a chain of n nodes, 1 <= n <= kMaxSegmentRows: node i sees 0..i.
  static std::vector<uint64_t> ChainMask(int32_t n);
  // Nodes 0, 1, ..., n-1: committing them keeps a whole chain.
  static std::vector<int32_t> AllNodes(int64_t n);
};

}  // namespace treeverify::worker
