// The forward on one GPU: the CPU backend's graph (the same ops and params structs) in bf16
// weights and activations with fp32 accumulation, an fp32 residual stream and fp32 logits
// (docs/gpu-worker-plan.md, "Data types"). Not batch invariant: compared with the CPU backend by
// teacher forcing with the margin rule.
//
//   ModelRunnerOptions options;
//   options.forward_factory = [](const ModelWeights& w, const KvCacheOptions& c, Communicator* k) {
//     return MakeCudaForward(w, c, k, {.device_ordinal = 0});
//   };
//
// With W > 1 the all-reduces run on the device when the communicator has DeviceCollectives
// (NCCL: steps replay from CUDA graphs too) and through the host otherwise (Gloo, in-process:
// eager steps). A failed step at W > 1 leaves the ranks out of step: every later Run is
// UNAVAILABLE until the group re-forms (a new communicator, a new backend).
//
// Prefill: chains longer than a tree (prompt chunks of more than kMaxSegmentRows rows, in pieces,
// see BatchInputs) take the MHA form (docs/gpu-worker.md, "Prefill"): per layer and chain the
// context's latent rows are gathered and up-projected through kv_b_proj, and a flash-attention
// kernel attends causally; the step's other sequences keep the absorbed form. Such steps run
// eagerly, never from a graph.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/device.h"
#include "treeverify/kernels/cuda/gemm.h"
#include "treeverify/kernels/cuda/lm_head_summary.h"
#include "treeverify/kernels/cuda/mla_verify_attention.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/worker/communicator.h"
#include "treeverify/worker/cuda_kv_storage.h"
#include "treeverify/worker/device_array.h"
#include "treeverify/worker/device_weights.h"
#include "treeverify/worker/forward_backend.h"
#include "treeverify/worker/kv_storage.h"
#include "treeverify/worker/model_weights.h"
#include "treeverify/worker/side_stream.h"
#include "treeverify/worker/step_accounting.h"

namespace treeverify::worker {

struct CudaForwardOptions {
  int device_ordinal = 0;
  // Keep a StepAccount of every step (step_accounting.h): GPU clock stamps between the phases, the
  // active experts per layer, and the copy bandwidth measured once at creation (a few
  // milliseconds).
  bool account_steps = false;
  // Replay each step shape's device work from a CUDA graph (captured on the shape's second step;
  // see docs/gpu-worker.md for what is and is not captured).
  bool graphs = true;
  // Dense products of at most 16 rows through ResidentGemm where it takes them (its weights
  // loaded while the kernel before it runs; resident_gemm.h), else all through cuBLASLt.
  bool resident_products = true;
  absl::Status Validate() const;
};

// Uploads the weights (converted to bf16) to the device and allocates the KV rows there.
// FAILED_PRECONDITION without a usable GPU.
absl::StatusOr<ForwardParts> MakeCudaForward(const ModelWeights& weights,
                                             const KvCacheOptions& cache,
                                             Communicator* communicator,
                                             const CudaForwardOptions& options);

class CudaForward final : public ForwardBackend {
 public:
  // On success the backend owns the stream (destroyed with it; the KV rows' moves run on it
  // too); on failure the caller still does. kv_rows and communicator must outlive the backend.
  static absl::StatusOr<std::unique_ptr<CudaForward>> Create(
      DeviceWeights weights, CudaKvStorage& kv_rows, Communicator* communicator,
      const kernels::cuda::DeviceInfo& device, cudaStream_t stream,
      const CudaForwardOptions& options);
  ~CudaForward() override;

  absl::Status Run(const BatchInputs& inputs, ForwardOutputs& outputs) override;
  std::optional<StepAccount> last_step_account() const override { return last_account_; }

