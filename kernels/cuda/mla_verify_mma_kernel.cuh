// The mma.sync MLA verify kernel: 512 latent + 64 rope dims on the tensor cores of any GPU from
// sm_80 on, for those without wgmma (Blackwell sm_120 and sm_100, Ampere, Ada). It must fit
// sm_120's 99 KB of shared memory per block.
//
// Shape of the work. A block of four warps owns one row tile (16 packed (node, head) rows of one
// sequence, which share its KV) and one split of the sequence's keys, and walks the split's 64-key
// tiles in halves of 32 keys, two stages of cp.async (the half being computed and the next), each
// key row looked up in the page table and padded by 16 bytes so that ldmatrix reads are free of
// bank conflicts. Per half tile, warp w computes the scores of keys 8w..8w+7 over all 576 dims
// (S = Q K^T, 36 mma steps, the queries read from shared memory); the four warps exchange their
// rows' maxima, each computes P for its keys and stores it (bf16) in shared memory; then warp w
// accumulates output dims 128w..128w+127 of all 16 rows (O += P V, V read transposed from the same
// key rows). Every warp keeps its own part of the rows' sums, added once at the end.
//
// Masks as in the other kernels: keys past the sequence's end are zero-filled and score -inf, tree
// keys follow the ancestor bitmasks.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "grid_dependency.cuh"
#include "mla_verify_common.cuh"
#include "mma_sync_primitives.cuh"

namespace treeverify::kernels::cuda::mla {

inline constexpr int kMmaRows = 16;      // packed rows per block
inline constexpr int kMmaThreads = 128;  // four warps
inline constexpr int kMmaHalfTile = kMlaKeyTile / 2;
inline constexpr int kMmaDims = kMlaLatent + kMlaRope;
inline constexpr int kMmaRowBytes = kMmaDims * 2 + 16;  // a key or query row, padded

struct MmaSmem {
  static constexpr int kQ = 0;
  static constexpr int kStages = kQ + kMmaRows * kMmaRowBytes;
  static constexpr int kStageBytes = kMmaHalfTile * kMmaRowBytes;
  static constexpr int kProbsStride = kMmaHalfTile * 2 + 16;  // bytes per row of P, padded
  static constexpr int kProbs = kStages + 2 * kStageBytes;
  static constexpr int kRowMax = kProbs + kMmaRows * kProbsStride;  // [warp][row] floats
  static constexpr int kBytes = kRowMax + 4 * kMmaRows * 4;
};
static_assert(MmaSmem::kBytes <= 99 * 1024, "sm_120 allows 99 KB of shared memory per block");

// Queues the cp.async loads of half tile `half` (keys first_key..+31 of the sequence) into
// `stage`: thread t loads 16-byte chunks t % 4, + 4, ... of key row t / 4. Keys at or past
// key_end, and keys on a page outside the cache (the caller's bug, read as zeros as the TMA
// kernels' are), are zero-filled.
__device__ inline void LoadHalfTile(const MlaVerifyParamsBf16& p, const int32_t* page_table,
                                    int first_key, int key_end, uint8_t* stage) {
  const int key_in_half = threadIdx.x / 4;
  const int key = first_key + key_in_half;
  const int32_t page = key < key_end ? page_table[key / p.page_size] : 0;
  const bool valid = key < key_end && PageInCache(p, page);
  // A zero-filled row reads no bytes, but its address stays inside the cache all the same.
  const __nv_bfloat16* src =
      valid ? p.kv_cache + (static_cast<int64_t>(page) * p.page_size + key % p.page_size) * kMmaDims
            : p.kv_cache;
  uint8_t* dst = stage + key_in_half * kMmaRowBytes;
#pragma unroll
  for (int c = threadIdx.x % 4; c < kMmaDims / 8; c += 4) {
    mma::CpAsync16(dst + c * 16, src + c * 8, valid);
  }
}

__global__ void __launch_bounds__(kMmaThreads)
    MlaVerifyMmaKernel(MlaVerifyParamsBf16 p, PartialLayout partial, int32_t min_split_keys,
                       int32_t row_tiles, bool direct_output) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) uint8_t smem_raw[];  // all ldmatrix and cp.async need 16 bytes
  uint8_t* smem = smem_raw;
  AllowDependentGridLaunch();
  WaitForPredecessorGrid();  // the queries and the tree nodes' keys may come from it
  const int seq = blockIdx.y;
  const int split = blockIdx.x / row_tiles;
  const int row0 = (blockIdx.x % row_tiles) * kMmaRows;
  const SequenceSpan span = LoadSequence(p, seq);
  const int heads = p.num_heads;
  const int rows = span.rows * heads;
  if (row0 >= rows) return;
  const int32_t keys = span.keys();
  const SplitTiles tiles = SplitRange(keys, partial.LaunchSplits(), min_split_keys, split);
  if (tiles.begin == tiles.end) return;  // the merge skips empty splits
  const int valid_rows = min(kMmaRows, rows - row0);
  const int key_begin = tiles.begin * kMlaKeyTile;
  const int key_end = min(tiles.end * kMlaKeyTile, keys);
  const int halves = (key_end - key_begin + kMmaHalfTile - 1) / kMmaHalfTile;
  const int32_t* page_table = p.page_table + static_cast<int64_t>(seq) * p.max_pages_per_seq;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // fragment row
  const int t = lane % 4;  // fragment column pair
  uint8_t* q_smem = smem + MmaSmem::kQ;
  uint8_t* probs = smem + MmaSmem::kProbs;
  float* row_max = reinterpret_cast<float*>(smem + MmaSmem::kRowMax);

  // The row tile's queries (rows past the sequence's zero-filled) and the first half tile.
  {
    const int r = threadIdx.x / 8;
    const int row = r < valid_rows ? r : 0;  // zero-filled rows: an address inside q all the same
    const __nv_bfloat16* src =
        p.q + (static_cast<int64_t>(span.row_begin) * heads + row0 + row) * kMmaDims;
#pragma unroll
    for (int c = threadIdx.x % 8; c < kMmaDims / 8; c += 8) {
      mma::CpAsync16(q_smem + r * kMmaRowBytes + c * 16, src + c * 8, r < valid_rows);
    }
  }
  LoadHalfTile(p, page_table, key_begin, key_end, smem + MmaSmem::kStages);
  mma::CpAsyncCommit();

  const float scale = p.softmax_scale * 1.4426950408889634f;  // scores in the log2 domain
  const uint64_t* mask =
      p.ancestor_mask + static_cast<int64_t>(span.row_begin) * kAncestorMaskWords;
  // This thread's rows g and g + 8 of the tile: their nodes, for the masks.
  int node[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) node[h] = min(row0 + g + 8 * h, rows - 1) / heads;

  float o[16][4];  // dims 128 * warp + 8 * n + 2t (+1), rows g (0, 1) and g + 8 (2, 3)
