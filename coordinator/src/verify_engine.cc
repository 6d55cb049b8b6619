#include "treeverify/coordinator/verify_engine.h"

#include <algorithm>
#include <deque>
#include <future>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "treeverify/coordinator/acceptance.h"
#include "treeverify/coordinator/tree_validator.h"
#include "treeverify/kernels/mla_verify_attention.h"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::coordinator {
namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// The ranks' outputs for one sequence of a batch, and when its batch ran.
struct SegmentResult {
  std::vector<worker::SegmentOutput> per_rank;  // [rank]
  absl::Time dispatched;
  absl::Time answered;
  int32_t batch_sequences = 0;
};

using SegmentCallback = std::function<void(absl::StatusOr<SegmentResult>)>;

// One sequence's rows waiting for a Forward.
// What a queued segment is: a forward holds one kind only (DispatchLoop).
enum class SegmentKind { kPromptChunk, kTree };

struct QueuedSegment {
  SegmentKind kind;
  worker::SegmentInput segment;
  absl::Time enqueued;
  SegmentCallback done;
};

// The shards' view of node `node` of a segment, for the token selector.
std::vector<ShardNode> ShardsOf(const SegmentResult& result, size_t node, int32_t candidates) {
  std::vector<ShardNode> shards;
  shards.reserve(result.per_rank.size());
  for (const worker::SegmentOutput& out : result.per_rank) {
    absl::Span<const kernels::Candidate> node_candidates;
    if (candidates > 0) {
      node_candidates = absl::MakeConstSpan(out.candidates).subspan(node * candidates, candidates);
    }
    shards.push_back({&out.summaries[node], node_candidates});
  }
  return shards;
}

absl::Status ValidateSampling(const SamplingParams& s) {
  if (!(s.temperature >= 0.0f && s.temperature <= 100.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.temperature must be in [0, 100], got ", s.temperature));
  }
  if (!(s.top_p >= 0.0f && s.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p must be in [0, 1], got ", s.top_p));
  }
  // Each rank sends at most kMaxCandidatesPerShard candidates, so larger top_k cannot be exact.
  if (s.top_k < 0 || s.top_k > kMaxCandidatesPerShard) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_k must be in [0, ", kMaxCandidatesPerShard, "], got ", s.top_k));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status VerifyEngineOptions::Validate() const {
  if (max_draft_nodes < 0 || max_draft_nodes > kernels::kMaxSegmentRows - 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_draft_nodes must be in [0, ",
                                                   kernels::kMaxSegmentRows - 1, "], got ",
                                                   max_draft_nodes));
  }
  if (prefill_chunk < 0 || prefill_chunk > worker::kMaxChainRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk must be in [1, ", worker::kMaxChainRows,
                     "], or 0 for the ranks' backend's default; got ", prefill_chunk));
  }
  if (max_batch_rows < kernels::kMaxSegmentRows) {
    return absl::InvalidArgumentError(absl::StrCat("max_batch_rows must be at least ",
                                                   kernels::kMaxSegmentRows, " (one full tree)"));
  }
  if (max_context_length < 0 || batch_window < absl::ZeroDuration() ||
      rank_timeout <= absl::ZeroDuration() || expiry_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "max_context_length, batch_window, rank_timeout and expiry_interval must be "
        "non-negative (the durations positive)");
  }
  return sessions.Validate();
}

class VerifyEngine::Impl {
 public:
  Impl(const VerifyEngineOptions& options, std::vector<std::unique_ptr<RankClient>> ranks,
       ModelInfo info, std::unique_ptr<SessionManager> sessions)
      : options_(options),
        ranks_(std::move(ranks)),
        info_(std::move(info)),
        sessions_(std::move(sessions)),
        dispatcher_([this] { DispatchLoop(); }) {}

  ~Impl() {
    Shutdown();
    dispatcher_.join();
  }

  const ModelInfo& info() const { return info_; }

  bool serving() const {
    absl::MutexLock lock(&mu_);
    return !stopping_ && !failed_;
  }

