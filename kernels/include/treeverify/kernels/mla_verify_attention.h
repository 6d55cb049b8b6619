// MLA tree-verify attention in the absorbed form, over a paged latent KV cache.
//
// Each sequence b has committed_lengths[b] keys already in the cache (the prefix, unmasked) and
// a segment of new rows (tree nodes: the pending token as root plus draft nodes, or a prefill
// chunk as a chain) whose own keys sit right after the prefix, at cache slots
// committed_lengths[b] + j for node j. Node i attends to the whole prefix and to the nodes whose
// bit is set in ancestor_mask[i] (its ancestors and itself). All heads share one latent row per
// key: score = scale * (q_latent . c_kv + q_rope . k_rope); output = softmax-weighted sum of c_kv.
//
// Slot s of sequence b lives at page page_table[b * max_pages_per_seq + s / page_size], row
// s % page_size. The cache holds one layer: [num_pages, page_size, latent_dim + rope_dim].
//
// The CPU implementation walks keys in position order (prefix, then ancestors by node index,
// which is depth order), so a node's result is bit-identical whether it is computed in a tree, a
// chain or a batch with other sequences.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

// At most 256 rows per sequence and step: the pending token plus 255 draft nodes.
inline constexpr int kMaxSegmentRows = 256;
inline constexpr int kAncestorMaskWords = kMaxSegmentRows / 64;

template <typename Element>
struct MlaVerifyParams {
  const Element* q = nullptr;                  // [num_rows, num_heads, latent_dim + rope_dim]
  const Element* kv_cache = nullptr;           // [num_pages, page_size, latent_dim + rope_dim]
  const int32_t* page_table = nullptr;         // [num_seqs, max_pages_per_seq]
  const int32_t* committed_lengths = nullptr;  // [num_seqs] keys before the segment
  const int32_t* row_offsets = nullptr;        // [num_seqs + 1] rows of b: row_offsets[b]..[b+1]
  const uint64_t* ancestor_mask = nullptr;     // [num_rows, kAncestorMaskWords], bit j = node j
  Element* out = nullptr;                      // [num_rows, num_heads, latent_dim]
  float* lse = nullptr;                        // [num_rows, num_heads] natural-log sum-exp
  int32_t num_seqs = 0;
  int32_t num_heads = 0;
  int32_t latent_dim = 0;  // 512 in DeepSeek-V3 / Kimi-K2
  int32_t rope_dim = 0;    // 64 in DeepSeek-V3 / Kimi-K2
  int32_t page_size = 0;
  int32_t max_pages_per_seq = 0;
  int32_t num_pages = 0;  // pages in kv_cache: every page a sequence uses must be below it
  float softmax_scale = 1.0f;
};

namespace cpu {
absl::Status MlaVerifyAttention(const MlaVerifyParams<float>& params);
}  // namespace cpu

}  // namespace treeverify::kernels
