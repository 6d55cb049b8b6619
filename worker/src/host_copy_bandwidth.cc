#include "treeverify/worker/host_copy_bandwidth.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace treeverify::worker {
namespace {

// 64 MiB each way: past any CPU's last-level cache, small enough for a test machine.
constexpr int64_t kBytes = int64_t{64} << 20;
constexpr int kRepeats = 5;

double Measure() {
  std::vector<char> src(kBytes, 1), dst(kBytes, 0);
  std::vector<double> rates;
  for (int r = 0; r < kRepeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
    {
      const int64_t threads = omp_get_num_threads();
      const int64_t chunk = (kBytes + threads - 1) / threads;
      const int64_t begin = std::min(kBytes, chunk * omp_get_thread_num());
      const int64_t end = std::min(kBytes, begin + chunk);
      std::memcpy(dst.data() + begin, src.data() + begin, end - begin);
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rates.push_back(2.0 * static_cast<double>(kBytes) / seconds);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace

double HostCopyBandwidth() {
  static const double measured = Measure();
  return measured;
}

}  // namespace treeverify::worker