  void Shutdown() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }

  EngineStats stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

  int64_t active_sessions() const { return sessions_->size(); }

  void CreateSessionAsync(CreateSessionInput input, CreateSessionCallback done);
  void VerifyAsync(VerifyInput input, VerifyCallback done);
  absl::Status CloseSession(const SessionId& id);

 private:
  TreeLimits Limits() const {
    return TreeLimits{.max_draft_nodes = options_.max_draft_nodes,
                      .vocab_size = info_.vocab_size,
                      .max_context_length = info_.max_context_length};
  }
  // Why new work is refused: a rank failed, or shutdown began.
  absl::Status NotServing() const {
    absl::MutexLock lock(&mu_);
    if (failed_) return failure_;
    if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
    return absl::OkStatus();
  }
  // Bytes of bf16 hidden states rank 0 returns for a segment.
  int64_t HiddenStateBytes(const worker::SegmentInput& segment) const {
    return static_cast<int64_t>(segment.token_ids.size() * segment.hidden_state_layers.size()) *
           info_.hidden_size * 2;
  }
  // Why queued work cannot run: a rank failed (shutdown still drains the queue).
  absl::Status Failure() const {
    absl::MutexLock lock(&mu_);
    return failed_ ? failure_ : absl::OkStatus();
  }
  // Queues rows for the next Forward of their kind; `done` runs on the dispatch thread.
  void Enqueue(SegmentKind kind, worker::SegmentInput segment, SegmentCallback done);
  void PrefillChunk(std::shared_ptr<SessionLease> lease, std::vector<int32_t> prompt,
                    size_t previous_begin, size_t begin, bool return_logprobs,
                    CreateSessionCallback done);
  absl::StatusOr<VerifyOutput> FinishVerify(Session& session, const VerifyInput& input,
                                            const std::vector<int32_t>& depth, absl::Time started,
                                            absl::Time validated,
                                            absl::StatusOr<SegmentResult> result);

  void DispatchLoop();
  void RunBatch(std::vector<QueuedSegment> batch);
  void ReleaseOnRanks(const std::vector<uint64_t>& ids);
  void Fail(absl::Status status);
  // Calls fn(rank) for every rank in parallel and returns their results in rank order.
  template <typename T, typename Fn>
  std::vector<absl::StatusOr<T>> OnAllRanks(Fn fn);

  const VerifyEngineOptions options_;
  std::vector<std::unique_ptr<RankClient>> ranks_;
  const ModelInfo info_;
  std::unique_ptr<SessionManager> sessions_;

  mutable absl::Mutex mu_;
  std::deque<QueuedSegment> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> to_release_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool dispatcher_exited_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread dispatcher_;  // last: starts once everything above exists
};

template <typename T, typename Fn>
std::vector<absl::StatusOr<T>> VerifyEngine::Impl::OnAllRanks(Fn fn) {
  const size_t world = ranks_.size();
  std::vector<absl::StatusOr<T>> results(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t r = 1; r < world; ++r) threads.emplace_back([&, r] { results[r] = fn(*ranks_[r]); });
  results[0] = fn(*ranks_[0]);
  for (std::thread& t : threads) t.join();
  return results;
}

void VerifyEngine::Impl::Enqueue(SegmentKind kind, worker::SegmentInput segment,
                                 SegmentCallback done) {
  {
    absl::MutexLock lock(&mu_);
    // Work queued after the dispatcher left would never run: refuse it instead.
    if (!failed_ && !dispatcher_exited_) {
      queue_.push_back({kind, std::move(segment), absl::Now(), std::move(done)});
      return;
    }
  }
  absl::Status refusal = NotServing();
  done(refusal.ok() ? absl::UnavailableError("the coordinator is shutting down") : refusal);
}

void VerifyEngine::Impl::CreateSessionAsync(CreateSessionInput input, CreateSessionCallback done) {
  if (absl::Status status = NotServing(); !status.ok()) return done(status);
  if (absl::Status status = ValidatePrompt(input.prompt_token_ids, Limits()); !status.ok()) {
    return done(status);
  }
  if (absl::Status status = ValidateSampling(input.sampling); !status.ok()) {
    return done(status);
  }
  absl::StatusOr<SessionLease> lease =
      sessions_->CreateSession(input.sampling, input.stopping, absl::Now());
  if (!lease.ok()) return done(lease.status());
  PrefillChunk(std::make_shared<SessionLease>(std::move(*lease)), std::move(input.prompt_token_ids),
               0, 0, input.return_logprobs, std::move(done));
}