 private:
  // Activations for up to `capacity` rows.
  struct Activations {
    int64_t capacity = 0;
    DeviceArray<float> residual;       // [rows, hidden] the residual stream
    DeviceArray<Bf16> normed;          // [rows, hidden] the next GEMM's input
    DeviceArray<float> branch;         // [rows, hidden] attention or MLP output, then all-reduced
    DeviceArray<float> q_a;            // [rows, q_lora_rank]
    DeviceArray<Bf16> q_a_normed;      // [rows, q_lora_rank]
    DeviceArray<Bf16> q;               // [rows, heads, qk_head_dim]
    DeviceArray<Bf16> q_attn;          // [rows, heads, kv_lora_rank + rope]: the absorbed query
    DeviceArray<float> kv_a;           // [rows, kv_lora_rank + rope]
    DeviceArray<Bf16> kv_row;          // [rows, kv_lora_rank + rope]: the new cache rows
    DeviceArray<Bf16> latent_out;      // [rows, heads, kv_lora_rank]
    DeviceArray<float> lse;            // [rows, heads]
    DeviceArray<Bf16> values;          // [rows, heads, v_head_dim]
    DeviceArray<float> gate_up;        // [rows, 2 * intermediate]
    DeviceArray<Bf16> activated;       // [rows, intermediate]
    DeviceArray<float> logits;         // [rows, vocab shard]
    DeviceArray<float> router_logits;  // [rows, n_routed_experts]
    DeviceArray<int32_t> topk_ids;     // [rows, num_experts_per_tok]
    DeviceArray<float> topk_weights;   // [rows, num_experts_per_tok]
    DeviceArray<float> shared_out;     // [rows, hidden] the shared experts' output
    DeviceArray<uint8_t> moe_workspace;
  };
  // What fixes a step's launches: a CUDA graph serves every step of the same layout. A batch's
  // rows are padded up to a bucket (RowBucket) with rows that belong to no sequence (the
  // attention skips them; they take no cache slot and no expert), so that trees of nearby sizes
  // share a graph; the longest segment and the page tables' width are padded to powers of two.
  // The number of sequences is padded to a bucket too (SequenceBucket) with sequences of no rows
  // and no keys; the attention reads the live count from the device and spreads its key splits
  // over the live sequences only (docs/gpu-worker.md). Only the batch's own rows reach the outputs.
  struct StepLayout {
    int64_t rows = 0;                // RowBucket(the batch's rows)
    int32_t sequences = 0;           // SequenceBucket(the batch's sequences)
    int32_t min_live_sequences = 0;  // the fewest live sequences of that bucket
    int32_t max_rows_per_seq = 0;    // a power of two
    int32_t max_pages = 0;           // the page tables' padded width, a power of two
    auto operator<=>(const StepLayout&) const = default;
  };
  // 8, 12, 16, 24, 32, ... 384, 512 (two buckets an octave), then multiples of 256: at most a
  // third of the rows are padding (at most 255 past 512).
  static int64_t RowBucket(int64_t rows);
  // 1, 2, 4, ..., 64, then multiples of 64; MinLiveSequences is the fewest sequences a bucket
  // serves (half of it and one more, then 63 under it): at most kMaxLiveCounts live counts, the
  // attention's limit for one plan.
  static int32_t SequenceBucket(int32_t sequences);
  static int32_t MinLiveSequences(int32_t bucket);
  // A chain the prefill path attends as one: rows [row_begin, row_begin + rows) of the batch
  // (its pieces joined), keys = its committed prefix + rows, its page table the first piece's.
  struct PrefillChain {
    int32_t row_begin = 0;
    int32_t rows = 0;
    int32_t keys = 0;
    int32_t sequence = 0;  // its first piece
  };
  // Keys per up-projection GEMM: the GEMMs' shapes (and cuBLASLt plans) stay few whatever the
  // context, each block's rows rounded up to kPrefillKeyAlign.
  static constexpr int64_t kPrefillKeyBlock = 4096;
  static constexpr int64_t kPrefillKeyAlign = 256;
  struct Graph {
    bool seen = false;  // run eagerly once (plans made, buffers sized)
    int64_t epoch = 0;  // buffers_epoch_ when seen or captured
    cudaGraphExec_t exec = nullptr;
    std::vector<StepPhase> marks;                            // the phase marks the graph records
    int64_t last_used = 0;                                   // graph_clock_ at its last step
    const kernels::cuda::MlaVerifyPlan* mla_plan = nullptr;  // the attention's, when captured
  };
  // Batches of many sequences and contexts still make many layouts: past this many, the least
  // recently used graph is dropped.
  static constexpr size_t kMaxGraphs = 64;
  // The step's inputs on the device, packed in one buffer and copied in one go.
  struct StepInputs {
    DeviceArray<uint8_t> buffer;
    const int32_t* token_ids = nullptr;          // [rows]
    const int32_t* positions = nullptr;          // [rows]
    const int64_t* sample_positions = nullptr;   // [rows]
    const int64_t* slots = nullptr;              // [rows]
    const int32_t* row_offsets = nullptr;        // [sequences + 1]
    const int32_t* committed_lengths = nullptr;  // [sequences]
    const uint64_t* ancestor_mask = nullptr;     // [rows, kAncestorMaskWords]
    const int32_t* page_table = nullptr;         // [sequences, max_pages]
    const int32_t* routed_rows = nullptr;        // [1] the batch's rows: the rest only pad
    const int32_t* live_sequences = nullptr;     // [1] the batch's sequences: the rest only pad
  };

