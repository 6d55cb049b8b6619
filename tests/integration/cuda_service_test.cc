// The whole service on a GPU: a treeverify-coordinator and one treeverify-worker with
// `--backend cuda`, as real processes, driven by the drafting loop with every drafter, greedy and
// with seeded sampling. Each emitted sequence is confirmed token by token by teacher forcing on
// the CPU backend (in process, TP 1): wherever the CPU's margin exceeds the GPU's rounding
// (margin_rule.h's tolerance, twice), the emitted token is the CPU's argmax (greedy) or its
// Gumbel-max winner under the same seed and position (sampling), and a greedy token's log-prob
// is the CPU's within the tolerance.
// Runs on the GPU machine (scripts/gpu-check.sh); skipped, saying so, without a GPU.

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../kernels/cuda/cuda_test_base.h"
#include "absl/strings/match.h"
#include "http_get.h"
#include "margin_rule.h"
#include "test_support.h"
#include "treeverify/kernels/cuda/device.h"
#include "treeverify/kernels/philox.h"
#include "treeverify/tools/drafters.h"

namespace treeverify::integration {
namespace {

using coordinator::SamplingParams;
using tools::GenerateResult;
using worker::kLogProbTolerance;

constexpr int kNewTokens = 16;
// Positions where the GPU's and the CPU's tokens may differ although the CPU's margin is clear:
// a near-tie of expert scores routes that token differently on the GPU (cuda_forward_test.cc).
constexpr int kNearTiePercent = 5;

class CudaServiceTest : public ReplicaTest {
 public:
  using ReplicaTest::StartReplica;

