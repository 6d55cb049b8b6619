// Many sessions at once through the real processes: 16 sessions in parallel threads (half over
// VerifyStream) stay lossless and share forwards (the batcher merged them), and every KV page comes
// back on every rank once sessions are closed, closed mid-step, finished or expired.
#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "test_support.h"
#include "treeverify/tools/drafters.h"

namespace treeverify::integration {
namespace {

using coordinator::FinishReason;

struct TimedRun {
  absl::Status status;
  std::vector<int32_t> tokens;
  int32_t max_batch_sequences = 0;
  int64_t accepted = 0;
};

// The drafting loop of tools::SpeculativeGenerate, asking for timings at every step, with unary
// Verify calls or over one VerifyStream.
TimedRun GenerateWithTimings(services::VerifierClient& api, int64_t vocab,
                             const std::vector<int32_t>& prompt, int max_new_tokens,
                             bool use_stream) {
  TimedRun run;
  auto drafter = tools::MakeDrafter("ngram", {.vocab_size = vocab});
  if (!drafter.ok()) {
    run.status = drafter.status();
    return run;
  }
  absl::StatusOr<coordinator::CreateSessionOutput> created =
      api.CreateSession({.prompt_token_ids = prompt,
                         .stopping = {.max_new_tokens = max_new_tokens, .ignore_eos = true}});
  if (!created.ok()) {
    run.status = created.status();
    return run;
  }
  run.tokens.push_back(created->pending_token_id);
  std::unique_ptr<services::VerifierStream> stream;
  if (use_stream) {
    absl::StatusOr<std::unique_ptr<services::VerifierStream>> opened = api.OpenStream();
    if (!opened.ok()) {
      run.status = opened.status();
      return run;
    }
    stream = *std::move(opened);
  }
  FinishReason finish = created->finish_reason;
  while (finish == FinishReason::kNone) {
    tools::DraftTree tree = (*drafter)->Propose(Concat(prompt, run.tokens), 8);
    coordinator::VerifyInput input{.session_id = created->session_id,
                                   .draft_token_ids = tree.token_ids,
                                   .draft_parents = tree.parents,
                                   .return_timings = true};
    absl::StatusOr<coordinator::VerifyOutput> out =
        stream != nullptr ? stream->Step(input) : api.Verify(input);
    if (!out.ok()) {
      run.status = out.status();
      break;
    }
    run.tokens.insert(run.tokens.end(), out->emitted_token_ids.begin(),
                      out->emitted_token_ids.end());
    run.max_batch_sequences = std::max(run.max_batch_sequences, out->timings.batch_sequences);
    run.accepted += static_cast<int64_t>(out->accepted_node_indices.size());
    finish = out->finish_reason;
  }
  if (stream != nullptr && run.status.ok()) run.status = stream->Finish();
  const absl::Status closed = api.CloseSession(created->session_id);
  if (run.status.ok()) run.status = closed;
  return run;
}

TEST_F(ReplicaTest, SixteenParallelSessionsAreLosslessAndBatched) {
  // A 2 ms batch window: the 16 threads' steps reach the coordinator within it.
  Replica* replica =
      StartReplica({.world_size = 2, .coordinator_flags = {"--batch-window-us", "2000"}});
  ASSERT_NE(replica, nullptr);
  const int64_t vocab = 512;
  const unsigned seed = 6006;
  std::cout << "prompt seed " << seed << "\n";
  const auto prompts = RepetitivePrompts(16, vocab, seed);
  constexpr int kNewTokens = 16;

  std::vector<std::vector<int32_t>> plain;
  for (const auto& prompt : prompts) {
    absl::StatusOr<tools::GenerateResult> run =
        Generate(replica->client(), vocab, prompt, {.max_new_tokens = kNewTokens});
    ASSERT_TRUE(run.ok()) << run.status();
    plain.push_back(run->tokens);
  }

  std::vector<TimedRun> runs(prompts.size());
  std::vector<std::thread> threads;
  for (size_t p = 0; p < prompts.size(); ++p) {
    threads.emplace_back([&, p] {
      // Half the sessions step over a VerifyStream each, half with unary calls.
      runs[p] = GenerateWithTimings(replica->client(), vocab, prompts[p], kNewTokens,
                                    /*use_stream=*/p % 2 == 1);
    });
  }
  for (std::thread& t : threads) t.join();  // bounded: every call has the client's deadline

  int32_t max_batch = 0;
  int64_t accepted = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    ASSERT_TRUE(runs[p].status.ok()) << "session " << p << ": " << runs[p].status;
    EXPECT_EQ(runs[p].tokens, plain[p]) << "session " << p;
    max_batch = std::max(max_batch, runs[p].max_batch_sequences);
    accepted += runs[p].accepted;
  }
  std::cout << "largest batch " << max_batch << " sequences; " << accepted
            << " draft tokens accepted\n";
  EXPECT_GT(max_batch, 1) << "no step shared its forward with another session";
  const absl::Status freed = replica->WaitForAllKvPagesFree(absl::Seconds(10));
  EXPECT_TRUE(freed.ok()) << freed;
}

// Every way a session ends gives its KV pages back on every rank: closed after steps, closed
// while a Verify is in flight, finished and then closed, or left idle until it expires.
TEST_F(ReplicaTest, EndingSessionsReturnsEveryKvPage) {
  // 16-token pages so that short prompts take several; sessions expire after 4 s idle.
  Replica* replica = StartReplica({.world_size = 2,
                                   .coordinator_flags = {"--session-ttl-s", "4"},
                                   .worker_flags = {"--kv-page-size", "16", "--kv-pages", "256"}});
  ASSERT_NE(replica, nullptr);
  services::VerifierClient& api = replica->client();
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<coordinator::RankDescription> d =
        replica->DescribeWorker(rank, absl::Seconds(10));
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->kv_pages_total, 256);
    EXPECT_EQ(d->kv_pages_free, 256) << "rank " << rank;
  }

  // Eight sessions of 40-token prompts, a few steps each.
  std::vector<coordinator::SessionId> sessions;
  for (int s = 0; s < 8; ++s) {
    std::vector<int32_t> prompt(40);
    for (int i = 0; i < 40; ++i) prompt[i] = 2 + (s * 41 + i * 7) % 500;
    absl::StatusOr<coordinator::CreateSessionOutput> created =
        api.CreateSession({.prompt_token_ids = prompt, .stopping = {.ignore_eos = true}});
    ASSERT_TRUE(created.ok()) << created.status();
    sessions.push_back(created->session_id);
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE(api.Verify({.session_id = created->session_id,
                              .draft_token_ids = {5, 6, 7},
                              .draft_parents = {-1, 0, -1}})
                      .ok());
    }
  }
  // At least 8 x 3 pages are held now (43 committed tokens each, 16 per page), on every rank.
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<coordinator::RankDescription> d =
        replica->DescribeWorker(rank, absl::Seconds(10));
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_LE(d->kv_pages_free, 256 - 8 * 3) << "rank " << rank;
  }

  // One closed while its Verify is in flight (the pages go once the step ends).
  {
    absl::Notification sending;
    std::thread in_flight([&] {
      sending.Notify();
      (void)api.Verify({.session_id = sessions[0],
                        .draft_token_ids = std::vector<int32_t>(100, 3),
                        .draft_parents = std::vector<int32_t>(100, -1)});
    });
    sending.WaitForNotification();
    EXPECT_TRUE(api.CloseSession(sessions[0]).ok());
    in_flight.join();
  }
  // One finished by max_new_tokens, then closed.
  absl::StatusOr<coordinator::CreateSessionOutput> finishing =
      api.CreateSession({.prompt_token_ids = std::vector<int32_t>(30, 9),
                         .stopping = {.max_new_tokens = 2, .ignore_eos = true}});
  ASSERT_TRUE(finishing.ok()) << finishing.status();
  absl::StatusOr<coordinator::VerifyOutput> last =
      api.Verify({.session_id = finishing->session_id});
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->finish_reason, FinishReason::kMaxNewTokens);
  EXPECT_TRUE(api.CloseSession(finishing->session_id).ok());
  // The rest closed, except the last one, which is left to expire.
  for (size_t s = 1; s + 1 < sessions.size(); ++s) {
    EXPECT_TRUE(api.CloseSession(sessions[s]).ok()) << "session " << s;
  }
  const absl::Time left_idle = absl::Now();

  const absl::Status freed = replica->WaitForAllKvPagesFree(absl::Seconds(15));
  EXPECT_TRUE(freed.ok()) << freed;
  std::cout << "all pages free " << absl::FormatDuration(absl::Now() - left_idle)
            << " after the last session went idle\n";
  absl::StatusOr<coordinator::VerifyOutput> expired = api.Verify({.session_id = sessions.back()});
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kNotFound) << expired.status();
}

}  // namespace
}  // namespace treeverify::integration
