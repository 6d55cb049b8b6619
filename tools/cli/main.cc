// treeverify-cli: the developer's command-line tool.
//
//   treeverify-cli make-checkpoint --out DIR [--preset demo] [--seed 0] [--shards 1]
//   treeverify-cli generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--tp W] [--json]
//   treeverify-cli generate --server ADDR --prompt-ids 1,2,3 --max-new-tokens N
//       [--drafter none|ngram|random|noisy-oracle] [--tree-nodes 8] [--oracle-acceptance 0.8]
//       [--temperature 0] [--seed 0] [--top-k 0] [--top-p 0] [--json]
//   treeverify-cli info --server ADDR [--wait-s 0]
//
// `generate --model` runs the model in-process (W tensor-parallel ranks as threads, CPU backend)
// and prints the greedy continuation with each emitted token's log-probability. With --server it
// drives a running coordinator instead: one Verify per step with the drafter's tree.
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
#include "treeverify/services/flag_names.h"
#include "treeverify/services/verifier_client.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/drafters.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/tools/speculative_generate.h"

ABSL_FLAG(std::string, model, "", "generate: checkpoint directory (config.json + safetensors)");
ABSL_FLAG(std::string, prompt_ids, "", "generate: comma-separated prompt token ids");
ABSL_FLAG(int, max_new_tokens, 16, "generate: number of tokens to generate");
ABSL_FLAG(int, tp, 1, "generate: tensor-parallel ranks (threads)");
ABSL_FLAG(std::string, expert_sharding, "split",
          "generate: 'split' (every rank holds 1/W of every expert) or 'whole' (expert parallel)");
ABSL_FLAG(bool, json, false, "generate: print {\"tokens\": [...], \"logprobs\": [...]}");
ABSL_FLAG(std::string, server, "", "generate, info: coordinator address (HOST:PORT)");
ABSL_FLAG(std::string, drafter, "none", "generate --server: none, ngram, random, noisy-oracle");
ABSL_FLAG(int, tree_nodes, 8, "generate --server: draft nodes per step");
ABSL_FLAG(double, oracle_acceptance, 0.8,
          "generate --server --drafter noisy-oracle: probability that each tree level holds the "
          "target's own token");
ABSL_FLAG(double, temperature, 0.0, "generate --server: sampling temperature (0 = greedy)");
ABSL_FLAG(int, top_k, 0, "generate --server: sample among the top k tokens (0 = all)");
ABSL_FLAG(double, top_p, 0.0, "generate --server: nucleus sampling threshold (0 = off)");
ABSL_FLAG(double, wait_s, 0.0, "info: wait up to this long for the service to be SERVING");
ABSL_FLAG(std::string, out, "", "make-checkpoint: output directory");
ABSL_FLAG(std::string, preset, "demo", "make-checkpoint: demo, tiny-v3, tiny-kimi, tiny-v2-lite");
ABSL_FLAG(uint64_t, seed, 0, "make-checkpoint: weights seed; generate --server: sampling seed");
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

absl::StatusOr<std::unique_ptr<services::VerifierClient>> ConnectToServer() {
  return services::VerifierClient::Connect(absl::GetFlag(FLAGS_server), absl::Seconds(10));
}

absl::Status Info() {
  TV_ASSIGN_OR_RETURN(std::unique_ptr<services::VerifierClient> client, ConnectToServer());
  if (absl::GetFlag(FLAGS_wait_s) > 0) {
    TV_RETURN_IF_ERROR(client->WaitUntilServing(absl::Seconds(absl::GetFlag(FLAGS_wait_s))));
  }
  TV_ASSIGN_OR_RETURN(coordinator::ModelInfo info, client->GetModelInfo());
  std::printf(
      "server %s: model %s (%s), vocab %lld, %lld layers, hidden %lld, max context %lld, "
      "max draft nodes %d, %d rank(s), %s backend\n",
      absl::GetFlag(FLAGS_server).c_str(), info.model_name.c_str(), info.model_type.c_str(),
      static_cast<long long>(info.vocab_size), static_cast<long long>(info.num_layers),
      static_cast<long long>(info.hidden_size), static_cast<long long>(info.max_context_length),
      info.max_draft_nodes, info.world_size, info.backend.c_str());
  return absl::OkStatus();
}

