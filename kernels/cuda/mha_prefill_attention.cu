// Flash attention for prefill in the MHA form (mha_prefill_attention.h). Floor: compute. Per
// visible (row, key) pair and head, 2 (qk + v) FLOPs: at DeepSeek's 192 + 128 dims a 4096-row
// chunk over 46k keys of context is 8 heads x 4096 x ~48k keys x 640 = 1.0 TFLOP per layer and
// rank, against H200's ~660 TFLOP/s of dense bf16 (wgmma; mma.sync reaches about two thirds).
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "mma_sync_primitives.cuh"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/mha_prefill_attention.h"

namespace treeverify::kernels::cuda {
namespace {

constexpr int kThreads = 128;  // four warps
constexpr int kRowTile = 64;   // query rows per block, 16 per warp
constexpr int kKeyTile = 64;   // keys per stage
constexpr int kPadBytes = 16;  // per shared-memory row: ldmatrix free of bank conflicts

// Shared memory: two stages of [64 keys] K rows and V rows. The query tile passes through the
// same space first (into registers) before the first keys land.
template <int kQk, int kV>
struct Layout {
  static constexpr int kKRowBytes = kQk * 2 + kPadBytes;
  static constexpr int kVRowBytes = kV * 2 + kPadBytes;
  static constexpr int kKBytes = kKeyTile * kKRowBytes;
  static constexpr int kStageBytes = kKBytes + kKeyTile * kVRowBytes;
  static constexpr int kBytes = std::max(2 * kStageBytes, kRowTile* kKRowBytes);
};

// Queues the cp.async loads of keys first..first+63 into `stage`: K rows (the head's k_nope,
// then the shared k_rope, zero up to kQk) and V rows (the head's v, zero up to kV). Keys at or
// past key_end are zeros.
template <int kQk, int kV>
__device__ void LoadKeyTile(const MhaPrefillParams& p, int head, int first, int key_end,
                            uint8_t* stage) {
  using L = Layout<kQk, kV>;
  const int nope_chunks = p.nope_dim / 8;
  const int qk_chunks = nope_chunks + p.rope_dim / 8;
  const int64_t up_width = static_cast<int64_t>(p.heads) * (p.nope_dim + p.v_dim);
  for (int i = threadIdx.x; i < kKeyTile * (kQk / 8); i += kThreads) {
    const int k = i / (kQk / 8);
    const int c = i % (kQk / 8);
    const int key = first + k;
    const bool valid = key < key_end && c < qk_chunks;
    const Bf16* src = p.kv_up;
    if (valid && c < nope_chunks) {
      src = p.kv_up + key * up_width + head * (p.nope_dim + p.v_dim) + c * 8;
    } else if (valid) {
      src = p.k_rope + key * p.k_rope_stride + (c - nope_chunks) * 8;
    }
    mma::CpAsync16(stage + k * L::kKRowBytes + c * 16, src, valid);
  }
  uint8_t* v_stage = stage + L::kKBytes;
  for (int i = threadIdx.x; i < kKeyTile * (kV / 8); i += kThreads) {
    const int k = i / (kV / 8);
    const int c = i % (kV / 8);
    const int key = first + k;
    const bool valid = key < key_end && c < p.v_dim / 8;
    const Bf16* src =
        valid ? p.kv_up + key * up_width + head * (p.nope_dim + p.v_dim) + p.nope_dim + c * 8
              : p.kv_up;
    mma::CpAsync16(v_stage + k * L::kVRowBytes + c * 16, src, valid);
  }
}

template <int kQk, int kV>
__global__ void __launch_bounds__(kThreads) MhaPrefillKernel(MhaPrefillParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<kQk, kV>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int head = blockIdx.y;
  // Later rows see more keys: the longest tiles go first, so the last wave is the short ones.
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kRowTile;
  const int committed = p.keys - p.rows;
  const int key_end = min(p.keys, committed + row0 + kRowTile);  // past the tile's last row's
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int qk = p.nope_dim + p.rope_dim;

  // The query tile into shared memory, then this warp's 16 rows into A fragments.
  for (int i = threadIdx.x; i < kRowTile * (kQk / 8); i += kThreads) {
    const int r = i / (kQk / 8);
    const int c = i % (kQk / 8);
    const int row = row0 + r;
    const bool valid = row < p.rows && c < qk / 8;
    const Bf16* src = valid ? p.q + (static_cast<int64_t>(row) * p.heads + head) * qk + c * 8 : p.q;
    mma::CpAsync16(smem + r * L::kKRowBytes + c * 16, src, valid);
  }
  mma::CpAsyncCommit();
  mma::CpAsyncWait<0>();
  __syncthreads();
  uint32_t q_frag[kQk / 16][4];
#pragma unroll
  for (int k = 0; k < kQk / 16; ++k) {
    mma::LoadMatrices4(q_frag[k],
                       smem + (16 * warp + lane % 16) * L::kKRowBytes + k * 32 + (lane / 16) * 16);
  }
  __syncthreads();  // the stages reuse the query tile's space

  const int tiles = (key_end + kKeyTile - 1) / kKeyTile;
  LoadKeyTile<kQk, kV>(p, head, 0, key_end, smem);
  mma::CpAsyncCommit();

  const float scale = p.softmax_scale * 1.4426950408889634f;  // scores in the log2 domain
  int last_key[2];  // the last key rows g and g + 8 of this warp see
#pragma unroll
  for (int h = 0; h < 2; ++h) last_key[h] = committed + row0 + 16 * warp + g + 8 * h;
  float o[kV / 8][4];
#pragma unroll
  for (int n = 0; n < kV / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.f;
  }
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // this thread's part of the rows' sums

  for (int tile = 0; tile < tiles; ++tile) {
    mma::CpAsyncWait<0>();
    __syncthreads();  // tile `tile` has landed; every warp is done with the other stage
    if (tile + 1 < tiles) {
      LoadKeyTile<kQk, kV>(p, head, (tile + 1) * kKeyTile, key_end,
                           smem + ((tile + 1) & 1) * L::kStageBytes);
    }
    mma::CpAsyncCommit();
    const uint8_t* k_stage = smem + (tile & 1) * L::kStageBytes;
    const uint8_t* v_stage = k_stage + L::kKBytes;
    const int first_key = tile * kKeyTile;

    // S[16 x 64] = Q K^T: eight n8 tiles of keys, two k16 steps per B load.
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < kQk / 16; k += 2) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t b[4];
        mma::LoadMatrices4(b,
                           k_stage + (8 * j + lane % 8) * L::kKRowBytes + (lane / 8) * 16 + k * 32);
        mma::MmaBf16(s[j], q_frag[k], b[0], b[1]);
        mma::MmaBf16(s[j], q_frag[k + 1], b[2], b[3]);
      }
    }

