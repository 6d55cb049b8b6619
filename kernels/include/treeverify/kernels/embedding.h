// Embedding lookup on one vocabulary shard: rows of tokens outside [vocab_begin, vocab_end) are
// zero, so summing the shards of all ranks (all-reduce) gives the full embedding exactly.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

// Table and Output: fp32 on the CPU (EmbeddingParams); bf16 table, fp32 rows on the GPU.
template <typename Table, typename Output>
struct EmbeddingParamsOf {
  const int32_t* token_ids = nullptr;  // [tokens]
  const Table* table = nullptr;        // [vocab_end - vocab_begin, hidden]
  Output* out = nullptr;               // [tokens, hidden]
  int64_t tokens = 0;
  int64_t hidden = 0;
  int32_t vocab_begin = 0;
  int32_t vocab_end = 0;
};
using EmbeddingParams = EmbeddingParamsOf<float, float>;

namespace cpu {
absl::Status Embedding(const EmbeddingParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
