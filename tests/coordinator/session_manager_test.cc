#include "treeverify/coordinator/session_manager.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace treeverify::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// A fixed fake clock: every test passes times explicitly.
const absl::Time kStart = absl::FromUnixSeconds(1'700'000'000);

std::unique_ptr<SessionManager> MakeManager(SessionManagerOptions options = {}) {
  auto manager = SessionManager::Create(options);
  EXPECT_TRUE(manager.ok()) << manager.status();
  return std::move(manager).value();
}

// Creates a session and ends its creation lease at `now`.
SessionId CreateIdle(SessionManager& manager, absl::Time now, uint64_t* sequence_id = nullptr) {
  auto lease = manager.CreateSession({}, {}, now);
  EXPECT_TRUE(lease.ok()) << lease.status();
  const SessionId id = (*lease)->id;
  if (sequence_id != nullptr) *sequence_id = (*lease)->sequence_id;
  return id;
}

TEST(SessionIdTest, HexRoundTrip) {
  const SessionId id{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  EXPECT_EQ(id.ToHex(), "0123456789abcdeffedcba9876543210");
  auto parsed = SessionId::FromHex(id.ToHex());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, id);

  // Leading zeros are kept: always 32 digits.
  const SessionId small{0, 1};
  EXPECT_EQ(small.ToHex(), "00000000000000000000000000000001");
  EXPECT_EQ(*SessionId::FromHex(small.ToHex()), small);

  // Upper case parses to the same id.
  EXPECT_EQ(*SessionId::FromHex("0123456789ABCDEFFEDCBA9876543210"), id);
}

TEST(SessionIdTest, MalformedHexIsInvalidArgument) {
  auto too_short = SessionId::FromHex("0123456789abcdef");
  EXPECT_EQ(too_short.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_short.status().message(), HasSubstr("32 hex digits; got 16 characters"));

  auto too_long = SessionId::FromHex(std::string(33, 'a'));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_long.status().message(), HasSubstr("got 33 characters"));

  auto empty = SessionId::FromHex("");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);

  auto non_hex = SessionId::FromHex("0123456789abcdefg123456789abcdef");
  EXPECT_EQ(non_hex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(non_hex.status().message(), HasSubstr("non-hex character 'g' at position 16"));

  auto control = SessionId::FromHex(std::string(31, '0') + "\n");
  EXPECT_EQ(control.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(control.status().message(), HasSubstr("'\\n' at position 31"));
}

TEST(SessionManagerOptionsTest, Validate) {
  EXPECT_TRUE(SessionManagerOptions{}.Validate().ok());
  EXPECT_EQ(SessionManager::Create({.max_sessions = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SessionManager::Create({.idle_ttl = absl::ZeroDuration()}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SessionManager::Create({.idle_ttl = absl::InfiniteDuration()}).ok());
}

TEST(SessionManagerTest, CreateSessionReturnsALeasedSessionWithItsSettings) {
  auto manager = MakeManager();
  auto lease = manager->CreateSession({.temperature = 0.7f, .seed = 42, .top_k = 5},
                                      {.max_new_tokens = 9, .stop_token_ids = {3}}, kStart);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(lease->held());
  EXPECT_EQ((*lease)->sampling.seed, 42u);
  EXPECT_EQ((*lease)->sampling.top_k, 5);
  EXPECT_EQ((*lease)->stopping.max_new_tokens, 9);
  EXPECT_THAT((*lease)->stopping.stop_token_ids, ::testing::ElementsAre(3));
  EXPECT_NE((*lease)->sequence_id, kNoSequenceId);
  EXPECT_EQ((*lease)->last_used, kStart);
  // Leased from birth: the prefill owns it.
  EXPECT_EQ(manager->Acquire((*lease)->id, kStart).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SessionManagerTest, IdsAndSequenceIdsAreUniqueOver10000Sessions) {
  auto manager = MakeManager({.max_sessions = 10000});
  absl::flat_hash_set<SessionId> ids;
  absl::flat_hash_set<uint64_t> sequence_ids;
  for (int i = 0; i < 10000; ++i) {
    auto lease = manager->CreateSession({}, {}, kStart);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_TRUE(ids.insert((*lease)->id).second) << (*lease)->id.ToHex();
    EXPECT_TRUE(sequence_ids.insert((*lease)->sequence_id).second);
    // Every session round-trips through its hex name.
    if (i % 997 == 0) {
      EXPECT_EQ(*SessionId::FromHex((*lease)->id.ToHex()), (*lease)->id);
    }
  }
  EXPECT_EQ(manager->size(), 10000);
  // Sequence ids are never reused, even after sessions close.
  for (const SessionId& id : ids) ASSERT_TRUE(manager->Close(id).ok());
  EXPECT_EQ(manager->size(), 0);
  for (int i = 0; i < 100; ++i) {
    auto lease = manager->CreateSession({}, {}, kStart);
    ASSERT_TRUE(lease.ok());
    EXPECT_FALSE(sequence_ids.contains((*lease)->sequence_id));
    EXPECT_FALSE(ids.contains((*lease)->id));
  }
}

TEST(SessionManagerTest, MaxSessionsIsEnforcedAndCloseFreesASlot) {
  auto manager = MakeManager({.max_sessions = 3});
  std::vector<SessionId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(CreateIdle(*manager, kStart));
  auto refused = manager->CreateSession({}, {}, kStart);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("too many sessions (3 of 3)"));

  auto closed = manager->Close(ids[1]);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(manager->size(), 2);
  EXPECT_TRUE(manager->CreateSession({}, {}, kStart).ok());
}

TEST(SessionManagerTest, CloseReturnsTheSequenceIdAndForgetsTheSession) {
  auto manager = MakeManager();
  uint64_t sequence_id = 0;
  const SessionId id = CreateIdle(*manager, kStart, &sequence_id);
  auto closed = manager->Close(id);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(*closed, sequence_id);

  auto again = manager->Close(id);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  auto acquire = manager->Acquire(id, kStart);
  EXPECT_EQ(acquire.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(acquire.status().message(), HasSubstr("unknown or expired session " + id.ToHex()));
  EXPECT_THAT(manager->TakeReleased(), IsEmpty());
}

TEST(SessionManagerTest, SecondAcquireWhileLeasedFailsUntilTheLeaseEnds) {
  auto manager = MakeManager();
  const SessionId id = CreateIdle(*manager, kStart);
  {
    auto first = manager->Acquire(id, kStart + absl::Seconds(1));
    ASSERT_TRUE(first.ok()) << first.status();
    (*first)->committed_tokens.push_back(17);
    auto second = manager->Acquire(id, kStart + absl::Seconds(2));
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(second.status().message(),
                HasSubstr("session " + id.ToHex() + " already has a Verify in flight"));

    // A moved lease still holds the session; the moved-from one releases nothing.
    SessionLease moved = std::move(*first);
    EXPECT_FALSE(first->held());
    EXPECT_EQ(manager->Acquire(id, kStart).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  auto third = manager->Acquire(id, kStart + absl::Seconds(3));
  ASSERT_TRUE(third.ok()) << third.status();
  // The state written under the first lease is there.
  EXPECT_THAT((*third)->committed_tokens, ::testing::ElementsAre(17));
  third->Release(kStart + absl::Seconds(4));
  EXPECT_FALSE(third->held());
  EXPECT_TRUE(manager->Acquire(id, kStart + absl::Seconds(5)).ok());
}

TEST(SessionManagerTest, UnknownSessionIsNotFound) {
  auto manager = MakeManager();
  const SessionId unknown{1, 2};
  auto acquire = manager->Acquire(unknown, kStart);
  EXPECT_EQ(acquire.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(acquire.status().message(),
              HasSubstr("unknown or expired session 00000000000000010000000000000002"));
  EXPECT_EQ(manager->Close(unknown).status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionManagerTest, ExpireIdleRemovesOnlyIdleSessionsWithoutALease) {
  const absl::Duration ttl = absl::Minutes(10);
  auto manager = MakeManager({.idle_ttl = ttl});
  uint64_t old_seq = 0, fresh_seq = 0, busy_seq = 0, touched_seq = 0;
  const SessionId old_id = CreateIdle(*manager, kStart, &old_seq);
  const SessionId fresh_id = CreateIdle(*manager, kStart + absl::Minutes(5), &fresh_seq);
  const SessionId busy_id = CreateIdle(*manager, kStart, &busy_seq);
  const SessionId touched_id = CreateIdle(*manager, kStart, &touched_seq);

  // Used again at +4 min: idle from then on. The lease ends with an explicit time.
  {
    auto lease = manager->Acquire(touched_id, kStart + absl::Minutes(3));
    ASSERT_TRUE(lease.ok());
    lease->Release(kStart + absl::Minutes(4));
  }
  auto busy = manager->Acquire(busy_id, kStart);
  ASSERT_TRUE(busy.ok());

  // Exactly at the TTL nothing is idle "longer than" it.
  EXPECT_THAT(manager->ExpireIdle(kStart + ttl), IsEmpty());
  EXPECT_EQ(manager->size(), 4);

  // Past it: only the old, unleased session goes.
  EXPECT_THAT(manager->ExpireIdle(kStart + ttl + absl::Seconds(1)), UnorderedElementsAre(old_seq));
  EXPECT_EQ(manager->Acquire(old_id, kStart).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager->size(), 3);

  // Much later: the touched and fresh sessions go; the leased one stays however long it runs.
  EXPECT_THAT(manager->ExpireIdle(kStart + absl::Hours(1)),
              UnorderedElementsAre(fresh_seq, touched_seq));
  EXPECT_THAT(manager->AllSequenceIds(), UnorderedElementsAre(busy_seq));

  // Its lease ends without a time: idle since its Acquire (kStart), so it expires next.
  { SessionLease ending = std::move(*busy); }
  EXPECT_FALSE(busy->held());
  EXPECT_THAT(manager->ExpireIdle(kStart + absl::Hours(1)), UnorderedElementsAre(busy_seq));
  EXPECT_EQ(manager->size(), 0);
  EXPECT_EQ(manager->Acquire(fresh_id, kStart).status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionManagerTest, LeaseDestructionKeepsLastUsedAsTheHolderLeftIt) {
  auto manager = MakeManager({.idle_ttl = absl::Minutes(1)});
  uint64_t sequence_id = 0;
  const SessionId id = CreateIdle(*manager, kStart, &sequence_id);
  {
    auto lease = manager->Acquire(id, kStart + absl::Minutes(2));
    ASSERT_TRUE(lease.ok());
    (*lease)->last_used = kStart + absl::Minutes(5);  // the step ended then
  }
  EXPECT_THAT(manager->ExpireIdle(kStart + absl::Minutes(6)), IsEmpty());
  EXPECT_THAT(manager->ExpireIdle(kStart + absl::Minutes(6) + absl::Seconds(1)),
              UnorderedElementsAre(sequence_id));
}

TEST(SessionManagerTest, CloseWhileInFlightReleasesAfterTheLeaseEnds) {
  auto manager = MakeManager({.max_sessions = 2});
  uint64_t sequence_id = 0;
  const SessionId id = CreateIdle(*manager, kStart, &sequence_id);
  auto lease = manager->Acquire(id, kStart);
  ASSERT_TRUE(lease.ok());

  auto closed = manager->Close(id);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(*closed, kNoSequenceId);  // not yet: a forward still uses the cache
  EXPECT_THAT(manager->TakeReleased(), IsEmpty());
  // Closed for clients, but still held (its KV is in use) and never expired.
  EXPECT_EQ(manager->Acquire(id, kStart).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager->Close(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager->size(), 1);
  EXPECT_THAT(manager->ExpireIdle(kStart + absl::Hours(5)), IsEmpty());
  EXPECT_THAT(manager->AllSequenceIds(), UnorderedElementsAre(sequence_id));
  // The holder may still finish its step on the session.
  (*lease)->committed_tokens.push_back(1);

  *lease = manager->CreateSession({}, {}, kStart).value();  // move-assign ends the old lease
  EXPECT_THAT(manager->TakeReleased(), UnorderedElementsAre(sequence_id));
  EXPECT_THAT(manager->TakeReleased(), IsEmpty());
  EXPECT_EQ(manager->size(), 1);
}

TEST(SessionManagerTest, CloseOfACreationLeaseReleasesOnDestruction) {
  auto manager = MakeManager();
  uint64_t sequence_id = 0;
  {
    auto lease = manager->CreateSession({}, {}, kStart);
    ASSERT_TRUE(lease.ok());
    sequence_id = (*lease)->sequence_id;
    EXPECT_EQ(*manager->Close((*lease)->id), kNoSequenceId);
  }
  EXPECT_THAT(manager->TakeReleased(), UnorderedElementsAre(sequence_id));
  EXPECT_EQ(manager->size(), 0);
}

TEST(SessionManagerTest, ConcurrentLeasesAreExclusive) {
  constexpr int kSessions = 16;
  constexpr int kThreads = 8;
  constexpr int kIterations = 3000;
  auto manager = MakeManager();
  std::vector<SessionId> ids;
  for (int i = 0; i < kSessions; ++i) ids.push_back(CreateIdle(*manager, kStart));
  std::vector<std::atomic<int>> holders(kSessions);
  std::atomic<int> overlaps{0};
  std::atomic<int> unexpected_errors{0};
  std::atomic<int64_t> acquired{0};
  std::atomic<int64_t> refused{0};

  const unsigned seed = 20260301;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(seed + t);
      std::uniform_int_distribution<int> pick(0, kSessions - 1);
      for (int i = 0; i < kIterations; ++i) {
        const int s = pick(rng);
        auto lease = manager->Acquire(ids[s], kStart);
        if (!lease.ok()) {
          if (lease.status().code() != absl::StatusCode::kFailedPrecondition) {
            ++unexpected_errors;
          }
          ++refused;
          continue;
        }
        if (holders[s].fetch_add(1) != 0) ++overlaps;
        // Unsynchronized writes: safe only if leases are exclusive (and TSan would say so).
        (*lease)->committed_tokens.push_back(t);
        (*lease)->emitted_tokens += 1;
        if (i % 7 == 0) std::this_thread::yield();
        holders[s].fetch_sub(1);
        ++acquired;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(unexpected_errors.load(), 0);
  EXPECT_EQ(acquired.load() + refused.load(), int64_t{kThreads} * kIterations);
  EXPECT_GT(acquired.load(), 0);
  int64_t total = 0;
  for (const SessionId& id : ids) {
    auto lease = manager->Acquire(id, kStart);
    ASSERT_TRUE(lease.ok()) << lease.status();  // every lease ended
    EXPECT_EQ(static_cast<int64_t>((*lease)->committed_tokens.size()), (*lease)->emitted_tokens);
    total += (*lease)->emitted_tokens;
  }
  EXPECT_EQ(total, acquired.load());
}

}  // namespace
}  // namespace treeverify::coordinator
