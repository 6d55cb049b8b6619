// How the coordinator talks to one tensor-parallel rank. Two implementations: in-process (wraps a
// worker::ModelRunner; unit and integration tests, the CLI) and gRPC (services/). Calls are
// synchronous with a timeout; the coordinator calls all ranks of a replica in parallel and
// never sends a second call to a rank before the first returned.
//
//   TV_ASSIGN_OR_RETURN(worker::ForwardResult result, rank->Forward(request, absl::Seconds(30)));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "treeverify/worker/model_runner.h"

namespace treeverify::coordinator {

// What a rank says about itself (worker.proto's DescribeResponse).
struct RankDescription {
  int rank = 0;
  int world_size = 1;
  int64_t group_epoch = 0;
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t vocab_begin = 0;
  int64_t vocab_end = 0;
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t max_position_embeddings = 0;
  std::vector<int32_t> eos_token_ids;
  std::string backend;  // "cpu" or "cuda"
  int64_t kv_pages_total = 0;
  int64_t kv_pages_free = 0;
  int32_t kv_page_size = 0;
};

class RankClient {
 public:
  virtual ~RankClient() = default;
  virtual absl::StatusOr<RankDescription> Describe(absl::Duration timeout) = 0;
  // UNAVAILABLE / DEADLINE_EXCEEDED when the rank cannot be reached in time; per-sequence
  // failures are inside the result.
  virtual absl::StatusOr<worker::ForwardResult> Forward(const worker::ForwardRequest& request,
                                                        absl::Duration timeout) = 0;
  // Returns the rank's free KV pages after the release.
  virtual absl::StatusOr<int64_t> Release(absl::Span<const uint64_t> sequence_ids,
                                          absl::Duration timeout) = 0;
};

// A rank in this process. The runner must outlive the client; calls are not serialized here
// (the coordinator sends one call at a time).
class InProcessRankClient final : public RankClient {
 public:
  explicit InProcessRankClient(worker::ModelRunner* runner) : runner_(runner) {}
  absl::StatusOr<RankDescription> Describe(absl::Duration timeout) override;
  absl::StatusOr<worker::ForwardResult> Forward(const worker::ForwardRequest& request,
                                                absl::Duration timeout) override;
  absl::StatusOr<int64_t> Release(absl::Span<const uint64_t> sequence_ids,
                                  absl::Duration timeout) override;

 private:
  worker::ModelRunner* runner_;
};

// The description every rank of a replica shares, filled from a ModelRunner (used by the
// in-process client and the worker service alike).
RankDescription DescribeRunner(const worker::ModelRunner& runner);

}  // namespace treeverify::coordinator
