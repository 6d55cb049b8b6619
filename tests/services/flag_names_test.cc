// Flags documented with dashes reach Abseil with underscores; values and positional arguments
// keep their dashes.
#include "treeverify/services/flag_names.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace treeverify::services {
namespace {

TEST(FlagNamesTest, DashesInNamesBecomeUnderscores) {
  std::vector<std::string> args = {"treeverify-worker",
                                   "--world-size=2",
                                   "--kv-page-size",
                                   "64",
                                   "--model=/m/a-b",
                                   "-group-epoch=3",
                                   "--rank",
                                   "1",
                                   "--",
                                   "--not-a-flag"};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  EXPECT_THAT(NormalizeFlagNames(static_cast<int>(argv.size()), argv.data()),
              testing::ElementsAre("treeverify-worker", "--world_size=2", "--kv_page_size", "64",
                                   "--model=/m/a-b", "-group_epoch=3", "--rank", "1", "--",
                                   "--not-a-flag"));
  FlagArgs flag_args(static_cast<int>(argv.size()), argv.data());
  ASSERT_EQ(flag_args.argc(), 10);
  EXPECT_STREQ(flag_args.argv()[1], "--world_size=2");
}

}  // namespace
}  // namespace treeverify::services
