// The coordinator's core over in-process ranks: lossless speculative decoding (greedy and
// seeded sampling) for every drafter at TP 1, 2 and 4, batching of concurrent sessions, stop
// conditions, error codes and KV release.
#include "treeverify/coordinator/verify_engine.h"

#include <algorithm>
#include <atomic>
#include <future>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "treeverify/coordinator/rank_client.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/drafters.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/tools/speculative_generate.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::coordinator {
namespace {

using testing::HasSubstr;
using tools::GenerateOptions;
using tools::GenerateResult;
using tools::LocalModel;

std::string ModelDir() {
  static const std::string* dir = [] {
    auto* path =
        new std::string(testing::TempDir() + "/verify_engine_test_" + std::to_string(::getpid()));
    auto spec = tools::PresetSpec("tiny-v3");
    EXPECT_TRUE(spec.ok());
    EXPECT_TRUE(tools::WriteCheckpoint(*path, *spec).ok());
    return path;
  }();
  return *dir;
}

// A replica in this process: W ranks as threads and the engine over them.
struct Replica {
  std::unique_ptr<LocalModel> model;
  std::unique_ptr<VerifyEngine> engine;
};

Replica MakeReplica(int world_size, VerifyEngineOptions options = {}) {
  Replica replica;
  tools::LocalModelOptions model_options;
  model_options.world_size = world_size;
  model_options.kv_page_size = 16;
  auto model = LocalModel::Create(ModelDir(), model_options);
  EXPECT_TRUE(model.ok()) << model.status();
  replica.model = std::move(*model);
  auto engine = VerifyEngine::Create(options, replica.model->RankClients());
  EXPECT_TRUE(engine.ok()) << engine.status();
  replica.engine = std::move(*engine);
  return replica;
}

std::vector<std::vector<int32_t>> Prompts(int count, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < count; ++p) {
    // Repetitive prompts give the ngram drafter something to find.
    std::vector<int32_t> base(std::uniform_int_distribution<int>(2, 6)(rng));
    for (int32_t& t : base) t = std::uniform_int_distribution<int32_t>(2, vocab - 1)(rng);
    std::vector<int32_t> prompt;
    const int repeats = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int r = 0; r < repeats; ++r) prompt.insert(prompt.end(), base.begin(), base.end());
    prompts.push_back(prompt);
  }
  return prompts;
}

GenerateResult Generate(VerifyEngine& engine, const std::vector<int32_t>& prompt,
                        const std::string& drafter_name, const std::vector<int32_t>& oracle,
                        SamplingParams sampling, int max_new_tokens = 24) {
  auto drafter = tools::MakeDrafter(drafter_name, {.vocab_size = engine.info().vocab_size,
                                                   .seed = 5,
                                                   .oracle = oracle,
                                                   .oracle_acceptance = 0.8});
  EXPECT_TRUE(drafter.ok()) << drafter.status();
  GenerateOptions options;
  options.sampling = sampling;
  options.stopping.max_new_tokens = max_new_tokens;
  options.stopping.ignore_eos = true;
  options.tree_nodes = 12;
  auto result = tools::SpeculativeGenerate(engine, prompt, options, **drafter);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : GenerateResult{};
}

class LosslessTest : public testing::TestWithParam<int> {};

