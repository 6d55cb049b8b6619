#include "treeverify/tools/local_model.h"

#include <omp.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "treeverify/coordinator/summary_reducer.h"
#include "treeverify/kernels/mla_verify_attention.h"
#include "treeverify/kernels/status.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::tools {
namespace {

// Runs fn(rank) for every rank and returns the first error. With several ranks each runs in a
// thread of its own, and the cores are divided among them: each rank's OpenMP regions would
// otherwise ask for every core, and W x cores spinning threads slow everything down.
template <typename Fn>
absl::Status ForEachRank(int world_size, Fn fn) {
  if (world_size == 1) return fn(0);
  std::vector<absl::Status> statuses(world_size);
  std::vector<std::thread> threads;
  const int threads_per_rank = std::max(1, omp_get_num_procs() / world_size);
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      omp_set_num_threads(threads_per_rank);
      statuses[r] = fn(r);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : statuses) TV_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalModel>> LocalModel::Create(const std::string& model_dir,
                                                               const LocalModelOptions& options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be >= 1, got ", options.world_size));
  }
  if (options.prefill_chunk < 1 || options.prefill_chunk > worker::kMaxChainRows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill_chunk must be in 1..", worker::kMaxChainRows, ", got ", options.prefill_chunk));
  }
  std::unique_ptr<worker::InProcessGroup> group;
  if (!options.communicator_factory) {
    TV_ASSIGN_OR_RETURN(group, worker::InProcessGroup::Create(options.world_size));
  }
  std::vector<std::unique_ptr<worker::Communicator>> communicators(options.world_size);
  std::vector<std::unique_ptr<worker::ModelRunner>> runners(options.world_size);
  TV_RETURN_IF_ERROR(ForEachRank(options.world_size, [&](int r) -> absl::Status {
    worker::Communicator* communicator = nullptr;
    if (group != nullptr) {
      communicator = group->communicator(r);
    } else {
      TV_ASSIGN_OR_RETURN(communicators[r], options.communicator_factory(r, options.world_size));
      communicator = communicators[r].get();
    }
    worker::ModelRunnerOptions runner_options;
    runner_options.rank = r;
    runner_options.world_size = options.world_size;
    runner_options.expert_sharding = options.expert_sharding;
    runner_options.kv_page_size = options.kv_page_size;
    runner_options.kv_pages = options.kv_pages;
    runner_options.forward_factory = options.forward_factory;
    TV_ASSIGN_OR_RETURN(runners[r],
                        worker::ModelRunner::Create(model_dir, runner_options, communicator));
    return absl::OkStatus();
  }));
  return std::unique_ptr<LocalModel>(
      new LocalModel(options, std::move(group), std::move(communicators), std::move(runners)));
}

LocalModel::LocalModel(LocalModelOptions options, std::unique_ptr<worker::InProcessGroup> group,
                       std::vector<std::unique_ptr<worker::Communicator>> communicators,
                       std::vector<std::unique_ptr<worker::ModelRunner>> runners)
    : options_(options),
      group_(std::move(group)),
      communicators_(std::move(communicators)),
      runners_(std::move(runners)) {}

LocalModel::~LocalModel() = default;

absl::StatusOr<std::vector<LocalSegmentResult>> LocalModel::Forward(
    const worker::ForwardRequest& request) {
  const int world = world_size();
  std::vector<worker::ForwardResult> per_rank(world);
  TV_RETURN_IF_ERROR(ForEachRank(world, [&](int r) -> absl::Status {
    TV_ASSIGN_OR_RETURN(per_rank[r], runners_[r]->Forward(request));
    return absl::OkStatus();
  }));

  std::vector<LocalSegmentResult> results(request.segments.size());
  for (size_t s = 0; s < results.size(); ++s) {
    LocalSegmentResult& result = results[s];
    const worker::SegmentOutput& first = per_rank[0].segments[s];
    result.status = first.status;
    result.committed_length = first.committed_length;
    if (!first.status.ok()) continue;
    const size_t nodes = first.summaries.size();
    result.summaries.resize(nodes);
    std::vector<kernels::NodeSummary> shards(world);
    for (size_t n = 0; n < nodes; ++n) {
      for (int r = 0; r < world; ++r) shards[r] = per_rank[r].segments[s].summaries[n];
      result.summaries[n] = coordinator::ReduceSummaries(shards);
    }
    result.shard_summaries.resize(world);
    result.shard_candidates.resize(world);
    for (int r = 0; r < world; ++r) {
      result.shard_summaries[r] = std::move(per_rank[r].segments[s].summaries);
      result.shard_candidates[r] = std::move(per_rank[r].segments[s].candidates);
    }
    result.hidden_states = std::move(per_rank[0].segments[s].hidden_states);
    if (request.return_logits) {
      const int64_t vocab = config().vocab_size;
      result.logits.resize(nodes * vocab);
      for (int r = 0; r < world; ++r) {
        const worker::ShardRange shard = runners_[r]->plan().vocab;
        const std::vector<float>& logits = per_rank[r].segments[s].logits;
        for (size_t n = 0; n < nodes; ++n) {
          std::copy_n(logits.begin() + n * shard.size(), shard.size(),
                      result.logits.begin() + n * vocab + shard.begin);
        }
      }
    }
  }
  return results;
}

