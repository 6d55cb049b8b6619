// CPU RMSNorm. Batch invariant: each row is reduced in the same fixed order whatever the number
// of rows or threads.
//
// Roofline: reads 4 * dim bytes and writes 4 * dim bytes per row, ~4 flops per element; memory
// bound everywhere (a 7168-wide row is 57 KB round trip, well inside L2).
#include "treeverify/kernels/rms_norm.h"

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::kernels::cpu {
namespace {

// Sum of squares accumulated in double in kLanes interleaved partial sums, combined in lane
// order. The order depends only on dim, so it is fixed per row; the lanes let the compiler use
// vector registers without reassociating anything (products of floats are exact in double).
constexpr int kLanes = 8;

double SumOfSquares(const float* x, int64_t dim) {
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) {
      const double v = x[i + lane];
      lanes[lane] += v * v;
    }
  }
  for (int lane = 0; i < dim; ++i, ++lane) {
    const double v = x[i];
    lanes[lane] += v * v;
  }
  double sum = 0.0;
  for (int lane = 0; lane < kLanes; ++lane) sum += lanes[lane];
  return sum;
}

}  // namespace

absl::Status RmsNorm(const RmsNormParams& params) {
  const int64_t dim = params.dim;
  if (dim <= 0)
    return absl::InvalidArgumentError(absl::StrCat("RmsNorm: dim must be > 0, got ", dim));
  if (params.rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RmsNorm: rows must be >= 0, got ", params.rows));
  }
  const int64_t input_stride = params.input_stride == 0 ? dim : params.input_stride;
  const int64_t output_stride = params.output_stride == 0 ? dim : params.output_stride;
  if (input_stride < dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("RmsNorm: input_stride must be >= dim (", dim, "), got ", input_stride));
  }
  if (output_stride < dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("RmsNorm: output_stride must be >= dim (", dim, "), got ", output_stride));
  }
  if (!(params.eps >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("RmsNorm: eps must be >= 0, got ", params.eps));
  }
  if (params.rows == 0) return absl::OkStatus();
  if (params.input == nullptr) return absl::InvalidArgumentError("RmsNorm: input is null");
  if (params.weight == nullptr) return absl::InvalidArgumentError("RmsNorm: weight is null");
  if (params.output == nullptr) return absl::InvalidArgumentError("RmsNorm: output is null");
  if ((params.add == nullptr) != (params.sum == nullptr)) {
    return absl::InvalidArgumentError("RmsNorm: a residual add needs both add and sum");
  }
  if (params.add != nullptr && params.output == params.input) {
    return absl::InvalidArgumentError("RmsNorm: with a residual add, output must not be input");
  }
  // In place is supported row by row; with different strides rows would overlap across threads.
  if (params.input == params.output && input_stride != output_stride) {
    return absl::InvalidArgumentError(
        absl::StrCat("RmsNorm: in-place normalization needs input_stride == output_stride, got ",
                     input_stride, " and ", output_stride));
  }

  const float* weight = params.weight;
  const int64_t rows = params.rows;
  const double eps = params.eps;
  const bool parallel = rows > 1 && rows * dim >= (int64_t{1} << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = params.input + r * input_stride;
    float* y = params.output + r * output_stride;
    if (params.add != nullptr) {
      // The residual add, element by element in fp32, then the sum is the row normalized.
      const float* add = params.add + r * input_stride;
      float* sum = params.sum + r * input_stride;
      for (int64_t i = 0; i < dim; ++i) sum[i] = x[i] + add[i];
      x = sum;
    }
    const double mean_square = SumOfSquares(x, dim) / static_cast<double>(dim);
    const float inv_rms = static_cast<float>(1.0 / std::sqrt(mean_square + eps));
    // As transformers: weight * (x * rsqrt(var + eps)), two fp32 products. Reading x[i] before
    // writing y[i] keeps in-place use correct.
    for (int64_t i = 0; i < dim; ++i) {
      const float normalized = x[i] * inv_rms;
      y[i] = weight[i] * normalized;
    }
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
