// CPU rotary position embedding, in place.
//
// Angles follow transformers: angle = float(position) * inv_freq[i] as one fp32 product (torch's
// inv_freq @ position in fp32). cos and sin of that fp32 angle are taken in double and rounded
// to float (correctly rounded in practice, where torch's vectorized cos/sin may differ by an
// ulp), then scaled by attention_factor in fp32. The rotation is two fp32 products and one
// fp32 add per output, without contraction, exactly like transformers' elementwise ops.
//
// Roofline: per row reads and writes 4 * heads * rope_dim bytes and computes rope_dim / 2
// cos/sin pairs; the trig dominates at DeepSeek's sizes (32 pairs, 128 heads).
#include "treeverify/kernels/rope.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::kernels::cpu {

absl::Status Rope(const RopeParams& params) {
  const int64_t rope_dim = params.rope_dim;
  const int64_t heads = params.heads;
  if (rope_dim <= 0 || rope_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Rope: rope_dim must be even and > 0, got ", rope_dim));
  }
  if (heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("Rope: heads must be > 0, got ", heads));
  }
  if (params.rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Rope: rows must be >= 0, got ", params.rows));
  }
  // head_stride only matters with several heads.
  if (heads > 1 && params.head_stride < rope_dim) {
    return absl::InvalidArgumentError(absl::StrCat("Rope: head_stride must be >= rope_dim (",
                                                   rope_dim, ") when heads > 1, got ",
                                                   params.head_stride));
  }
  const int64_t input_row_stride =
      params.input_row_stride == 0 ? params.row_stride : params.input_row_stride;
  const int64_t input_head_stride =
      params.input_head_stride == 0 ? params.head_stride : params.input_head_stride;
  if (params.input != nullptr && heads > 1 && input_head_stride < rope_dim) {
    return absl::InvalidArgumentError(absl::StrCat("Rope: input_head_stride must be >= rope_dim (",
                                                   rope_dim, "), got ", input_head_stride));
  }
  if (params.input != nullptr && input_row_stride < (heads - 1) * input_head_stride + rope_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("Rope: input_row_stride ", input_row_stride, " is smaller than a row"));
  }
  const int64_t row_span = (heads - 1) * params.head_stride + rope_dim;
  if (params.row_stride < row_span) {
    return absl::InvalidArgumentError(
        absl::StrCat("Rope: row_stride must be >= (heads - 1) * head_stride + rope_dim (", row_span,
                     "), got ", params.row_stride));
  }
  if (!std::isfinite(params.attention_factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Rope: attention_factor must be finite, got ", params.attention_factor));
  }
  if (params.rows == 0) return absl::OkStatus();
  if (params.x == nullptr) return absl::InvalidArgumentError("Rope: x is null");
  if (params.positions == nullptr) return absl::InvalidArgumentError("Rope: positions is null");
  if (params.inv_freq == nullptr) return absl::InvalidArgumentError("Rope: inv_freq is null");
  for (int64_t r = 0; r < params.rows; ++r) {
    if (params.positions[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Rope: positions[", r, "] must be >= 0, got ", params.positions[r]));
    }
  }

  const int64_t half = rope_dim / 2;
  const int64_t rows = params.rows;
  const float factor = params.attention_factor;
  const bool parallel = rows > 1 && rows * heads * rope_dim >= (int64_t{1} << 14);
#pragma omp parallel if (parallel)
  {
    std::vector<float> cos_values(half);
    std::vector<float> sin_values(half);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float position = static_cast<float>(params.positions[r]);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = position * params.inv_freq[i];
        cos_values[i] = static_cast<float>(std::cos(static_cast<double>(angle))) * factor;
        sin_values[i] = static_cast<float>(std::sin(static_cast<double>(angle))) * factor;
      }
      // Interleaved pairs sit at (2i, 2i+1); rotate_half pairs at (i, i + d/2).
      const int64_t first_step = params.interleaved ? 2 : 1;
      const int64_t second_offset = params.interleaved ? 1 : half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = params.x + r * params.row_stride + h * params.head_stride;
        const float* in = params.input == nullptr
                              ? x
                              : params.input + r * input_row_stride + h * input_head_stride;
        for (int64_t i = 0; i < half; ++i) {
          float* first = x + i * first_step;
          float* second = first + second_offset;
          const float x1 = in[i * first_step];
          const float x2 = in[i * first_step + second_offset];
          const float c = cos_values[i];
          const float s = sin_values[i];
          *first = x1 * c - x2 * s;
          *second = x2 * c + x1 * s;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