// Prefills prompt[begin, begin + chunk) as a chain, committing the previous chunk
// (prompt[previous_begin, begin)) first; the last chunk's last node decides the first pending
// token. The last chunk returns top-k / top-p candidates for each of its rows, so it is held to a
// tree's size (kMaxSegmentRows): the tail of a prompt longer than that goes in a chunk of its own.
void VerifyEngine::Impl::PrefillChunk(std::shared_ptr<SessionLease> lease,
                                      std::vector<int32_t> prompt, size_t previous_begin,
                                      size_t begin, bool return_logprobs,
                                      CreateSessionCallback done) {
  Session& session = **lease;
  size_t end = std::min(prompt.size(), begin + options_.prefill_chunk);
  const size_t tail = kernels::kMaxSegmentRows;
  if (end == prompt.size() && end - begin > tail && CandidatesPerShard(session.sampling) > 0) {
    end -= tail;
  }
  const bool last = end == prompt.size();
  worker::SegmentInput segment;
  segment.sequence_id = session.sequence_id;
  if (begin > 0) segment.commit_nodes = worker::SegmentTree::AllNodes(begin - previous_begin);
  segment.expected_committed_length = static_cast<int64_t>(begin);
  segment.token_ids.assign(prompt.begin() + begin, prompt.begin() + end);
  segment.parents = worker::SegmentTree::ChainParents(static_cast<int32_t>(end - begin));
  if (last) {
    segment.sampling = {.temperature = session.sampling.temperature,
                        .seed = session.sampling.seed,
                        .candidates = CandidatesPerShard(session.sampling)};
  }
  Enqueue(SegmentKind::kPromptChunk, std::move(segment),
          [this, lease = std::move(lease), prompt = std::move(prompt), begin, end, last,
           return_logprobs, done = std::move(done)](absl::StatusOr<SegmentResult> result) mutable {
            Session& session = **lease;
            absl::Status status = result.status();
            if (status.ok()) status = result->per_rank[0].status;
            if (!status.ok()) {
              // The session never became usable: forget it and free whatever the ranks hold.
              const SessionId id = session.id;
              lease.reset();  // ends the lease first, so Close removes the session at once
              if (absl::StatusOr<uint64_t> sequence = sessions_->Close(id);
                  sequence.ok() && *sequence != kNoSequenceId) {
                absl::MutexLock lock(&mu_);
                to_release_.push_back(*sequence);
              }
              return done(status);
            }
            if (!last) {
              // Re-enter through the queue so other sessions' work interleaves with long prompts.
              return PrefillChunk(lease, std::move(prompt), begin, end, return_logprobs,
                                  std::move(done));
            }
            const int32_t candidates = CandidatesPerShard(session.sampling);
            const size_t last_node = end - begin - 1;
            absl::StatusOr<SelectedToken> first =
                SelectToken(ShardsOf(*result, last_node, candidates), session.sampling,
                            static_cast<int64_t>(prompt.size()));
            if (!first.ok()) {
              lease.reset();
              return done(first.status());
            }
            session.committed_tokens = prompt;
            session.pending_token = first->token;
            session.pending_commit = worker::SegmentTree::AllNodes(end - begin);
            const std::vector<int32_t> emitted = {first->token};
            const StopDecision stop =
                ApplyStopping(emitted, 0, session.stopping, info_.eos_token_ids,
                              static_cast<int64_t>(prompt.size()), info_.max_context_length);
            session.emitted_tokens = 1;
            session.finish_reason = stop.reason;
            CreateSessionOutput out;
            out.session_id = session.id;
            out.pending_token_id = first->token;
            out.context_length = static_cast<int64_t>(prompt.size());
            out.pending_logprob = return_logprobs ? first->logprob : 0.0f;
            out.finish_reason = stop.reason;
            lease.reset();
            if (options_.observer != nullptr) options_.observer->OnSessionCreated();
            done(std::move(out));
          });
}

