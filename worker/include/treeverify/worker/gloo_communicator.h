// A Communicator for worker processes on CPUs: Gloo over TCP, one process (or thread) per rank.
//
// The ranks find each other through a RendezvousStore (hosted by the coordinator) under a key
// prefix that names the group epoch. AllReduceSum is an all-gather followed by a sum in rank
// order, so its results are bit-identical to InProcessGroup's for the same inputs and do not
// depend on timing: the CPU backend stays batch invariant across processes.
//
// Failure is final: a peer that does not show up fails Create within about the timeout, and after
// any failed collective (a peer gone, a timeout, ranks that passed different lengths) every later
// call fails too. Form a new group under a new epoch prefix.
//
//   GlooOptions options{.rank = rank, .world_size = 4, .key_prefix = "epoch/3/"};
//   TV_ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> communicator,
//                       GlooCommunicator::Create(options, store));
//   TV_RETURN_IF_ERROR(communicator->AllReduceSum(absl::MakeSpan(hidden)));
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "treeverify/worker/communicator.h"
#include "treeverify/worker/rendezvous_store.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace treeverify::worker {

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  // Address to bind the TCP device to; peers connect to it. An IP address or a host name.
  std::string interface_address = "127.0.0.1";
  // Bounds every collective, and forming the group: waiting for the peers' keys in the store
  // and, after that, the TCP connections (so Create fails within at most about twice this).
  absl::Duration timeout = absl::Seconds(30);
  // Prepended to every store key, e.g. "epoch/3/": groups with different prefixes never meet.
  std::string key_prefix;

  absl::Status Validate() const;
};

// Not thread safe: like every Communicator, each rank calls collectives from one thread at a
// time, in the same order on every rank.
class GlooCommunicator final : public Communicator {
 public:
  // World size 1 needs no store (it may be nullptr) and touches no network. Otherwise the store
  // must outlive Create (not the communicator). INVALID_ARGUMENT for bad options or an address
  // that cannot be bound; DEADLINE_EXCEEDED when a peer does not show up within the timeout;
  // ALREADY_EXISTS when the prefix was used by an earlier group; UNAVAILABLE for other failures.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(const GlooOptions& options,
                                                                  RendezvousStore* store);
  ~GlooCommunicator() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }

  // Every rank must pass the same length. On failure `data` is left unchanged and the
  // communicator is broken: DEADLINE_EXCEEDED for a timeout (a slow or missing peer, or ranks
  // that passed different lengths), UNAVAILABLE when a peer closed its connection and for every
  // call after a failure.
  absl::Status AllReduceSum(absl::Span<float> data) override;

 private:
  GlooCommunicator(const GlooOptions& options, std::shared_ptr<gloo::Context> context);

  const GlooOptions options_;
  std::shared_ptr<gloo::Context> context_;  // nullptr for world size 1
  std::vector<float> gathered_;             // [world_size, length]: every rank's input, in order
  absl::Status failure_;                    // the first failure; OK while the mesh is usable
};

}  // namespace treeverify::worker