 protected:
  void SetUp() override {
    absl::StatusOr<kernels::cuda::DeviceInfo> device = kernels::cuda::QueryDevice(0);
    if (!device.ok()) GTEST_SKIP() << "GPU test skipped: " << device.status();
  }
};

struct Confirmation {
  int tokens = 0;
  int compared = 0;     // tokens whose CPU margin was clear
  int disagreeing = 0;  // of those, tokens that were not the CPU's
  double worst_logprob = 0.0;
};

// Teacher forcing on the CPU: `run` continued `prompt`; row prompt.size() - 1 + i of the forced
// forward predicts run.tokens[i], whose sampling noise is keyed by position prompt.size() + i.
void Confirm(tools::LocalModel& cpu, const std::vector<int32_t>& prompt, const GenerateResult& run,
             const SamplingParams& sampling, const std::string& what, Confirmation& confirmation) {
  const int64_t vocab = cpu.config().vocab_size;
  absl::StatusOr<tools::LocalSegmentResult> forced =
      ForwardChain(cpu, Concat(prompt, run.tokens), /*return_logits=*/true, {});
  ASSERT_TRUE(forced.ok()) << forced.status();
  for (size_t i = 0; i < run.tokens.size(); ++i) {
    const int64_t row = static_cast<int64_t>(prompt.size() - 1 + i);
    const float* logits = forced->logits.data() + row * vocab;
    // The CPU's choice and its margin over the runner-up, in the units the choice is made in.
    std::vector<double> scores(logits, logits + vocab);
    double threshold = 2 * kLogProbTolerance;
    if (sampling.temperature > 0) {
      const int64_t position = static_cast<int64_t>(prompt.size() + i);
      for (int32_t v = 0; v < vocab; ++v) {
        scores[v] =
            kernels::GumbelMaxScore(logits[v], sampling.temperature, sampling.seed, position, v);
      }
      threshold /= sampling.temperature;
    }
    const int32_t expected =
        static_cast<int32_t>(std::max_element(scores.begin(), scores.end()) - scores.begin());
    std::vector<double> top = scores;
    std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<>());
    ++confirmation.tokens;
    if (top[0] - top[1] > threshold) {
      ++confirmation.compared;
      if (run.tokens[i] != expected) {
        ++confirmation.disagreeing;
        std::cout << what << " token " << i << ": " << run.tokens[i] << ", the CPU's " << expected
                  << " by " << top[0] - top[1] << "\n";
      }
    }
    if (sampling.temperature == 0 && run.tokens[i] == expected) {
      const std::vector<double> log_probs = worker::LogSoftmax(logits, vocab);
      if (log_probs[expected] >= worker::kLikelyLogProb) {
        const double difference = std::abs(run.logprobs[i] - log_probs[expected]);
        confirmation.worst_logprob = std::max(confirmation.worst_logprob, difference);
        EXPECT_LE(difference, kLogProbTolerance) << what << " token " << i;
      }
    }
  }
}

// Every drafter, greedy and seeded sampling, on a replica of `world_size` GPU ranks.
void ExpectEmittedSequencesConfirmed(CudaServiceTest& test, int world_size) {
  const std::string model_dir = GoldenModelDir("kimi_k2_tiny");
  Replica* replica = test.StartReplica(
      {.world_size = world_size, .model_dir = model_dir, .worker_flags = {"--backend", "cuda"}});
  ASSERT_NE(replica, nullptr);
  auto cpu = tools::LocalModel::Create(model_dir, {.world_size = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const int64_t vocab = (*cpu)->config().vocab_size;
  const unsigned seed = 4004;
  std::cout << "prompt seed " << seed << "\n";
  const auto prompts = RepetitivePrompts(6, vocab, seed);
  for (const SamplingParams& sampling :
       {SamplingParams{}, SamplingParams{.temperature = 0.8f, .seed = 42}}) {
    Confirmation confirmation;
    int64_t accepted = 0;
    for (size_t p = 0; p < prompts.size(); ++p) {
      absl::StatusOr<GenerateResult> plain =
          Generate(replica->client(), vocab, prompts[p],
                   {.sampling = sampling, .max_new_tokens = kNewTokens});
      ASSERT_TRUE(plain.ok()) << plain.status();
      for (const std::string& drafter : tools::DrafterNames()) {
        absl::StatusOr<GenerateResult> run = Generate(replica->client(), vocab, prompts[p],
                                                      {.drafter = drafter,
                                                       .oracle = Concat(prompts[p], plain->tokens),
                                                       .sampling = sampling,
                                                       .max_new_tokens = kNewTokens});
        ASSERT_TRUE(run.ok()) << drafter << ": " << run.status();
        ASSERT_EQ(run->tokens.size(), static_cast<size_t>(kNewTokens));
        for (int32_t n : run->accepted_per_step) accepted += n;
        Confirm(**cpu, prompts[p], *run, sampling,
                "prompt " + std::to_string(p) + " drafter " + drafter, confirmation);
      }
    }
    std::cout << (sampling.temperature > 0 ? "seeded sampling" : "greedy") << ": "
              << confirmation.tokens << " tokens, " << confirmation.compared
              << " with a clear CPU margin, " << confirmation.disagreeing
              << " of those not the CPU's; " << accepted << " draft tokens accepted";
    if (sampling.temperature == 0) std::cout << "; log-probs within " << confirmation.worst_logprob;
    std::cout << "\n";
    EXPECT_GT(confirmation.compared, confirmation.tokens / 2) << "margins too small to test";
    EXPECT_LE(confirmation.disagreeing, confirmation.compared * kNearTiePercent / 100);
    EXPECT_GT(accepted, 0) << "no draft token was ever accepted";
  }
  const absl::Status freed = replica->WaitForAllKvPagesFree(absl::Seconds(10));
  EXPECT_TRUE(freed.ok()) << freed;
}

TEST_F(CudaServiceTest, EmittedSequencesAreConfirmedByTeacherForcingOnTheCpu) {
  ExpectEmittedSequencesConfirmed(*this, 1);
}

// A GPU worker's metrics: its forward phases against the bytes model and the copy bandwidth
// measured on the device, the MLA planner's NSPLIT and waves, and NVML's memory utilization
// (DRAM bandwidth too where the GPU has GPM), every scrape passing the naming conventions.
TEST_F(CudaServiceTest, GpuWorkersExportTheirMetrics) {
  const std::string model_dir = GoldenModelDir("kimi_k2_tiny");
  Replica* replica = StartReplica({.world_size = 1,
                                   .model_dir = model_dir,
                                   .worker_flags = {"--backend", "cuda"},
                                   .metrics = true});
  ASSERT_NE(replica, nullptr);
  absl::StatusOr<coordinator::ModelInfo> info = replica->client().GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  for (const std::vector<int32_t>& prompt : RepetitivePrompts(2, info->vocab_size, 77)) {
    absl::StatusOr<GenerateResult> run =
        Generate(replica->client(), info->vocab_size, prompt, {.drafter = "ngram"});
    ASSERT_TRUE(run.ok()) << run.status();
  }
  absl::SleepFor(absl::Milliseconds(2500));  // NVML samples every second
  absl::StatusOr<std::string> scrape =
      testing_http::HttpGet(replica->metrics_addresses()[1], "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  std::map<std::string, double> samples;
  std::istringstream lines(*scrape);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    samples[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  auto value = [&](const std::string& series) {
    const auto found = samples.find(series);
    EXPECT_NE(found, samples.end()) << series << " missing from\n" << *scrape;
    return found != samples.end() ? found->second : -1.0;
  };
  EXPECT_GT(value("treeverify_forwards_total{rank=\"0\"}"), 0);
  EXPECT_GT(value("treeverify_forward_dram_bytes_total{phase=\"moe\",rank=\"0\"}"), 0);
  EXPECT_GT(value("treeverify_forward_busy_seconds_total{phase=\"attention\",rank=\"0\"}"), 0);
  EXPECT_GT(value("treeverify_copy_bandwidth_bytes_per_second{rank=\"0\"}"), 1e11);
  EXPECT_GE(value("treeverify_attention_nsplit{rank=\"0\"}"), 1);
  EXPECT_GT(value("treeverify_attention_waves{rank=\"0\"}"), 0);
  const double memory = value("treeverify_gpu_memory_utilization_ratio{rank=\"0\"}");
  EXPECT_GE(memory, 0);
  EXPECT_LE(memory, 1);
  const bool gpm = samples.contains("treeverify_gpu_dram_bandwidth_utilization_ratio{rank=\"0\"}");
  std::cout << "GPU worker metrics: NSPLIT " << value("treeverify_attention_nsplit{rank=\"0\"}")
            << ", NVML memory utilization " << memory << ", GPM "
            << (gpm ? std::to_string(
                          samples["treeverify_gpu_dram_bandwidth_utilization_ratio{rank=\"0\"}"])
                    : std::string("absent"))
            << "\n";
  EXPECT_TRUE(
      absl::StrContains(*scrape, "treeverify_build_info{backend=\"cuda\",component=\"worker\""));
}

// Two worker processes, one GPU each (--gpu defaults to the rank), over NCCL.
TEST_F(CudaServiceTest, TwoRanksOverNcclAreConfirmedByTeacherForcingOnTwoGpus) {
  if (kernels::cuda::VisibleGpus() < 2) {
    GTEST_SKIP() << "GPU test skipped: needs 2 GPUs, " << kernels::cuda::VisibleGpus()
                 << " visible";
  }
  ExpectEmittedSequencesConfirmed(*this, 2);
}

}  // namespace
}  // namespace treeverify::integration