void VerifyEngine::Impl::VerifyAsync(VerifyInput input, VerifyCallback done) {
  const absl::Time started = absl::Now();
  if (absl::Status status = NotServing(); !status.ok()) return done(status);
  absl::StatusOr<SessionLease> acquired = sessions_->Acquire(input.session_id, started);
  if (!acquired.ok()) return done(acquired.status());
  auto lease = std::make_shared<SessionLease>(std::move(*acquired));
  Session& session = **lease;
  // A refused request leaves the session as it was, and free for the client's next call.
  auto refuse = [&lease, &done](absl::Status status) {
    lease.reset();
    done(std::move(status));
  };
  if (session.finish_reason != FinishReason::kNone) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat("session ", session.id.ToHex(), " has finished; create a new session")));
  }
  const int64_t committed = static_cast<int64_t>(session.committed_tokens.size());
  if (absl::Status status =
          ValidateDraftTree(input.draft_token_ids, input.draft_parents, Limits(), committed);
      !status.ok()) {
    return refuse(status);
  }
  absl::flat_hash_set<int32_t> layers;
  for (int32_t layer : input.hidden_state_layers) {
    if (layer < 0 || layer > info_.num_layers || !layers.insert(layer).second) {
      return refuse(absl::InvalidArgumentError(absl::StrCat("hidden_state_layers: layer ", layer,
                                                            " is not in [0, ", info_.num_layers,
                                                            "] or is listed twice")));
    }
  }
  const int64_t hidden_bytes =
      static_cast<int64_t>((input.draft_token_ids.size() + 1) * input.hidden_state_layers.size()) *
      info_.hidden_size * 2;
  if (hidden_bytes > options_.max_hidden_state_bytes) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        "hidden states of ", input.draft_token_ids.size() + 1, " rows x ",
        input.hidden_state_layers.size(), " layers would be ", hidden_bytes, " bytes; at most ",
        options_.max_hidden_state_bytes, " per step: ask for fewer layers or a smaller tree")));
  }
  worker::SegmentInput segment;
  segment.sequence_id = session.sequence_id;
  segment.commit_nodes = session.pending_commit;
  segment.expected_committed_length = committed;
  segment.token_ids.push_back(session.pending_token);
  segment.token_ids.insert(segment.token_ids.end(), input.draft_token_ids.begin(),
                           input.draft_token_ids.end());
  segment.parents = SegmentParents(input.draft_parents);
  segment.sampling = {.temperature = session.sampling.temperature,
                      .seed = session.sampling.seed,
                      .candidates = CandidatesPerShard(session.sampling)};
  segment.hidden_state_layers = input.hidden_state_layers;
  std::vector<int32_t> depth(segment.parents.size(), 0);
  for (size_t s = 1; s < depth.size(); ++s) depth[s] = depth[segment.parents[s]] + 1;
  const absl::Time validated = absl::Now();
  Enqueue(
      SegmentKind::kTree, std::move(segment),
      [this, lease = std::move(lease), input = std::move(input), depth = std::move(depth), started,
       validated, done = std::move(done)](absl::StatusOr<SegmentResult> result) mutable {
        absl::StatusOr<VerifyOutput> out =
            FinishVerify(**lease, input, depth, started, validated, std::move(result));
        lease.reset();  // before replying: the client may send its next step at once
        done(std::move(out));
      });
}

