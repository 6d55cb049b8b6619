#include "treeverify/worker/communicator.h"

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
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collective_test_util.h"
#include "gtest/gtest.h"

namespace treeverify::worker {
namespace {

using testing_util::RandomData;
using testing_util::RankOrderSum;
using testing_util::RunRanks;
using testing_util::TestSeed;

TEST(SoloCommunicatorTest, IsTheIdentity) {
  SoloCommunicator solo;
  EXPECT_EQ(solo.rank(), 0);
  EXPECT_EQ(solo.world_size(), 1);
  std::vector<float> data = {1.5f, -2.25f, 3.0f};
  const std::vector<float> before = data;
  ASSERT_TRUE(solo.AllReduceSum(absl::MakeSpan(data)).ok());
  EXPECT_EQ(data, before);
}

TEST(InProcessGroupTest, RejectsAnEmptyWorld) {
  EXPECT_EQ(InProcessGroup::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InProcessGroup::Create(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(InProcessGroupTest, MembersKnowTheirRank) {
  auto created = InProcessGroup::Create(3);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<InProcessGroup> group = std::move(*created);
  EXPECT_EQ(group->world_size(), 3);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(group->communicator(rank)->rank(), rank);
    EXPECT_EQ(group->communicator(rank)->world_size(), 3);
  }
}

class AllReduceTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(AllReduceTest, SumsInRankOrderBitExactly) {
  const auto [world_size, length] = GetParam();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed, " (rerun with TREEVERIFY_TEST_SEED=", seed, ")"));
  std::cout << "SumsInRankOrderBitExactly W=" << world_size << " length=" << length << " seed "
            << seed << "\n";
  std::mt19937_64 rng(seed);

  std::vector<std::vector<float>> inputs;
  for (int rank = 0; rank < world_size; ++rank) inputs.push_back(RandomData(rng, length));
  const std::vector<float> expected = RankOrderSum(inputs);

  auto created = InProcessGroup::Create(world_size);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<InProcessGroup> group = std::move(*created);
  std::vector<std::vector<float>> outputs = inputs;
  std::vector<absl::Status> statuses(world_size);
  RunRanks(world_size, [&](int rank) {
    statuses[rank] = group->communicator(rank)->AllReduceSum(absl::MakeSpan(outputs[rank]));
  });
  for (int rank = 0; rank < world_size; ++rank) {
    ASSERT_TRUE(statuses[rank].ok()) << "rank " << rank << ": " << statuses[rank];
    for (size_t i = 0; i < length; ++i) {
      ASSERT_EQ(outputs[rank][i], expected[i]) << "rank " << rank << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndLengths, AllReduceTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(size_t{1}, size_t{7}, size_t{733})));

TEST(InProcessGroupTest, BackToBackCollectivesDoNotRace) {
  const int world_size = 4;
  const int calls = 3000;
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed, " (rerun with TREEVERIFY_TEST_SEED=", seed, ")"));
  std::cout << "BackToBackCollectivesDoNotRace seed " << seed << "\n";
  std::mt19937_64 rng(seed);

  // inputs[call][rank]. The length changes from call to call. About one call in five is
  // malformed (one rank passes one element more): it must fail on every rank, leave the data
  // alone, and not disturb the calls around it.
  std::vector<std::vector<std::vector<float>>> inputs(calls);
  std::vector<bool> malformed(calls);
  for (int call = 0; call < calls; ++call) {
    const size_t length = 1 + rng() % 97;
    malformed[call] = rng() % 5 == 0;
    const int odd_rank = static_cast<int>(rng() % world_size);
    for (int rank = 0; rank < world_size; ++rank) {
      const bool longer = malformed[call] && rank == odd_rank;
      inputs[call].push_back(RandomData(rng, length + (longer ? 1 : 0)));
    }
  }
  std::vector<uint32_t> rank_seeds;
  for (int rank = 0; rank < world_size; ++rank) rank_seeds.push_back(static_cast<uint32_t>(rng()));

  auto created = InProcessGroup::Create(world_size);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<InProcessGroup> group = std::move(*created);
  std::vector<std::vector<std::vector<float>>> outputs(calls,
                                                       std::vector<std::vector<float>>(world_size));
  std::vector<std::vector<absl::StatusCode>> codes(
      calls, std::vector<absl::StatusCode>(world_size, absl::StatusCode::kUnknown));
  RunRanks(world_size, [&](int rank) {
    // Each rank reuses one buffer (as a forward pass does) and dawdles at random, so fast
    // ranks start the next collective while slow ones are still finishing the last.
    std::mt19937 timing(rank_seeds[rank]);
    std::vector<float> buffer;
    for (int call = 0; call < calls; ++call) {
      buffer = inputs[call][rank];
      if (timing() % 4 == 0) std::this_thread::yield();
      if (timing() % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
      codes[call][rank] = group->communicator(rank)->AllReduceSum(absl::MakeSpan(buffer)).code();
      outputs[call][rank] = buffer;
    }
  });

  for (int call = 0; call < calls; ++call) {
    const std::vector<float> expected =
        malformed[call] ? std::vector<float>() : RankOrderSum(inputs[call]);
    for (int rank = 0; rank < world_size; ++rank) {
      if (malformed[call]) {
        ASSERT_EQ(codes[call][rank], absl::StatusCode::kInvalidArgument)
            << "call " << call << " rank " << rank;
        ASSERT_EQ(outputs[call][rank], inputs[call][rank]) << "call " << call << " rank " << rank;
      } else {
        ASSERT_EQ(codes[call][rank], absl::StatusCode::kOk) << "call " << call << " rank " << rank;
        ASSERT_EQ(outputs[call][rank], expected) << "call " << call << " rank " << rank;
      }
    }
  }
}

TEST(InProcessGroupTest, MismatchedLengthsFailOnEveryRankAndTheGroupRecovers) {
  const int world_size = 3;
  auto created = InProcessGroup::Create(world_size);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<InProcessGroup> group = std::move(*created);

  std::vector<std::vector<float>> buffers = {{1, 2, 3, 4, 5}, {1, 2, 3, 4, 5}, {1, 2, 3, 4, 5, 6}};
  const std::vector<std::vector<float>> before = buffers;
  std::vector<absl::Status> statuses(world_size);
  RunRanks(world_size, [&](int rank) {
    statuses[rank] = group->communicator(rank)->AllReduceSum(absl::MakeSpan(buffers[rank]));
  });
  for (int rank = 0; rank < world_size; ++rank) {
    EXPECT_EQ(statuses[rank].code(), absl::StatusCode::kInvalidArgument) << "rank " << rank;
    EXPECT_EQ(buffers[rank], before[rank]) << "rank " << rank << " data changed on failure";
  }

  // The failed call kept the barrier phases aligned: the next collective works.
  std::vector<std::vector<float>> next = {{1.0f, 2.0f}, {10.0f, 20.0f}, {100.0f, 200.0f}};
  RunRanks(world_size, [&](int rank) {
    statuses[rank] = group->communicator(rank)->AllReduceSum(absl::MakeSpan(next[rank]));
  });
  for (int rank = 0; rank < world_size; ++rank) {
    ASSERT_TRUE(statuses[rank].ok()) << "rank " << rank << ": " << statuses[rank];
    EXPECT_EQ(next[rank], (std::vector<float>{111.0f, 222.0f})) << "rank " << rank;
  }
}

}  // namespace
}  // namespace treeverify::worker
