#include <algorithm>

#include "absl/strings/str_cat.h"
#include "fp8_dequantize.cuh"
#include "treeverify/kernels/cuda/block_fp8.h"
#include "treeverify/kernels/cuda/cuda_status.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPairsPerThread = 4;  // eight bytes: one 8-byte load where rows allow it

struct DequantizeArgs {
  const uint8_t* values;
  const float* scales;
  Bf16* out;
  int64_t batch, n, k;
  int64_t value_batch_stride, scale_batch_stride;
  int64_t scale_columns;
};

// Thread i: eight consecutive weights of one row (k is a multiple of 8, the bytes 8-aligned), or
// one weight where not (`kWide` false).
template <bool kWide>
__global__ void __launch_bounds__(kThreads) DequantizeBlockFp8Kernel(DequantizeArgs a) {
  constexpr int kPer = kWide ? 2 * kPairsPerThread : 1;
  const int64_t per_row = a.k / kPer;
  const int64_t pieces = a.batch * a.n * per_row;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < pieces;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t product = i / (a.n * per_row);
    const int64_t row = i / per_row % a.n, column = i % per_row * kPer;
    const uint8_t* values = a.values + product * a.value_batch_stride + row * a.k + column;
    const float scale = a.scales[product * a.scale_batch_stride +
                                 row / kFp8BlockSize * a.scale_columns + column / kFp8BlockSize];
    Bf16* out = a.out + (product * a.n + row) * a.k + column;
    if constexpr (kWide) {
      const uint2 bytes = *reinterpret_cast<const uint2*>(values);
      uint4 pairs;
      pairs.x = DequantizeFp8Pair(bytes.x, scale);
      pairs.y = DequantizeFp8Pair(bytes.x >> 16, scale);
      pairs.z = DequantizeFp8Pair(bytes.y, scale);
      pairs.w = DequantizeFp8Pair(bytes.y >> 16, scale);
      *reinterpret_cast<uint4*>(out) = pairs;
    } else {
      out[0] = BitCast<__nv_bfloat162>(DequantizeFp8Pair(values[0], scale)).x;
    }
  }
}

template <typename Output>
absl::Status Dequantize(const BlockFp8GemmParamsOf<Output>& p, Bf16* out, cudaStream_t stream) {
  const GemmParamsOf<Bf16, uint8_t, Output>& g = p.product;
  if (g.n <= 0 || g.k <= 0 || g.batch < 1 || (g.weight_stride != 0 && g.weight_stride != g.k) ||
      g.weight == nullptr || p.scales == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DequantizeBlockFp8: need n, k, batch > 0, rows k apart and non-null arrays; got n=", g.n,
        " k=", g.k, " batch=", g.batch, " weight_stride=", g.weight_stride));
  }
  const DequantizeArgs args{
      .values = g.weight,
      .scales = p.scales,
      .out = out,
      .batch = g.batch,
      .n = g.n,
      .k = g.k,
      .value_batch_stride = g.batch > 1 ? g.weight_batch_stride : 0,
      .scale_batch_stride =
          g.batch > 1 ? (p.scale_batch_stride ? p.scale_batch_stride : Fp8ScaleCount(g.n, g.k)) : 0,
      .scale_columns = Fp8ScaleColumns(g.k)};
  const bool wide = g.k % 8 == 0 && reinterpret_cast<uintptr_t>(g.weight) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                    (g.batch == 1 || g.weight_batch_stride % 8 == 0);
  const int64_t pieces = g.batch * g.n * (wide ? g.k / 8 : g.k);
  const int blocks = static_cast<int>(std::min<int64_t>((pieces + kThreads - 1) / kThreads, 4096));
  if (wide) {
    DequantizeBlockFp8Kernel<true><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    DequantizeBlockFp8Kernel<false><<<blocks, kThreads, 0, stream>>>(args);
  }
  return CudaStatus(cudaGetLastError(), "DequantizeBlockFp8Kernel launch");
}

}  // namespace

absl::Status DequantizeBlockFp8(const BlockFp8GemmParamsOf<Bf16>& p, Bf16* out,
                                cudaStream_t stream) {
  return Dequantize(p, out, stream);
}

absl::Status DequantizeBlockFp8(const BlockFp8GemmParamsOf<float>& p, Bf16* out,
                                cudaStream_t stream) {
  return Dequantize(p, out, stream);
}

}  // namespace treeverify::kernels::cuda
