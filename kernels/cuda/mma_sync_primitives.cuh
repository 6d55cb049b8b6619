// Warp-level tensor-core and asynchronous-copy primitives of sm_80 and later (sm_90, sm_100,
// sm_120): mma.sync on bf16 m16n8k16 tiles, ldmatrix, and cp.async with zero fill. The fragment
// layouts are PTX's (lane = 4 * g + t): an A fragment holds rows g and g + 8, columns 2t, 2t + 1
// and 2t + 8, 2t + 9; a B fragment columns g, rows 2t, 2t + 1 and 2t + 8, 2t + 9; an fp32
// accumulator rows g and g + 8, columns 2t and 2t + 1.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace treeverify::kernels::cuda::mma {

// The shared-space address of a generic pointer into shared memory (also sm90::SmemAddress).
__device__ inline uint32_t SmemAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes from global to shared memory, asynchronously; with `valid` false the 16 bytes are
// zeroes and global memory is not read.
__device__ inline void CpAsync16(void* smem_dst, const void* global_src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(SmemAddress(smem_dst)),
               "l"(global_src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ inline void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// One arrival on the mbarrier `bar` once this thread's cp.async copies issued so far have landed
// (.noinc: the barrier's expected count includes it), so a consumer that waits on the barrier
// sees them.
__device__ inline void CpAsyncArriveOn(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(SmemAddress(bar))
               : "memory");
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ inline void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ inline void LoadMatrices4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row)));
}
// The same, each matrix transposed.
__device__ inline void LoadMatrices4Transposed(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row)));
}

// d += a * b: m16n8k16, bf16 inputs, fp32 accumulators.
__device__ inline void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16 (round to nearest) in one register, `lo` in the low half: an A fragment's
// pair of columns.
__device__ inline uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace treeverify::kernels::cuda::mma