    // Causal mask, online softmax: s[j][2h + e] is row g + 8h, key first_key + 8j + 2t + e.
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = first_key + 8 * j + 2 * t + e;
          float& x = s[j][2 * h + e];
          x = key <= last_key[h] && key < key_end ? x * scale : -INFINITY;
          tile_max = fmaxf(tile_max, x);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(m[h], tile_max);
      // Nothing visible yet (a row past the chain's end): O and l stay zero.
      alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * h + e];
          x = m_new == -INFINITY ? 0.f : exp2f(x - m_new);
          sum += x;
        }
      }
      l[h] = l[h] * alpha[h] + sum;
      m[h] = m_new;
    }
#pragma unroll
    for (int n = 0; n < kV / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    // O[16 x kV] += P[16 x 64] V[64 x kV]. The score accumulators of key tiles 2kk and 2kk + 1
    // are the A fragment of k16 step kk; V^T fragments by ldmatrix.trans (matrix i of a load:
    // keys 8 (i % 2).., dims 8 (i / 2).. of the n16 pair).
#pragma unroll
    for (int kk = 0; kk < kKeyTile / 16; ++kk) {
      const uint32_t a[4] = {mma::PackBf16x2(s[2 * kk][0], s[2 * kk][1]),
                             mma::PackBf16x2(s[2 * kk][2], s[2 * kk][3]),
                             mma::PackBf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             mma::PackBf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const uint8_t* v_row = v_stage + (16 * kk + 8 * ((lane / 8) % 2) + lane % 8) * L::kVRowBytes +
                             8 * (lane / 16) * 2;
#pragma unroll
      for (int n = 0; n < kV / 8; n += 2) {
        uint32_t b[4];
        mma::LoadMatrices4Transposed(b, v_row + n * 16);
        mma::MmaBf16(o[n], a, b[0], b[1]);
        mma::MmaBf16(o[n + 1], a, b[2], b[3]);
      }
    }
  }
  mma::CpAsyncWait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int row = row0 + 16 * warp + g + 8 * h;
    if (row >= p.rows) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    Bf16* out = p.out + (static_cast<int64_t>(row) * p.heads + head) * p.v_dim;
#pragma unroll
    for (int n = 0; n < kV / 8; ++n) {
      const int dim = 8 * n + 2 * t;
      if (dim < p.v_dim) {
        *reinterpret_cast<__nv_bfloat162*>(out + dim) =
            __floats2bfloat162_rn(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
      }
    }
  }
#endif
}

