// The coordinator's own cost per Verify: the same verify step (an 8-node draft tree, tiny-v3
// model) measured through the real service (client -> coordinator over gRPC -> W worker
// processes over gRPC, Gloo all-reduce over loopback TCP) and in-process (the same VerifyEngine
// over W ranks as threads of one process, in-process all-reduce), at 1 and 16 concurrent
// sessions. diff = service - in-process at each percentile; the floor the service is held
// against is the in-process step (zero overhead), ratio = in-process p50 / service p50.
// coord = the coordinator's own part of each service Verify: client-observed latency minus the
// ranks' part (the coordinator's fan-out to the last rank's answer, from the reply's timings):
// the client <-> coordinator gRPC hop, validation, the batch window, reduction and acceptance.
//
// Also the demo's end-to-end tokens per second (demo model, TP = 2, 48 new tokens) for plain
// decoding, the ngram drafter and the noisy-oracle drafter at acceptance 0.8.
//
//   build/bench/coordinator_overhead_bench [--steps 200] [--json out.json]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "replica.h"
#include "treeverify/coordinator/verify_engine.h"
#include "treeverify/tools/checkpoint_generator.h"
#include "treeverify/tools/drafters.h"
#include "treeverify/tools/local_model.h"
#include "treeverify/tools/speculative_generate.h"

namespace treeverify {
namespace {

using Clock = std::chrono::steady_clock;

struct Percentiles {
  double p50_ms = 0;
  double p99_ms = 0;
  size_t samples = 0;
};

Percentiles Summarize(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  Percentiles p;
  p.samples = seconds.size();
  if (seconds.empty()) return p;
  p.p50_ms = seconds[seconds.size() / 2] * 1e3;
  p.p99_ms = seconds[std::min(seconds.size() - 1, seconds.size() * 99 / 100)] * 1e3;
  return p;
}

struct Latencies {
  std::vector<double> total;        // client-observed Verify latency
  std::vector<double> coordinator;  // total minus the ranks' forward (fan-out to last answer)
};

// `sessions` threads, each with its own session and client, each running `steps` Verify calls
// with a fresh random 8-node tree; returns every call's latency. make_api(i) gives thread i's
// client (the same engine for in-process runs).
template <typename MakeApi>
Latencies MeasureVerify(MakeApi make_api, int sessions, int steps, int64_t vocab) {
  std::vector<std::vector<double>> per_thread(sessions);
  std::vector<std::vector<double>> own_per_thread(sessions);
  std::vector<std::thread> threads;
  for (int s = 0; s < sessions; ++s) {
    threads.emplace_back([&, s] {
      coordinator::VerifierApi& api = make_api(s);
      auto drafter = tools::MakeDrafter("random", {.vocab_size = vocab, .seed = 100u + s});
      std::vector<int32_t> prompt(32);
      for (size_t i = 0; i < prompt.size(); ++i)
        prompt[i] = static_cast<int32_t>((i * 7 + s) % vocab);
      coordinator::CreateSessionInput create{.prompt_token_ids = prompt};
      create.stopping.ignore_eos = true;
      auto session = api.CreateSession(create);
      if (!session.ok()) {
        std::fprintf(stderr, "CreateSession: %s\n", session.status().ToString().c_str());
        std::exit(1);
      }
      std::vector<int32_t> context = prompt;
      for (int step = 0; step < steps; ++step) {
        tools::DraftTree tree = (*drafter)->Propose(context, 8);
        const auto start = Clock::now();
        auto out = api.Verify({.session_id = session->session_id,
                               .draft_token_ids = tree.token_ids,
                               .draft_parents = tree.parents,
                               .return_timings = true});
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        per_thread[s].push_back(seconds);
        if (!out.ok()) {
          std::fprintf(stderr, "Verify: %s\n", out.status().ToString().c_str());
          std::exit(1);
        }
        own_per_thread[s].push_back(seconds - out->timings.fanout_seconds);
        context.insert(context.end(), out->emitted_token_ids.begin(), out->emitted_token_ids.end());
      }
      (void)api.CloseSession(session->session_id);
    });
  }
  for (std::thread& t : threads) t.join();
  Latencies all;
  for (const auto& v : per_thread) all.total.insert(all.total.end(), v.begin(), v.end());
  for (const auto& v : own_per_thread) {
    all.coordinator.insert(all.coordinator.end(), v.begin(), v.end());
  }
  return all;
}

struct Row {
  int world_size;
  int sessions;
  Percentiles in_process;
  Percentiles service;
  Percentiles service_coordinator;  // the coordinator's own part of a service Verify
};

Row MeasureOne(int world_size, int sessions, int steps) {
  Row row{world_size, sessions, {}, {}, {}};
  const std::string& model = integration::TinyModelDir();
  {
    tools::LocalModelOptions options;
    options.world_size = world_size;
    auto local = tools::LocalModel::Create(model, options);
    auto engine = coordinator::VerifyEngine::Create({}, (*local)->RankClients());
    if (!local.ok() || !engine.ok()) std::exit(1);
    row.in_process =
        Summarize(MeasureVerify([&](int) -> coordinator::VerifierApi& { return **engine; },
                                sessions, steps, (*engine)->info().vocab_size)
                      .total);
  }
  {
    auto replica = integration::Replica::Start({.world_size = world_size, .model_dir = model});
    if (!replica.ok()) {
      std::fprintf(stderr, "replica: %s\n", replica.status().ToString().c_str());
      std::exit(1);
    }
    std::vector<std::unique_ptr<services::VerifierClient>> clients;
    for (int s = 0; s < sessions; ++s) clients.push_back(*(*replica)->NewClient(absl::Seconds(60)));
    auto info = (*replica)->client().GetModelInfo();
    Latencies service =
        MeasureVerify([&](int s) -> coordinator::VerifierApi& { return *clients[s]; }, sessions,
                      steps, info->vocab_size);
    row.service = Summarize(service.total);
    row.service_coordinator = Summarize(service.coordinator);
  }
  return row;
}

}  // namespace
}  // namespace treeverify

