// The counter-based random numbers behind exact, reproducible sampling: Philox4x32-10 (Salmon,
// Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011, with Random123's
// constants) and the Gumbel noise drawn from it.
//
// The noise for token v at absolute position p depends only on (seed, p, v), so every rank, the
// coordinator and the GPU draw the same number for the same token without sharing state, and the
// sampled token does not depend on the tree, the batch or the vocabulary split:
//
//   token = argmax_v GumbelMaxScore(logit_v, temperature, seed, position, v)
//
// is an exact sample of softmax(logits / temperature). Header-only and usable from CUDA code.
#pragma once

#include <cmath>
#include <cstdint>

#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels {

struct Philox4x32Block {
  uint32_t word[4];
};

inline constexpr uint32_t kPhilox4x32Multiplier0 = 0xD2511F53u;
inline constexpr uint32_t kPhilox4x32Multiplier1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhilox32Weyl0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kPhilox32Weyl1 = 0xBB67AE85u;  // sqrt(3) - 1

// Philox4x32 with `Rounds` rounds (10 is the standard, crush-resistant choice). The key's low
// word is Random123's key[0], its high word key[1].
template <int Rounds = 10>
TV_HOST_DEVICE constexpr Philox4x32Block Philox4x32(Philox4x32Block counter, uint64_t key) {
  uint32_t key0 = static_cast<uint32_t>(key);
  uint32_t key1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < Rounds; ++round) {
    if (round > 0) {
      key0 += kPhilox32Weyl0;
      key1 += kPhilox32Weyl1;
    }
    const uint64_t product0 = uint64_t{kPhilox4x32Multiplier0} * counter.word[0];
    const uint64_t product1 = uint64_t{kPhilox4x32Multiplier1} * counter.word[2];
    counter = {{static_cast<uint32_t>(product1 >> 32) ^ counter.word[1] ^ key0,
                static_cast<uint32_t>(product1),
                static_cast<uint32_t>(product0 >> 32) ^ counter.word[3] ^ key1,
                static_cast<uint32_t>(product0)}};
  }
  return counter;
}

// Gumbel(0, 1) noise from one 32-bit random word: u = (word + 0.5) / 2^32 lies strictly inside
// (0, 1), so g = -log(-log(u)) is finite: g in [-3.13, 22.88]. All in double.
TV_HOST_DEVICE inline double GumbelFromWord(uint32_t word) {
  const double u = (static_cast<double>(word) + 0.5) * (1.0 / 4294967296.0);
#if defined(__CUDA_ARCH__)
  return -::log(-::log(u));
#else
  return -std::log(-std::log(u));
#endif
}

// An upper bound on every value GumbelNoise returns. A column whose logit / T + bound cannot beat
// the best score so far can be skipped without changing the winner.
inline constexpr double kGumbelNoiseBound = 23.0;

// The noise of token `token` at absolute position `position` under `seed`: Philox4x32-10 keyed by
// the seed at counter (position, token, 0, 0), first output word. Positions are taken modulo
// 2^32 (contexts are far shorter).
TV_HOST_DEVICE inline double GumbelNoise(uint64_t seed, int64_t position, int32_t token) {
  const Philox4x32Block counter = {
      {static_cast<uint32_t>(position), static_cast<uint32_t>(token), 0u, 0u}};
  return GumbelFromWord(Philox4x32<10>(counter, seed).word[0]);
}

// The Gumbel-max score of one token: double(logit) / T plus its noise. Ranks and coordinator
// both compute it with this function, so they agree bit for bit. temperature must be > 0.
TV_HOST_DEVICE inline double GumbelMaxScore(float logit, float temperature, uint64_t seed,
                                            int64_t position, int32_t token) {
  return static_cast<double>(logit) / static_cast<double>(temperature) +
         GumbelNoise(seed, position, token);
}

}  // namespace treeverify::kernels
