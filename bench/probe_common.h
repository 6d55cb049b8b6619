// What the GPU probes (gemm_algo_probe, phase_stream_probe, wgmma_shape_probe) share: a failed
// call ends the probe naming it, the median of repeated timings, and the one flag they take.
//
//   CHECK_CUDA(cudaStreamCreate(&stream));
//   const std::optional<std::string> out_dir = OutDirArgument(argc, argv);
//   if (!out_dir) return 2;
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace treeverify::bench {

// Ends the probe unless `ok`, naming the file and line, the failed expression and why.
inline void Check(bool ok, const char* file, int line, const char* expression, const char* detail) {
  if (ok) return;
  const char* slash = std::strrchr(file, '/');
  std::fprintf(stderr, "%s:%d %s: %s\n", slash != nullptr ? slash + 1 : file, line, expression,
               detail);
  std::exit(1);
}

inline double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// `[--out DIR]` (default "."), or nullopt after printing the usage for anything else.
inline std::optional<std::string> OutDirArgument(int argc, char** argv) {
  std::string out_dir = ".";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--out DIR]\n", argv[0]);
      return std::nullopt;
    }
  }
  return out_dir;
}

}  // namespace treeverify::bench

#define CHECK_CUDA(expr)                                                     \
  do {                                                                       \
    const cudaError_t e_ = (expr);                                           \
    ::treeverify::bench::Check(e_ == cudaSuccess, __FILE__, __LINE__, #expr, \
                               cudaGetErrorString(e_));                      \
  } while (0)