  CudaForward(DeviceWeights weights, CudaKvStorage& kv_rows, Communicator* communicator,
              const kernels::cuda::DeviceInfo& device, cudaStream_t stream,
              std::unique_ptr<kernels::cuda::GemmRunner> gemm, std::unique_ptr<SideStream> side,
              std::unique_ptr<kernels::cuda::GemmRunner> side_gemm);
  // Accounting: Mark records the time that closes the interval since the previous mark, which
  // counts to `phase`; Account turns the step's intervals into last_account_.
  absl::Status StartAccount();
  absl::Status Mark(StepPhase phase);
  // Where only the all-reduce stands between the phase's end and the next RmsNorm: the mark is
  // the norm's own start stamp when there is no all-reduce (W = 1), else Mark (the all-reduce's
  // mark is then the norm's). One kernel node fewer a mark (bench/NOTES.md, step 107).
  absl::Status MarkBeforeNorm(StepPhase phase);
  absl::Status MarkAtNextNorm(StepPhase phase);
  // The slot the next norm stamps (nullptr if none), and the stamp kernel for a pending slot when
  // something else comes first (a copy to the host).
  uint64_t* TakeNormStamp();
  absl::Status FlushNormStamp();
  absl::Status Account(const BatchInputs& batch, const StepLayout& layout);
  // Run's work; Run adds what a failure means for the group.
  absl::Status Step(const BatchInputs& batch, ForwardOutputs& outputs);
  void DropGraphs();
  // Waits for the stream: bounded by the group's timeout where collectives may be in flight.
  absl::Status Synchronize();
  absl::Status Reserve(int64_t rows);
  static StepLayout LayoutOf(const BatchInputs& batch);
  // The batch's chains longer than a tree (BatchInputs puts them last), which take the prefill
  // path, else empty.
  std::vector<PrefillChain> PrefillChainsOf(const BatchInputs& batch) const;
  absl::Status ReservePrefill(const BatchInputs& batch);
  // How many of the step's first sequences take the absorbed form: all, or those before the
  // first long chain.
  int32_t AbsorbedSequences(int32_t sequences) const;
  absl::Status Upload(const BatchInputs& batch, const StepLayout& layout);
  // The step's device work, embedding to LM head; hidden states of the layers `capture` marks
  // copied out as it goes (eager only).
  absl::Status Layers(const StepLayout& layout, const std::vector<bool>* capture,
                      std::vector<std::vector<float>>& hidden_states);
  absl::Status RunGraph(const StepLayout& layout);
  // The per-node summaries (and candidates, and logits on request) into outputs.
  absl::Status Summarize(const BatchInputs& batch, ForwardOutputs& outputs);
  // Both forms: the queries (a.q), the new rows' KV into the cache, the attention into
  // a.values, then o_proj into a.branch.
  absl::Status Attention(int64_t layer, const StepLayout& layout);
  // This rank's attention sizes: heads, qk_nope, qk_rope, qk (their sum), kv_lora, the cache
  // row (kv_lora + rope) and v.
  struct AttentionDims {
    int64_t heads, nope, rope, qk, lora, row_dim, v;
  };
  AttentionDims attention_dims() const;
  absl::Status ProjectQueries(const DeviceAttentionWeights& w, int64_t rows);
  // The new rows' latent KV into the cache, on `stream` with `gemm` (the side branch's).
  absl::Status AppendNewRows(int64_t layer, int64_t rows, cudaStream_t stream,
                             kernels::cuda::GemmRunner& gemm);
  // q_nope through W_UK on stream_ and q_pe's rotation on the side branch (forked here; the
  // caller joins), into the absorbed query rows.
  absl::Status AbsorbedQueries(int64_t layer, int64_t rows);
  absl::Status AbsorbedAttention(int64_t layer, const StepLayout& layout);
  absl::Status PrefillAttention(int64_t layer, const StepLayout& layout);
  absl::Status Mlp(int64_t layer, int64_t rows);
  // out = down(silu(gate . x) * (up . x)) of the normed rows, on `stream` with `gemm`.
  absl::Status GatedMlp(const DeviceMlpWeights& mlp, int64_t rows, float* out, cudaStream_t stream,
                        kernels::cuda::GemmRunner& gemm);
  // active_count (device): where the MoE grouping writes the layer's active experts, or null.
  absl::Status Moe(const DeviceMoeWeights& moe, int64_t rows, int32_t* active_count);
  // The routed experts' op params for this layer and batch.
  kernels::MoeExpertsParamsOf<kernels::cuda::Bf16, kernels::cuda::Bf16> ExpertsParams(
      const DeviceMoeWeights& moe, int64_t rows) const;
  // The routed experts and the combine (shared_ready and grouping: see cuda::MoeExperts).
  absl::Status RoutedExperts(const DeviceMoeWeights& moe, int64_t rows, int32_t* active_count,
                             cudaEvent_t shared_ready, kernels::cuda::MoeGrouping grouping);
  // The router's product, the routing and, at verify sizes, the experts' grouping.
  absl::StatusOr<kernels::cuda::MoeGrouping> Route(const DeviceMoeWeights& moe, int64_t rows,
                                                   int32_t* active_count);
  // The side branch (side_stream.h): forked from and joined to stream_, or stream_ itself.
  absl::Status ForkSide();
  absl::Status JoinSide();
  cudaStream_t side_stream() const { return side_ != nullptr ? side_->stream() : stream_; }
  kernels::cuda::GemmRunner& side_gemm() const {
    return side_gemm_ != nullptr ? *side_gemm_ : *gemm_;
  }
  absl::Status AllReduce(float* data, int64_t count);
  absl::Status CopyToHost(const float* data, int64_t count, std::vector<float>& host);
  absl::StatusOr<const kernels::cuda::MlaVerifyPlan*> MlaPlanFor(
      const kernels::cuda::MlaVerifyShape& shape);

