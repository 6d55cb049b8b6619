// Failures of real processes: a worker killed mid-run (in-flight calls end with UNAVAILABLE within
// their deadline, health turns NOT_SERVING, the coordinator stays up and answers), and SIGTERM to
// a coordinator with sessions open (it drains and exits 0 within its grace period).
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "test_support.h"

namespace treeverify::integration {
namespace {

// What one generating thread saw.
struct ThreadOutcome {
  int64_t steps = 0;
  absl::Status final_status;  // of the call that failed (OK if none failed)
  absl::Duration final_call;  // how long that call took
  absl::Time ended = absl::InfinitePast();
};

class LostRankTest : public ReplicaTest {
 protected:
  // Four threads step sessions of a TP 2 replica; then `signal` goes to worker `lost_rank`
  // (SIGKILL: a crash, the sockets close at once; SIGSTOP: a hang, only the deadlines notice).
  void ExpectLostRankFailsCallsAndCoordinatorStaysUp(int lost_rank, int signal,
                                                     int rank_timeout_seconds);
};

void LostRankTest::ExpectLostRankFailsCallsAndCoordinatorStaysUp(int lost_rank, int signal,
                                                                 int rank_timeout_seconds) {
  Replica* replica = StartReplica(
      {.world_size = 2,
       .coordinator_flags = {"--rank-timeout-s", std::to_string(rank_timeout_seconds)},
       .worker_flags = {"--collective-timeout-s", std::to_string(rank_timeout_seconds)}});
  ASSERT_NE(replica, nullptr);
  // Calls get a client deadline well past the rank timeout: the server must end them first.
  auto client = replica->NewClient(absl::Seconds(3 * rank_timeout_seconds));
  ASSERT_TRUE(client.ok()) << client.status();
  services::VerifierClient& api = **client;

  constexpr int kThreads = 4;
  std::vector<coordinator::SessionId> sessions;
  for (int t = 0; t < kThreads; ++t) {
    absl::StatusOr<coordinator::CreateSessionOutput> created = api.CreateSession(
        {.prompt_token_ids = {30 + t, 31, 32, 30 + t, 31, 32}, .stopping = {.ignore_eos = true}});
    ASSERT_TRUE(created.ok()) << created.status();
    sessions.push_back(created->session_id);
  }
  std::atomic<int64_t> total_steps{0};
  std::vector<ThreadOutcome> seen(kThreads);
  std::vector<std::thread> threads;
  const absl::Time give_up = absl::Now() + absl::Seconds(120);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Steps until a call fails (the kill) or, as a safety net, the session's context nears
      // its end or time runs out.
      for (int step = 0; step < 900 && absl::Now() < give_up; ++step) {
        const absl::Time start = absl::Now();
        absl::StatusOr<coordinator::VerifyOutput> out = api.Verify(
            {.session_id = sessions[t], .draft_token_ids = {7, 8}, .draft_parents = {-1, 0}});
        if (!out.ok()) {
          seen[t].final_status = out.status();
          seen[t].final_call = absl::Now() - start;
          break;
        }
        ++seen[t].steps;
        ++total_steps;
      }
      seen[t].ended = absl::Now();
    });
  }
  // Let the threads get going, then lose the rank.
  const absl::Time warm_up = absl::Now() + absl::Seconds(30);
  while (total_steps.load() < 8 * kThreads && absl::Now() < warm_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GE(total_steps.load(), 8 * kThreads) << "the sessions hardly stepped before the kill";
  const absl::Time killed = absl::Now();
  replica->worker(lost_rank).Signal(signal);
  for (std::thread& t : threads) t.join();

  // Every thread's next (or in-flight) call failed with UNAVAILABLE, within the rank timeout
  // plus a margin, and nothing hung.
  const absl::Duration bound = absl::Seconds(rank_timeout_seconds + 5);
  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE(testing::Message() << "thread " << t << " (" << seen[t].steps << " steps)");
    EXPECT_EQ(seen[t].final_status.code(), absl::StatusCode::kUnavailable) << seen[t].final_status;
    EXPECT_THAT(std::string(seen[t].final_status.message()), testing::HasSubstr("rank"));
    EXPECT_LT(seen[t].final_call, bound);
    EXPECT_LT(seen[t].ended - killed, bound);
    std::cout << "thread " << t << ": " << seen[t].final_status << " after "
              << absl::FormatDuration(seen[t].ended - killed) << " from the kill\n";
  }

  // Health turns NOT_SERVING within a few seconds (the coordinator polls the engine).
  bool not_serving = false;
  const absl::Time health_deadline = absl::Now() + absl::Seconds(5);
  while (!not_serving && absl::Now() < health_deadline) {
    absl::StatusOr<bool> serving = api.CheckHealth(std::string(v1::Verifier::service_full_name()));
    ASSERT_TRUE(serving.ok()) << serving.status();
    not_serving = !*serving;
    if (!not_serving) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(not_serving) << "health still SERVING 5 s after the calls failed";
  absl::StatusOr<bool> overall = api.CheckHealth("");
  ASSERT_TRUE(overall.ok()) << overall.status();
  EXPECT_FALSE(*overall);

  // The coordinator is still up: it answers GetModelInfo, refuses new work with UNAVAILABLE.
  EXPECT_TRUE(replica->coordinator().Running());
  absl::StatusOr<coordinator::ModelInfo> info = api.GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->world_size, 2);
  EXPECT_EQ(api.CreateSession({.prompt_token_ids = {3, 4}}).status().code(),
            absl::StatusCode::kUnavailable);
  const absl::Time start = absl::Now();
  EXPECT_EQ(api.Verify({.session_id = sessions[0]}).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, bound);
  EXPECT_TRUE(api.CloseSession(sessions[0]).ok());
  EXPECT_TRUE(replica->coordinator().Running());
}