#pragma unroll
  for (int n = 0; n < 16; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.f;
  }
  float m[2] = {-INFINITY, -INFINITY};  // running max of rows g, g + 8 (log2 domain)
  float l[2] = {0.f, 0.f};              // this thread's part of their sums

  for (int half = 0; half < halves; ++half) {
    mma::CpAsyncWait<0>();
    __syncthreads();  // half tile `half` has landed; every warp is done with the other stage
    if (half + 1 < halves) {
      LoadHalfTile(p, page_table, key_begin + (half + 1) * kMmaHalfTile, key_end,
                   smem + MmaSmem::kStages + ((half + 1) & 1) * MmaSmem::kStageBytes);
    }
    mma::CpAsyncCommit();
    const uint8_t* stage = smem + MmaSmem::kStages + (half & 1) * MmaSmem::kStageBytes;
    const int first_key = key_begin + half * kMmaHalfTile;

    // S[16 x 8] of keys 8 * warp.. over the 576 dims, two k16 steps per B load.
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    const uint8_t* a_row = q_smem + (lane % 16) * kMmaRowBytes + (lane / 16) * 16;
    const uint8_t* b_row = stage + (8 * warp + lane % 8) * kMmaRowBytes + (lane / 8) * 16;
#pragma unroll 6
    for (int k = 0; k < kMmaDims / 16; k += 2) {
      uint32_t b[4];
      mma::LoadMatrices4(b, b_row + k * 32);
      uint32_t a[4];
      mma::LoadMatrices4(a, a_row + k * 32);
      mma::MmaBf16(s, a, b[0], b[1]);
      mma::LoadMatrices4(a, a_row + (k + 1) * 32);
      mma::MmaBf16(s, a, b[2], b[3]);
    }

    // Scale and mask: s[2h + e] is row g + 8h, key first_key + 8 * warp + 2t + e.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = first_key + 8 * warp + 2 * t + e;
        const bool visible = key < key_end && KeyVisible(mask, span.committed, node[h], key);
        s[2 * h + e] = visible ? s[2 * h + e] * scale : -INFINITY;
        tile_max[h] = fmaxf(tile_max[h], s[2 * h + e]);
      }
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      if (t == 0) row_max[warp * kMmaRows + g + 8 * h] = tile_max[h];
    }
    __syncthreads();  // every warp's maxima are in
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m_new = m[h];
#pragma unroll
      for (int w = 0; w < 4; ++w) m_new = fmaxf(m_new, row_max[w * kMmaRows + g + 8 * h]);
      // Nothing visible yet: keep O and l (zero), P = 0.
      alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
      float p_sum = 0.f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float prob = m_new == -INFINITY ? 0.f : exp2f(s[2 * h + e] - m_new);
        s[2 * h + e] = prob;
        p_sum += prob;
      }
      l[h] = l[h] * alpha[h] + p_sum;
      m[h] = m_new;
      *reinterpret_cast<uint32_t*>(probs + (g + 8 * h) * MmaSmem::kProbsStride +
                                   (8 * warp + 2 * t) * 2) =
          mma::PackBf16x2(s[2 * h], s[2 * h + 1]);
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    __syncthreads();  // P is complete (and row_max read by every warp)

    // O[16 x 128] += P[16 x 32] V[32 x 128 dims of this warp], V^T fragments by ldmatrix.trans:
    // matrix j of a load is keys 8 (j % 2).. of dims 8 (j / 2).. (two n8 tiles per load).
