// Hopper (sm_90a) building blocks in inline PTX: mbarriers, TMA tile loads, wgmma with shared
// memory descriptors. Only compiled into device code for sm_90a (guarded by the callers).
//
// Shared-memory layout used throughout: "128-byte swizzle", the layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B and wgmma reads with swizzle mode 1. A tile is stored as rows of
// 128 bytes (64 bf16); within each group of 8 rows (1024 bytes, 1024-aligned) the 16-byte unit u
// of row r sits at unit u ^ (r % 8).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "mma_sync_primitives.cuh"

namespace treeverify::kernels::cuda::sm90 {

using mma::SmemAddress;

// %globaltimer, in ns (the timestamps' and the in-grid merge's wait limit's clock).
__device__ inline uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// `smem` (dynamic shared memory) advanced to the next multiple of kAlign of its shared-space
// address. By pointer arithmetic on `smem` itself, so that the compiler still knows the result
// points to shared memory and emits LDS/STS for it; an integer round trip (uintptr_t) would make
// every access through it a generic LD/ST.
template <int kAlign>
__device__ inline uint8_t* AlignSharedUp(uint8_t* smem) {
  const uint32_t address = SmemAddress(smem);
  return smem + (((address + kAlign - 1) & ~static_cast<uint32_t>(kAlign - 1)) - address);
}

// Byte offset of element `col` (bf16) of row `row` in a 128-byte-swizzled tile.
__host__ __device__ constexpr uint32_t Swizzle128(uint32_t row, uint32_t col) {
  return row * 128u + ((((col * 2u) >> 4) ^ (row & 7u)) << 4) + ((col * 2u) & 15u);
}

// ---- mbarrier -------------------------------------------------------------------------------

__device__ inline void MbarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddress(bar)), "r"(count));
}

__device__ inline void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ inline void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddress(bar)),
               "r"(bytes)
               : "memory");
}

__device__ inline void MbarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddress(bar)) : "memory");
}

__device__ inline void MbarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(SmemAddress(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ------------------------------------------------------------------------------------

// Loads the box at (x = column, y = row) of a 2D tensor map into shared memory; the mbarrier
// counts the bytes as they land.
__device__ inline void TmaLoad2d(void* smem_dst, const CUtensorMap* map, int32_t x, int32_t y,
                                 uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(SmemAddress(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(SmemAddress(bar))
      : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory
// with the bulk copy engine; the mbarrier counts the bytes as they land.
__device__ inline void BulkLoad(void* smem_dst, const void* global_src, uint32_t bytes,
                                uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SmemAddress(smem_dst)),
      "l"(global_src), "r"(bytes), "r"(SmemAddress(bar))
      : "memory");
}

// L2 eviction policies (createpolicy) for the cache-hinted loads and stores below.
__device__ inline uint64_t L2EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ inline uint64_t L2EvictLastPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// TmaLoad2d with an L2 eviction policy for the loaded lines.
__device__ inline void TmaLoad2dHinted(void* smem_dst, const CUtensorMap* map, int32_t x, int32_t y,
                                       uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(SmemAddress(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(SmemAddress(bar)), "l"(policy)
      : "memory");
}

// A 16-byte (or 4-byte) global store with an L2 eviction policy.
__device__ inline void StoreGlobalHinted(void* dst, uint4 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy)
               : "memory");
}
__device__ inline void StoreGlobalHinted(float* dst, float v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(dst), "f"(v), "l"(policy)
               : "memory");
}

// 16 bytes from global memory (through L2 only) to shared memory, asynchronously: this thread's
// later CpAsyncWaitAll waits for them. No register holds the data in flight, so a loop of these
// keeps many loads outstanding without unrolling.
__device__ inline void CpAsync16(void* smem_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(SmemAddress(smem_dst)),
               "l"(global_src)
               : "memory");
}
__device__ inline void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ inline void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Orders this thread's ordinary shared-memory writes before later async-proxy (wgmma, TMA) reads.
__device__ inline void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// A barrier among kThreads threads (a multiple of 32) of the block; ids 1..15 (0 is
// __syncthreads). bar.sync is the .aligned form: every participating thread executes this same
// instruction, converged, which lets the compiler keep wgmma sequences after it unserialized.
template <int kId, int kThreads>
__device__ inline void NamedBarrier() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0);
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}

// The same for threads that reach the barrier from different places in the code (the roles of a
// warp-specialized kernel meeting in its epilogue), which the .aligned form forbids.
template <int kId, int kThreads>
__device__ inline void NamedBarrierFromAnywhere() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0);
  asm volatile("barrier.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}

// ---- register budget per warpgroup ----

// Hands registers back (producer warpgroups) or takes them (consumers); all warps of a warpgroup
// execute the same one. Needs a register cap at kernel entry (__launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ inline void IncreaseRegisters() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ inline void DecreaseRegisters() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// Signals a named barrier without waiting (the producer side of a producer-consumer pair; the
// consumer side calls NamedBarrier with the same id and count).
template <int kId, int kThreads>
__device__ inline void NamedBarrierArrive() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0);
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}

// Stores four 8x8 bf16 matrices from a warp's fragments (matrix k from register rk: lane t holds
// row t / 4, columns 2 * (t % 4) and + 1); lane t gives the address of row t % 8 of matrix t / 8.
__device__ inline void StoreMatrices8x8x4(void* row, uint32_t r0, uint32_t r1, uint32_t r2,
                                          uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(SmemAddress(row)),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// 2^x in one MUFU op: exp2f is ex2.approx without .ftz, which ptxas wraps in a range fix-up for
// results under 2^-126; a probability relative to its row max loses nothing by flushing those.
__device__ inline float Exp2FlushDenormals(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- wgmma ----------------------------------------------------------------------------------

// Shared-memory matrix descriptor with 128-byte swizzle. For a K-major operand (rows of 64
// contraction elements) `stride_bytes` is the distance between groups of 8 rows; for an MN-major
// operand (rows of 64 M or N elements, one row per contraction index) it is the distance between
// groups of 8 contraction rows, and `leading_bytes` the distance between 64-element column blocks.
__device__ inline uint64_t MakeSmemDescriptor(const void* smem, uint32_t leading_bytes,
                                              uint32_t stride_bytes) {
  const uint64_t address = SmemAddress(smem);
  return ((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ inline void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ inline void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ inline void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across an async wgmma.
template <int kCount>
__device__ inline void FenceRegisters(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x N] (+)= A[64 x 16] * B[16 x N], bf16 operands from shared memory, fp32 accumulators.
// kTransposeA: A is MN-major (its 64 M elements contiguous per contraction index).
template <int kN, int kTransposeA>
struct Wgmma;

template <int kTransposeA>
struct Wgmma<8, kTransposeA> {
  __device__ static void Run(float (&d)[4], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(accumulate), "n"(kTransposeA));
  }
};

template <int kTransposeA>
struct Wgmma<16, kTransposeA> {
  __device__ static void Run(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(a), "l"(b), "r"(accumulate), "n"(kTransposeA));
  }
};

template <int kTransposeA>
struct Wgmma<24, kTransposeA> {
  __device__ static void Run(float (&d)[12], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, %12, %13, p, 1, 1, %15, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
        : "l"(a), "l"(b), "r"(accumulate), "n"(kTransposeA));
  }
};

template <int kTransposeA>
struct Wgmma<32, kTransposeA> {
  __device__ static void Run(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, %19, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(accumulate), "n"(kTransposeA));
  }
};

}  // namespace treeverify::kernels::cuda::sm90