// Every drafter emits exactly the tokens of plain decoding (empty trees) at the same TP degree,
// greedy and with seeded sampling; the oracle drafter is accepted often enough to matter.
TEST_P(LosslessTest, EveryDrafterEqualsPlainDecoding) {
  const int world_size = GetParam();
  Replica replica = MakeReplica(world_size);
  const int vocab = static_cast<int>(replica.engine->info().vocab_size);
  const unsigned seed = 1000 + world_size;
  SCOPED_TRACE(testing::Message() << "TP " << world_size << " seed " << seed);
  const auto prompts = Prompts(20, vocab, seed);
  for (const SamplingParams& sampling :
       {SamplingParams{}, SamplingParams{.temperature = 0.8f, .seed = 42},
        SamplingParams{.temperature = 0.8f, .seed = 42, .top_k = 20, .top_p = 0.9f}}) {
    int64_t accepted = 0;
    for (size_t p = 0; p < prompts.size(); ++p) {
      const GenerateResult plain = Generate(*replica.engine, prompts[p], "none", {}, sampling);
      ASSERT_EQ(plain.tokens.size(), 24u);
      std::vector<int32_t> oracle = prompts[p];
      oracle.insert(oracle.end(), plain.tokens.begin(), plain.tokens.end());
      for (const std::string& drafter : tools::DrafterNames()) {
        const GenerateResult speculative =
            Generate(*replica.engine, prompts[p], drafter, oracle, sampling);
        ASSERT_EQ(speculative.tokens, plain.tokens)
            << "prompt " << p << " drafter " << drafter << " temperature " << sampling.temperature;
        if (drafter == "noisy-oracle") {
          accepted += std::accumulate(speculative.accepted_per_step.begin(),
                                      speculative.accepted_per_step.end(), 0);
          EXPECT_LT(speculative.steps, plain.steps);
        }
      }
    }
    EXPECT_GT(accepted, 0);
  }
  // Everything was closed: every page is free again on every rank (releases are asynchronous).
  for (int attempt = 0; attempt < 200 && replica.engine->active_sessions() > 0; ++attempt) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  replica.engine.reset();  // drains queued releases
  for (int r = 0; r < world_size; ++r) {
    EXPECT_EQ(replica.model->rank(r).kv_cache().used_pages(), 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, LosslessTest, testing::Values(1, 2, 4));

TEST(VerifyEngineTest, SeedsMatterAndTopKRestricts) {
  Replica replica = MakeReplica(1);
  const std::vector<int32_t> prompt = {5, 6, 7, 8};
  const GenerateResult a =
      Generate(*replica.engine, prompt, "none", {}, {.temperature = 1.0f, .seed = 1}, 32);
  const GenerateResult b =
      Generate(*replica.engine, prompt, "none", {}, {.temperature = 1.0f, .seed = 2}, 32);
  EXPECT_NE(a.tokens, b.tokens);
  const GenerateResult greedy = Generate(*replica.engine, prompt, "none", {}, {}, 32);
  const GenerateResult top1 = Generate(*replica.engine, prompt, "none", {},
                                       {.temperature = 1.0f, .seed = 3, .top_k = 1}, 32);
  EXPECT_EQ(top1.tokens, greedy.tokens);
}

// A rank client that records the size of every segment of every forward, then forwards; it may
// describe its rank as another backend's.
class RecordingRankClient final : public coordinator::RankClient {
 public:
  RecordingRankClient(std::unique_ptr<coordinator::RankClient> rank,
                      std::vector<std::vector<size_t>>* forwards, absl::Mutex* mu,
                      std::string backend = "")
      : rank_(std::move(rank)), forwards_(forwards), mu_(mu), backend_(std::move(backend)) {}
  absl::StatusOr<coordinator::RankDescription> Describe(absl::Duration timeout) override {
    absl::StatusOr<coordinator::RankDescription> description = rank_->Describe(timeout);
    if (description.ok() && !backend_.empty()) description->backend = backend_;
    return description;
  }
  absl::StatusOr<worker::ForwardResult> Forward(const worker::ForwardRequest& request,
                                                absl::Duration timeout) override {
    if (forwards_ != nullptr) {
      std::vector<size_t> rows;
      for (const worker::SegmentInput& s : request.segments) rows.push_back(s.token_ids.size());
      absl::MutexLock lock(mu_);
      forwards_->push_back(std::move(rows));
    }
    return rank_->Forward(request, timeout);
  }
  absl::StatusOr<int64_t> Release(absl::Span<const uint64_t> ids, absl::Duration timeout) override {
    return rank_->Release(ids, timeout);
  }

 private:
  std::unique_ptr<coordinator::RankClient> rank_;
  std::vector<std::vector<size_t>>* forwards_;  // rank 0's only
  absl::Mutex* mu_;
  std::string backend_;
};

// With prefill_chunk 0 (the default) the prompt chunks follow the ranks' backend: a tree's size
// on CPUs, kCudaPrefillChunk on GPUs (whose MHA form pays for long chunks).
TEST(VerifyEngineTest, DefaultPrefillChunkFollowsTheRanksBackend) {
  for (const std::string backend : {"cpu", "cuda"}) {
    SCOPED_TRACE(backend);
    auto model = LocalModel::Create(ModelDir(), {.kv_page_size = 16});
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<std::vector<size_t>> forwards;
    absl::Mutex mu;
    std::vector<std::unique_ptr<coordinator::RankClient>> ranks;
    for (auto& rank : (*model)->RankClients()) {
      ranks.push_back(
          std::make_unique<RecordingRankClient>(std::move(rank), &forwards, &mu, backend));
    }
    auto engine = VerifyEngine::Create({}, std::move(ranks));
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->info().backend, backend);
    EXPECT_EQ((*engine)->info().prefill_chunk,
              backend == "cuda" ? kCudaPrefillChunk : kCpuPrefillChunk);
    std::vector<int32_t> prompt(600);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(2 + i % 50);
    const GenerateResult result = Generate(**engine, prompt, "none", {}, {}, 2);
    EXPECT_EQ(result.tokens.size(), 2u);
    absl::MutexLock lock(&mu);
    ASSERT_GE(forwards.size(), 2u);
    const std::vector<std::vector<size_t>> chunks(forwards.begin(), forwards.end() - 1);
    if (backend == "cuda") {
      EXPECT_EQ(chunks, (std::vector<std::vector<size_t>>{{600}}));
    } else {
      EXPECT_EQ(chunks, (std::vector<std::vector<size_t>>{{256}, {256}, {88}}));
    }
  }
}

// Prompt chunks and draft trees never share a forward (docs/gpu-worker.md, "Prefill": a GPU
// rank prefills a forward of chains in the MHA form, and replays trees from graphs), while
// sessions verify and others prefill at the same time; every session stays lossless.
TEST(VerifyEngineTest, PrefillChunksAndTreesNeverShareAForward) {
  VerifyEngineOptions options;
  options.batch_window = absl::Milliseconds(5);
  options.prefill_chunk = 100;
  tools::LocalModelOptions model_options;
  model_options.kv_page_size = 16;
  auto model = LocalModel::Create(ModelDir(), model_options);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::vector<size_t>> forwards;
  absl::Mutex mu;
  std::vector<std::unique_ptr<coordinator::RankClient>> ranks;
  for (auto& rank : (*model)->RankClients()) {
    ranks.push_back(std::make_unique<RecordingRankClient>(
        std::move(rank), ranks.empty() ? &forwards : nullptr, &mu));
  }
  auto engine = VerifyEngine::Create(options, std::move(ranks));
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int vocab = static_cast<int>((*engine)->info().vocab_size);
  std::mt19937 rng(41);
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 8; ++p) {
    // Prompts of one chunk of 40 rows and of five chunks of 100; trees have at most 13 rows.
    std::vector<int32_t> prompt(p % 2 == 0 ? 40 : 500);
    for (int32_t& t : prompt) t = std::uniform_int_distribution<int32_t>(2, vocab - 1)(rng);
    prompts.push_back(prompt);
  }
  std::vector<GenerateResult> plain(prompts.size()), together(prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) {
    plain[p] = Generate(**engine, prompts[p], "none", {}, {}, 12);
  }
  {
    absl::MutexLock lock(&mu);
    forwards.clear();
  }
  std::vector<std::thread> threads;
  for (size_t p = 0; p < prompts.size(); ++p) {
    threads.emplace_back(
        [&, p] { together[p] = Generate(**engine, prompts[p], "random", {}, {}, 12); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t p = 0; p < prompts.size(); ++p) {
    EXPECT_EQ(together[p].tokens, plain[p].tokens) << "prompt " << p;
  }
  absl::MutexLock lock(&mu);
  int prefill_forwards = 0, tree_forwards = 0;
  for (const std::vector<size_t>& rows : forwards) {
    const bool chunk = std::any_of(rows.begin(), rows.end(), [](size_t r) { return r >= 40; });
    const bool tree = std::any_of(rows.begin(), rows.end(), [](size_t r) { return r <= 13; });
    EXPECT_FALSE(chunk && tree) << "a forward mixed prompt chunks and draft trees";
    (chunk ? prefill_forwards : tree_forwards) += 1;
  }
  EXPECT_GT(prefill_forwards, 0);
  EXPECT_GT(tree_forwards, 0);
}

// Long prompts in long prefill chunks (longer than a tree: the ranks take them in pieces) give
// the tokens of short chunks, greedy and with top-k / top-p sampling, whose last chunk returns
// candidates for each row and so is held to a tree's size (the tail of the prompt on its own).
TEST(VerifyEngineTest, LongPrefillChunksGiveTheTokensOfShortOnes) {
  VerifyEngineOptions long_chunks;
  long_chunks.prefill_chunk = 700;
  Replica short_replica = MakeReplica(1);
  Replica long_replica = MakeReplica(1, long_chunks);
  const int vocab = static_cast<int>(short_replica.engine->info().vocab_size);
  std::mt19937 rng(31);
  for (int length : {300, 699, 701, 900}) {
    std::vector<int32_t> prompt(length);
    for (int32_t& t : prompt) t = std::uniform_int_distribution<int32_t>(2, vocab - 1)(rng);
    for (const SamplingParams& sampling :
         {SamplingParams{}, SamplingParams{.temperature = 0.8f, .seed = 9, .top_k = 20}}) {
      SCOPED_TRACE(testing::Message() << "prompt of " << length << ", top_k " << sampling.top_k);
      const GenerateResult expected =
          Generate(*short_replica.engine, prompt, "none", {}, sampling, 8);
      const GenerateResult actual =
          Generate(*long_replica.engine, prompt, "random", {}, sampling, 8);
      ASSERT_EQ(expected.tokens.size(), 8u);
      EXPECT_EQ(actual.tokens, expected.tokens);
    }
  }
  VerifyEngineOptions too_long;
  too_long.prefill_chunk = worker::kMaxChainRows + 1;
  EXPECT_EQ(too_long.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// Sessions verifying at the same time share forwards, and each stays lossless.
TEST(VerifyEngineTest, ConcurrentSessionsAreBatchedAndLossless) {
  VerifyEngineOptions options;
  options.batch_window = absl::Milliseconds(5);
  Replica replica = MakeReplica(2, options);
  const int vocab = static_cast<int>(replica.engine->info().vocab_size);
  const auto prompts = Prompts(16, vocab, 77);
  std::vector<GenerateResult> plain(prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) {
    plain[p] = Generate(*replica.engine, prompts[p], "none", {}, {});
  }
  const int64_t forwards_before = replica.engine->stats().forwards;
  std::vector<GenerateResult> together(prompts.size());
  std::vector<std::thread> threads;
  for (size_t p = 0; p < prompts.size(); ++p) {
    threads.emplace_back(
        [&, p] { together[p] = Generate(*replica.engine, prompts[p], "ngram", {}, {}); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t p = 0; p < prompts.size(); ++p) {
    EXPECT_EQ(together[p].tokens, plain[p].tokens) << "prompt " << p;
  }
  const EngineStats stats = replica.engine->stats();
  EXPECT_GT(stats.max_batch_sequences, 1);
  EXPECT_GT(stats.batched_sequences - 0, stats.forwards - forwards_before);
}

TEST(VerifyEngineTest, StopConditionsEndTheSession) {
  Replica replica = MakeReplica(1);
  const std::vector<int32_t> prompt = {9, 10, 11};
  const GenerateResult reference = Generate(*replica.engine, prompt, "none", {}, {}, 12);
  ASSERT_EQ(reference.tokens.size(), 12u);
  EXPECT_EQ(reference.finish_reason, FinishReason::kMaxNewTokens);

  // A stop token ends generation right after it is emitted, whatever the drafter.
  const int32_t stop = reference.tokens[5];
  const size_t first_stop =
      std::find(reference.tokens.begin(), reference.tokens.end(), stop) - reference.tokens.begin();
  std::vector<int32_t> oracle = prompt;
  oracle.insert(oracle.end(), reference.tokens.begin(), reference.tokens.end());
  for (const std::string drafter : {"none", "noisy-oracle"}) {
    auto d = tools::MakeDrafter(drafter, {.vocab_size = replica.engine->info().vocab_size,
                                          .oracle = oracle,
                                          .oracle_acceptance = 1.0});
    ASSERT_TRUE(d.ok());
    GenerateOptions options;
    options.stopping.max_new_tokens = 12;
    options.stopping.stop_token_ids = {stop};
    options.stopping.ignore_eos = true;
    auto result = tools::SpeculativeGenerate(*replica.engine, prompt, options, **d);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->finish_reason, FinishReason::kStopToken) << drafter;
    EXPECT_EQ(result->tokens, std::vector<int32_t>(reference.tokens.begin(),
                                                   reference.tokens.begin() + first_stop + 1))
        << drafter;
  }

  // The context limit: the session finishes when no further token fits, with or without drafts
  // (the drafting loop shrinks its trees near the end).
  VerifyEngineOptions small;
  small.max_context_length = 10;
  Replica limited = MakeReplica(1, small);
  for (const std::string drafter_name : {"none", "random"}) {
    auto d = tools::MakeDrafter(drafter_name, {.vocab_size = limited.engine->info().vocab_size});
    ASSERT_TRUE(d.ok());
    GenerateOptions options;
    options.stopping.ignore_eos = true;
    options.tree_nodes = 6;
    auto result = tools::SpeculativeGenerate(*limited.engine, prompt, options, **d);
    ASSERT_TRUE(result.ok()) << drafter_name << ": " << result.status();
    EXPECT_EQ(result->finish_reason, FinishReason::kMaxContext) << drafter_name;
    EXPECT_EQ(prompt.size() + result->tokens.size(), 11u);  // 10 positions + the last pending
  }
}

// A step that finds the KV cache full fails alone (RESOURCE_EXHAUSTED); once space is freed the
// session goes on, still lossless.
TEST(VerifyEngineTest, FullCacheFailsTheStepAndTheSessionRecovers) {
  const std::vector<int32_t> prompt = {21, 22, 23, 24, 25, 26, 27, 28, 29, 30};
  Replica reference = MakeReplica(1);
  const GenerateResult expected = Generate(*reference.engine, prompt, "none", {}, {}, 6);

  tools::LocalModelOptions model_options;
  model_options.kv_page_size = 16;
  model_options.kv_pages = 4;  // 64 rows in all
  auto model = LocalModel::Create(ModelDir(), model_options);
  ASSERT_TRUE(model.ok());
  auto engine = VerifyEngine::Create({}, (*model)->RankClients());
  ASSERT_TRUE(engine.ok());
  auto hog = (*engine)->CreateSession({.prompt_token_ids = std::vector<int32_t>(40, 3)});
  ASSERT_TRUE(hog.ok()) << hog.status();  // 3 pages
  CreateSessionInput create{.prompt_token_ids = prompt};
  create.stopping.ignore_eos = true;
  auto session = (*engine)->CreateSession(create);
  ASSERT_TRUE(session.ok()) << session.status();  // the 4th page
  std::vector<int32_t> tokens = {session->pending_token_id};

  // 10 committed + the pending token + 8 drafts need a 2nd page: none is free.
  auto full = (*engine)->Verify({.session_id = session->session_id,
                                 .draft_token_ids = std::vector<int32_t>(8, 5),
                                 .draft_parents = {-1, 0, 1, 2, 3, 4, 5, 6}});
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();

  ASSERT_TRUE((*engine)->CloseSession(hog->session_id).ok());
  while (tokens.size() < expected.tokens.size()) {
    auto step = (*engine)->Verify({.session_id = session->session_id});
    ASSERT_TRUE(step.ok()) << step.status();
    tokens.insert(tokens.end(), step->emitted_token_ids.begin(), step->emitted_token_ids.end());
  }
  EXPECT_EQ(tokens, expected.tokens);
}

TEST(VerifyEngineTest, ErrorsNameTheProblemAndLeaveSessionsUsable) {
  VerifyEngineOptions options;
  options.sessions.max_sessions = 2;
  options.max_context_length = 64;
  options.max_hidden_state_bytes = 1000;
  Replica replica = MakeReplica(1, options);
  VerifyEngine& engine = *replica.engine;
  const int vocab = static_cast<int>(engine.info().vocab_size);

  auto session = engine.CreateSession({.prompt_token_ids = {1, 2, 3}});
  ASSERT_TRUE(session.ok()) << session.status();
  const SessionId id = session->session_id;

  auto unknown = engine.Verify({.session_id = SessionId{.high = 1, .low = 2}});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);

  auto bad_token =
      engine.Verify({.session_id = id, .draft_token_ids = {vocab}, .draft_parents = {-1}});
  EXPECT_EQ(bad_token.status().code(), absl::StatusCode::kInvalidArgument);
  auto bad_parent =
      engine.Verify({.session_id = id, .draft_token_ids = {1, 2}, .draft_parents = {-1, 1}});
  EXPECT_EQ(bad_parent.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad_parent.status().message()), HasSubstr("parents[1]"));
  auto too_many = engine.Verify({.session_id = id,
                                 .draft_token_ids = std::vector<int32_t>(256, 1),
                                 .draft_parents = std::vector<int32_t>(256, -1)});
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  auto too_long = engine.Verify({.session_id = id,
                                 .draft_token_ids = std::vector<int32_t>(70, 1),
                                 .draft_parents = std::vector<int32_t>(70, -1)});
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kOutOfRange);
  auto long_prompt = engine.CreateSession({.prompt_token_ids = std::vector<int32_t>(64, 1)});
  EXPECT_EQ(long_prompt.status().code(), absl::StatusCode::kOutOfRange);

  // Hidden states: 9 rows x 2 layers x 64 x 2 bytes is over the 1000-byte budget; a layer twice is
  // malformed.
  auto too_big = engine.Verify({.session_id = id,
                                .draft_token_ids = std::vector<int32_t>(8, 1),
                                .draft_parents = std::vector<int32_t>(8, -1),
                                .hidden_state_layers = {0, 1}});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_big.status().message()), HasSubstr("hidden states"));
  auto twice = engine.Verify({.session_id = id, .hidden_state_layers = {1, 1}});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);

  // Still usable, and still lossless, after the refusals.
  auto ok = engine.Verify({.session_id = id});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->emitted_token_ids.size(), 1u);

  auto second = engine.CreateSession({.prompt_token_ids = {4}});
  ASSERT_TRUE(second.ok());
  auto third = engine.CreateSession({.prompt_token_ids = {4}});
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);

  ASSERT_TRUE(engine.CloseSession(id).ok());
  EXPECT_EQ(engine.Verify({.session_id = id}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine.CloseSession(id).code(), absl::StatusCode::kNotFound);
}

