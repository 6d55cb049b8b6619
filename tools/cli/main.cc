// treeverify-cli: the developer's command-line tool.
//
//   treeverify-cli make-checkpoint --out DIR [--preset demo] [--seed 7] [--shards 1]
//   treeverify-cli generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--tp W] [--json]
//
// `generate` runs the model in-process (W tensor-parallel ranks as threads, CPU backend) and
// prints the greedy continuation with each emitted token's log-probability.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "treeverify/kernels/status.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/local_model.h"

ABSL_FLAG(std::string, model, "", "generate: checkpoint directory (config.json + safetensors)");
ABSL_FLAG(std::string, prompt_ids, "", "generate: comma-separated prompt token ids");
ABSL_FLAG(int, max_new_tokens, 16, "generate: number of tokens to generate");
ABSL_FLAG(int, tp, 1, "generate: tensor-parallel ranks (threads)");
ABSL_FLAG(std::string, expert_sharding, "split",
          "generate: 'split' (every rank holds 1/W of every expert) or 'whole' (expert parallel)");
ABSL_FLAG(bool, json, false, "generate: print {\"tokens\": [...], \"logprobs\": [...]}");
ABSL_FLAG(std::string, out, "", "make-checkpoint: output directory");
ABSL_FLAG(std::string, preset, "demo", "make-checkpoint: demo, tiny-v3, tiny-kimi, tiny-v2-lite");
ABSL_FLAG(uint64_t, seed, 7, "make-checkpoint: random seed");
ABSL_FLAG(int, shards, 1, "make-checkpoint: number of safetensors files");

namespace treeverify::tools {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--prompt-ids: '%s' is not an integer", std::string(part)));
    }
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError("--prompt-ids is empty");
  return ids;
}

absl::Status Generate() {
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  TV_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, ParseIds(absl::GetFlag(FLAGS_prompt_ids)));
  LocalModelOptions options;
  options.world_size = absl::GetFlag(FLAGS_tp);
  const std::string sharding = absl::GetFlag(FLAGS_expert_sharding);
  if (sharding == "whole") {
    options.expert_sharding = worker::ExpertSharding::kWholeExperts;
  } else if (sharding != "split") {
    return absl::InvalidArgumentError("--expert-sharding must be 'split' or 'whole'");
  }
  TV_ASSIGN_OR_RETURN(std::unique_ptr<LocalModel> model, LocalModel::Create(model_dir, options));
  TV_ASSIGN_OR_RETURN(
      Generation generation,
      model->GenerateGreedy(/*sequence_id=*/1, prompt, absl::GetFlag(FLAGS_max_new_tokens)));
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = {{"tokens", generation.tokens}, {"logprobs", generation.logprobs}};
    std::printf("%s\n", out.dump().c_str());
    return absl::OkStatus();
  }
  const worker::ModelConfig& config = model->config();
  std::printf("model    %s (%s, %lld layers, vocab %lld), tp=%d, CPU backend\n", model_dir.c_str(),
              config.model_type.c_str(), static_cast<long long>(config.num_hidden_layers),
              static_cast<long long>(config.vocab_size), model->world_size());
  std::printf("prompt   %s\n", absl::StrJoin(prompt, " ").c_str());
  std::printf("%5s %8s %10s\n", "step", "token", "logprob");
  for (size_t i = 0; i < generation.tokens.size(); ++i) {
    std::printf("%5zu %8d %10.4f\n", i, generation.tokens[i], generation.logprobs[i]);
  }
  return absl::OkStatus();
}

absl::Status MakeCheckpoint() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  TV_RETURN_IF_ERROR(RunMakeCheckpoint(out, absl::GetFlag(FLAGS_preset), absl::GetFlag(FLAGS_seed),
                                       absl::GetFlag(FLAGS_shards)));
  std::printf("wrote %s checkpoint to %s\n", absl::GetFlag(FLAGS_preset).c_str(), out.c_str());
  return absl::OkStatus();
}

// Abseil flag names are identifiers; the CLI documents them with dashes (--prompt-ids), so the
// name part of every "--flag[=value]" argument has its dashes turned into underscores.
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) continue;
    const size_t name_end = std::min(arg.find('='), arg.size());
    for (size_t c = 2; c < name_end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return args;
}

}  // namespace
}  // namespace treeverify::tools

int main(int argc, char** argv) {
  std::vector<std::string> normalized = treeverify::tools::NormalizeFlagNames(argc, argv);
  std::vector<char*> normalized_argv;
  for (std::string& arg : normalized) normalized_argv.push_back(arg.data());
  absl::SetProgramUsageMessage(
      "treeverify-cli COMMAND [flags]\n"
      "  make-checkpoint --out DIR [--preset demo] [--seed 7] [--shards 1]\n"
      "  generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--tp W] [--json]");
  std::vector<char*> args =
      absl::ParseCommandLine(static_cast<int>(normalized_argv.size()), normalized_argv.data());
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = args[1];
  absl::Status status;
  if (command == "generate") {
    status = treeverify::tools::Generate();
  } else if (command == "make-checkpoint") {
    status = treeverify::tools::MakeCheckpoint();
  } else {
    std::fprintf(stderr, "unknown command '%s'\n%s\n", command.c_str(),
                 absl::ProgramUsageMessage().data());
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "treeverify-cli %s: %s\n", command.c_str(), status.ToString().c_str());
    return 1;
  }
  return 0;
}
