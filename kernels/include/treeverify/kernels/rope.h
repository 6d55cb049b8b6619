// Rotary position embedding applied in place to the rope part of queries and keys.
//
// Pairs are (x[2i], x[2i+1]) when interleaved (DeepSeek's checkpoints, rope_interleave = true,
// and always for DeepSeek-V2), else (x[i], x[i + d/2]) (rotate_half). Pair i turns by the angle
// position * inv_freq[i]; cos and sin are scaled by attention_factor (YaRN's mscale ratio), as
// transformers does. The angle is the fp32 product float(position) * inv_freq[i], as torch's;
// its cos and sin are taken in double and rounded to fp32. Interleaved pairs stay in place: q
// and k are rotated alike, so q.k is the same as with transformers' de-interleaved layout.
//
// In place by default; with `input` set the values are read there and the rotated ones written
// to x (the GPU reads q_pe from the q projection and writes the absorbed query, or reads k_pe
// from the fp32 kv_a projection and writes the bf16 cache row). Math is fp32 whatever the
// element types: fp32 on the CPU (RopeParams); bf16 or fp32 input and bf16 output on the GPU.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace treeverify::kernels {

template <typename Input, typename Output>
struct RopeParamsOf {
  Output* x = nullptr;                 // [rows, heads, rope_dim] at x[r*row_stride + h*head_stride]
  const int32_t* positions = nullptr;  // [rows] absolute positions
  const float* inv_freq = nullptr;     // [rope_dim / 2]
  int64_t rows = 0;
  int64_t heads = 1;
  int64_t rope_dim = 0;
  int64_t row_stride = 0;   // elements between rows
  int64_t head_stride = 0;  // elements between heads of a row
  float attention_factor = 1.0f;
  bool interleaved = true;
  // When set: [rows, heads, rope_dim] at input[r*input_row_stride + h*input_head_stride], read
  // instead of x. It must not overlap x.
  const Input* input = nullptr;
  int64_t input_row_stride = 0;   // 0 means row_stride
  int64_t input_head_stride = 0;  // 0 means head_stride
};
using RopeParams = RopeParamsOf<float, float>;

namespace cpu {
absl::Status Rope(const RopeParams& params);
}  // namespace cpu

}  // namespace treeverify::kernels