// A rank that waits until the test opens a gate: holds a Verify in flight.
class GatedRank final : public RankClient {
 public:
  GatedRank(std::unique_ptr<RankClient> inner, std::atomic<bool>* open, std::atomic<bool>* fail)
      : inner_(std::move(inner)), open_(open), fail_(fail) {}
  absl::StatusOr<RankDescription> Describe(absl::Duration t) override {
    return inner_->Describe(t);
  }
  absl::StatusOr<worker::ForwardResult> Forward(const worker::ForwardRequest& request,
                                                absl::Duration t) override {
    while (!open_->load()) absl::SleepFor(absl::Milliseconds(1));
    if (fail_->load()) return absl::UnavailableError("rank 0 is gone (test)");
    return inner_->Forward(request, t);
  }
  absl::StatusOr<int64_t> Release(absl::Span<const uint64_t> ids, absl::Duration t) override {
    return inner_->Release(ids, t);
  }

 private:
  std::unique_ptr<RankClient> inner_;
  std::atomic<bool>* open_;
  std::atomic<bool>* fail_;
};

TEST(VerifyEngineTest, OneVerifyInFlightAndRankFailureIsUnavailable) {
  tools::LocalModelOptions model_options;
  auto model = LocalModel::Create(ModelDir(), model_options);
  ASSERT_TRUE(model.ok());
  std::atomic<bool> open{true}, fail{false};
  std::vector<std::unique_ptr<RankClient>> ranks;
  for (auto& client : (*model)->RankClients()) {
    ranks.push_back(std::make_unique<GatedRank>(std::move(client), &open, &fail));
  }
  auto engine = VerifyEngine::Create({}, std::move(ranks));
  ASSERT_TRUE(engine.ok());
  auto session = (*engine)->CreateSession({.prompt_token_ids = {1, 2, 3}});
  ASSERT_TRUE(session.ok());

  open = false;
  std::promise<absl::StatusOr<VerifyOutput>> first;
  (*engine)->VerifyAsync({.session_id = session->session_id},
                         [&first](absl::StatusOr<VerifyOutput> out) { first.set_value(out); });
  auto second = (*engine)->Verify({.session_id = session->session_id});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("in flight"));
  fail = true;
  open = true;
  auto failed = first.get_future().get();
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE((*engine)->serving());
  EXPECT_EQ((*engine)->Verify({.session_id = session->session_id}).status().code(),
            absl::StatusCode::kUnavailable);
}