int main(int argc, char** argv) {
  using namespace treeverify;
  int steps = 200;
  std::string json_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--steps") steps = std::atoi(argv[i + 1]);
    if (flag == "--json") json_path = argv[i + 1];
  }
  // Several processes share the machine: one passive OpenMP thread per process, in-process too,
  // so both sides get the same compute.
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);

  nlohmann::json out;
  std::printf(
      "Verify latency, 8-node random tree over a 32-token prompt, tiny-v3, %d steps per "
      "session\n",
      steps);
  std::printf("%4s %8s | %10s %8s | %11s %8s | %10s %8s | %10s %8s | %6s\n", "TP", "sessions",
              "inproc p50", "p99", "service p50", "p99", "diff p50", "p99", "coord p50", "p99",
              "ratio");
  for (int world : {2, 4}) {
    for (int sessions : {1, 16}) {
      const Row row = MeasureOne(world, sessions, sessions == 1 ? steps : steps / 4);
      const double ratio = row.in_process.p50_ms / row.service.p50_ms;
      std::printf("%4d %8d | %10.3f %8.3f | %11.3f %8.3f | %10.3f %8.3f | %10.3f %8.3f | %6.2f\n",
                  world, sessions, row.in_process.p50_ms, row.in_process.p99_ms, row.service.p50_ms,
                  row.service.p99_ms, row.service.p50_ms - row.in_process.p50_ms,
                  row.service.p99_ms - row.in_process.p99_ms, row.service_coordinator.p50_ms,
                  row.service_coordinator.p99_ms, ratio);
      std::fflush(stdout);
      out["verify_latency"].push_back({{"world_size", world},
                                       {"sessions", sessions},
                                       {"in_process_p50_ms", row.in_process.p50_ms},
                                       {"in_process_p99_ms", row.in_process.p99_ms},
                                       {"service_p50_ms", row.service.p50_ms},
                                       {"service_p99_ms", row.service.p99_ms},
                                       {"coordinator_own_p50_ms", row.service_coordinator.p50_ms},
                                       {"coordinator_own_p99_ms", row.service_coordinator.p99_ms},
                                       {"samples", row.service.samples}});
    }
  }

  // The demo's end-to-end tokens per second.
  const std::string demo_dir = integration::ScratchDir() + "/demo-model";
  auto spec = tools::PresetSpec("demo");
  if (!spec.ok() || !tools::WriteCheckpoint(demo_dir, *spec).ok()) return 1;
  auto replica = integration::Replica::Start({.world_size = 2, .model_dir = demo_dir});
  if (!replica.ok()) return 1;
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3};
  tools::GenerateOptions options;
  options.stopping.max_new_tokens = 48;
  options.stopping.ignore_eos = true;
  auto none = tools::MakeDrafter("none", {});
  auto plain = tools::SpeculativeGenerate((*replica)->client(), prompt, options, **none);
  if (!plain.ok()) return 1;
  std::vector<int32_t> oracle = prompt;
  oracle.insert(oracle.end(), plain->tokens.begin(), plain->tokens.end());
  std::printf("\nDemo end to end (demo model, TP = 2 processes, 48 new tokens, 8-node trees)\n");
  std::printf("%14s %8s %12s %10s\n", "drafter", "steps", "accepted/step", "tokens/s");
  for (const std::string name : {"none", "ngram", "noisy-oracle"}) {
    auto drafter = tools::MakeDrafter(
        name, {.vocab_size = 1024, .seed = 1, .oracle = oracle, .oracle_acceptance = 0.8});
    auto result = tools::SpeculativeGenerate((*replica)->client(), prompt, options, **drafter);
    if (!result.ok()) return 1;
    std::printf("%14s %8lld %12.2f %10.1f\n", name.c_str(), static_cast<long long>(result->steps),
                result->mean_accepted_per_step(), result->tokens_per_second());
    out["demo_tokens_per_second"][name] = result->tokens_per_second();
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
