// Draft-tree builders for the drafting loop: they guess the target's next tokens as a tree
// hanging under the session's pending token (parents[i] = -1 for children of the pending token).
//
//   std::unique_ptr<Drafter> drafter = MakeDrafter("ngram", {.vocab_size = 1024});
//   DraftTree tree = drafter->Propose(context, /*max_nodes=*/8);
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace treeverify::tools {

struct DraftTree {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> parents;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // `context` holds every token so far: the prompt and the emitted tokens, the last one being
  // the pending token. Returns at most max_nodes nodes.
  virtual DraftTree Propose(absl::Span<const int32_t> context, int max_nodes) = 0;
};

struct DrafterOptions {
  int64_t vocab_size = 0;
  uint64_t seed = 1;
  // noisy-oracle: the target's own output (prompt followed by the continuation), and the
  // probability that each level of the tree contains the oracle's token.
  std::vector<int32_t> oracle;
  double oracle_acceptance = 0.8;
  // ngram: longest suffix to look up.
  int max_ngram = 3;
};

// "none" (empty trees: plain decoding), "ngram" (prompt lookup), "random" (random shapes and
// tokens: exercises verification, rarely accepted), "noisy-oracle" (the oracle's next tokens,
// each level kept with probability oracle_acceptance, plus wrong siblings).
absl::StatusOr<std::unique_ptr<Drafter>> MakeDrafter(const std::string& name,
                                                     const DrafterOptions& options);
std::vector<std::string> DrafterNames();

}  // namespace treeverify::tools