// Records what the engine reports (on its dispatch thread; read after the calls returned).
class RecordingObserver final : public EngineObserver {
 public:
  void OnVerifyStep(const VerifyStepReport& step) override {
    absl::MutexLock lock(&mu_);
    steps.push_back(step);
  }
  void OnSessionCreated() override {
    absl::MutexLock lock(&mu_);
    ++sessions;
  }
  void OnForward(int32_t sequences, int64_t rows) override {
    absl::MutexLock lock(&mu_);
    ++forwards;
    forward_sequences += sequences;
    forward_rows += rows;
  }
  void OnRankLost(int rank) override {
    absl::MutexLock lock(&mu_);
    lost.push_back(rank);
  }

  std::vector<VerifyStepReport> steps;
  int64_t sessions = 0, forwards = 0, forward_sequences = 0, forward_rows = 0;
  std::vector<int> lost;

 private:
  absl::Mutex mu_;
};

// The observer sees every step as the client does: its steps' accepted and emitted tokens are
// the client's, its forwards the engine's, and each step's phases add up to no more than the
// client's wait for it.
TEST(VerifyEngineTest, TheObserverSeesWhatTheClientsGet) {
  RecordingObserver observer;
  Replica replica = MakeReplica(2, {.observer = &observer});
  const int vocab = static_cast<int>(replica.engine->info().vocab_size);
  int64_t tokens = 0, steps = 0, accepted = 0;
  const std::vector<std::vector<int32_t>> prompts = Prompts(3, vocab, 17);
  for (const std::vector<int32_t>& prompt : prompts) {
    const GenerateResult plain = Generate(*replica.engine, prompt, "none", {}, {});
    std::vector<int32_t> oracle = prompt;
    oracle.insert(oracle.end(), plain.tokens.begin(), plain.tokens.end());
    const GenerateResult drafted = Generate(*replica.engine, prompt, "noisy-oracle", oracle, {});
    for (const GenerateResult* r : {&plain, &drafted}) {
      tokens += static_cast<int64_t>(r->tokens.size());
      steps += r->steps;
      for (int32_t a : r->accepted_per_step) accepted += a;
    }
  }
  ASSERT_GT(accepted, 0) << "the oracle drafter should get some drafts accepted";
  EXPECT_EQ(observer.sessions, 6);
  ASSERT_EQ(static_cast<int64_t>(observer.steps.size()), steps);
  int64_t emitted = observer.sessions, observed_accepted = 0, with_draft = 0;
  for (const VerifyStepReport& step : observer.steps) {
    emitted += step.emitted_tokens;
    observed_accepted += step.accepted_nodes;
    with_draft += step.draft_nodes > 0 ? 1 : 0;
    EXPECT_LE(step.accepted_nodes, step.draft_depth);
    EXPECT_LE(step.draft_depth, step.draft_nodes);
    const StepTimings& t = step.timings;
    for (double phase : {t.validate_seconds, t.queue_seconds, t.fanout_seconds, t.reduce_seconds,
                         t.accept_seconds}) {
      EXPECT_GE(phase, 0);
    }
    EXPECT_GT(t.fanout_seconds, 0);
    EXPECT_GE(t.batch_sequences, 1);
  }
  EXPECT_EQ(emitted, tokens);
  EXPECT_EQ(observed_accepted, accepted);
  EXPECT_GT(with_draft, 0);
  EXPECT_EQ(observer.forwards, replica.engine->stats().forwards);
  EXPECT_EQ(observer.forward_sequences, replica.engine->stats().batched_sequences);
  EXPECT_TRUE(observer.lost.empty());
}