absl::StatusOr<VerifyOutput> VerifyEngine::Impl::FinishVerify(
    Session& session, const VerifyInput& input, const std::vector<int32_t>& depth,
    absl::Time started, absl::Time validated, absl::StatusOr<SegmentResult> result) {
  const int64_t committed = static_cast<int64_t>(session.committed_tokens.size());
  if (!result.ok()) return result.status();
  const worker::SegmentOutput& first_rank = result->per_rank[0];
  if (session.pending_commit && first_rank.committed_length == committed) {
    session.pending_commit.reset();  // the ranks applied it, even if the new rows failed
  }
  if (!first_rank.status.ok()) return first_rank.status;

  // The target's token after every segment node.
  const int32_t candidates = CandidatesPerShard(session.sampling);
  std::vector<int32_t> targets(depth.size());
  std::vector<float> logprobs(depth.size());
  for (size_t s = 0; s < depth.size(); ++s) {
    absl::StatusOr<SelectedToken> token =
        SelectToken(ShardsOf(*result, s, candidates), session.sampling, committed + depth[s] + 1);
    if (!token.ok()) return token.status();
    targets[s] = token->token;
    logprobs[s] = token->logprob;
  }
  const absl::Time accept_start = absl::Now();
  Acceptance acceptance = AcceptLongestPath(input.draft_token_ids, input.draft_parents, targets);
  const int64_t context_after =
      committed + 1 + static_cast<int64_t>(acceptance.accepted_draft_nodes.size());
  const StopDecision stop =
      ApplyStopping(acceptance.emitted_tokens, session.emitted_tokens, session.stopping,
                    info_.eos_token_ids, context_after, info_.max_context_length);

  VerifyOutput out;
  // When the step stops inside the accepted drafts, report only the nodes whose tokens were
  // emitted.
  out.accepted_node_indices.assign(
      acceptance.accepted_draft_nodes.begin(),
      acceptance.accepted_draft_nodes.begin() +
          std::min(acceptance.accepted_draft_nodes.size(), stop.emit_count));
  out.emitted_token_ids.assign(acceptance.emitted_tokens.begin(),
                               acceptance.emitted_tokens.begin() + stop.emit_count);
  if (input.return_logprobs) {
    for (size_t k = 0; k < stop.emit_count; ++k) {
      out.logprobs.push_back(logprobs[acceptance.commit_nodes[k]]);
    }
  }
  // Rows whose KV this step committed, in order: the inputs that produced the emitted tokens.
  for (const worker::SegmentOutput::LayerHiddenStates& layer : first_rank.hidden_states) {
    HiddenStateRows rows{.layer = layer.layer, .hidden_size = info_.hidden_size};
    for (size_t k = 0; k < stop.emit_count; ++k) {
      const auto row = layer.values.begin() + acceptance.commit_nodes[k] * info_.hidden_size;
      rows.values.insert(rows.values.end(), row, row + info_.hidden_size);
      ++rows.rows;
    }
    out.hidden_states.push_back(std::move(rows));
  }

  session.committed_tokens.push_back(session.pending_token);
  for (int32_t node : acceptance.accepted_draft_nodes) {
    session.committed_tokens.push_back(input.draft_token_ids[node]);
  }
  session.pending_token = acceptance.new_pending_token;
  session.pending_commit = acceptance.commit_nodes;
  session.emitted_tokens += static_cast<int64_t>(stop.emit_count);
  session.finish_reason = stop.reason;
  out.pending_token_id = session.pending_token;
  out.context_length = static_cast<int64_t>(session.committed_tokens.size());
  out.finish_reason = stop.reason;
  // Phases that add up to the whole step (reduce includes the hop from the forward's answer to
  // this callback).
  const absl::Time finished = absl::Now();
  const StepTimings timings = {.validate_seconds = Seconds(validated - started),
                               .queue_seconds = Seconds(result->dispatched - validated),
                               .fanout_seconds = Seconds(result->answered - result->dispatched),
                               .reduce_seconds = Seconds(accept_start - result->answered),
                               .accept_seconds = Seconds(finished - accept_start),
                               .batch_sequences = result->batch_sequences};
  if (input.return_timings) out.timings = timings;
  if (options_.observer != nullptr) {
    const int32_t draft_depth = depth.empty() ? 0 : *std::max_element(depth.begin(), depth.end());
    options_.observer->OnVerifyStep(
        {.timings = timings,
         .draft_nodes = static_cast<int32_t>(input.draft_token_ids.size()),
         .draft_depth = draft_depth,
         .accepted_nodes = static_cast<int32_t>(acceptance.accepted_draft_nodes.size()),
         .emitted_tokens = static_cast<int32_t>(out.emitted_token_ids.size())});
  }
  return out;
}

