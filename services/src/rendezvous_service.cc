#include "treeverify/services/rendezvous_service.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "treeverify/services/status_conversion.h"

namespace treeverify::services {
namespace {

constexpr size_t kMaxKeyBytes = 1024;
constexpr size_t kMaxValueBytes = 1 << 20;
constexpr int kMaxKeysPerGet = 4096;

grpc::Status InvalidArgument(std::string message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(message));
}

grpc::Status CheckEpoch(int64_t epoch) {
  if (epoch < 0) return InvalidArgument(absl::StrCat("group_epoch must be >= 0, got ", epoch));
  return grpc::Status::OK;
}

grpc::Status CheckKey(const std::string& key, absl::string_view field) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return InvalidArgument(
        absl::StrCat(field, " must have 1 to ", kMaxKeyBytes, " bytes, got ", key.size()));
  }
  return grpc::Status::OK;
}

// A deadline this far out counts as none (gRPC's "no deadline" is the clock's maximum).
constexpr absl::Duration kNoDeadline = absl::Hours(24 * 365);

}  // namespace

absl::Status RendezvousServiceOptions::Validate() const {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", world_size));
  }
  if (poll_interval <= absl::ZeroDuration() || max_get_wait <= absl::ZeroDuration() ||
      max_waiting_gets < 1) {
    return absl::InvalidArgumentError(
        "poll_interval, max_get_wait and max_waiting_gets must be positive");
  }
  return absl::OkStatus();
}

std::string RendezvousKey(int64_t epoch, const std::string& key) {
  return absl::StrCat("epoch/", epoch, "/", key);
}

RendezvousService::RendezvousService(const RendezvousServiceOptions& options, JoinCallback on_join)
    : options_(options), on_join_(std::move(on_join)), waiter_([this] { WaiterLoop(); }) {}

RendezvousService::~RendezvousService() {
  Shutdown();
  waiter_.join();
}

void RendezvousService::Shutdown() {
  absl::MutexLock lock(&mutex_);
  stopping_ = true;
}

grpc::ServerUnaryReactor* RendezvousService::Set(grpc::CallbackServerContext* context,
                                                 const v1::SetRequest* request,
                                                 v1::SetResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status = CheckEpoch(request->group_epoch());
  if (status.ok()) status = CheckKey(request->key(), "key");
  if (status.ok() && request->value().size() > kMaxValueBytes) {
    status = InvalidArgument(
        absl::StrCat("value has ", request->value().size(), " bytes; at most ", kMaxValueBytes));
  }
  if (status.ok()) {
    status = ToGrpcStatus(
        store_.Set(RendezvousKey(request->group_epoch(), request->key()), request->value()));
  }
  if (status.ok()) {
    absl::MutexLock lock(&mutex_);
    wake_ = true;  // a parked Get may be waiting for this key
  }
  reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousService::Get(grpc::CallbackServerContext* context,
                                                 const v1::GetRequest* request,
                                                 v1::GetResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status = CheckEpoch(request->group_epoch());
  if (status.ok() && (request->keys_size() == 0 || request->keys_size() > kMaxKeysPerGet)) {
    status = InvalidArgument(
        absl::StrCat("keys must name 1 to ", kMaxKeysPerGet, " keys, got ", request->keys_size()));
  }
  for (int i = 0; status.ok() && i < request->keys_size(); ++i) {
    status = CheckKey(request->keys(i), absl::StrCat("keys[", i, "]"));
  }
  if (status.ok() && !(request->timeout_seconds() >= 0)) {
    status = InvalidArgument(
        absl::StrCat("timeout_seconds must be >= 0, got ", request->timeout_seconds()));
  }
  if (!status.ok()) {
    reactor->Finish(status);
    return reactor;
  }

  const absl::Time now = absl::Now();
  absl::Duration wait = std::isinf(request->timeout_seconds())
                            ? absl::InfiniteDuration()
                            : absl::Seconds(request->timeout_seconds());
  const absl::Duration until_deadline = absl::FromChrono(context->deadline()) - now;
  if (until_deadline < kNoDeadline) wait = std::min(wait, until_deadline);
  if (wait == absl::InfiniteDuration()) wait = options_.max_get_wait;

  ParkedGet get{.context = context,
                .reactor = reactor,
                .response = response,
                .group_epoch = request->group_epoch(),
                .keys = {request->keys().begin(), request->keys().end()},
                .store_keys = {},
                .started = now,
                .deadline = now + std::max(wait, absl::ZeroDuration())};
  for (const std::string& key : get.keys) {
    get.store_keys.push_back(RendezvousKey(get.group_epoch, key));
  }
  // Most Gets find their keys at once, or have no time to wait: answer those here.
  if (std::optional<grpc::Status> done = Poll(get, now)) {
    reactor->Finish(*done);
    return reactor;
  }
  {
    absl::MutexLock lock(&mutex_);
    if (stopping_) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down");
    } else if (static_cast<int>(parked_.size()) >= options_.max_waiting_gets) {
      status = grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("more than ", options_.max_waiting_gets, " rendezvous Gets are waiting"));
    } else {
      parked_.push_back(std::move(get));
      wake_ = true;
      return reactor;
    }
  }
  reactor->Finish(status);
  return reactor;
}