// The padded (qk, v) sizes built: the tiny test models' (24 -> 32, 16), the demo model's
// (48 -> 64, 32) and DeepSeek / Kimi's (192, 128).
template <int kQk, int kV>
bool Fits(int32_t qk, int32_t v) {
  return qk <= kQk && qk > kQk - 32 && v <= kV && v > kV - 16;
}

template <int kQk, int kV>
absl::Status Launch(const MhaPrefillParams& p, cudaStream_t stream) {
  constexpr int bytes = Layout<kQk, kV>::kBytes;
  // Per call: the attribute belongs to the current device.
  TV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(MhaPrefillKernel<kQk, kV>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const dim3 grid((p.rows + kRowTile - 1) / kRowTile, p.heads);
  MhaPrefillKernel<kQk, kV><<<grid, kThreads, bytes, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "MhaPrefillKernel launch");
}

}  // namespace

bool MhaPrefillSupported(int32_t nope_dim, int32_t rope_dim, int32_t v_dim) {
  if (nope_dim <= 0 || rope_dim <= 0 || v_dim <= 0 || nope_dim % 8 || rope_dim % 8 || v_dim % 8) {
    return false;
  }
  const int32_t qk = nope_dim + rope_dim;
  return Fits<32, 16>(qk, v_dim) || Fits<64, 32>(qk, v_dim) || Fits<192, 128>(qk, v_dim);
}

absl::Status MhaPrefillAttention(const MhaPrefillParams& p, cudaStream_t stream) {
  if (!MhaPrefillSupported(p.nope_dim, p.rope_dim, p.v_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda::MhaPrefillAttention: no kernel for head dims nope ", p.nope_dim,
                     ", rope ", p.rope_dim, ", v ", p.v_dim));
  }
  if (p.rows < 1 || p.keys < p.rows || p.heads < 1 || p.heads > 65535 ||
      p.k_rope_stride < p.rope_dim || p.k_rope_stride % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda::MhaPrefillAttention: rows ", p.rows, ", keys ", p.keys, ", heads ", p.heads,
        ", k_rope_stride ", p.k_rope_stride, " (rows 1..keys, a stride of whole 16-byte units)"));
  }
  if (p.q == nullptr || p.kv_up == nullptr || p.k_rope == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError(
        "cuda::MhaPrefillAttention: q, kv_up, k_rope and out must be non-null");
  }
  for (const void* pointer : {static_cast<const void*>(p.q), static_cast<const void*>(p.kv_up),
                              static_cast<const void*>(p.k_rope)}) {
    if (reinterpret_cast<uintptr_t>(pointer) % 16 != 0) {
      return absl::InvalidArgumentError(
          "cuda::MhaPrefillAttention: q, kv_up and k_rope must be 16-byte aligned (cp.async)");
    }
  }
  const int32_t qk = p.nope_dim + p.rope_dim;
  if (Fits<32, 16>(qk, p.v_dim)) return Launch<32, 16>(p, stream);
  if (Fits<64, 32>(qk, p.v_dim)) return Launch<64, 32>(p, stream);
  return Launch<192, 128>(p, stream);
}

double MhaPrefillFlops(const MhaPrefillParams& p) {
  // Row i sees keys - rows + i + 1 keys.
  const double rows = p.rows;
  const double visible = rows * (p.keys - p.rows) + rows * (rows + 1) / 2;
  return 2.0 * visible * p.heads * (p.nope_dim + p.rope_dim + p.v_dim);
}

}  // namespace treeverify::kernels::cuda