absl::Status VerifyEngine::Impl::CloseSession(const SessionId& id) {
  TV_ASSIGN_OR_RETURN(uint64_t sequence, sessions_->Close(id));
  // A session closed during its Verify is released once that step ends (TakeReleased).
  if (sequence == kNoSequenceId) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  to_release_.push_back(sequence);
  return absl::OkStatus();
}

void VerifyEngine::Impl::DispatchLoop() {
  absl::Time next_expiry = absl::Now() + options_.expiry_interval;
  while (true) {
    std::vector<uint64_t> releases;
    std::vector<QueuedSegment> batch;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return !queue_.empty() || !to_release_.empty() || stopping_;
      };
      mu_.AwaitWithDeadline(absl::Condition(&has_work), next_expiry);
      if (!queue_.empty() && !failed_) {
        // Give other sessions' trees the batch window to arrive, unless the batch is full.
        const absl::Time close_at = queue_.front().enqueued + options_.batch_window;
        auto full = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          int64_t rows = 0;
          for (const QueuedSegment& q : queue_) rows += q.segment.token_ids.size();
          return rows >= options_.max_batch_rows || stopping_;
        };
        mu_.AwaitWithDeadline(absl::Condition(&full), close_at);
        int64_t rows = 0;
        int64_t hidden_bytes = 0;
        absl::flat_hash_set<uint64_t> sequences;
        // A forward holds prompt chunks or draft trees, never both: a GPU rank prefills a forward
        // of chains in the MHA form and replays one of trees from a CUDA graph, and a mix would
        // take neither path. The first queued segment picks the kind; the other kind's segments
        // keep their places for the next forward.
        const SegmentKind kind = queue_.front().kind;
        for (auto it = queue_.begin(); it != queue_.end();) {
          if (it->kind != kind) {
            ++it;
            continue;
          }
          const int64_t next_rows = static_cast<int64_t>(it->segment.token_ids.size());
          const int64_t next_hidden = HiddenStateBytes(it->segment);
          // Rank 0's answer carries every requested hidden state: keep it under the budget.
          if (!batch.empty() && (rows + next_rows > options_.max_batch_rows ||
                                 hidden_bytes + next_hidden > options_.max_hidden_state_bytes ||
                                 sequences.contains(it->segment.sequence_id))) {
            break;
          }
          rows += next_rows;
          hidden_bytes += next_hidden;
          sequences.insert(it->segment.sequence_id);
          batch.push_back(std::move(*it));
          it = queue_.erase(it);
        }
      }
      if (failed_) {
        while (!queue_.empty()) {
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
      }
      releases.swap(to_release_);
      if (stopping_ && queue_.empty() && batch.empty() && releases.empty()) {
        dispatcher_exited_ = true;
        break;
      }
    }
    if (absl::Now() >= next_expiry) {
      std::vector<uint64_t> expired = sessions_->ExpireIdle(absl::Now());
      releases.insert(releases.end(), expired.begin(), expired.end());
      next_expiry = absl::Now() + options_.expiry_interval;
    }
    std::vector<uint64_t> closed_in_flight = sessions_->TakeReleased();
    releases.insert(releases.end(), closed_in_flight.begin(), closed_in_flight.end());
    if (!batch.empty()) RunBatch(std::move(batch));
    if (!releases.empty()) ReleaseOnRanks(releases);
  }
}