std::optional<grpc::Status> RendezvousService::Poll(ParkedGet& get, absl::Time now) {
  absl::StatusOr<std::vector<std::string>> values =
      store_.Get(get.store_keys, absl::ZeroDuration());
  if (values.ok()) {
    for (std::string& value : *values) get.response->add_values(std::move(value));
    return grpc::Status::OK;
  }
  if (get.context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the rendezvous Get was cancelled");
  }
  if (now < get.deadline) return std::nullopt;
  std::vector<std::string> missing;
  for (size_t i = 0; i < get.keys.size(); ++i) {
    if (!store_.Get({get.store_keys[i]}, absl::ZeroDuration()).ok()) missing.push_back(get.keys[i]);
  }
  return grpc::Status(
      grpc::StatusCode::DEADLINE_EXCEEDED,
      absl::StrCat("rendezvous keys of group epoch ", get.group_epoch, " still missing after ",
                   absl::FormatDuration(now - get.started), ": ", absl::StrJoin(missing, ", ")));
}

void RendezvousService::WaiterLoop() {
  while (true) {
    std::vector<std::pair<grpc::ServerUnaryReactor*, grpc::Status>> finished;
    bool exit = false;
    {
      absl::MutexLock lock(&mutex_);
      auto woken = [this]() ABSL_SHARED_LOCKS_REQUIRED(mutex_) { return wake_ || stopping_; };
      if (parked_.empty()) {
        mutex_.Await(absl::Condition(&woken));
      } else {
        mutex_.AwaitWithTimeout(absl::Condition(&woken), options_.poll_interval);
      }
      wake_ = false;
      const absl::Time now = absl::Now();
      for (auto it = parked_.begin(); it != parked_.end();) {
        std::optional<grpc::Status> done = Poll(*it, now);
        if (!done && stopping_) {
          done = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down");
        }
        if (done) {
          finished.emplace_back(it->reactor, *std::move(done));
          it = parked_.erase(it);
        } else {
          ++it;
        }
      }
      exit = stopping_;
    }
    // Outside the lock: Finish may run gRPC's completion inline.
    for (auto& [reactor, status] : finished) reactor->Finish(status);
    if (exit) return;
  }
}

grpc::ServerUnaryReactor* RendezvousService::Join(grpc::CallbackServerContext* context,
                                                  const v1::JoinRequest* request,
                                                  v1::JoinResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status = CheckEpoch(request->group_epoch());
  if (status.ok() && request->world_size() != options_.world_size) {
    status = grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("rank ", request->rank(), " joins with world size ", request->world_size(),
                     " but this coordinator serves a replica of ", options_.world_size,
                     " ranks; start every worker with --world-size ", options_.world_size));
  }
  if (status.ok() && (request->rank() < 0 || request->rank() >= options_.world_size)) {
    status = InvalidArgument(
        absl::StrCat("rank ", request->rank(), " is not in [0, ", options_.world_size, ")"));
  }
  if (status.ok() && (request->address().empty() || request->address().size() > kMaxKeyBytes)) {
    status = InvalidArgument("address must be host:port");
  }
  if (!status.ok()) {
    reactor->Finish(status);
    return reactor;
  }
  const JoinedRank joined{.group_epoch = request->group_epoch(),
                          .rank = request->rank(),
                          .address = request->address()};
  {
    absl::MutexLock lock(&mutex_);
    joined_[joined.group_epoch][joined.rank] = joined.address;
  }
  if (on_join_) on_join_(joined);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::StatusOr<RendezvousGroup> RendezvousService::WaitForGroup(absl::Duration timeout) {
  absl::MutexLock lock(&mutex_);
  const int world_size = options_.world_size;
  auto complete_epoch = [&]() ABSL_SHARED_LOCKS_REQUIRED(mutex_) -> const int64_t* {
    for (const auto& [epoch, ranks] : joined_) {
      if (static_cast<int>(ranks.size()) == world_size) return &epoch;
    }
    return nullptr;
  };
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mutex_) {
    return stopping_ || complete_epoch() != nullptr;
  };
  mutex_.AwaitWithTimeout(absl::Condition(&done), timeout);
  if (const int64_t* epoch = complete_epoch()) {
    RendezvousGroup group{.group_epoch = *epoch, .addresses = {}};
    for (const auto& [rank, address] : joined_.at(*epoch)) group.addresses.push_back(address);
    return group;
  }
  if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
  std::vector<int> missing;
  const std::map<int, std::string> none;
  const std::map<int, std::string>& latest = joined_.empty() ? none : joined_.rbegin()->second;
  for (int r = 0; r < world_size; ++r) {
    if (!latest.contains(r)) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      missing.size() == 1 ? "rank " : "ranks ", absl::StrJoin(missing, ", "), " of ", world_size,
      missing.size() == 1 ? " has" : " have", " not joined",
      joined_.empty() ? std::string()
                      : absl::StrCat(" (latest group epoch ", joined_.rbegin()->first, ")")));
}

}  // namespace treeverify::services