#pragma unroll
    for (int k = 0; k < kMmaHalfTile / 16; ++k) {
      uint32_t a[4];
      mma::LoadMatrices4(a,
                         probs + (lane % 16) * MmaSmem::kProbsStride + k * 32 + (lane / 16) * 16);
      const uint8_t* v_row = stage + (16 * k + 8 * ((lane / 8) % 2) + lane % 8) * kMmaRowBytes +
                             (128 * warp + 8 * (lane / 16)) * 2;
#pragma unroll
      for (int n = 0; n < 16; n += 2) {
        uint32_t b[4];
        mma::LoadMatrices4Transposed(b, v_row + n * 16);
        mma::MmaBf16(o[n], a, b[0], b[1]);
        mma::MmaBf16(o[n + 1], a, b[2], b[3]);
      }
    }
  }
  mma::CpAsyncWait<0>();

  // The rows' whole sums: this thread's keys, then the quad's, then the four warps'.
  float* row_sum = row_max;  // free: every warp has read the last maxima
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (t == 0) row_sum[warp * kMmaRows + g + 8 * h] = l[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= valid_rows) continue;
    const float sum =
        row_sum[r] + row_sum[kMmaRows + r] + row_sum[2 * kMmaRows + r] + row_sum[3 * kMmaRows + r];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float lse = NaturalLse(m[h], sum);
    const int64_t global_row = static_cast<int64_t>(span.row_begin) * heads + row0 + r;
    if (direct_output) {
      __nv_bfloat16* out = p.out + global_row * kMlaLatent + 128 * warp + 2 * t;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * n) =
            __floats2bfloat162_rn(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
      }
      if (warp == 0 && t == 0) p.lse[global_row] = lse;
    } else {
      // A quad's four lanes store 32 contiguous bytes: whole sectors.
      float* out = partial.Out<float>(seq, split, row0 + r) + 128 * warp + 2 * t;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<float2*>(out + 8 * n) =
            make_float2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
      }
      if (warp == 0 && t == 0) partial.lse[partial.Index(seq, split, row0 + r)] = lse;
    }
  }
#endif
}

}  // namespace treeverify::kernels::cuda::mla
