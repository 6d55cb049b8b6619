// CPU reference of MLA tree-verify attention (absorbed form, paged latent cache).
//
// For each (row, head) the keys are visited in position order: the committed prefix, then the
// row's ancestors by node index (a parent always precedes its child, so node order is depth
// order). Scores are computed first, then one max, one exp-sum and one weighted sum in that
// order: the result for a node is bit-identical wherever the same keys meet it — in a tree, in a
// chain, or batched with other sequences.
//
// Roofline (per sequence, per step): bytes = (L + Q) * 576 * 4 read once per (row, head) here;
// this is the oracle, not the fast path — the CUDA kernel packs (row, head) pairs into tiles so
// each KV byte is read once per tile.
#include "treeverify/kernels/mla_verify_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "simd.h"

namespace treeverify::kernels::cpu {
namespace {

absl::Status Validate(const MlaVerifyParams<float>& p) {
  if (p.num_seqs < 0 || p.num_heads <= 0 || p.latent_dim <= 0 || p.rope_dim < 0 ||
      p.page_size <= 0 || p.max_pages_per_seq < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MlaVerifyAttention: bad shape num_seqs=", p.num_seqs, " num_heads=", p.num_heads,
        " latent_dim=", p.latent_dim, " rope_dim=", p.rope_dim, " page_size=", p.page_size,
        " max_pages_per_seq=", p.max_pages_per_seq));
  }
  if (p.num_seqs == 0) return absl::OkStatus();
  if (!p.q || !p.kv_cache || !p.page_table || !p.committed_lengths || !p.row_offsets ||
      !p.ancestor_mask || !p.out || !p.lse) {
    return absl::InvalidArgumentError("MlaVerifyAttention: a required pointer is null");
  }
  if (p.row_offsets[0] != 0) {
    return absl::InvalidArgumentError("MlaVerifyAttention: row_offsets[0] must be 0");
  }
  for (int32_t b = 0; b < p.num_seqs; ++b) {
    const int32_t rows = p.row_offsets[b + 1] - p.row_offsets[b];
    if (rows < 0 || rows > kMaxSegmentRows) {
      return absl::InvalidArgumentError(absl::StrCat("MlaVerifyAttention: sequence ", b, " has ",
                                                     rows, " rows; expected 0..", kMaxSegmentRows));
    }
    const int64_t keys = int64_t{p.committed_lengths[b]} + rows;
    if (p.committed_lengths[b] < 0 || keys > int64_t{p.max_pages_per_seq} * p.page_size) {
      return absl::InvalidArgumentError(absl::StrCat("MlaVerifyAttention: sequence ", b, " needs ",
                                                     keys, " key slots but its page table holds ",
                                                     int64_t{p.max_pages_per_seq} * p.page_size));
    }
    // The page table is data from the cache's owner: check it rather than read out of bounds.
    const int64_t pages_used = (keys + p.page_size - 1) / p.page_size;
    for (int64_t page = 0; page < pages_used; ++page) {
      const int32_t id = p.page_table[int64_t{b} * p.max_pages_per_seq + page];
      if (id < 0 || id >= p.num_pages) {
        return absl::InvalidArgumentError(
            absl::StrCat("MlaVerifyAttention: sequence ", b, " page ", page, " is ", id,
                         "; the cache has pages 0..", p.num_pages - 1));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MlaVerifyAttention(const MlaVerifyParams<float>& p) {
  if (absl::Status status = Validate(p); !status.ok()) return status;
  if (p.num_seqs == 0) return absl::OkStatus();
  const int64_t row_dim = int64_t{p.latent_dim} + p.rope_dim;
  const int64_t total_rows = p.row_offsets[p.num_seqs];
  const int64_t work = total_rows * p.num_heads;

#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<const float*> keys;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t row = item / p.num_heads;
      const int64_t head = item % p.num_heads;
      // The sequence owning this row (few sequences: a linear scan is fine).
      int32_t b = 0;
      while (p.row_offsets[b + 1] <= row) ++b;
      const int64_t committed = p.committed_lengths[b];
      const int32_t* pages = p.page_table + int64_t{b} * p.max_pages_per_seq;
      const uint64_t* mask = p.ancestor_mask + row * kAncestorMaskWords;

      auto key_row = [&](int64_t slot) {
        const int64_t page = pages[slot / p.page_size];
        return p.kv_cache + (page * p.page_size + slot % p.page_size) * row_dim;
      };
      keys.clear();
      for (int64_t s = 0; s < committed; ++s) keys.push_back(key_row(s));
      const int64_t segment_rows = p.row_offsets[b + 1] - p.row_offsets[b];
      for (int64_t j = 0; j < segment_rows; ++j) {
        if (mask[j / 64] >> (j % 64) & 1) keys.push_back(key_row(committed + j));
      }

      const float* q = p.q + (row * p.num_heads + head) * row_dim;
      float* out = p.out + (row * p.num_heads + head) * p.latent_dim;
      scores.resize(keys.size());
      float max_score = -std::numeric_limits<float>::infinity();
      for (size_t j = 0; j < keys.size(); ++j) {
        scores[j] = simd::Dot(q, keys[j], row_dim) * p.softmax_scale;
        max_score = std::max(max_score, scores[j]);
      }
      for (int64_t c = 0; c < p.latent_dim; ++c) out[c] = 0.0f;
      if (keys.empty()) {
        p.lse[row * p.num_heads + head] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0.0;
      for (size_t j = 0; j < keys.size(); ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      const float inv_sum = static_cast<float>(1.0 / sum);
      for (size_t j = 0; j < keys.size(); ++j) {
        simd::Axpy(scores[j] * inv_sum, keys[j], out, p.latent_dim);
      }
      p.lse[row * p.num_heads + head] = max_score + static_cast<float>(std::log(sum));
    }
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
