#include "test_support.h"

#include <algorithm>
#include <atomic>
#include <iostream>
#include <limits>
#include <random>
#include <utility>

#include "treeverify/tools/drafters.h"
#include "treeverify/worker/safetensors.h"
#include "treeverify/worker/segment_tree.h"

namespace treeverify::integration {

Replica* ReplicaTest::StartReplica(const ReplicaOptions& options) {
  absl::StatusOr<std::unique_ptr<Replica>> replica = Replica::Start(options);
  if (!replica.ok()) {
    ADD_FAILURE() << "replica (TP " << options.world_size
                  << ") did not start: " << replica.status();
    return nullptr;
  }
  replicas_.push_back(*std::move(replica));
  return replicas_.back().get();
}

void ReplicaTest::TearDown() {
  if (HasFailure()) {
    for (size_t i = 0; i < replicas_.size(); ++i) {
      std::cerr << "===== replica " << i << " (TP " << replicas_[i]->world_size()
                << ", coordinator " << replicas_[i]->coordinator_address() << ") =====\n"
                << replicas_[i]->Logs();
    }
  }
  for (auto& replica : replicas_) replica->Stop();
  replicas_.clear();
}

std::vector<std::vector<int32_t>> RepetitivePrompts(int count, int64_t vocab_size, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < count; ++p) {
    std::vector<int32_t> base(std::uniform_int_distribution<int>(2, 6)(rng));
    for (int32_t& t : base) {
      t = std::uniform_int_distribution<int32_t>(2, static_cast<int32_t>(vocab_size) - 1)(rng);
    }
    std::vector<int32_t> prompt;
    const int repeats = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int r = 0; r < repeats; ++r) prompt.insert(prompt.end(), base.begin(), base.end());
    prompts.push_back(std::move(prompt));
  }
  return prompts;
}

absl::StatusOr<tools::GenerateResult> Generate(coordinator::VerifierApi& api, int64_t vocab_size,
                                               const std::vector<int32_t>& prompt,
                                               const GenerateSpec& spec) {
  absl::StatusOr<std::unique_ptr<tools::Drafter>> drafter =
      tools::MakeDrafter(spec.drafter, {.vocab_size = vocab_size,
                                        .seed = spec.drafter_seed,
                                        .oracle = spec.oracle,
                                        .oracle_acceptance = spec.oracle_acceptance});
  if (!drafter.ok()) return drafter.status();
  tools::GenerateOptions options;
  options.sampling = spec.sampling;
  options.stopping.max_new_tokens = spec.max_new_tokens;
  options.stopping.ignore_eos = spec.ignore_eos;
  options.tree_nodes = spec.tree_nodes;
  options.return_logprobs = true;
  return tools::SpeculativeGenerate(api, prompt, options, **drafter);
}

std::vector<int32_t> Concat(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> out = a;
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

absl::StatusOr<tools::LocalSegmentResult> ForwardChain(tools::LocalModel& model,
                                                       const std::vector<int32_t>& tokens,
                                                       bool return_logits,
                                                       const std::vector<int32_t>& hidden_layers) {
  static std::atomic<uint64_t> next_sequence_id{1};
  const uint64_t sequence_id = next_sequence_id.fetch_add(1);
  worker::ForwardRequest request;
  request.return_logits = return_logits;
  worker::SegmentInput segment;
  segment.sequence_id = sequence_id;
  segment.token_ids = tokens;
  segment.parents = worker::SegmentTree::ChainParents(static_cast<int32_t>(tokens.size()));
  segment.hidden_state_layers = hidden_layers;
  request.segments.push_back(std::move(segment));
  absl::StatusOr<std::vector<tools::LocalSegmentResult>> results = model.Forward(request);
  const absl::Status released = model.Release(sequence_id);
  if (!results.ok()) return results.status();
  if (!(*results)[0].status.ok()) return (*results)[0].status;
  if (!released.ok()) return released;
  return std::move((*results)[0]);
}

float TopTwoMargin(const float* logits, int64_t vocab_size) {
  float first = -std::numeric_limits<float>::infinity();
  float second = first;
  for (int64_t v = 0; v < vocab_size; ++v) {
    if (logits[v] > first) {
      second = first;
      first = logits[v];
    } else if (logits[v] > second) {
      second = logits[v];
    }
  }
  return first - second;
}

int64_t RankOf(const float* logits, int64_t vocab_size, int32_t token) {
  int64_t rank = 0;
  for (int64_t v = 0; v < vocab_size; ++v) {
    if (v != token && logits[v] >= logits[token]) ++rank;
  }
  return rank;
}

float RoundToBf16(float value) { return worker::Bf16ToFloat(worker::FloatToBf16(value)); }

}  // namespace treeverify::integration
