// The compute half of one rank's forward: a batch of rows whose bookkeeping ModelRunner has done
// (commits applied, cache slots reserved, trees turned into positions and ancestor masks) goes
// through the layers, the LM head and the per-node summaries of this rank's vocabulary shard.
// CpuForward is the oracle; a GPU backend implements the same interface, so everything above it
// (the runner's checks, the cache's bookkeeping, the service) is shared.
//
//   BatchInputs inputs = ...;  // built by ModelRunner
//   ForwardOutputs outputs;
//   TV_RETURN_IF_ERROR(backend->Run(inputs, outputs));
//   // outputs.summaries[row], outputs.candidates[sequence], ...
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/kernels/lm_head_summary.h"
#include "treeverify/worker/communicator.h"
#include "treeverify/worker/kv_storage.h"
#include "treeverify/worker/model_weights.h"
#include "treeverify/worker/step_accounting.h"

namespace treeverify::worker {

// How a sequence samples its next tokens. Node i's sampled token is the one for absolute
// position committed_length + depth(i) + 1 (the position of the token node i predicts), so a
// tree node samples exactly what the same node computed in a chain samples.
struct SegmentSampling {
  float temperature = 0.0f;  // 0: greedy only, no sampled fields in the summaries
  uint64_t seed = 0;
  int32_t candidates = 0;  // per node, this shard's largest logits (top-k / top-p), at most 1024
};

// The rows of all sequences of one forward, flattened in request order. Every rank of a group
// builds the same inputs from the same request.
struct BatchInputs {
  std::vector<int32_t> token_ids;  // [rows]
  std::vector<int32_t> positions;  // [rows] committed_length + depth
  // [rows] committed_length + depth + 1: the position of the token each row predicts, which keys
  // its sampling noise.
  std::vector<int64_t> sample_positions;
  std::vector<int64_t> slots;              // [rows] cache slot of each row's own KV
  std::vector<int32_t> row_offsets{0};     // [sequences + 1]
  std::vector<int32_t> committed_lengths;  // [sequences]
  std::vector<uint64_t> ancestor_mask;     // [rows, kernels::kAncestorMaskWords]
  std::vector<int32_t> page_table;         // [sequences, max_pages], padded with page 0
  int32_t max_pages = 0;
  std::vector<SegmentSampling> sampling;  // [sequences]
  // A chain longer than kernels::kMaxSegmentRows (up to kMaxChainRows: a prefill chunk) enters
  // the batch as consecutive sequences of at most that many rows, its pieces. Piece k's committed
  // length counts the rows of the pieces before it, whose KV each layer appends before it
  // attends, so the tree attention takes a piece as it takes any sequence; a backend with a
  // prefill path joins the pieces again. Such long chains come after every other sequence.
  std::vector<bool> chain;            // [sequences] the rows form a chain
  std::vector<bool> continues_chain;  // [sequences] a second or later piece of one chain
  // capture_layer[l] for l in 0..num_hidden_layers: return layer l's hidden states (0 = the
  // embedding output after its all-reduce, l = decoder layer l - 1's output).
  std::vector<bool> capture_layer;
  bool return_logits = false;

  int64_t rows() const { return static_cast<int64_t>(token_ids.size()); }
  int32_t sequences() const { return static_cast<int32_t>(committed_lengths.size()); }
};

struct ForwardOutputs {
  std::vector<kernels::NodeSummary> summaries;  // [rows], this rank's vocabulary shard
  // [sequences][rows of the sequence, sampling[s].candidates]
  std::vector<std::vector<kernels::Candidate>> candidates;
  std::vector<float> logits;  // [rows, vocab shard] when return_logits, else empty
  // [num_hidden_layers + 1]: [rows, hidden] for each captured layer, else empty.
  std::vector<std::vector<float>> layer_hidden;
};

class ForwardBackend {
 public:
  virtual ~ForwardBackend() = default;
  // Writes the new rows' KV into the cache, runs the model and fills outputs. Every rank of a
  // group calls it with the same inputs (they meet in all-reduces). An error fails the whole
  // batch: per-sequence problems were refused before the inputs were built.
  virtual absl::Status Run(const BatchInputs& inputs, ForwardOutputs& outputs) = 0;
  // The last step's phases, times and modeled bytes, where the backend keeps an account (the GPU
  // backend with accounting on); nullopt otherwise.
  virtual std::optional<StepAccount> last_step_account() const { return std::nullopt; }
};

// A backend and the storage of the KV rows it reads and writes: KvCache owns the storage, the
// runner owns both and destroys the backend first.
struct ForwardParts {
  std::unique_ptr<KvStorage> kv_rows;
  std::unique_ptr<ForwardBackend> backend;
};
// Makes the parts for a model's weights (which outlive them), a cache shape and a communicator.
using ForwardFactory = std::function<absl::StatusOr<ForwardParts>(
    const ModelWeights& weights, const KvCacheOptions& cache, Communicator* communicator)>;

// What every backend's Create checks: KV rows with the model's layers and row width, and a
// communicator. INVALID_ARGUMENT naming `backend` otherwise.
absl::Status CheckForwardInputs(const char* backend, const ModelConfig& config,
                                const KvCacheOptions& kv_rows, const Communicator* communicator);

// The per-sequence summaries of logits [rows, vocab shard] in host memory (outputs.summaries and
// outputs.candidates), each sequence with its own sampling parameters.
absl::Status SummarizeLogits(const BatchInputs& batch, const float* logits, int64_t vocab_shard,
                             int32_t vocab_begin, ForwardOutputs& outputs);

}  // namespace treeverify::worker
