// Batch-invariant blocked GEMM: y[m, n] = sum_k x[m, k] * weight[n, k].
//
// Each output element is one 8-lane accumulator walked along k in increasing order and folded by
// simd::HorizontalSum, so its bits do not depend on m, on the tile it falls in, or on the thread
// that computes it. Tiles of kRowTile x kColTile outputs reuse each loaded x and weight vector
// several times (12 accumulators + 4 operands fit the 16 AVX2 registers).
#include "treeverify/kernels/gemm.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "simd.h"
#include "treeverify/kernels/status.h"

namespace treeverify::kernels::cpu {
namespace {

constexpr int kRowTile = 3;
constexpr int kColTile = 4;

template <int kRows, int kCols>
void Tile(const float* x, int64_t x_stride, const float* w, int64_t w_stride, float* y,
          int64_t y_stride, int64_t k) {
  simd::Vec acc[kRows][kCols];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kCols; ++j) acc[i][j] = simd::Zero();
  int64_t kk = 0;
  for (; kk + simd::kLanes <= k; kk += simd::kLanes) {
    simd::Vec xv[kRows];
    for (int i = 0; i < kRows; ++i) xv[i] = simd::Load(x + i * x_stride + kk);
    for (int j = 0; j < kCols; ++j) {
      const simd::Vec wv = simd::Load(w + j * w_stride + kk);
      for (int i = 0; i < kRows; ++i) acc[i][j] = simd::Fma(xv[i], wv, acc[i][j]);
    }
  }
  if (kk < k) {
    const int64_t rest = k - kk;
    for (int j = 0; j < kCols; ++j) {
      const simd::Vec wv = simd::LoadPartial(w + j * w_stride + kk, rest);
      for (int i = 0; i < kRows; ++i)
        acc[i][j] = simd::Fma(simd::LoadPartial(x + i * x_stride + kk, rest), wv, acc[i][j]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kCols; ++j) y[i * y_stride + j] = simd::HorizontalSum(acc[i][j]);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);

template <int kRows>
constexpr TileFn kTilesForRows[kColTile + 1] = {nullptr, Tile<kRows, 1>, Tile<kRows, 2>,
                                                Tile<kRows, 3>, Tile<kRows, 4>};

TileFn TileFor(int rows, int cols) {
  switch (rows) {
    case 1:
      return kTilesForRows<1>[cols];
    case 2:
      return kTilesForRows<2>[cols];
    default:
      return kTilesForRows<3>[cols];
  }
}

}  // namespace

absl::Status Gemm(const GemmParams& p) {
  if (p.batch < 1) return absl::InvalidArgumentError(absl::StrCat("Gemm: batch ", p.batch));
  if (p.batch > 1) {
    // One product at a time: each is the batch-1 product of its own operands.
    for (int64_t b = 0; b < p.batch; ++b) {
      GemmParams one = p;
      one.batch = 1;
      one.x = p.x == nullptr ? nullptr : p.x + b * p.x_batch_stride;
      one.weight = p.weight == nullptr ? nullptr : p.weight + b * p.weight_batch_stride;
      one.y = p.y == nullptr ? nullptr : p.y + b * p.y_batch_stride;
      TV_RETURN_IF_ERROR(Gemm(one));
    }
    return absl::OkStatus();
  }
  if (p.m < 0 || p.n <= 0 || p.k <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: need m >= 0, n > 0, k > 0; got m=", p.m, " n=", p.n, " k=", p.k));
  }
  if (p.m == 0) return absl::OkStatus();
  if (p.x == nullptr || p.weight == nullptr || p.y == nullptr) {
    return absl::InvalidArgumentError("Gemm: x, weight and y must be non-null");
  }
  const int64_t x_stride = p.x_stride ? p.x_stride : p.k;
  const int64_t w_stride = p.weight_stride ? p.weight_stride : p.k;
  const int64_t y_stride = p.y_stride ? p.y_stride : p.n;
  if (x_stride < p.k || w_stride < p.k || y_stride < p.n) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: strides (", x_stride, ", ", w_stride,
                                                   ", ", y_stride, ") smaller than the rows"));
  }
  const int64_t row_tiles = (p.m + kRowTile - 1) / kRowTile;
  const int64_t col_tiles = (p.n + kColTile - 1) / kColTile;
  const int64_t tiles = row_tiles * col_tiles;
  // Threads only split the tiles; they never change an element's arithmetic.
  const bool parallel = p.m * p.n * p.k >= (1 << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t col_tile = t % col_tiles;
    const int64_t row_tile = t / col_tiles;
    const int64_t row = row_tile * kRowTile;
    const int64_t col = col_tile * kColTile;
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, p.m - row));
    const int cols = static_cast<int>(std::min<int64_t>(kColTile, p.n - col));
    TileFor(rows, cols)(p.x + row * x_stride, x_stride, p.weight + col * w_stride, w_stride,
                        p.y + row * y_stride + col, y_stride, p.k);
  }
  return absl::OkStatus();
}

}  // namespace treeverify::kernels::cpu
