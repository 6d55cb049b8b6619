// Each error code of DESIGN.md over the wire, produced by the case that should produce it, with a
// message naming the problem; refused requests leave the session usable and its output lossless.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "test_support.h"
#include "treeverify/services/client_channel.h"

namespace treeverify::integration {
namespace {

using coordinator::SessionId;
using coordinator::VerifyInput;
using testing::HasSubstr;

constexpr int kMaxContext = 64;

// The status's code and message, checked together so a failure prints both.
void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& needle) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(needle)) << status;
}

TEST_F(ReplicaTest, ErrorCodesNameTheProblemAndLeaveSessionsUsable) {
  // Two sessions at most, a small context, and a long batch window: a Verify waits 200 ms in the
  // batcher, so a second Verify on the same session reliably finds it in flight.
  Replica* replica = StartReplica(
      {.world_size = 1,
       .coordinator_flags = {"--max-sessions", "2", "--max-context", std::to_string(kMaxContext),
                             "--batch-window-us", "200000"}});
  ASSERT_NE(replica, nullptr);
  services::VerifierClient& api = replica->client();
  absl::StatusOr<coordinator::ModelInfo> info = api.GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const int32_t vocab = static_cast<int32_t>(info->vocab_size);
  EXPECT_EQ(info->max_draft_nodes, 255);

  const std::vector<int32_t> prompt = {8, 9, 10, 11, 8, 9, 10, 11};
  absl::StatusOr<coordinator::CreateSessionOutput> session =
      api.CreateSession({.prompt_token_ids = prompt});
  ASSERT_TRUE(session.ok()) << session.status();
  const SessionId id = session->session_id;
  std::vector<int32_t> committed = prompt;  // the session's tokens, to check it stays lossless
  int32_t pending = session->pending_token_id;

  // INVALID_ARGUMENT: malformed trees, tokens outside the vocabulary, too many nodes.
  ExpectError(
      api.Verify({.session_id = id, .draft_token_ids = {1, 2}, .draft_parents = {-1, 1}}).status(),
      absl::StatusCode::kInvalidArgument, "parents[1] = 1");
  ExpectError(
      api.Verify({.session_id = id, .draft_token_ids = {1, 2}, .draft_parents = {-1}}).status(),
      absl::StatusCode::kInvalidArgument, "tree.parents has 1");
  ExpectError(
      api.Verify({.session_id = id, .draft_token_ids = {3}, .draft_parents = {-2}}).status(),
      absl::StatusCode::kInvalidArgument, "parents[0] = -2");
  ExpectError(
      api.Verify({.session_id = id, .draft_token_ids = {5, vocab}, .draft_parents = {-1, 0}})
          .status(),
      absl::StatusCode::kInvalidArgument, "token_ids[1] = 512 is outside the vocabulary");
  ExpectError(api.Verify({.session_id = id,
                          .draft_token_ids = std::vector<int32_t>(256, 7),
                          .draft_parents = std::vector<int32_t>(256, -1)})
                  .status(),
              absl::StatusCode::kInvalidArgument, "256 draft nodes; the limit is 255");
  ExpectError(api.Verify({.session_id = id, .hidden_state_layers = {99}}).status(),
              absl::StatusCode::kInvalidArgument, "hidden_state_layers");
  ExpectError(api.CreateSession({.prompt_token_ids = {4, -1}}).status(),
              absl::StatusCode::kInvalidArgument, "prompt_token_ids[1] = -1");
  ExpectError(api.CreateSession({.prompt_token_ids = {}}).status(),
              absl::StatusCode::kInvalidArgument, "prompt_token_ids");
  {
    // A session id that is not 32 hex digits, straight through the stub.
    grpc::ClientContext context;
    services::SetTimeout(context, absl::Seconds(30));
    v1::VerifyRequest request;
    request.set_session_id("not-a-session");
    v1::VerifyResponse response;
    const grpc::Status status = api.stub().Verify(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("session_id"));
  }

  // OUT_OF_RANGE: a tree that would cross the max context, and a prompt that fills it.
  ExpectError(api.Verify({.session_id = id,
                          .draft_token_ids = std::vector<int32_t>(kMaxContext - prompt.size(), 7),
                          .draft_parents = std::vector<int32_t>(kMaxContext - prompt.size(), -1)})
                  .status(),
              absl::StatusCode::kOutOfRange, "max_context_length is 64");
  ExpectError(
      api.CreateSession({.prompt_token_ids = std::vector<int32_t>(kMaxContext, 3)}).status(),
      absl::StatusCode::kOutOfRange, "max_context_length is 64");

  // NOT_FOUND: a session that never existed.
  const SessionId unknown{.high = 0x0123456789abcdef, .low = 42};
  ExpectError(api.Verify({.session_id = unknown}).status(), absl::StatusCode::kNotFound,
              unknown.ToHex());
  ExpectError(api.CloseSession(unknown), absl::StatusCode::kNotFound, unknown.ToHex());

  // After all of that the session still works, and still emits the target's tokens: each step's
  // token equals the first token of a fresh session prefilled with everything so far.
  for (int step = 0; step < 2; ++step) {
    absl::StatusOr<coordinator::VerifyOutput> out = api.Verify({.session_id = id});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->emitted_token_ids.size(), 1u);
    committed.push_back(pending);
    absl::StatusOr<coordinator::CreateSessionOutput> forced =
        api.CreateSession({.prompt_token_ids = committed});
    ASSERT_TRUE(forced.ok()) << forced.status();
    EXPECT_EQ(out->emitted_token_ids[0], forced->pending_token_id) << "step " << step;
    EXPECT_EQ(out->context_length, static_cast<int64_t>(committed.size()));
    ASSERT_TRUE(api.CloseSession(forced->session_id).ok());
    pending = out->pending_token_id;
  }

  // FAILED_PRECONDITION: a second Verify while the first is in flight (it waits in the 200 ms
  // batch window). Retried a few times in case the first call was slow to leave this process.
  bool observed = false;
  for (int attempt = 0; attempt < 5 && !observed; ++attempt) {
    absl::Notification sending;
    absl::StatusOr<coordinator::VerifyOutput> first;
    std::thread in_flight([&] {
      sending.Notify();
      first = api.Verify({.session_id = id,
                          .draft_token_ids = std::vector<int32_t>(30, 9),
                          .draft_parents = std::vector<int32_t>(30, -1)});
    });
    sending.WaitForNotification();
    absl::SleepFor(absl::Milliseconds(50));
    const absl::Status second = api.Verify({.session_id = id}).status();
    in_flight.join();
    ASSERT_TRUE(first.ok()) << first.status();
    if (second.ok()) continue;  // the first call had not arrived yet: the second just stepped
    ExpectError(second, absl::StatusCode::kFailedPrecondition, "in flight");
    observed = true;
  }
  EXPECT_TRUE(observed) << "never saw two Verify calls of one session overlap";

  // RESOURCE_EXHAUSTED: a third live session with --max-sessions 2.
  absl::StatusOr<coordinator::CreateSessionOutput> second =
      api.CreateSession({.prompt_token_ids = {4}, .stopping = {.max_new_tokens = 2}});
  ASSERT_TRUE(second.ok()) << second.status();
  ExpectError(api.CreateSession({.prompt_token_ids = {4}}).status(),
              absl::StatusCode::kResourceExhausted, "too many sessions");

  // FAILED_PRECONDITION: a finished session.
  absl::StatusOr<coordinator::VerifyOutput> last = api.Verify({.session_id = second->session_id});
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->finish_reason, coordinator::FinishReason::kMaxNewTokens);
  ExpectError(api.Verify({.session_id = second->session_id}).status(),
              absl::StatusCode::kFailedPrecondition, "has finished");

  // NOT_FOUND: a closed session; its slot is free again.
  ASSERT_TRUE(api.CloseSession(second->session_id).ok());
  ExpectError(api.Verify({.session_id = second->session_id}).status(), absl::StatusCode::kNotFound,
              "unknown or expired session");
  ExpectError(api.CloseSession(second->session_id), absl::StatusCode::kNotFound,
              second->session_id.ToHex());
  absl::StatusOr<coordinator::CreateSessionOutput> third =
      api.CreateSession({.prompt_token_ids = {4}});
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE(api.CloseSession(third->session_id).ok());
  ASSERT_TRUE(api.CloseSession(id).ok());
}

