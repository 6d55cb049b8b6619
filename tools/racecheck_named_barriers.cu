// Which of the wgmma kernels' shared-memory orderings does compute-sanitizer's racecheck model
// (bench/NOTES.md, "Sanitizers" and step 40)? Correct hand-offs of shared memory from warpgroup 0
// (writes) to warpgroup 1 (reads), 256 threads:
//   syncthreads: both __syncthreads();
//   sync-sync:   both `bar.sync 1, 256` (the .aligned form, from the same place in the code);
//   arrive-sync: the writers `bar.arrive 1, 256`, the readers `bar.sync 1, 256` (the producer-
//                consumer form of the kernels' "tile ready");
//   from-anywhere: both `barrier.sync 1, 256` from different places in the code;
//   mbarrier:    the writers arrive on an mbarrier (count 128), the readers wait on its phase
//                (the kernels' "empty" stages, consumers to producer);
//   bulk-copy:   one thread of warpgroup 0 copies global memory into the buffer with
//                cp.async.bulk (the TMA's async proxy) completing on an mbarrier; the readers
//                wait on it (the kernels' "full" stages).
//   ping-pong:   the wide kernel's tile ownership: the warpgroups own tiles 0..7 in turn, the
//                owner writes the buffer and arrives on barrier 1 or 2 by tile parity, the other
//                waits there and reads it; the next tile's owner (the reader) then writes the
//                buffer again, ordered after the other side's accesses only through that chain
//                of barriers (a bar.arrive synchronizes with the bar.sync of the same barrier).
// Each kernel checks its own result; racecheck's reports are what the probe is for. Run 86 of
// bench/NOTES.md (step 45): the first six are clean, ping-pong is reported.
//
//   nvcc -arch=sm_90a -o racecheck_named_barriers tools/racecheck_named_barriers.cu
//   compute-sanitizer --tool racecheck ./racecheck_named_barriers
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>

namespace {

enum Handoff { kSyncthreads, kSyncSync, kArriveSync, kFromAnywhere, kMbarrier, kBulkCopy };

__device__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ void WaitPhase0(uint64_t* bar) {
  asm volatile(
      "{\n.reg .pred done;\nwait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra wait_loop;\n}\n" ::"r"(SmemAddress(bar))
      : "memory");
}

template <Handoff kHandoff>
__global__ void HandOff(int* out, const int* in) {
  __shared__ alignas(128) int buffer[128];
  __shared__ alignas(8) uint64_t bar;
  const int t = threadIdx.x;
  if (t == 0) {
    const int count = kHandoff == kMbarrier ? 128 : 1;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddress(&bar)), "r"(count));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (t < 128) {
    if constexpr (kHandoff == kBulkCopy) {
      if (t == 0) {
        asm volatile(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddress(&bar)),
            "r"(512)
            : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(SmemAddress(buffer)),
            "l"(in), "r"(512), "r"(SmemAddress(&bar))
            : "memory");
      }
    } else {
      buffer[t] = 3 * t + 1;
    }
    if constexpr (kHandoff == kSyncthreads) __syncthreads();
    if constexpr (kHandoff == kSyncSync) asm volatile("bar.sync 1, 256;" ::: "memory");
    if constexpr (kHandoff == kArriveSync) asm volatile("bar.arrive 1, 256;" ::: "memory");
    if constexpr (kHandoff == kFromAnywhere) asm volatile("barrier.sync 1, 256;" ::: "memory");
    if constexpr (kHandoff == kMbarrier) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddress(&bar)) : "memory");
    }
  } else {
    if constexpr (kHandoff == kSyncthreads) __syncthreads();
    if constexpr (kHandoff == kSyncSync) asm volatile("bar.sync 1, 256;" ::: "memory");
    if constexpr (kHandoff == kArriveSync) asm volatile("bar.sync 1, 256;" ::: "memory");
    if constexpr (kHandoff == kFromAnywhere) asm volatile("barrier.sync 1, 256;" ::: "memory");
    if constexpr (kHandoff == kMbarrier || kHandoff == kBulkCopy) WaitPhase0(&bar);
    out[t - 128] = buffer[255 - t];
  }
}

// The ping-pong hand-off: thread j of each warpgroup writes and reads slot j only, so every
// ordering between the warpgroups comes from the barriers.
__global__ void PingPong(int* out) {
  __shared__ int buffer[128];
  const int wg = threadIdx.x / 128;
  const int j = threadIdx.x % 128;
  int sum = 0;
  for (int tile = 0; tile < 8; ++tile) {
    if (tile % 2 == wg) {
      buffer[j] = 1000 * tile + j;
      if (tile % 2 == 0) {
        asm volatile("bar.arrive 1, 256;" ::: "memory");
      } else {
        asm volatile("bar.arrive 2, 256;" ::: "memory");
      }
    } else {
      if (tile % 2 == 0) {
        asm volatile("bar.sync 1, 256;" ::: "memory");
      } else {
        asm volatile("bar.sync 2, 256;" ::: "memory");
      }
      sum += buffer[j];
    }
  }
  out[threadIdx.x] = sum;
}

bool RunPingPong(int* out) {
  PingPong<<<1, 256>>>(out);
  int host[256];
  if (cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  bool ok = true;
  for (int t = 0; t < 256; ++t) {
    int expected = 0;
    for (int tile = 1 - t / 128; tile < 8; tile += 2) expected += 1000 * tile + t % 128;
    ok = ok && host[t] == expected;
  }
  std::printf("%-14s %s\n", "ping-pong", ok ? "correct" : "WRONG");
  return ok;
}

template <Handoff kHandoff>
bool Run(const char* name, int* out, const int* in) {
  HandOff<kHandoff><<<1, 256>>>(out, in);
  int host[128];
  if (cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  bool ok = true;
  for (int i = 0; i < 128; ++i) ok = ok && host[i] == 3 * (127 - i) + 1;
  std::printf("%-14s %s\n", name, ok ? "correct" : "WRONG");
  return ok;
}

}  // namespace

int main() {
  int* out = nullptr;
  int* in = nullptr;
  if (cudaMalloc(&out, 256 * sizeof(int)) != cudaSuccess) return 1;
  if (cudaMalloc(&in, 128 * sizeof(int)) != cudaSuccess) return 1;
  int host[128];
  for (int i = 0; i < 128; ++i) host[i] = 3 * i + 1;  // what the bulk copy brings
  cudaMemcpy(in, host, sizeof(host), cudaMemcpyHostToDevice);
  bool ok = Run<kSyncthreads>("syncthreads", out, in);
  ok = Run<kSyncSync>("sync-sync", out, in) && ok;
  ok = Run<kArriveSync>("arrive-sync", out, in) && ok;
  ok = Run<kFromAnywhere>("from-anywhere", out, in) && ok;
  ok = Run<kMbarrier>("mbarrier", out, in) && ok;
  ok = Run<kBulkCopy>("bulk-copy", out, in) && ok;
  ok = RunPingPong(out) && ok;
  cudaFree(in);
  cudaFree(out);
  return ok ? 0 : 1;
}