absl::StatusOr<kernels::NodeSummary> LocalModel::Prefill(uint64_t sequence_id,
                                                         const std::vector<int32_t>& prompt) {
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  kernels::NodeSummary last;
  // Each chunk is a chain; it is committed whole at the start of the next forward, and the last
  // one by a commit-only forward, so the cache ends up holding exactly the prompt.
  size_t uncommitted = 0;
  for (size_t begin = 0;; begin = std::min(prompt.size(), begin + options_.prefill_chunk)) {
    const size_t end = std::min(prompt.size(), begin + options_.prefill_chunk);
    worker::ForwardRequest request;
    worker::SegmentInput segment;
    segment.sequence_id = sequence_id;
    if (uncommitted > 0) segment.commit_nodes = worker::SegmentTree::AllNodes(uncommitted);
    segment.token_ids.assign(prompt.begin() + begin, prompt.begin() + end);
    segment.parents = worker::SegmentTree::ChainParents(static_cast<int32_t>(end - begin));
    if (end == begin) segment.expected_committed_length = static_cast<int64_t>(prompt.size());
    request.segments.push_back(std::move(segment));
    TV_ASSIGN_OR_RETURN(std::vector<LocalSegmentResult> results, Forward(request));
    TV_RETURN_IF_ERROR(results[0].status);
    if (end == begin) break;
    last = results[0].summaries.back();
    uncommitted = end - begin;
  }
  return last;
}

absl::StatusOr<Generation> LocalModel::GenerateGreedy(uint64_t sequence_id,
                                                      const std::vector<int32_t>& prompt,
                                                      int max_new_tokens) {
  Generation generation;
  if (max_new_tokens <= 0) return generation;
  TV_ASSIGN_OR_RETURN(kernels::NodeSummary next, Prefill(sequence_id, prompt));
  for (int step = 0; step < max_new_tokens; ++step) {
    generation.tokens.push_back(next.argmax);
    generation.logprobs.push_back(next.max_logit - next.log_sum_exp);
    if (step + 1 == max_new_tokens) break;
    worker::ForwardRequest request;
    worker::SegmentInput segment;
    segment.sequence_id = sequence_id;
    // The previous step's single node becomes committed as this step starts.
    if (step > 0) segment.commit_nodes = std::vector<int32_t>{0};
    segment.token_ids = {next.argmax};
    segment.parents = {-1};
    request.segments.push_back(std::move(segment));
    TV_ASSIGN_OR_RETURN(std::vector<LocalSegmentResult> results, Forward(request));
    TV_RETURN_IF_ERROR(results[0].status);
    next = results[0].summaries[0];
  }
  return generation;
}

absl::Status LocalModel::Release(uint64_t sequence_id) {
  return ForEachRank(world_size(), [&](int r) { return runners_[r]->Release(sequence_id); });
}

std::vector<std::unique_ptr<coordinator::RankClient>> LocalModel::RankClients() {
  std::vector<std::unique_ptr<coordinator::RankClient>> clients;
  for (auto& runner : runners_) {
    clients.push_back(std::make_unique<coordinator::InProcessRankClient>(runner.get()));
  }
  return clients;
}

}  // namespace treeverify::tools