  DeviceWeights weights_;
  CudaKvStorage& kv_rows_;
  Communicator* communicator_;
  DeviceCollectives* collectives_;  // W > 1 on the device (NCCL), or nullptr
  absl::Status group_failure_;      // a failed step at W > 1: the group must re-form
  kernels::cuda::DeviceInfo device_;
  cudaStream_t stream_;
  std::unique_ptr<kernels::cuda::GemmRunner> gemm_;
  // Independent chains of a layer's small kernels run beside the main stream's (side_stream.h);
  // null (the chains on stream_) for ranks over NCCL.
  std::unique_ptr<SideStream> side_;
  std::unique_ptr<kernels::cuda::GemmRunner> side_gemm_;
  Activations activations_;
  StepInputs inputs_;
  StepLaunch last_launch_ = StepLaunch::kEager;
  int64_t step_rows_ = 0;  // the batch's rows in the step running (the layout's are padded)
  std::vector<uint8_t> staging_;
  std::vector<int32_t> padded_pages_;
  DeviceArray<kernels::NodeSummary> summaries_;          // [capacity]
  kernels::cuda::LmHeadSummaryScratch summary_scratch_;  // [capacity] rows' slices (freed here)
  DeviceArray<kernels::Candidate> candidates_;  // every sequence's [rows, candidates], packed
  bool use_graphs_ = true;
  int64_t buffers_epoch_ = 0;  // bumped whenever a buffer a graph reads is reallocated
  std::map<StepLayout, Graph> graphs_;
  int64_t graph_clock_ = 0;
  // (sequences, fewest live, most rows of one sequence, row capacity) -> plan.
  std::map<std::tuple<int32_t, int32_t, int32_t, int32_t>, kernels::cuda::MlaVerifyPlan> mla_plans_;
  DeviceArray<uint8_t> mla_workspace_;
  std::vector<PrefillChain> prefill_chains_;  // this step's, when it takes the prefill path
  DeviceArray<Bf16> prefill_latent_;          // [keys, kv_row_dim] a chain's gathered context
  DeviceArray<Bf16> prefill_kv_up_;           // [keys, heads, nope + v] its up-projection
  float rope_attention_factor_ = 1.0f;
  float softmax_scale_ = 1.0f;

  bool account_steps_ = false;
  double copy_bytes_per_second_ = 0.0;
  // %globaltimer at the step's start (stamps_[0]) and at each mark, written on the stream (kernel
  // nodes in graphs); marks_[i] closes the interval stamps_[i] .. stamps_[i + 1].
  DeviceArray<uint64_t> stamps_;
  std::vector<StepPhase> marks_;
  uint64_t* norm_stamp_ = nullptr;       // a mark's slot that the next RmsNorm writes
  DeviceArray<int32_t> active_experts_;  // [layers] written by the MoE grouping
  std::optional<StepAccount> last_account_;
  // The MLA plan the step's tree attention ran with (its NSPLIT and waves go to the account).
  const kernels::cuda::MlaVerifyPlan* last_mla_plan_ = nullptr;
};

}  // namespace treeverify::worker