void VerifyEngine::Impl::RunBatch(std::vector<QueuedSegment> batch) {
  if (absl::Status failure = Failure(); !failure.ok()) {
    for (QueuedSegment& item : batch) item.done(failure);
    return;
  }
  worker::ForwardRequest request;
  for (QueuedSegment& item : batch) request.segments.push_back(std::move(item.segment));
  const absl::Time dispatched = absl::Now();
  std::vector<absl::StatusOr<worker::ForwardResult>> results = OnAllRanks<worker::ForwardResult>(
      [&](RankClient& rank) { return rank.Forward(request, options_.rank_timeout); });
  const absl::Time answered = absl::Now();
  for (size_t r = 0; r < results.size(); ++r) {
    if (!results[r].ok()) {
      if (options_.observer != nullptr) options_.observer->OnRankLost(static_cast<int>(r));
      Fail(absl::UnavailableError(
          absl::StrCat("rank ", r, " failed during a forward: ", results[r].status().ToString())));
      for (QueuedSegment& item : batch) item.done(Failure());
      return;
    }
  }
  // Every rank ran the same request on the same state, so every rank must have reached the same
  // outcome for every segment; anything else means the replica is out of step.
  for (size_t i = 0; i < batch.size(); ++i) {
    const worker::SegmentOutput& first = results[0]->segments[i];
    for (size_t r = 1; r < results.size(); ++r) {
      const worker::SegmentOutput& other = results[r]->segments[i];
      if (other.status.code() != first.status.code() ||
          other.summaries.size() != first.summaries.size() ||
          other.committed_length != first.committed_length) {
        if (options_.observer != nullptr) options_.observer->OnRankLost(static_cast<int>(r));
        Fail(absl::UnavailableError(
            absl::StrCat("ranks 0 and ", r, " disagree on a sequence's outcome (",
                         first.status.ToString(), " vs ", other.status.ToString(), ")")));
        for (QueuedSegment& item : batch) item.done(Failure());
        return;
      }
    }
  }
  if (options_.observer != nullptr) {
    int64_t rows = 0;
    for (const worker::SegmentInput& segment : request.segments) {
      rows += static_cast<int64_t>(segment.token_ids.size());
    }
    options_.observer->OnForward(static_cast<int32_t>(batch.size()), rows);
  }
  {
    absl::MutexLock lock(&mu_);
    ++stats_.forwards;
    stats_.batched_sequences += static_cast<int64_t>(batch.size());
    stats_.max_batch_sequences =
        std::max<int64_t>(stats_.max_batch_sequences, static_cast<int64_t>(batch.size()));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    SegmentResult segment;
    segment.dispatched = dispatched;
    segment.answered = answered;
    segment.batch_sequences = static_cast<int32_t>(batch.size());
    for (absl::StatusOr<worker::ForwardResult>& rank_result : results) {
      segment.per_rank.push_back(std::move(rank_result->segments[i]));
    }
    batch[i].done(std::move(segment));
  }
}

void VerifyEngine::Impl::ReleaseOnRanks(const std::vector<uint64_t>& ids) {
  if (!Failure().ok()) return;  // the ranks are gone or out of step; nothing to free there
  std::vector<absl::StatusOr<int64_t>> results = OnAllRanks<int64_t>(
      [&](RankClient& rank) { return rank.Release(ids, options_.rank_timeout); });
  for (size_t r = 0; r < results.size(); ++r) {
    if (!results[r].ok()) {
      if (options_.observer != nullptr) options_.observer->OnRankLost(static_cast<int>(r));
      Fail(absl::UnavailableError(
          absl::StrCat("rank ", r, " failed during a release: ", results[r].status().ToString())));
      return;
    }
  }
}