// A rank that fails a forward is reported lost. (One rank: an in-process peer of a failed rank
// would wait in its collective for good.)
TEST(VerifyEngineTest, TheObserverHearsOfALostRank) {
  auto model = LocalModel::Create(ModelDir(), {});
  ASSERT_TRUE(model.ok());
  std::atomic<bool> open{true}, fail{false};
  std::vector<std::unique_ptr<RankClient>> ranks;
  for (auto& client : (*model)->RankClients()) {
    ranks.push_back(std::make_unique<GatedRank>(std::move(client), &open, &fail));
  }
  RecordingObserver observer;
  auto engine = VerifyEngine::Create({.observer = &observer}, std::move(ranks));
  ASSERT_TRUE(engine.ok());
  auto session = (*engine)->CreateSession({.prompt_token_ids = {1, 2, 3}});
  ASSERT_TRUE(session.ok());
  EXPECT_TRUE(observer.lost.empty());
  fail = true;
  EXPECT_EQ((*engine)->Verify({.session_id = session->session_id}).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(observer.lost, std::vector<int>{0});
}

TEST(VerifyEngineTest, HiddenStatesAreTheCommittedRows) {
  Replica replica = MakeReplica(2);
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  auto session = replica.engine->CreateSession({.prompt_token_ids = prompt});
  ASSERT_TRUE(session.ok());
  const int layers = static_cast<int>(replica.engine->info().num_layers);
  auto step = replica.engine->Verify(
      {.session_id = session->session_id, .hidden_state_layers = {0, layers}});
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(step->hidden_states.size(), 2u);
  EXPECT_EQ(step->hidden_states[0].rows, 1);
  EXPECT_EQ(step->hidden_states[0].layer, 0);
  // Layer 0 is the embedding of the committed token (the previous pending token).
  EXPECT_EQ(static_cast<int64_t>(step->hidden_states[0].values.size()),
            replica.engine->info().hidden_size);
  bool nonzero = false;
  for (float v : step->hidden_states[1].values) nonzero |= v != 0.0f;
  EXPECT_TRUE(nonzero);
}

}  // namespace
}  // namespace treeverify::coordinator
