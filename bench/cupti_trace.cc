// A timeline of a CUDA program's kernels, copies, memsets and runtime calls, for the GPU machine,
// which has no Nsight Systems: CUPTI's activity API, loaded into the program through the
// driver's injection hook, writes one line per record when the program exits.
//
//   CUDA_INJECTION64_PATH=libcupti_trace.so TREEVERIFY_TRACE=trace.tsv ./rank_step_bench ...
//
// Lines: kind, start ns, end ns, name (kernel name, copy kind, runtime function). Timestamps are
// CUPTI's (GPU records and host API calls on one clock), so the gaps between kernels show where
// the device waited for the host.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>

namespace {

FILE* out = nullptr;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        std::fprintf(out, "kernel\t%llu\t%llu\t%s\n", static_cast<unsigned long long>(k->start),
                     static_cast<unsigned long long>(k->end), k->name);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        std::fprintf(out, "memcpy\t%llu\t%llu\tkind %u, %llu bytes\n",
                     static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->copyKind,
                     static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        std::fprintf(
            out, "memset\t%llu\t%llu\t%llu bytes\n", static_cast<unsigned long long>(m->start),
            static_cast<unsigned long long>(m->end), static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        std::fprintf(out, "runtime\t%llu\t%llu\t%s\n", static_cast<unsigned long long>(a->start),
                     static_cast<unsigned long long>(a->end), name != nullptr ? name : "?");
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void Flush() {
  cuptiActivityFlushAll(1);
  if (out != nullptr) std::fclose(out);
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("TREEVERIFY_TRACE");
  out = std::fopen(path != nullptr ? path : "trace.tsv", "w");
  if (out == nullptr) return 0;
  cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
  std::atexit(Flush);
  return 1;
}
