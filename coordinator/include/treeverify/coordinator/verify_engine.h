// The coordinator's core: sessions, validation, batching, fan-out to the ranks, reduction of
// their vocabulary-shard summaries, acceptance and stopping. Plain C++ (services/ translates the
// gRPC API to and from these structs).
//
// Every call into the ranks goes through one dispatch thread: it takes the queued work (prefill
// chunks, verify trees, releases), merges the trees of different sessions that arrive within
// `batch_window` (up to `max_batch_rows` rows) into one Forward, sends it to every rank in
// parallel, and completes each caller's callback. Callbacks run on the dispatch thread and must
// not block.
//
//   TV_ASSIGN_OR_RETURN(auto engine, VerifyEngine::Create(options, std::move(rank_clients)));
//   engine->VerifyAsync(input, [](absl::StatusOr<VerifyOutput> out) { ... });
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "treeverify/coordinator/engine_observer.h"
#include "treeverify/coordinator/rank_client.h"
#include "treeverify/coordinator/session_manager.h"
#include "treeverify/coordinator/verifier_api.h"
#include "treeverify/coordinator/verify_types.h"

namespace treeverify::coordinator {

// Default prompt chunks. CPU ranks: a tree's size. GPU ranks: long enough for the MHA form to pay
// (bench/results/2026-11-30-prefill.md), short enough that a chunk's forward does not hold other
// sessions' steps for long (about 0.3 s for a 4096-row chunk at 46k on one TP8 rank of Kimi-K2).
inline constexpr int32_t kCpuPrefillChunk = 256;
inline constexpr int32_t kCudaPrefillChunk = 4096;

struct VerifyEngineOptions {
  std::string model_name = "model";
  int32_t max_draft_nodes = 255;   // at most kernels::kMaxSegmentRows - 1
  int64_t max_context_length = 0;  // 0: the model's max_position_embeddings
  absl::Duration batch_window = absl::Microseconds(300);
  int64_t max_batch_rows = 4096;  // rows of one Forward (a prefill chunk or a tree counts whole)
  // bf16 hidden states one step may ask for, and one Forward's answer from rank 0 may carry
  // (kept below the gRPC message limit, 64 MiB by default).
  int64_t max_hidden_state_bytes = int64_t{32} << 20;
  // Prompt rows per prefill forward, at most worker::kMaxChainRows; 0: by the ranks' backend
  // (kCpuPrefillChunk, or kCudaPrefillChunk for GPU ranks, which prefill long chunks in the MHA
  // form). The engine's info() says which.
  int32_t prefill_chunk = 0;
  absl::Duration rank_timeout = absl::Seconds(60);
  absl::Duration expiry_interval = absl::Seconds(1);  // how often idle sessions are expired
  SessionManagerOptions sessions;
  // Told of every step, session, forward and lost rank (metrics); not owned, outlives the
  // engine. Null: nobody is told.
  EngineObserver* observer = nullptr;

  absl::Status Validate() const;
};

// Counters for tests and metrics.
struct EngineStats {
  int64_t forwards = 0;           // Forward calls sent to the ranks (per rank)
  int64_t batched_sequences = 0;  // sequences over all forwards
  int64_t max_batch_sequences = 0;
};

class VerifyEngine final : public VerifierApi {
 public:
  // Describes every rank (they must agree on the model and form one replica: ranks 0..W-1).
  static absl::StatusOr<std::unique_ptr<VerifyEngine>> Create(
      const VerifyEngineOptions& options, std::vector<std::unique_ptr<RankClient>> ranks);
  ~VerifyEngine()
      override;  // drains queued work (callbacks get UNAVAILABLE), stops the dispatch thread

  const ModelInfo& info() const;

  using CreateSessionCallback = std::function<void(absl::StatusOr<CreateSessionOutput>)>;
  using VerifyCallback = std::function<void(absl::StatusOr<VerifyOutput>)>;
  void CreateSessionAsync(CreateSessionInput input, CreateSessionCallback done);
  void VerifyAsync(VerifyInput input, VerifyCallback done);
  // Releases the session's KV on every rank (queued behind in-flight work).
  absl::Status CloseSession(const SessionId& id) override;

  // VerifierApi: blocking conveniences (tests, the in-process CLI).
  absl::StatusOr<ModelInfo> GetModelInfo() override { return info(); }
  absl::StatusOr<CreateSessionOutput> CreateSession(CreateSessionInput input) override;
  absl::StatusOr<VerifyOutput> Verify(VerifyInput input) override;

  // False once a rank failed (UNAVAILABLE from then on) or Shutdown began.
  bool serving() const;
  // Stops accepting work; in-flight work completes. Idempotent.
  void Shutdown();
  EngineStats stats() const;
  int64_t active_sessions() const;

 private:
  class Impl;
  explicit VerifyEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace treeverify::coordinator
