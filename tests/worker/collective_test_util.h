// Helpers shared by the collective tests (in-process and Gloo communicators): ranks as threads
// with a hang guard, data whose sums depend on the order of additions, and the reference sum in
// rank order.
#pragma once

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace treeverify::worker::testing_util {

// TREEVERIFY_TEST_SEED reruns a failing seed; otherwise a fresh one.
inline uint32_t TestSeed() {
  if (const char* seed = std::getenv("TREEVERIFY_TEST_SEED")) {
    return static_cast<uint32_t>(std::strtoul(seed, nullptr, 10));
  }
  return std::random_device()();
}

// Runs body(rank) on one thread per rank. A collective that hangs would hang the test binary,
// so after `deadline` it aborts with a message instead.
inline void RunRanks(int world_size, const std::function<void(int)>& body,
                     std::chrono::seconds deadline = std::chrono::seconds(60)) {
  std::mutex mutex;
  std::condition_variable all_done;
  int finished = 0;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      body(rank);
      std::lock_guard<std::mutex> lock(mutex);
      ++finished;
      all_done.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (!all_done.wait_for(lock, deadline, [&] { return finished == world_size; })) {
      std::cerr << "collective hung: " << finished << " of " << world_size
                << " ranks finished within " << deadline.count() << " s\n";
      std::abort();
    }
  }
  for (std::thread& thread : threads) thread.join();
}

// Floats over many binades, so the order of additions changes the rounding.
inline std::vector<float> RandomData(std::mt19937_64& rng, size_t length) {
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<float> data(length);
  for (float& x : data) x = std::ldexp(mantissa(rng), exponent(rng));
  return data;
}

// The sum in rank order, written independently of the implementations.
inline std::vector<float> RankOrderSum(const std::vector<std::vector<float>>& inputs) {
  std::vector<float> sum = inputs[0];
  for (size_t rank = 1; rank < inputs.size(); ++rank) {
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i] + inputs[rank][i];
  }
  return sum;
}

}  // namespace treeverify::worker::testing_util
