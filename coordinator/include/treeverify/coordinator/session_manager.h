// The coordinator's sessions: the committed tokens, pending token and sampling/stopping settings
// of every generation, keyed by an opaque random 128-bit id, plus the KV-cache sequence id under
// which the ranks hold the session's cache.
//
// A Verify (or the prefill of CreateSession) works on a session through a SessionLease: at most
// one lease per session exists at a time, which is how a second concurrent Verify on the same
// session is refused (FAILED_PRECONDITION) instead of corrupting its state. The manager owns no
// clock: callers pass `now`, so tests drive time by hand.
//
//   TV_ASSIGN_OR_RETURN(auto manager, SessionManager::Create({.max_sessions = 256}));
//   TV_ASSIGN_OR_RETURN(SessionLease created,
//                       manager->CreateSession(sampling, stopping, absl::Now()));
//   ... prefill created->sequence_id on the ranks, set created->pending_token ...
//   std::string reply_id = created->id.ToHex();
//
//   // One Verify step:
//   TV_ASSIGN_OR_RETURN(SessionId id, SessionId::FromHex(request_id));
//   TV_ASSIGN_OR_RETURN(SessionLease lease, manager->Acquire(id, absl::Now()));
//   ... run the step on *lease ...
//   lease.Release(absl::Now());  // or let it go out of scope
//
//   // Periodically: free the KV of abandoned sessions on the ranks.
//   for (uint64_t seq : manager->ExpireIdle(absl::Now())) ReleaseOnRanks(seq);
//   for (uint64_t seq : manager->TakeReleased()) ReleaseOnRanks(seq);
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "treeverify/coordinator/token_selector.h"

namespace treeverify::coordinator {

// A session's public name: 128 random bits, written as 32 lowercase hex digits (high word first).
struct SessionId {
  uint64_t high = 0;
  uint64_t low = 0;

  std::string ToHex() const;
  // Accepts exactly 32 hex digits (either case). INVALID_ARGUMENT naming the problem otherwise.
  static absl::StatusOr<SessionId> FromHex(absl::string_view hex);

  bool operator==(const SessionId&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const SessionId& id) {
    return H::combine(std::move(h), id.high, id.low);
  }
};

// Why a session stopped emitting tokens (the proto's FinishReason).
enum class FinishReason { kNone, kEos, kStopToken, kMaxNewTokens, kMaxContext };

struct StoppingCriteria {
  // 0: no limit but the context. Counts CreateSession's pending token.
  int32_t max_new_tokens = 0;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

// The session's sampling settings are the token selector's parameters (temperature 0: greedy).
using SamplingConfig = SamplingParams;

// Sequence ids start at 1; kNoSequenceId is never a session's.
inline constexpr uint64_t kNoSequenceId = 0;

struct Session {
  // Set by the manager; a lease holder must not change id or sequence_id.
  SessionId id;
  // The ranks' KV-cache id of this session: unique within the process, never reused.
  uint64_t sequence_id = kNoSequenceId;
  SamplingConfig sampling;
  StoppingCriteria stopping;
  // Tokens whose KV the ranks hold, or will hold once pending_commit is applied.
  std::vector<int32_t> committed_tokens;
  // The target's next token, decided but with no KV yet; -1 before the prefill decides it.
  int32_t pending_token = -1;
  // Segment node indices of the last step to commit at the next forward (0 is the old pending
  // token), when that commit has not reached the ranks yet.
  std::optional<std::vector<int32_t>> pending_commit;
  // Tokens emitted so far, CreateSession's pending token included.
  int64_t emitted_tokens = 0;
  FinishReason finish_reason = FinishReason::kNone;
  // Idle time counts from here. Acquire sets it; a lease holder may move it forward.
  absl::Time last_used;
};

struct SessionManagerOptions {
  // Live sessions (including closed ones whose step is still in flight).
  int64_t max_sessions = 1024;
  // A session not used for longer than this is expired by ExpireIdle. InfiniteDuration: never.
  absl::Duration idle_ttl = absl::Minutes(10);