void VerifyEngine::Impl::Fail(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (failed_) return;
  failed_ = true;
  failure_ = std::move(status);
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<VerifyEngine>> VerifyEngine::Create(
    const VerifyEngineOptions& options, std::vector<std::unique_ptr<RankClient>> ranks) {
  TV_RETURN_IF_ERROR(options.Validate());
  if (ranks.empty()) return absl::InvalidArgumentError("a replica needs at least one rank");
  std::vector<RankDescription> described;
  for (size_t r = 0; r < ranks.size(); ++r) {
    TV_ASSIGN_OR_RETURN(RankDescription d, ranks[r]->Describe(options.rank_timeout));
    if (d.rank != static_cast<int>(r) || d.world_size != static_cast<int>(ranks.size())) {
      return absl::FailedPreconditionError(absl::StrCat("rank client ", r, " reached rank ", d.rank,
                                                        " of ", d.world_size, "; expected rank ", r,
                                                        " of ", ranks.size()));
    }
    // The ranks must make identical decisions (the same cache geometry) on one model, and their
    // vocabulary shards must tile [0, vocab) in rank order.
    const int64_t expected_vocab_begin = described.empty() ? 0 : described.back().vocab_end;
    if (!described.empty() &&
        (d.model_type != described[0].model_type || d.vocab_size != described[0].vocab_size ||
         d.num_layers != described[0].num_layers || d.hidden_size != described[0].hidden_size ||
         d.max_position_embeddings != described[0].max_position_embeddings ||
         d.eos_token_ids != described[0].eos_token_ids ||
         d.kv_pages_total != described[0].kv_pages_total ||
         d.kv_page_size != described[0].kv_page_size ||
         d.group_epoch != described[0].group_epoch)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, " differs from rank 0 in its model, KV cache geometry or group epoch"));
    }
    if (d.vocab_begin != expected_vocab_begin ||
        (r + 1 == ranks.size() && d.vocab_end != d.vocab_size)) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " holds vocabulary [", d.vocab_begin, ", ", d.vocab_end,
                       "); the shards must tile [0, ", d.vocab_size, ") in rank order"));
    }
    described.push_back(std::move(d));
  }
  const RankDescription& d = described[0];
  ModelInfo info;
  info.model_name = options.model_name;
  info.model_type = d.model_type;
  info.vocab_size = d.vocab_size;
  info.max_context_length = options.max_context_length > 0
                                ? std::min(options.max_context_length, d.max_position_embeddings)
                                : d.max_position_embeddings;
  info.max_draft_nodes = options.max_draft_nodes;
  info.world_size = static_cast<int32_t>(ranks.size());
  info.backend = d.backend;
  info.eos_token_ids = d.eos_token_ids;
  info.num_layers = d.num_layers;
  info.hidden_size = d.hidden_size;
  VerifyEngineOptions resolved = options;
  if (resolved.prefill_chunk == 0) {
    resolved.prefill_chunk = d.backend == "cuda" ? kCudaPrefillChunk : kCpuPrefillChunk;
  }
  info.prefill_chunk = resolved.prefill_chunk;
  TV_ASSIGN_OR_RETURN(std::unique_ptr<SessionManager> sessions,
                      SessionManager::Create(options.sessions));
  return std::unique_ptr<VerifyEngine>(new VerifyEngine(
      std::make_unique<Impl>(resolved, std::move(ranks), std::move(info), std::move(sessions))));
}

VerifyEngine::VerifyEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VerifyEngine::~VerifyEngine() = default;

const ModelInfo& VerifyEngine::info() const { return impl_->info(); }
void VerifyEngine::CreateSessionAsync(CreateSessionInput input, CreateSessionCallback done) {
  impl_->CreateSessionAsync(std::move(input), std::move(done));
}
void VerifyEngine::VerifyAsync(VerifyInput input, VerifyCallback done) {
  impl_->VerifyAsync(std::move(input), std::move(done));
}
absl::Status VerifyEngine::CloseSession(const SessionId& id) { return impl_->CloseSession(id); }
bool VerifyEngine::serving() const { return impl_->serving(); }
void VerifyEngine::Shutdown() { impl_->Shutdown(); }
EngineStats VerifyEngine::stats() const { return impl_->stats(); }
int64_t VerifyEngine::active_sessions() const { return impl_->active_sessions(); }

absl::StatusOr<CreateSessionOutput> VerifyEngine::CreateSession(CreateSessionInput input) {
  std::promise<absl::StatusOr<CreateSessionOutput>> promise;
  auto future = promise.get_future();
  CreateSessionAsync(std::move(input), [&promise](absl::StatusOr<CreateSessionOutput> out) {
    promise.set_value(std::move(out));
  });
  return future.get();
}

absl::StatusOr<VerifyOutput> VerifyEngine::Verify(VerifyInput input) {
  std::promise<absl::StatusOr<VerifyOutput>> promise;
  auto future = promise.get_future();
  VerifyAsync(std::move(input),
              [&promise](absl::StatusOr<VerifyOutput> out) { promise.set_value(std::move(out)); });
  return future.get();
}

}  // namespace treeverify::coordinator
