// The Rendezvous gRPC service the coordinator hosts for its ranks: a write-once key/value store
// (worker::InMemoryRendezvousStore) in which each group epoch has its own namespace
// ("epoch/<n>/<key>"), and Join, with which a rank announces that its group formed and where it
// serves Worker.
//
// Get waits for missing keys up to the request's timeout (bounded by the RPC's deadline) without
// holding a gRPC thread: waiting Gets are parked and one waiter thread re-checks them whenever a
// key is set (and every poll_interval), finishing each once its keys exist, its time is up, or
// its call was cancelled.
//
//   RendezvousService rendezvous({.world_size = 2});
//   ... start a server with &rendezvous ...
//   TV_ASSIGN_OR_RETURN(RendezvousGroup group, rendezvous.WaitForGroup(absl::Minutes(5)));
//   // group.addresses[r] serves Worker for rank r.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "treeverify/v1/worker.grpc.pb.h"
#include "treeverify/worker/rendezvous_store.h"

namespace treeverify::services {

struct RendezvousServiceOptions {
  // The replica's world size: Join refuses any other, and ranks outside [0, world_size).
  int world_size = 1;
  // How often parked Gets are re-checked for cancellation, deadlines and keys set behind the
  // service's back (a Set through the service wakes them at once).
  absl::Duration poll_interval = absl::Milliseconds(50);
  // Parked Gets beyond this are refused with RESOURCE_EXHAUSTED.
  int max_waiting_gets = 1024;
  // The longest a Get waits when neither its timeout nor its deadline is finite.
  absl::Duration max_get_wait = absl::Minutes(10);

  absl::Status Validate() const;
};

// A rank's Join.
struct JoinedRank {
  int64_t group_epoch = 0;
  int rank = 0;
  std::string address;  // serves Worker
};

// Every rank of one epoch.
struct RendezvousGroup {
  int64_t group_epoch = 0;
  std::vector<std::string> addresses;  // [world_size], by rank
};

// The store key of `key` in group epoch `epoch`.
std::string RendezvousKey(int64_t epoch, const std::string& key);

class RendezvousService final : public v1::Rendezvous::CallbackService {
 public:
  using JoinCallback = std::function<void(const JoinedRank&)>;

  // `on_join` (optional) runs on a gRPC thread after each accepted Join; it must not block.
  explicit RendezvousService(const RendezvousServiceOptions& options,
                             JoinCallback on_join = nullptr);
  // Shutdown(), then stops the waiter thread.
  ~RendezvousService() override;

  // Blocks until ranks 0..world_size-1 of one epoch have all joined; DEADLINE_EXCEEDED naming
  // the ranks still missing after `timeout`, UNAVAILABLE after Shutdown.
  absl::StatusOr<RendezvousGroup> WaitForGroup(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mutex_);

  // Fails every parked Get (UNAVAILABLE) and refuses new waits, so the server can shut down
  // without waiting for them. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mutex_);

  worker::InMemoryRendezvousStore& store() { return store_; }

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context, const v1::SetRequest* request,
                                v1::SetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context, const v1::GetRequest* request,
                                v1::GetResponse* response) override;
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;

 private:
  struct ParkedGet {
    grpc::CallbackServerContext* context;
    grpc::ServerUnaryReactor* reactor;
    v1::GetResponse* response;
    int64_t group_epoch;
    std::vector<std::string> keys;  // as the client named them
    std::vector<std::string> store_keys;
    absl::Time started;
    absl::Time deadline;
  };

  // How `get` ends now (OK with its values in the response once every key exists), or nullopt
  // while it should keep waiting.
  std::optional<grpc::Status> Poll(ParkedGet& get, absl::Time now);
  void WaiterLoop();

  const RendezvousServiceOptions options_;
  const JoinCallback on_join_;
  worker::InMemoryRendezvousStore store_;

  absl::Mutex mutex_;
  std::list<ParkedGet> parked_ ABSL_GUARDED_BY(mutex_);
  bool wake_ ABSL_GUARDED_BY(mutex_) = false;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  // Joined ranks: epoch -> rank -> address.
  std::map<int64_t, std::map<int, std::string>> joined_ ABSL_GUARDED_BY(mutex_);
  std::thread waiter_;  // last: starts once the members above exist
};

}  // namespace treeverify::services