  absl::Status Validate() const;
};

class SessionManager;

// Exclusive access to one session while a step (or the prefill) runs on it. Move-only. When it
// ends (Release or destruction) the session is no longer in flight and its idle time starts
// counting from Session::last_used; a session closed while leased is removed then and its
// sequence id comes out of SessionManager::TakeReleased(). The manager must outlive its leases.
class SessionLease {
 public:
  SessionLease(SessionLease&& other) noexcept;
  SessionLease& operator=(SessionLease&& other) noexcept;
  SessionLease(const SessionLease&) = delete;
  SessionLease& operator=(const SessionLease&) = delete;
  ~SessionLease();

  // Both require a held lease (not moved from, not released).
  Session* operator->() const { return session_; }
  Session& operator*() const { return *session_; }
  bool held() const { return session_ != nullptr; }

  // Ends the lease now, with the session's idle time counting from `now` (or from last_used,
  // if that is later). Destruction without Release keeps last_used as the holder left it: the
  // time of Acquire unless the holder moved it.
  void Release(absl::Time now);

 private:
  friend class SessionManager;
  SessionLease(SessionManager* manager, Session* session) : manager_(manager), session_(session) {}
  void End(std::optional<absl::Time> now);

  SessionManager* manager_ = nullptr;
  Session* session_ = nullptr;
};

// Thread-safe.
class SessionManager {
 public:
  static absl::StatusOr<std::unique_ptr<SessionManager>> Create(
      const SessionManagerOptions& options);

  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;

  // A new session with a fresh id and sequence id, returned already leased (the caller prefills
  // it). RESOURCE_EXHAUSTED at max_sessions.
  absl::StatusOr<SessionLease> CreateSession(SamplingConfig sampling, StoppingCriteria stopping,
                                             absl::Time now) ABSL_LOCKS_EXCLUDED(mutex_);

  // NOT_FOUND for an unknown, expired or closed session; FAILED_PRECONDITION while another lease
  // of the session is held. Sets last_used to `now`.
  absl::StatusOr<SessionLease> Acquire(const SessionId& id, absl::Time now)
      ABSL_LOCKS_EXCLUDED(mutex_);

  // Removes the session and returns its sequence id, for the caller to release on the ranks.
  // NOT_FOUND if unknown. A session with a lease held is only marked closed (Acquire then fails
  // with NOT_FOUND) and kNoSequenceId is returned: the lease's end removes it, and its sequence
  // id comes out of TakeReleased(), so the ranks never free a cache a forward still uses.
  absl::StatusOr<uint64_t> Close(const SessionId& id) ABSL_LOCKS_EXCLUDED(mutex_);

  // Removes the sessions idle for longer than idle_ttl at `now` (never one with a lease held)
  // and returns their sequence ids.
  std::vector<uint64_t> ExpireIdle(absl::Time now) ABSL_LOCKS_EXCLUDED(mutex_);

  // Sequence ids of sessions closed while leased and removed since the last call.
  std::vector<uint64_t> TakeReleased() ABSL_LOCKS_EXCLUDED(mutex_);

  // Sessions held, including closed ones whose lease has not ended (their KV is still in use).
  int64_t size() const ABSL_LOCKS_EXCLUDED(mutex_);
  // Sequence ids of every session counted by size(), in no particular order.
  std::vector<uint64_t> AllSequenceIds() const ABSL_LOCKS_EXCLUDED(mutex_);

  const SessionManagerOptions& options() const { return options_; }

 private:
  friend class SessionLease;

  struct Entry {
    Session session;
    bool in_flight = false;
    bool closing = false;
  };

  explicit SessionManager(const SessionManagerOptions& options) : options_(options) {}
  void EndLease(Session* session, std::optional<absl::Time> now) ABSL_LOCKS_EXCLUDED(mutex_);

  const SessionManagerOptions options_;
  mutable absl::Mutex mutex_;
  // Entries are boxed so that a lease's Session* survives rehashing.
  absl::flat_hash_map<SessionId, std::unique_ptr<Entry>> sessions_ ABSL_GUARDED_BY(mutex_);
  std::vector<uint64_t> released_ ABSL_GUARDED_BY(mutex_);
  uint64_t next_sequence_id_ ABSL_GUARDED_BY(mutex_) = kNoSequenceId + 1;
  absl::BitGen id_generator_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace treeverify::coordinator
