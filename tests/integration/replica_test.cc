// The harness itself: child processes are read with deadlines and killed with their whole process
// group, and a replica that cannot start says why (its processes' stderr) without leaving
// anything running.
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "test_support.h"

namespace treeverify::integration {
namespace {

using testing::HasSubstr;

bool ProcessExists(pid_t pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

TEST(ChildProcessTest, ReadsLinesWithDeadlinesAndKillsTheWholeGroup) {
  // The shell starts a grandchild in its process group and prints its pid.
  auto child = ChildProcess::Start(
      {.argv = {"/bin/sh", "-c", "sleep 60 & echo grandchild $!; echo ready; sleep 60"},
       .stderr_path = ScratchDir() + "/child_process_test.log",
       .name = "shell"});
  ASSERT_TRUE(child.ok()) << child.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<std::string> line = (*child)->ReadLineContaining("grandchild", deadline);
  ASSERT_TRUE(line.ok()) << line.status();
  pid_t grandchild = 0;
  ASSERT_TRUE(absl::SimpleAtoi(line->substr(line->rfind(' ') + 1), &grandchild)) << *line;
  EXPECT_TRUE((*child)->ReadLineContaining("ready", deadline).ok());

  const absl::Time start = absl::Now();
  EXPECT_EQ(
      (*child)->ReadLineContaining("never", absl::Now() + absl::Milliseconds(200)).status().code(),
      absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*child)->WaitForExit(absl::Milliseconds(200)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE((*child)->Running());
  EXPECT_TRUE(ProcessExists(grandchild));

  (*child)->Kill();
  EXPECT_FALSE((*child)->Running());
  ASSERT_TRUE((*child)->wait_status().has_value());
  EXPECT_TRUE(WIFSIGNALED(*(*child)->wait_status()));
  EXPECT_EQ(WTERMSIG(*(*child)->wait_status()), SIGKILL);
  // The grandchild went with the group (it is reparented and reaped, or a zombie at worst, for a
  // moment).
  bool gone = false;
  for (int attempt = 0; attempt < 200 && !gone; ++attempt) {
    gone = !ProcessExists(grandchild);
    if (!gone) {
      FILE* stat = std::fopen(("/proc/" + std::to_string(grandchild) + "/stat").c_str(), "r");
      if (stat != nullptr) {
        char buffer[256] = {};
        gone = std::fgets(buffer, sizeof(buffer), stat) != nullptr &&
               std::string(buffer).find(") Z") != std::string::npos;
        std::fclose(stat);
      }
      if (!gone) absl::SleepFor(absl::Milliseconds(10));
    }
  }
  EXPECT_TRUE(gone) << "grandchild " << grandchild << " survived the group kill";

  // A child that exits by itself: stdout closing ends a read at once.
  auto short_lived = ChildProcess::Start({.argv = {"/bin/sh", "-c", "exit 3"}, .name = "exit"});
  ASSERT_TRUE(short_lived.ok()) << short_lived.status();
  EXPECT_EQ((*short_lived)
                ->ReadLineContaining("anything", absl::Now() + absl::Seconds(10))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<int> status = (*short_lived)->WaitForExit(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(DescribeWaitStatus(*status), "exited with status 3");
}

TEST(ReplicaStartTest, AFailedStartSaysWhyAndLeavesNothingRunning) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Replica>> replica =
      Replica::Start({.world_size = 1,
                      .coordinator_flags = {"--max-batch-rows", "1"},
                      .start_timeout = absl::Seconds(30)});
  ASSERT_FALSE(replica.ok());
  // The coordinator refused its flags and exited: its stderr is in the status.
  EXPECT_THAT(std::string(replica.status().message()), HasSubstr("max_batch_rows"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // Nothing is left: this process has no children at all.
  errno = 0;
  EXPECT_EQ(waitpid(-1, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
}

}  // namespace
}  // namespace treeverify::integration
