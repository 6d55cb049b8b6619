#include "treeverify/tools/drafters.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace treeverify::tools {
namespace {

class NoDrafter final : public Drafter {
 public:
  DraftTree Propose(absl::Span<const int32_t>, int) override { return {}; }
};

// Prompt lookup: the continuations that followed earlier occurrences of the context's last n
// tokens (longest n first), merged into a trie. Each continuation becomes a branch.
class NgramDrafter final : public Drafter {
 public:
  explicit NgramDrafter(int max_ngram) : max_ngram_(max_ngram) {}

  DraftTree Propose(absl::Span<const int32_t> context, int max_nodes) override {
    DraftTree tree;
    const int64_t length = static_cast<int64_t>(context.size());
    for (int n = std::min<int64_t>(max_ngram_, length - 1); n >= 1; --n) {
      const absl::Span<const int32_t> suffix = context.subspan(length - n);
      // Most recent matches first: recent text predicts best.
      for (int64_t start = length - n - 1; start >= 0; --start) {
        if (static_cast<int>(tree.token_ids.size()) >= max_nodes) return tree;
        if (!std::equal(suffix.begin(), suffix.end(), context.begin() + start)) continue;
        AddBranch(tree, context.subspan(start + n), max_nodes);
      }
      if (!tree.token_ids.empty()) return tree;
    }
    return tree;
  }

 private:
  // Inserts `continuation` as a path from the root, sharing existing prefixes.
  static void AddBranch(DraftTree& tree, absl::Span<const int32_t> continuation, int max_nodes) {
    int32_t parent = -1;
    for (int32_t token : continuation) {
      int32_t existing = -1;
      for (size_t i = 0; i < tree.token_ids.size(); ++i) {
        if (tree.parents[i] == parent && tree.token_ids[i] == token) {
          existing = static_cast<int32_t>(i);
          break;
        }
      }
      if (existing < 0) {
        if (static_cast<int>(tree.token_ids.size()) >= max_nodes) return;
        tree.token_ids.push_back(token);
        tree.parents.push_back(parent);
        existing = static_cast<int32_t>(tree.token_ids.size()) - 1;
      }
      parent = existing;
    }
  }

  int max_ngram_;
};

class RandomDrafter final : public Drafter {
 public:
  RandomDrafter(int64_t vocab_size, uint64_t seed) : vocab_size_(vocab_size), rng_(seed) {}

  DraftTree Propose(absl::Span<const int32_t>, int max_nodes) override {
    DraftTree tree;
    const int nodes = max_nodes <= 0 ? 0 : std::uniform_int_distribution<int>(1, max_nodes)(rng_);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab_size_) - 1);
    for (int i = 0; i < nodes; ++i) {
      tree.token_ids.push_back(token(rng_));
      tree.parents.push_back(std::uniform_int_distribution<int32_t>(-1, i - 1)(rng_));
    }
    return tree;
  }

 private:
  int64_t vocab_size_;
  std::mt19937_64 rng_;
};

// A chain along the oracle's continuation in which each level holds the oracle's token with
// probability p (else a wrong token, which ends the useful chain), plus wrong siblings up to
// max_nodes. Accepted tokens per step then follow the geometric law of p.
class NoisyOracleDrafter final : public Drafter {
 public:
  NoisyOracleDrafter(std::vector<int32_t> oracle, double p, int64_t vocab_size, uint64_t seed)
      : oracle_(std::move(oracle)), p_(p), vocab_size_(vocab_size), rng_(seed) {}

  DraftTree Propose(absl::Span<const int32_t> context, int max_nodes) override {
    DraftTree tree;
    std::bernoulli_distribution keep(p_);
    int32_t parent = -1;
    size_t next = context.size();  // oracle index of the token after the pending one
    std::vector<int32_t> chain;
    while (static_cast<int>(tree.token_ids.size()) < max_nodes / 2 + 1 && next < oracle_.size() &&
           static_cast<int>(tree.token_ids.size()) < max_nodes) {
      const bool right = keep(rng_);
      tree.token_ids.push_back(right ? oracle_[next] : WrongToken(oracle_[next]));
      tree.parents.push_back(parent);
      parent = static_cast<int32_t>(tree.token_ids.size()) - 1;
      chain.push_back(parent);
      if (!right) break;
      ++next;
    }
    // Wrong siblings hang off the chain's nodes (or the root).
    while (static_cast<int>(tree.token_ids.size()) < max_nodes) {
      const int32_t at =
          std::uniform_int_distribution<int32_t>(-1, static_cast<int32_t>(chain.size()) - 1)(rng_);
      const int32_t anchor = at < 0 ? -1 : chain[at];
      const size_t oracle_index = context.size() + (at + 1);
      const int32_t avoid = oracle_index < oracle_.size() ? oracle_[oracle_index] : -1;
      tree.token_ids.push_back(WrongToken(avoid));
      tree.parents.push_back(anchor);
    }
    return tree;
  }

 private:
  int32_t WrongToken(int32_t avoid) {
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab_size_) - 1);
    int32_t t = token(rng_);
    while (t == avoid && vocab_size_ > 1) t = token(rng_);
    return t;
  }

  std::vector<int32_t> oracle_;
  double p_;
  int64_t vocab_size_;
  std::mt19937_64 rng_;
};

}  // namespace

std::vector<std::string> DrafterNames() { return {"none", "ngram", "random", "noisy-oracle"}; }

absl::StatusOr<std::unique_ptr<Drafter>> MakeDrafter(const std::string& name,
                                                     const DrafterOptions& options) {
  if (name == "none") return std::make_unique<NoDrafter>();
  if (name == "ngram") {
    if (options.max_ngram < 1) return absl::InvalidArgumentError("max_ngram must be >= 1");
    return std::make_unique<NgramDrafter>(options.max_ngram);
  }
  if (options.vocab_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("drafter ", name, " needs the vocabulary size"));
  }
  if (name == "random") return std::make_unique<RandomDrafter>(options.vocab_size, options.seed);
  if (name == "noisy-oracle") {
    if (!(options.oracle_acceptance >= 0.0 && options.oracle_acceptance <= 1.0)) {
      return absl::InvalidArgumentError("oracle acceptance must be in [0, 1]");
    }
    return std::make_unique<NoisyOracleDrafter>(options.oracle, options.oracle_acceptance,
                                                options.vocab_size, options.seed);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown drafter '", name, "' (known: ", absl::StrJoin(DrafterNames(), ", "), ")"));
}

}  // namespace treeverify::tools
