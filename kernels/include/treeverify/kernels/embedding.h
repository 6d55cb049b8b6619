// Embedding lookup on one vocabulary shard: rows of tokens outside [vocab_begin, vocab_end) are
// zero, so summing the shards of all ranks (all-reduce) gives the full embedding exactly.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

struct EmbeddingParams {
  const int32_t* token_ids = nullptr;  // [tokens]
  const float* table = nullptr;        // [vocab_end - vocab_begin, hidden]
  float* out = nullptr;                // [tokens, hidden]
  int64_t tokens = 0;
  int64_t hidden = 0;
  int32_t vocab_begin = 0;
  int32_t vocab_end = 0;
};

namespace cpu {
absl::Status Embedding(const EmbeddingParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
