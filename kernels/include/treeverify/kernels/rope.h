// Rotary position embedding applied in place to the rope part of queries and keys.
//
// Pairs are (x[2i], x[2i+1]) when interleaved (DeepSeek's checkpoints, rope_interleave = true,
// and always for DeepSeek-V2), else (x[i], x[i + d/2]) (rotate_half). Pair i turns by the angle
// position * inv_freq[i]; cos and sin are scaled by attention_factor (YaRN's mscale ratio), as
// transformers does. The angle is the fp32 product float(position) * inv_freq[i], as torch's;
// its cos and sin are taken in double and rounded to fp32. Interleaved pairs stay in place: q
// and k are rotated alike, so q.k is the same as with transformers' de-interleaved layout.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

struct RopeParams {
  float* x = nullptr;                  // [rows, heads, rope_dim] at x[r*row_stride + h*head_stride]
  const int32_t* positions = nullptr;  // [rows] absolute positions
  const float* inv_freq = nullptr;     // [rope_dim / 2]
  int64_t rows = 0;
  int64_t heads = 1;
  int64_t rope_dim = 0;
  int64_t row_stride = 0;   // elements between rows
  int64_t head_stride = 0;  // elements between heads of a row
  float attention_factor = 1.0f;
  bool interleaved = true;
};

namespace cpu {
absl::Status Rope(const RopeParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