// VerifyStream: a refused request ends the stream with its status; the session is unharmed and
// a new stream continues it.
TEST_F(ReplicaTest, StreamEndsWithTheRefusedRequestsStatus) {
  Replica* replica = StartReplica({.world_size = 1});
  ASSERT_NE(replica, nullptr);
  services::VerifierClient& api = replica->client();
  absl::StatusOr<coordinator::CreateSessionOutput> session =
      api.CreateSession({.prompt_token_ids = {20, 21, 22}});
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<coordinator::CreateSessionOutput> twin =
      api.CreateSession({.prompt_token_ids = {20, 21, 22}});
  ASSERT_TRUE(twin.ok()) << twin.status();

  auto stream = api.OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::StatusOr<coordinator::VerifyOutput> step =
      (*stream)->Step({.session_id = session->session_id});
  ASSERT_TRUE(step.ok()) << step.status();
  const absl::Status refused =
      (*stream)
          ->Step({.session_id = session->session_id, .draft_token_ids = {1}, .draft_parents = {0}})
          .status();
  ExpectError(refused, absl::StatusCode::kInvalidArgument, "parents[0] = 0");
  ExpectError((*stream)->Finish(), absl::StatusCode::kInvalidArgument, "parents[0] = 0");

  auto next = api.OpenStream();
  ASSERT_TRUE(next.ok()) << next.status();
  std::vector<int32_t> streamed = step->emitted_token_ids;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<coordinator::VerifyOutput> more =
        (*next)->Step({.session_id = session->session_id});
    ASSERT_TRUE(more.ok()) << more.status();
    streamed.insert(streamed.end(), more->emitted_token_ids.begin(), more->emitted_token_ids.end());
  }
  EXPECT_TRUE((*next)->Finish().ok());
  // The twin session, never refused anything, emits the same tokens with unary calls.
  std::vector<int32_t> unary;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<coordinator::VerifyOutput> out = api.Verify({.session_id = twin->session_id});
    ASSERT_TRUE(out.ok()) << out.status();
    unary.insert(unary.end(), out->emitted_token_ids.begin(), out->emitted_token_ids.end());
  }
  EXPECT_EQ(streamed, unary);
}

}  // namespace
}  // namespace treeverify::integration
