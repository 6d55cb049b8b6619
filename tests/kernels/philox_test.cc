// Philox4x32 against Random123's published known answers, and the Gumbel noise drawn from it:
// range, composition and distribution.
#include "treeverify/kernels/philox.h"

#include <cmath>
#include <cstdint>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace treeverify::kernels {
namespace {

struct KnownAnswer {
  int rounds;
  Philox4x32Block counter;
  uint32_t key[2];  // Random123's key[0], key[1]
  Philox4x32Block expected;
};

// Random123 1.14, tests/kat_vectors (github.com/DEShawResearch/random123), the philox4x32 lines;
// columns: rounds, CTR (4 words), KEY (2 words), EXPECTED (4 words):
//   philox4x32 7  00000000 00000000 00000000 00000000 00000000 00000000
//                 5f6fb709 0d893f64 4f121f81 4f730a48
//   philox4x32 7  ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff
//                 5207ddc2 45165e59 4d8ee751 8c52f662
//   philox4x32 7  243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0
//                 4dfccaba 190a87f0 c47362ba b6b5242a
//   philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000
//                 6627e8d5 e169c58d bc57ac4c 9b00dbd8
//   philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff
//                 408f276d 41c83b0e a20bc7c6 6d5451fd
//   philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0
//                 d16cfe09 94fdcceb 5001e420 24126ea1
constexpr KnownAnswer kKnownAnswers[] = {
    {7, {{0, 0, 0, 0}}, {0, 0}, {{0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48}}},
    {7,
     {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
     {0xffffffff, 0xffffffff},
     {{0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662}}},
    {7,
     {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
     {0xa4093822, 0x299f31d0},
     {{0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a}}},
    {10, {{0, 0, 0, 0}}, {0, 0}, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
    {10,
     {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
     {0xffffffff, 0xffffffff},
     {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
    {10,
     {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
     {0xa4093822, 0x299f31d0},
     {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
};

TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  for (const KnownAnswer& kat : kKnownAnswers) {
    const uint64_t key = (uint64_t{kat.key[1]} << 32) | kat.key[0];
    const Philox4x32Block out =
        kat.rounds == 7 ? Philox4x32<7>(kat.counter, key) : Philox4x32<10>(kat.counter, key);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(out.word[i], kat.expected.word[i])
          << "rounds " << kat.rounds << " counter[0] " << std::hex << kat.counter.word[0]
          << " word " << i;
    }
  }
}

TEST(PhiloxTest, IsConstexpr) {
  constexpr Philox4x32Block out = Philox4x32({{0, 0, 0, 0}}, 0);
  static_assert(out.word[0] == 0x6627e8d5u);
  EXPECT_EQ(out.word[3], 0x9b00dbd8u);
}

TEST(GumbelNoiseTest, WordsMapStrictlyInsideTheBound) {
  const double lowest = GumbelFromWord(0);
  const double highest = GumbelFromWord(0xffffffffu);
  // u = 2^-33 and 1 - 2^-33.
  EXPECT_NEAR(lowest, -std::log(-std::log(std::ldexp(1.0, -33))), 1e-12);
  EXPECT_NEAR(highest, -std::log(std::ldexp(1.0, -33)), 1e-6);
  EXPECT_TRUE(std::isfinite(lowest));
  EXPECT_LT(highest, kGumbelNoiseBound);
  EXPECT_GT(lowest, -kGumbelNoiseBound);
  EXPECT_LT(GumbelFromWord(0x7fffffffu), GumbelFromWord(0x80000000u));
}

TEST(GumbelNoiseTest, IsPhiloxOfSeedPositionAndToken) {
  const uint64_t seed = 0x299f31d0a4093822ull;
  for (int64_t position : {int64_t{0}, int64_t{1}, int64_t{4097}, int64_t{123456789}}) {
    for (int32_t token : {0, 5, 129279}) {
      const Philox4x32Block counter = {
          {static_cast<uint32_t>(position), static_cast<uint32_t>(token), 0, 0}};
      EXPECT_EQ(GumbelNoise(seed, position, token),
                GumbelFromWord(Philox4x32<10>(counter, seed).word[0]))
          << "position " << position << " token " << token;
    }
  }
  // Every argument changes the noise.
  EXPECT_NE(GumbelNoise(1, 2, 3), GumbelNoise(2, 2, 3));
  EXPECT_NE(GumbelNoise(1, 2, 3), GumbelNoise(1, 3, 3));
  EXPECT_NE(GumbelNoise(1, 2, 3), GumbelNoise(1, 2, 4));
  EXPECT_EQ(GumbelMaxScore(1.5f, 0.5f, 1, 2, 3), 3.0 + GumbelNoise(1, 2, 3));
}

// Gumbel(0, 1) has mean = the Euler-Mascheroni constant and variance pi^2 / 6.
TEST(GumbelNoiseTest, HasTheGumbelMoments) {
  const uint64_t seed = 20240611;
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  const int n = 1 << 20;
  double sum = 0.0, sum_sq = 0.0;
  for (int i = 0; i < n; ++i) {
    const double g = GumbelNoise(seed, i >> 10, i & 1023);
    sum += g;
    sum_sq += g * g;
  }
  const double mean = sum / n;
  const double variance = sum_sq / n - mean * mean;
  // Standard errors: sqrt(1.645 / 2^20) = 0.0013 for the mean, about 0.005 for the variance.
  EXPECT_NEAR(mean, std::numbers::egamma, 0.01);
  EXPECT_NEAR(variance, std::numbers::pi * std::numbers::pi / 6.0, 0.03);
}

}  // namespace
}  // namespace treeverify::kernels