// generate --server: the drafting loop against a running coordinator. The noisy-oracle drafter
// needs the target's own continuation, so it first decodes plainly (not timed).
absl::Status GenerateOnServer(const std::vector<int32_t>& prompt) {
  TV_ASSIGN_OR_RETURN(std::unique_ptr<services::VerifierClient> client, ConnectToServer());
  TV_ASSIGN_OR_RETURN(coordinator::ModelInfo info, client->GetModelInfo());
  GenerateOptions options;
  options.sampling = {.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature)),
                      .seed = absl::GetFlag(FLAGS_seed),
                      .top_k = absl::GetFlag(FLAGS_top_k),
                      .top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p))};
  options.stopping.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  options.tree_nodes = absl::GetFlag(FLAGS_tree_nodes);
  DrafterOptions drafter_options{.vocab_size = info.vocab_size,
                                 .oracle_acceptance = absl::GetFlag(FLAGS_oracle_acceptance)};
  const std::string drafter_name = absl::GetFlag(FLAGS_drafter);
  if (drafter_name == "noisy-oracle") {
    TV_ASSIGN_OR_RETURN(std::unique_ptr<Drafter> none, MakeDrafter("none", {}));
    TV_ASSIGN_OR_RETURN(GenerateResult plain, SpeculativeGenerate(*client, prompt, options, *none));
    drafter_options.oracle = prompt;
    drafter_options.oracle.insert(drafter_options.oracle.end(), plain.tokens.begin(),
                                  plain.tokens.end());
  }
  TV_ASSIGN_OR_RETURN(std::unique_ptr<Drafter> drafter, MakeDrafter(drafter_name, drafter_options));
  TV_ASSIGN_OR_RETURN(GenerateResult result,
                      SpeculativeGenerate(*client, prompt, options, *drafter));
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = {{"tokens", result.tokens},
                          {"logprobs", result.logprobs},
                          {"steps", result.steps},
                          {"accepted_per_step", result.accepted_per_step},
                          {"tokens_per_second", result.tokens_per_second()}};
    std::printf("%s\n", out.dump().c_str());
    return absl::OkStatus();
  }
  std::printf("tokens             %s\n", absl::StrJoin(result.tokens, " ").c_str());
  std::printf("steps              %lld (Verify calls after CreateSession)\n",
              static_cast<long long>(result.steps));
  std::printf("accepted per step  %s (mean %.2f draft tokens)\n",
              absl::StrJoin(result.accepted_per_step, " ").c_str(),
              result.mean_accepted_per_step());
  std::printf("tokens per second  %.1f (%zu tokens in %.3f s)\n", result.tokens_per_second(),
              result.tokens.size(), result.seconds);
  return absl::OkStatus();
}

absl::Status Generate() {
  if (!absl::GetFlag(FLAGS_server).empty()) {
    TV_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, ParseIds(absl::GetFlag(FLAGS_prompt_ids)));
    return GenerateOnServer(prompt);
  }
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

}  // namespace
}  // namespace treeverify::tools

int main(int argc, char** argv) {
  // Flags are documented with dashes (--prompt-ids); Abseil's names have underscores.
  treeverify::services::FlagArgs args(argc, argv);
  absl::SetProgramUsageMessage(
      "treeverify-cli COMMAND [flags]\n"
      "  make-checkpoint --out DIR [--preset demo] [--seed 0] [--shards 1]\n"
      "  generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--tp W] [--json]\n"
      "  generate --server ADDR --prompt-ids 1,2,3 --max-new-tokens N [--drafter ngram]\n"
      "      [--tree-nodes 8] [--oracle-acceptance 0.8] [--temperature T] [--seed S]\n"
      "      [--top-k K] [--top-p P] [--json]\n"
      "  info --server ADDR [--wait-s SECONDS]");
  std::vector<char*> positional = absl::ParseCommandLine(args.argc(), args.argv());
  if (positional.size() != 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = positional[1];
  absl::Status status;
  if (command == "generate") {
    status = treeverify::tools::Generate();
  } else if (command == "info") {
    status = treeverify::tools::Info();
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
