// CPU embedding lookup on one vocabulary shard.
//
// Roofline: pure data movement (copies 4 * hidden bytes per token): memory bound.
#include "treeverify/kernels/embedding.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::kernels::cpu {

absl::Status Embedding(const EmbeddingParams& params) {
  const int64_t hidden = params.hidden;
  if (hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding: hidden must be > 0, got ", hidden));
  }
  if (params.tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Embedding: tokens must be >= 0, got ", params.tokens));
  }
  if (params.vocab_begin < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Embedding: vocab_begin must be >= 0, got ", params.vocab_begin));
  }
  if (params.vocab_end <= params.vocab_begin) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding: vocab_end must be > vocab_begin (",
                                                   params.vocab_begin, "), got ",
                                                   params.vocab_end));
  }
  if (params.tokens == 0) return absl::OkStatus();
  if (params.token_ids == nullptr)
    return absl::InvalidArgumentError("Embedding: token_ids is null");
  if (params.table == nullptr) return absl::InvalidArgumentError("Embedding: table is null");
  if (params.out == nullptr) return absl::InvalidArgumentError("Embedding: out is null");
  // Check every id before writing, so a bad id leaves out untouched.
  for (int64_t t = 0; t < params.tokens; ++t) {
    if (params.token_ids[t] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Embedding: token_ids[", t, "] must be >= 0, got ", params.token_ids[t]));
    }
  }

  const int64_t tokens = params.tokens;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const bool parallel = tokens > 1 && tokens * hidden >= (int64_t{1} << 16);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t id = params.token_ids[t];
    float* out = params.out + t * hidden;
    if (id >= params.vocab_begin && id < params.vocab_end) {
      std::memcpy(out, params.table + static_cast<int64_t>(id - params.vocab_begin) * hidden,
                  row_bytes);
    } else {
      std::memset(out, 0, row_bytes);  // another shard's token: all-reduce adds its row
    }
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