TEST_F(LostRankTest, KilledWorkerFailsCallsWithUnavailableAndCoordinatorStaysUp) {
  ExpectLostRankFailsCallsAndCoordinatorStaysUp(/*rank=*/1, SIGKILL, /*rank_timeout_seconds=*/10);
}

TEST_F(LostRankTest, KilledRankZeroFailsCallsWithUnavailableAndCoordinatorStaysUp) {
  ExpectLostRankFailsCallsAndCoordinatorStaysUp(/*rank=*/0, SIGKILL, /*rank_timeout_seconds=*/10);
}

// A hung worker (stopped, its sockets open) is noticed only through the deadlines: the rank
// timeout on the coordinator's call, the collective timeout on the other rank. A short timeout
// keeps the test quick; the fixture's SIGKILL ends the stopped process.
TEST_F(LostRankTest, HungWorkerFailsCallsWithinTheRankTimeout) {
  ExpectLostRankFailsCallsAndCoordinatorStaysUp(/*rank=*/1, SIGSTOP, /*rank_timeout_seconds=*/4);
}

// SIGTERM with sessions open and a session stepping: the coordinator drains (in-flight calls
// end, OK or UNAVAILABLE, none hangs) and exits 0 within its grace period; SIGTERM to the workers
// then stops them with 0 too (anything left is killed by the fixture).
TEST_F(ReplicaTest, SigtermDrainsAndExitsZero) {
  constexpr int kGraceSeconds = 3;
  Replica* replica =
      StartReplica({.world_size = 2,
                    .coordinator_flags = {"--shutdown-grace-s", std::to_string(kGraceSeconds)},
                    .worker_flags = {"--shutdown-grace-s", std::to_string(kGraceSeconds)}});
  ASSERT_NE(replica, nullptr);
  auto client = replica->NewClient(absl::Seconds(30));
  ASSERT_TRUE(client.ok()) << client.status();
  services::VerifierClient& api = **client;
  std::vector<coordinator::SessionId> sessions;
  for (int s = 0; s < 3; ++s) {
    absl::StatusOr<coordinator::CreateSessionOutput> created =
        api.CreateSession({.prompt_token_ids = {50 + s, 60, 70}, .stopping = {.ignore_eos = true}});
    ASSERT_TRUE(created.ok()) << created.status();
    sessions.push_back(created->session_id);
  }
  std::atomic<int64_t> steps{0};
  absl::Status last_status;
  absl::Duration last_call;
  std::thread stepping([&] {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    for (int step = 0; step < 900 && absl::Now() < give_up; ++step) {
      const absl::Time start = absl::Now();
      absl::StatusOr<coordinator::VerifyOutput> out = api.Verify({.session_id = sessions[0]});
      last_call = absl::Now() - start;
      last_status = out.status();
      if (!out.ok()) break;
      ++steps;
    }
  });
  const absl::Time warm_up = absl::Now() + absl::Seconds(30);
  while (steps.load() < 5 && absl::Now() < warm_up) absl::SleepFor(absl::Milliseconds(5));

  const absl::Time signalled = absl::Now();
  replica->coordinator().Signal(SIGTERM);
  absl::StatusOr<int> exited =
      replica->coordinator().WaitForExit(absl::Seconds(kGraceSeconds + 10));
  stepping.join();
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << DescribeWaitStatus(*exited);
  const absl::Duration took = absl::Now() - signalled;
  std::cout << "coordinator " << DescribeWaitStatus(*exited) << " " << absl::FormatDuration(took)
            << " after SIGTERM; the stepping session ended with " << last_status << " after "
            << steps.load() << " steps\n";
  EXPECT_LT(took, absl::Seconds(kGraceSeconds + 2));
  EXPECT_TRUE(last_status.code() == absl::StatusCode::kUnavailable) << last_status;
  EXPECT_LT(last_call, absl::Seconds(kGraceSeconds + 2));

  for (int rank = 0; rank < replica->world_size(); ++rank) {
    replica->worker(rank).Signal(SIGTERM);
  }
  for (int rank = 0; rank < replica->world_size(); ++rank) {
    absl::StatusOr<int> worker =
        replica->worker(rank).WaitForExit(absl::Seconds(kGraceSeconds + 10));
    ASSERT_TRUE(worker.ok()) << worker.status();
    EXPECT_TRUE(WIFEXITED(*worker) && WEXITSTATUS(*worker) == 0)
        << "rank " << rank << " " << DescribeWaitStatus(*worker);
  }
}

}  // namespace
}  // namespace treeverify::integration
