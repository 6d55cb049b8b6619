#include "treeverify/coordinator/session_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace treeverify::coordinator {

namespace {

constexpr size_t kHexDigits = 32;

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string SessionId::ToHex() const { return absl::StrFormat("%016x%016x", high, low); }

absl::StatusOr<SessionId> SessionId::FromHex(absl::string_view hex) {
  if (hex.size() != kHexDigits) {
    return absl::InvalidArgumentError(absl::StrCat("session id must be ", kHexDigits,
                                                   " hex digits; got ", hex.size(), " characters"));
  }
  SessionId id;
  for (size_t i = 0; i < kHexDigits; ++i) {
    const int digit = HexValue(hex[i]);
    if (digit < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("session id has a non-hex character '", absl::CHexEscape(hex.substr(i, 1)),
                       "' at position ", i, "; it must be ", kHexDigits, " hex digits"));
    }
    uint64_t& word = i < kHexDigits / 2 ? id.high : id.low;
    word = (word << 4) | static_cast<uint64_t>(digit);
  }
  return id;
}

absl::Status SessionManagerOptions::Validate() const {
  if (max_sessions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_sessions must be at least 1; got ", max_sessions));
  }
  if (idle_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("idle_ttl must be positive; got ", absl::FormatDuration(idle_ttl)));
  }
  return absl::OkStatus();
}

// --- SessionLease ---

SessionLease::SessionLease(SessionLease&& other) noexcept
    : manager_(std::exchange(other.manager_, nullptr)),
      session_(std::exchange(other.session_, nullptr)) {}

SessionLease& SessionLease::operator=(SessionLease&& other) noexcept {
  if (this != &other) {
    End(std::nullopt);
    manager_ = std::exchange(other.manager_, nullptr);
    session_ = std::exchange(other.session_, nullptr);
  }
  return *this;
}

SessionLease::~SessionLease() { End(std::nullopt); }

void SessionLease::Release(absl::Time now) { End(now); }

void SessionLease::End(std::optional<absl::Time> now) {
  if (session_ == nullptr) return;
  manager_->EndLease(session_, now);
  manager_ = nullptr;
  session_ = nullptr;
}

// --- SessionManager ---

absl::StatusOr<std::unique_ptr<SessionManager>> SessionManager::Create(
    const SessionManagerOptions& options) {
  if (absl::Status status = options.Validate(); !status.ok()) return status;
  return std::unique_ptr<SessionManager>(new SessionManager(options));
}

absl::StatusOr<SessionLease> SessionManager::CreateSession(SamplingConfig sampling,
                                                           StoppingCriteria stopping,
                                                           absl::Time now) {
  absl::MutexLock lock(&mutex_);
  const int64_t held = static_cast<int64_t>(sessions_.size());
  if (held >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat("too many sessions (", held, " of ",
                                                     options_.max_sessions,
                                                     "); close finished sessions or retry later"));
  }
  // 128 random bits from a generator seeded by the OS. Redrawing on a clash with a live session
  // (or the all-zero id) makes live ids unique for certain; repeating a closed session's id
  // would take a 2^-128 coincidence.
  SessionId id;
  do {
    id.high = absl::Uniform<uint64_t>(id_generator_);
    id.low = absl::Uniform<uint64_t>(id_generator_);
  } while ((id.high == 0 && id.low == 0) || sessions_.contains(id));

  auto entry = std::make_unique<Entry>();
  entry->session.id = id;
  entry->session.sequence_id = next_sequence_id_++;
  entry->session.sampling = std::move(sampling);
  entry->session.stopping = std::move(stopping);
  entry->session.last_used = now;
  entry->in_flight = true;
  Session* session = &entry->session;
  sessions_.emplace(id, std::move(entry));
  return SessionLease(this, session);
}

absl::StatusOr<SessionLease> SessionManager::Acquire(const SessionId& id, absl::Time now) {
  absl::MutexLock lock(&mutex_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->closing) {
    return absl::NotFoundError(absl::StrCat("unknown or expired session ", id.ToHex()));
  }
  Entry& entry = *it->second;
  if (entry.in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id.ToHex(),
                     " already has a Verify in flight; wait for its reply before the next step"));
  }
  entry.in_flight = true;
  entry.session.last_used = now;
  return SessionLease(this, &entry.session);
}

absl::StatusOr<uint64_t> SessionManager::Close(const SessionId& id) {
  absl::MutexLock lock(&mutex_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->closing) {
    return absl::NotFoundError(absl::StrCat("unknown or expired session ", id.ToHex()));
  }
  if (it->second->in_flight) {
    it->second->closing = true;
    return kNoSequenceId;
  }
  const uint64_t sequence_id = it->second->session.sequence_id;
  sessions_.erase(it);
  return sequence_id;
}

void SessionManager::EndLease(Session* session, std::optional<absl::Time> now) {
  absl::MutexLock lock(&mutex_);
  auto it = sessions_.find(session->id);
  // A lease's session stays in the map until the lease ends: Close and ExpireIdle skip it.
  if (it == sessions_.end() || &it->second->session != session) return;
  Entry& entry = *it->second;
  entry.in_flight = false;
  if (now.has_value()) entry.session.last_used = std::max(entry.session.last_used, *now);
  if (entry.closing) {
    released_.push_back(entry.session.sequence_id);
    sessions_.erase(it);
  }
}

std::vector<uint64_t> SessionManager::ExpireIdle(absl::Time now) {
  absl::MutexLock lock(&mutex_);
  std::vector<uint64_t> expired;
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const Entry& entry = *it->second;
    if (!entry.in_flight && now - entry.session.last_used > options_.idle_ttl) {
      expired.push_back(entry.session.sequence_id);
      sessions_.erase(it++);
    } else {
      ++it;
    }
  }
  return expired;
}

std::vector<uint64_t> SessionManager::TakeReleased() {
  absl::MutexLock lock(&mutex_);
  return std::exchange(released_, {});
}

int64_t SessionManager::size() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(sessions_.size());
}

std::vector<uint64_t> SessionManager::AllSequenceIds() const {
  absl::MutexLock lock(&mutex_);
  std::vector<uint64_t> ids;
  ids.reserve(sessions_.size());
  for (const auto& [id, entry] : sessions_) ids.push_back(entry->session.sequence_id);
  return ids;
}

}  // namespace treeverify::coordinator
