#include "treeverify/worker/segment_tree.h"

#include "absl/strings/str_cat.h"

namespace treeverify::worker {

using kernels::kAncestorMaskWords;

absl::StatusOr<SegmentTree> SegmentTree::Build(absl::Span<const int32_t> parents) {
  const int64_t nodes = static_cast<int64_t>(parents.size());
  if (nodes < 1 || nodes > kernels::kMaxSegmentRows) {
    return absl::InvalidArgumentError(absl::StrCat("a step holds 1..", kernels::kMaxSegmentRows,
                                                   " nodes per sequence, got ", nodes));
  }
  SegmentTree tree;
  tree.depth.resize(nodes);
  tree.ancestor_mask.assign(nodes * kAncestorMaskWords, 0);
  for (int64_t i = 0; i < nodes; ++i) {
    const int32_t parent = parents[i];
    if (parent < -1 || parent >= i) {
      return absl::InvalidArgumentError(
          absl::StrCat("parents[", i, "] = ", parent,
                       ": a parent must be -1 or an earlier node (0..", i - 1, ")"));
    }
    uint64_t* mask = &tree.ancestor_mask[i * kAncestorMaskWords];
    if (parent >= 0) {
      const uint64_t* parent_mask = &tree.ancestor_mask[parent * kAncestorMaskWords];
      for (int w = 0; w < kAncestorMaskWords; ++w) mask[w] = parent_mask[w];
      tree.depth[i] = tree.depth[parent] + 1;
    } else {
      tree.depth[i] = 0;
    }
    mask[i / 64] |= uint64_t{1} << (i % 64);
  }
  return tree;
}

std::vector<int32_t> SegmentTree::AllNodes(int64_t n) {
  std::vector<int32_t> nodes(n);
  for (int64_t i = 0; i < n; ++i) nodes[i] = static_cast<int32_t>(i);
  return nodes;
}

std::vector<int32_t> SegmentTree::ChainParents(int32_t n) {
  std::vector<int32_t> parents(n);
  for (int32_t i = 0; i < n; ++i) parents[i] = i - 1;
  return parents;
}

std::vector<uint64_t> SegmentTree::ChainMask(int32_t n) {
  std::vector<uint64_t> mask(int64_t{n} * kAncestorMaskWords, 0);
  for (int32_t i = 0; i < n; ++i) {
    uint64_t* row = &mask[int64_t{i} * kAncestorMaskWords];
    for (int32_t w = 0; w <= i / 64; ++w) {
      row[w] = w < i / 64 ? ~uint64_t{0} : (~uint64_t{0} >> (63 - i % 64));
    }
  }
  return mask;
}

bool SegmentTree::IsChain(absl::Span<const int32_t> parents) {
  if (parents.empty()) return false;
  for (size_t i = 0; i < parents.size(); ++i) {
    if (parents[i] != static_cast<int32_t>(i) - 1) return false;
  }
  return true;
}

}  // namespace treeverify::worker
