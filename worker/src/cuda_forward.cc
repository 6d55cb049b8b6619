#include "treeverify/worker/cuda_forward.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/cuda/activation.h"
#include "treeverify/kernels/cuda/copy_bandwidth.h"
#include "treeverify/kernels/cuda/cuda_status.h"
#include "treeverify/kernels/cuda/embedding.h"
#include "treeverify/kernels/cuda/global_timer.h"
#include "treeverify/kernels/cuda/kv_cache_ops.h"
#include "treeverify/kernels/cuda/lm_head_summary.h"
#include "treeverify/kernels/cuda/mha_prefill_attention.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/kernels/cuda/moe_tiles.h"
#include "treeverify/kernels/cuda/rms_norm.h"
#include "treeverify/kernels/cuda/rope.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {

namespace cuda = kernels::cuda;

absl::Status CudaForwardOptions::Validate() const {
  if (device_ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaForwardOptions.device_ordinal must be >= 0, got ", device_ordinal));
  }
  return absl::OkStatus();
}

namespace {

// y = x . w^T, `p` giving everything but the weight: w's bf16, or its FP8 bytes and scales (a
// batch's products one after another, as DeviceProjection lays them out).
template <typename Output>
absl::Status ProjectImpl(cuda::GemmRunner& gemm, const DeviceProjection& w,
                         kernels::GemmParamsOf<Bf16, Bf16, Output> p, cudaStream_t stream) {
  if (!w.is_fp8()) {
    p.weight = w.bf16.get();
    return gemm.Run(p, stream);
  }
  return gemm.Run(cuda::BlockFp8GemmParamsOf<Output>{.product = kernels::WithWeight(p, w.fp8.get()),
                                                     .scales = w.fp8_scales.get()},
                  stream);
}
absl::Status Project(cuda::GemmRunner& gemm, const DeviceProjection& w,
                     const kernels::GemmParamsOf<Bf16, Bf16, Bf16>& p, cudaStream_t stream) {
  return ProjectImpl(gemm, w, p, stream);
}
absl::Status Project(cuda::GemmRunner& gemm, const DeviceProjection& w,
                     const kernels::GemmParamsOf<Bf16, Bf16, float>& p, cudaStream_t stream) {
  return ProjectImpl(gemm, w, p, stream);
}

// The elements of the largest FP8 projection of every layer (`side`: of those the side branch
// runs, kv_a and the shared expert), 0 where none is FP8.
int64_t LargestFp8Projection(const DeviceWeights& weights, bool side) {
  int64_t largest = 0;
  auto consider = [&](const DeviceProjection& w) {
    if (w.is_fp8()) largest = std::max(largest, w.elements());
  };
  for (const DeviceLayerWeights& layer : weights.layers) {
    const DeviceAttentionWeights& a = layer.attention;
    consider(a.kv_a_proj);
    const DeviceMlpWeights& shared = layer.moe.shared;
    for (const DeviceProjection* w : {&shared.gate_up, &shared.down}) consider(*w);
    if (side) continue;
    for (const DeviceProjection* w : {&a.q_a_proj, &a.q_proj, &a.w_uk_t, &a.w_uv, &a.kv_b_proj,
                                      &a.o_proj, &layer.dense.gate_up, &layer.dense.down}) {
      consider(*w);
    }
  }
  return largest;
}

// A stream that is destroyed unless handed on.
class OwnedStream {
 public:
  ~OwnedStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  absl::Status Create() {
    return cuda::CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                            "cudaStreamCreateWithFlags");
  }
  cudaStream_t get() const { return stream_; }
  cudaStream_t release() { return std::exchange(stream_, nullptr); }

 private:
  cudaStream_t stream_ = nullptr;
};

// Grows `array` to at least `count` elements (contents are not kept).
template <typename T>
absl::Status Grow(DeviceArray<T>& array, int64_t count) {
  if (array.size() >= count) return absl::OkStatus();
  array = DeviceArray<T>();
  TV_ASSIGN_OR_RETURN(array, DeviceArray<T>::Allocate(count));
  return absl::OkStatus();
}

// Appends `values`, then `padding` copies of `pad`, to `staging` at a 256-byte aligned offset
// and returns that offset.
template <typename T>
size_t Stage(const std::vector<T>& values, std::vector<uint8_t>& staging, int64_t padding = 0,
             T pad = T{}) {
  const size_t offset = (staging.size() + 255) / 256 * 256;
  const size_t bytes = values.size() * sizeof(T);
  staging.resize(offset + bytes + padding * sizeof(T));
  if (!values.empty()) std::memcpy(staging.data() + offset, values.data(), bytes);
  for (int64_t i = 0; i < padding; ++i) {
    std::memcpy(staging.data() + offset + bytes + i * sizeof(T), &pad, sizeof(T));
  }
  return offset;
}

}  // namespace

absl::StatusOr<ForwardParts> MakeCudaForward(const ModelWeights& weights,
                                             const KvCacheOptions& cache,
                                             Communicator* communicator,
                                             const CudaForwardOptions& options) {
  TV_RETURN_IF_ERROR(options.Validate());
  TV_ASSIGN_OR_RETURN(cuda::DeviceInfo device, cuda::QueryDevice(options.device_ordinal));
  TV_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device_ordinal));
  OwnedStream stream;
  TV_RETURN_IF_ERROR(stream.Create());
  TV_ASSIGN_OR_RETURN(DeviceWeights device_weights, UploadWeights(weights));
  TV_ASSIGN_OR_RETURN(std::unique_ptr<CudaKvStorage> rows,
                      CudaKvStorage::Create(cache, stream.get()));
  TV_ASSIGN_OR_RETURN(std::unique_ptr<CudaForward> backend,
                      CudaForward::Create(std::move(device_weights), *rows, communicator, device,
                                          stream.get(), options));
  stream.release();  // the backend owns it now
  return ForwardParts{.kv_rows = std::move(rows), .backend = std::move(backend)};
}

absl::StatusOr<std::unique_ptr<CudaForward>> CudaForward::Create(
    DeviceWeights weights, CudaKvStorage& kv_rows, Communicator* communicator,
    const cuda::DeviceInfo& device, cudaStream_t stream, const CudaForwardOptions& options) {
  const ModelConfig& c = weights.config;
  TV_RETURN_IF_ERROR(CheckForwardInputs("CudaForward", c, kv_rows.options(), communicator));
  if (static_cast<int64_t>(weights.layers.size()) != c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("CudaForward: ", weights.layers.size(),
                                                   " layers of weights for a model of ",
                                                   c.num_hidden_layers));
  }
  constexpr int64_t kGemmWorkspaceBytes = 32 << 20;
  TV_ASSIGN_OR_RETURN(std::unique_ptr<cuda::GemmRunner> gemm,
                      cuda::GemmRunner::Create(kGemmWorkspaceBytes, options.resident_products));
  // The side branch's GEMMs run beside the main stream's: their own handle and workspace. Not
  // over NCCL yet: repeated two-GPU tests hung once in a few runs with it (bench/NOTES.md, step
  // 95), not yet told apart from a hang of the one-stream code; until then ranks over NCCL run
  // every chain on the one stream.
  std::unique_ptr<cuda::GemmRunner> side_gemm;
  std::unique_ptr<SideStream> side;
  if (communicator->world_size() == 1 || communicator->device_collectives() == nullptr) {
    TV_ASSIGN_OR_RETURN(side_gemm,
                        cuda::GemmRunner::Create(kGemmWorkspaceBytes, options.resident_products));
    TV_ASSIGN_OR_RETURN(side, SideStream::Create());
  }
  // Scratch for the FP8 products the resident kernel does not take (more than 16 rows).
  TV_RETURN_IF_ERROR(gemm->ReserveDequantized(LargestFp8Projection(weights, /*side=*/false)));
  if (side_gemm != nullptr) {
    TV_RETURN_IF_ERROR(side_gemm->ReserveDequantized(LargestFp8Projection(weights, true)));
  }
  // Everything that can fail comes before the backend exists: it owns the stream from then on,
  // and a failed Create leaves the stream to the caller.
  double copy_bytes_per_second = 0.0;
  DeviceArray<int32_t> active_experts;
  DeviceArray<uint64_t> stamps;
  if (options.account_steps) {
    TV_ASSIGN_OR_RETURN(copy_bytes_per_second, cuda::DeviceCopyBandwidth(stream));
    TV_ASSIGN_OR_RETURN(active_experts, DeviceArray<int32_t>::Allocate(c.num_hidden_layers));
    // The step's start, then at most five marks a layer (attention, moe and their all-reduces,
    // the embedding's) and the LM head's.
    TV_ASSIGN_OR_RETURN(stamps, DeviceArray<uint64_t>::Allocate(5 * c.num_hidden_layers + 8));
    TV_RETURN_IF_ERROR(kv_rows.EnableAccounting());
  }
  std::unique_ptr<CudaForward> forward(new CudaForward(std::move(weights), kv_rows, communicator,
                                                       device, stream, std::move(gemm),
                                                       std::move(side), std::move(side_gemm)));
  forward->use_graphs_ = options.graphs;
  forward->account_steps_ = options.account_steps;
  forward->copy_bytes_per_second_ = copy_bytes_per_second;
  forward->active_experts_ = std::move(active_experts);
  forward->stamps_ = std::move(stamps);
  return forward;
}

CudaForward::CudaForward(DeviceWeights weights, CudaKvStorage& kv_rows, Communicator* communicator,
                         const cuda::DeviceInfo& device, cudaStream_t stream,
                         std::unique_ptr<cuda::GemmRunner> gemm, std::unique_ptr<SideStream> side,
                         std::unique_ptr<cuda::GemmRunner> side_gemm)
    : weights_(std::move(weights)),
      kv_rows_(kv_rows),
      communicator_(communicator),
      collectives_(communicator->world_size() > 1 ? communicator->device_collectives() : nullptr),
      device_(device),
      stream_(stream),
      gemm_(std::move(gemm)),
      side_(std::move(side)),
      side_gemm_(std::move(side_gemm)) {
  rope_attention_factor_ = static_cast<float>(weights_.config.rope_attention_factor());
  softmax_scale_ = static_cast<float>(weights_.config.softmax_scale());
}

absl::Status CudaForward::ForkSide() {
  return side_ != nullptr ? side_->Fork(stream_) : absl::OkStatus();
}

absl::Status CudaForward::JoinSide() {
  return side_ != nullptr ? side_->Join(stream_) : absl::OkStatus();
}

CudaForward::~CudaForward() {
  // Bounded where collectives may be in flight (a failed step has already waited for them).
  if (!Synchronize().ok()) cudaStreamSynchronize(stream_);
  if (side_ != nullptr) side_->Synchronize().IgnoreError();  // before the buffers go
  DropGraphs();
  cuda::FreeLmHeadSummaryScratch(summary_scratch_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaForward::StartAccount() {
  marks_.clear();
  norm_stamp_ = nullptr;
  if (!account_steps_) return absl::OkStatus();
  return cuda::RecordGlobalTimer(stamps_.get(), stream_);
}

absl::Status CudaForward::Mark(StepPhase phase) {
  TV_RETURN_IF_ERROR(MarkAtNextNorm(phase));
  return FlushNormStamp();
}

absl::Status CudaForward::MarkBeforeNorm(StepPhase phase) {
  return communicator_->world_size() == 1 ? MarkAtNextNorm(phase) : Mark(phase);
}

absl::Status CudaForward::MarkAtNextNorm(StepPhase phase) {
  if (!account_steps_) return absl::OkStatus();
  TV_RETURN_IF_ERROR(FlushNormStamp());  // an earlier mark's slot not yet stamped
  const size_t next = marks_.size() + 1;
  if (static_cast<int64_t>(next) >= stamps_.size()) {
    return absl::InternalError(
        absl::StrCat("CudaForward: more than ", stamps_.size() - 1, " phase marks in one step"));
  }
  marks_.push_back(phase);
  norm_stamp_ = stamps_.get() + next;
  return absl::OkStatus();
}

uint64_t* CudaForward::TakeNormStamp() { return std::exchange(norm_stamp_, nullptr); }

absl::Status CudaForward::FlushNormStamp() {
  uint64_t* slot = TakeNormStamp();
  return slot != nullptr ? cuda::RecordGlobalTimer(slot, stream_) : absl::OkStatus();
}

absl::Status CudaForward::Account(const BatchInputs& batch, const StepLayout& layout) {
  if (!account_steps_) return absl::OkStatus();
  StepAccount account;
  account.copy_bytes_per_second = copy_bytes_per_second_;
  account.rows = batch.rows();
  account.padded_rows = layout.rows;
  account.sequences = batch.sequences();
  account.padded_sequences = layout.sequences;
  if (last_mla_plan_ != nullptr) {
    // With padding sequences the launch took the NSPLIT of the step's live count.
    const cuda::MlaVerifyPlan& plan = *last_mla_plan_;
    const int32_t live = batch.sequences() - plan.shape.min_live_seqs;
    account.attention_nsplit = !plan.live_nsplit.empty() && live >= 0 &&
                                       live < static_cast<int32_t>(plan.live_nsplit.size())
                                   ? plan.live_nsplit[live]
                                   : plan.nsplit;
    // The waves of the blocks the live sequences run (the grid is sized for the most splits).
    account.attention_waves = plan.waves *
                              (static_cast<double>(batch.sequences()) * account.attention_nsplit) /
                              (static_cast<double>(plan.shape.num_seqs) * plan.nsplit);
  }
  account.launch = last_launch_;
  account.prefill = !prefill_chains_.empty();
  std::vector<uint64_t> stamps(marks_.size() + 1);
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(stamps.data(), stamps_.get(),
                                          stamps.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                                          stream_));
  TV_RETURN_IF_ERROR(Synchronize());
  for (size_t i = 0; i < marks_.size(); ++i) {
    account.phase(marks_[i]).seconds += static_cast<double>(stamps[i + 1] - stamps[i]) * 1e-9;
  }
  TV_ASSIGN_OR_RETURN(const CudaKvStorage::Commits commits, kv_rows_.TakeCommits());
  account.phase(StepPhase::kKvCommit).seconds = commits.seconds;
  for (const PhaseAccount& phase : account.phases) account.total_seconds += phase.seconds;

  const ModelConfig& c = weights_.config;
  StepShape shape{.rows = batch.rows(), .committed_moves = commits.moves};
  if (!weights_.layers.empty() && weights_.layers.front().attention.o_proj.is_fp8()) {
    shape.projection_weight_bytes = 1.0 + 4.0 / (128.0 * 128.0);  // block_fp8.h
  }
  for (const DeviceLayerWeights& layer : weights_.layers) {
    if (!layer.is_moe) continue;
    if (layer.moe.layout == DeviceMoeWeights::Layout::kInt4) {
      shape.expert_weight_bytes = 0.5 + 2.0 / 32.0;  // moe_int4_tiles.h
    } else if (layer.moe.layout == DeviceMoeWeights::Layout::kFp8) {
      shape.expert_weight_bytes = 1.0 + 4.0 / (128.0 * 128.0);  // moe_fp8_tiles.h
    }
  }
  // The context each attention pass reads: every absorbed sequence's, and each long chain's once.
  for (int32_t s = 0; s < AbsorbedSequences(batch.sequences()); ++s) {
    shape.keys.push_back(int64_t{batch.committed_lengths[s]} + batch.row_offsets[s + 1] -
                         batch.row_offsets[s]);
  }
  for (const PrefillChain& chain : prefill_chains_) shape.keys.push_back(chain.keys);
  shape.active_experts.assign(c.num_hidden_layers, 0);
  if (c.n_routed_experts > 0) {
    TV_CUDA_RETURN_IF_ERROR(cudaMemcpy(shape.active_experts.data(), active_experts_.get(),
                                       active_experts_.bytes(), cudaMemcpyDeviceToHost));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      if (!c.is_moe_layer(l)) shape.active_experts[l] = 0;
    }
  }
  account.active_experts = shape.active_experts;
  ModelStepBytes(c, weights_.plan, shape, account);
  last_account_ = std::move(account);
  return absl::OkStatus();
}

absl::Status CudaForward::Reserve(int64_t rows) {
  if (rows <= activations_.capacity) return absl::OkStatus();
  // Whatever is in flight may still read the old buffers.
  TV_RETURN_IF_ERROR(Synchronize());
  int64_t capacity = 16;
  while (capacity < rows) capacity *= 2;
  const ModelConfig& c = weights_.config;
  const int64_t heads = weights_.plan.heads.size();
  const int64_t q_lora = c.q_lora_rank.value_or(0);
  int64_t intermediate = 0;
  for (const DeviceLayerWeights& layer : weights_.layers) {
    intermediate =
        std::max({intermediate, layer.dense.intermediate, layer.moe.shared.intermediate});
  }
  const int64_t experts = c.n_routed_experts;
  const int64_t top_k = c.num_experts_per_tok;
  const ShardingPlan& plan = weights_.plan;
  Activations& a = activations_;
  TV_RETURN_IF_ERROR(Grow(a.residual, capacity * c.hidden_size));
  TV_RETURN_IF_ERROR(Grow(a.normed, capacity * c.hidden_size));
  TV_RETURN_IF_ERROR(Grow(a.branch, capacity * c.hidden_size));
  TV_RETURN_IF_ERROR(Grow(a.q_a, capacity * q_lora));
  TV_RETURN_IF_ERROR(Grow(a.q_a_normed, capacity * q_lora));
  TV_RETURN_IF_ERROR(Grow(a.q, capacity * heads * c.qk_head_dim()));
  TV_RETURN_IF_ERROR(Grow(a.q_attn, capacity * heads * c.kv_row_dim()));
  TV_RETURN_IF_ERROR(Grow(a.kv_a, capacity * c.kv_row_dim()));
  TV_RETURN_IF_ERROR(Grow(a.kv_row, capacity * c.kv_row_dim()));
  TV_RETURN_IF_ERROR(Grow(a.latent_out, capacity * heads * c.kv_lora_rank));
  // The attention writes only the batch's rows: the padding rows read zeros here, so that every
  // value they carry through the row-wise ops stays finite.
  TV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a.latent_out.get(), 0, a.latent_out.bytes(), stream_));
  TV_RETURN_IF_ERROR(Grow(a.lse, capacity * heads));
  TV_RETURN_IF_ERROR(Grow(a.values, capacity * heads * c.v_head_dim));
  TV_RETURN_IF_ERROR(Grow(a.gate_up, capacity * 2 * intermediate));
  TV_RETURN_IF_ERROR(Grow(a.activated, capacity * intermediate));
  TV_RETURN_IF_ERROR(Grow(a.logits, capacity * plan.vocab.size()));
  if (experts > 0) {
    TV_RETURN_IF_ERROR(Grow(a.router_logits, capacity * experts));
    TV_RETURN_IF_ERROR(Grow(a.topk_ids, capacity * top_k));
    TV_RETURN_IF_ERROR(Grow(a.topk_weights, capacity * top_k));
    TV_RETURN_IF_ERROR(Grow(a.shared_out, capacity * c.hidden_size));
    TV_RETURN_IF_ERROR(Grow(a.moe_workspace, cuda::MoeExpertsWorkspaceBytes(
                                                 capacity, static_cast<int32_t>(top_k),
                                                 static_cast<int32_t>(plan.experts.size()),
                                                 plan.expert_intermediate.size(), c.hidden_size)));
    // Zero once: the routing counts its blocks there (cuda::MoeRoutingAndGrouping).
    TV_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.moe_workspace.get(), 0, a.moe_workspace.bytes(), stream_));
  }
  a.capacity = capacity;
  ++buffers_epoch_;  // graphs hold the old pointers
  return absl::OkStatus();
}

absl::Status CudaForward::Upload(const BatchInputs& batch, const StepLayout& layout) {
  // The batch's rows, then the padding rows up to the layout's: token 0 (any shard may hold it),
  // position 0 and no cache slot (-1: nothing written). They belong to no sequence, so the
  // attention never reads them, and the routing gives them no expert (routed_rows).
  const int64_t rows = batch.rows();
  const int64_t padding = layout.rows - rows;
  staging_.clear();
  const size_t token_ids = Stage(batch.token_ids, staging_, padding);
  const size_t positions = Stage(batch.positions, staging_, padding);
  const size_t sample_positions = Stage(batch.sample_positions, staging_, padding);
  const size_t slots = Stage(batch.slots, staging_, padding, int64_t{-1});
  // The padding sequences after the batch's: no rows (their offsets all the batch's row count,
  // before the padding rows) and no committed keys.
  const int64_t padding_sequences = layout.sequences - batch.sequences();
  const size_t row_offsets =
      Stage(batch.row_offsets, staging_, padding_sequences, static_cast<int32_t>(rows));
  const size_t committed = Stage(batch.committed_lengths, staging_, padding_sequences);
  const size_t mask = Stage(batch.ancestor_mask, staging_);
  const size_t routed_rows = Stage(std::vector<int32_t>{static_cast<int32_t>(rows)}, staging_);
  const size_t live_sequences = Stage(std::vector<int32_t>{batch.sequences()}, staging_);
  // Each sequence's pages, then page 0 up to the layout's padded width; the padding sequences'
  // rows all page 0 (they have no keys: nothing reads them).
  padded_pages_.assign(int64_t{layout.sequences} * layout.max_pages, 0);
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    std::copy_n(batch.page_table.begin() + int64_t{s} * batch.max_pages, batch.max_pages,
                padded_pages_.begin() + int64_t{s} * layout.max_pages);
  }
  const size_t page_table = Stage(padded_pages_, staging_);
  if (inputs_.buffer.size() < static_cast<int64_t>(staging_.size())) {
    TV_RETURN_IF_ERROR(Synchronize());
    TV_RETURN_IF_ERROR(Grow(inputs_.buffer, static_cast<int64_t>(staging_.size()) * 2));
    ++buffers_epoch_;  // graphs hold the old pointers
  }
  // From pageable memory: returns once staged, and runs after the previous step's kernels.
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(inputs_.buffer.get(), staging_.data(), staging_.size(),
                                          cudaMemcpyHostToDevice, stream_));
  uint8_t* base = inputs_.buffer.get();
  inputs_.token_ids = reinterpret_cast<const int32_t*>(base + token_ids);
  inputs_.positions = reinterpret_cast<const int32_t*>(base + positions);
  inputs_.sample_positions = reinterpret_cast<const int64_t*>(base + sample_positions);
  inputs_.slots = reinterpret_cast<const int64_t*>(base + slots);
  inputs_.row_offsets = reinterpret_cast<const int32_t*>(base + row_offsets);
  inputs_.committed_lengths = reinterpret_cast<const int32_t*>(base + committed);
  inputs_.ancestor_mask = reinterpret_cast<const uint64_t*>(base + mask);
  inputs_.routed_rows = reinterpret_cast<const int32_t*>(base + routed_rows);
  inputs_.live_sequences = reinterpret_cast<const int32_t*>(base + live_sequences);
  inputs_.page_table = reinterpret_cast<const int32_t*>(base + page_table);
  return absl::OkStatus();
}

absl::Status CudaForward::CopyToHost(const float* data, int64_t count, std::vector<float>& host) {
  TV_RETURN_IF_ERROR(FlushNormStamp());  // a mark waiting for a norm is stamped before the copy
  host.resize(count);
  TV_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host.data(), data, count * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  return Synchronize();
}

// Collectives in flight make a plain stream synchronization a possible hang: the group's wait
// is bounded by its timeout instead.
absl::Status CudaForward::Synchronize() {
  if (collectives_ != nullptr) return collectives_->WaitForStream(stream_);
  TV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  // Joined side work is done once the main stream is; this covers a join that failed, before
  // buffers the side stream reads are reused or freed.
  return side_ != nullptr ? side_->Synchronize() : absl::OkStatus();
}

// On the device through NCCL; otherwise (a host communicator: Gloo, in-process) through the
// host, one copy each way. Marks the all-reduce phase's end, except at W = 1, where there is no
// all-reduce (and a mark is a kernel node more in the graph).
absl::Status CudaForward::AllReduce(float* data, int64_t count) {
  if (communicator_->world_size() == 1) return absl::OkStatus();
  if (collectives_ != nullptr) {
    TV_RETURN_IF_ERROR(FlushNormStamp());  // the phase before ends before the all-reduce
    TV_RETURN_IF_ERROR(collectives_->EnqueueAllReduceSum(data, count, stream_));
    return MarkAtNextNorm(StepPhase::kAllReduce);  // every all-reduce is followed by a norm
  }
  std::vector<float> host;
  TV_RETURN_IF_ERROR(CopyToHost(data, count, host));
  TV_RETURN_IF_ERROR(communicator_->AllReduceSum(absl::MakeSpan(host)));
  TV_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(data, host.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream_));
  return MarkAtNextNorm(StepPhase::kAllReduce);
}

absl::StatusOr<const cuda::MlaVerifyPlan*> CudaForward::MlaPlanFor(
    const cuda::MlaVerifyShape& shape) {
  const auto key = std::make_tuple(shape.num_seqs, shape.min_live_seqs, shape.max_rows_per_seq,
                                   shape.row_capacity);
  auto found = mla_plans_.find(key);
  if (found == mla_plans_.end()) {
    TV_ASSIGN_OR_RETURN(cuda::MlaVerifyPlan plan, cuda::PlanMlaVerify(shape, device_, {}));
    found = mla_plans_.emplace(key, std::move(plan)).first;
  }
  const cuda::MlaVerifyPlan& plan = found->second;
  if (plan.workspace_bytes > mla_workspace_.size()) {
    TV_RETURN_IF_ERROR(Synchronize());
    TV_RETURN_IF_ERROR(Grow(mla_workspace_, plan.workspace_bytes));
    ++buffers_epoch_;  // graphs hold the old pointers
    TV_RETURN_IF_ERROR(
        cuda::PrepareMlaVerifyWorkspace(mla_workspace_.get(), mla_workspace_.size(), stream_));
  }
  return &plan;
}

int64_t CudaForward::RowBucket(int64_t rows) {
  if (rows <= 8) return 8;
  if (rows > 512) return (rows + 255) / 256 * 256;
  int64_t bucket = 8;
  while (true) {
    if (rows <= bucket) return bucket;
    if (rows <= bucket * 3 / 2) return bucket * 3 / 2;
    bucket *= 2;
  }
}

int32_t CudaForward::SequenceBucket(int32_t sequences) {
  if (sequences <= 64) return static_cast<int32_t>(std::bit_ceil(static_cast<uint32_t>(sequences)));
  return (sequences + 63) / 64 * 64;
}

int32_t CudaForward::MinLiveSequences(int32_t bucket) {
  return bucket <= 64 ? bucket / 2 + 1 : bucket - 63;
}

CudaForward::StepLayout CudaForward::LayoutOf(const BatchInputs& batch) {
  StepLayout layout{.rows = RowBucket(batch.rows()),
                    .sequences = SequenceBucket(batch.sequences())};
  layout.min_live_sequences = MinLiveSequences(layout.sequences);
  int32_t longest = 0;
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    longest = std::max(longest, batch.row_offsets[s + 1] - batch.row_offsets[s]);
  }
  layout.max_rows_per_seq = 1;
  while (layout.max_rows_per_seq < longest) layout.max_rows_per_seq *= 2;
  // Page tables are padded to a power of two of pages, so that a growing context keeps the
  // shape (and the CUDA graph) for as long as its pages fit: the kernels read only the pages
  // their lengths reach.
  layout.max_pages = 1;
  while (layout.max_pages < batch.max_pages) layout.max_pages *= 2;
  return layout;
}

absl::Status CudaForward::Run(const BatchInputs& batch, ForwardOutputs& outputs) {
  if (!group_failure_.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "an earlier step failed on this rank, so the tensor-parallel group is out of step and "
        "must re-form: ",
        group_failure_.message()));
  }
  const absl::Status status = Step(batch, outputs);
  if (!status.ok() && collectives_ != nullptr) {
    // The ranks no longer run the same collectives: the group is done. The bounded wait ends
    // (by aborting the communicator, if need be) the kernels still waiting for peers, and the
    // graphs that captured the communicator go with it.
    collectives_->WaitForStream(stream_).IgnoreError();
    DropGraphs();
    group_failure_ = status;
  }
  return status;
}

void CudaForward::DropGraphs() {
  for (auto& [layout, graph] : graphs_) {
    if (graph.exec != nullptr) cudaGraphExecDestroy(graph.exec);
  }
  graphs_.clear();
}

absl::Status CudaForward::Step(const BatchInputs& batch, ForwardOutputs& outputs) {
  const ModelConfig& c = weights_.config;
  outputs = ForwardOutputs();
  outputs.layer_hidden.resize(c.num_hidden_layers + 1);
  const int64_t rows = batch.rows();
  if (rows == 0) return absl::OkStatus();
  if (batch.capture_layer.size() != static_cast<size_t>(c.num_hidden_layers) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("BatchInputs.capture_layer has ", batch.capture_layer.size(),
                     " entries; the model has ", c.num_hidden_layers + 1, " layers to capture"));
  }
  const size_t sequences = static_cast<size_t>(batch.sequences());
  if (batch.chain.size() != sequences || batch.continues_chain.size() != sequences) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BatchInputs.chain and .continues_chain need an entry per sequence (", sequences,
        "), have ", batch.chain.size(), " and ", batch.continues_chain.size()));
  }
  TV_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_.ordinal));
  const StepLayout layout = LayoutOf(batch);
  step_rows_ = rows;
  TV_RETURN_IF_ERROR(Reserve(layout.rows));
  TV_RETURN_IF_ERROR(ReservePrefill(batch));
  TV_RETURN_IF_ERROR(StartAccount());
  TV_RETURN_IF_ERROR(Upload(batch, layout));
  last_launch_ = StepLaunch::kEager;  // unless RunGraph captures or replays
  last_mla_plan_ = nullptr;           // set by the attention (or the replayed graph)
  const bool captures = std::find(batch.capture_layer.begin(), batch.capture_layer.end(), true) !=
                        batch.capture_layer.end();
  // A graph replays device work only: hidden states copied out mid-step and all-reduces through
  // a host communicator run eagerly; so does prefill (its shapes vary with every prompt).
  if (use_graphs_ && !captures && prefill_chains_.empty() &&
      (communicator_->world_size() == 1 || collectives_ != nullptr)) {
    TV_RETURN_IF_ERROR(RunGraph(layout));
  } else {
    TV_RETURN_IF_ERROR(Layers(layout, &batch.capture_layer, outputs.layer_hidden));
  }

  TV_RETURN_IF_ERROR(Summarize(batch, outputs));
  return Account(batch, layout);
}

// Each sequence's rows with its own sampling parameters (one launch per sequence, after the
// graph: the parameters change every step); only the summaries, the candidates and, on request,
// the logits come back to the host.
absl::Status CudaForward::Summarize(const BatchInputs& batch, ForwardOutputs& outputs) {
  const int64_t rows = batch.rows();
  const int64_t vocab_shard = weights_.plan.vocab.size();

  int64_t candidate_slots = 0;
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    candidate_slots +=
        int64_t{batch.row_offsets[s + 1] - batch.row_offsets[s]} * batch.sampling[s].candidates;
  }
  if (summaries_.size() < rows || candidates_.size() < candidate_slots ||
      summary_scratch_.rows < rows) {
    TV_RETURN_IF_ERROR(Synchronize());
    TV_RETURN_IF_ERROR(Grow(summaries_, activations_.capacity));
    TV_RETURN_IF_ERROR(Grow(candidates_, std::max<int64_t>(candidate_slots, 1)));
    if (summary_scratch_.rows < rows) {
      cuda::FreeLmHeadSummaryScratch(summary_scratch_);
      TV_ASSIGN_OR_RETURN(summary_scratch_,
                          cuda::AllocateLmHeadSummaryScratch(activations_.capacity));
    }
  }
  int64_t candidate_offset = 0;
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const SegmentSampling& sampling = batch.sampling[s];
    const int64_t begin = batch.row_offsets[s];
    const int64_t count = batch.row_offsets[s + 1] - begin;
    TV_RETURN_IF_ERROR(cuda::LmHeadSummary(
        {.logits = activations_.logits.get() + begin * vocab_shard,
         .out = summaries_.get() + begin,
         .rows = count,
         .vocab_shard = vocab_shard,
         .vocab_begin = static_cast<int32_t>(weights_.plan.vocab.begin),
         .temperature = sampling.temperature,
         .seed = sampling.seed,
         .positions = inputs_.sample_positions + begin,
         .num_candidates = sampling.candidates,
         .candidates = sampling.candidates > 0 ? candidates_.get() + candidate_offset : nullptr},
        summary_scratch_, stream_));
    candidate_offset += count * sampling.candidates;
  }
  TV_RETURN_IF_ERROR(Mark(StepPhase::kLmHead));  // the summaries count to the LM head
  outputs.summaries.resize(rows);
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(outputs.summaries.data(), summaries_.get(),
                                          rows * sizeof(kernels::NodeSummary),
                                          cudaMemcpyDeviceToHost, stream_));
  std::vector<kernels::Candidate> all(candidate_offset);
  if (candidate_offset > 0) {
    TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(all.data(), candidates_.get(),
                                            candidate_offset * sizeof(kernels::Candidate),
                                            cudaMemcpyDeviceToHost, stream_));
  }
  if (batch.return_logits) {
    outputs.logits.resize(rows * vocab_shard);
    TV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(outputs.logits.data(), activations_.logits.get(),
                                            outputs.logits.size() * sizeof(float),
                                            cudaMemcpyDeviceToHost, stream_));
  }
  TV_RETURN_IF_ERROR(Synchronize());
  outputs.candidates.resize(batch.sequences());
  candidate_offset = 0;
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const int64_t size =
        int64_t{batch.row_offsets[s + 1] - batch.row_offsets[s]} * batch.sampling[s].candidates;
    outputs.candidates[s].assign(all.begin() + candidate_offset,
                                 all.begin() + candidate_offset + size);
    candidate_offset += size;
  }
  return absl::OkStatus();
}

absl::Status CudaForward::RunGraph(const StepLayout& layout) {
  if (graphs_.size() >= kMaxGraphs && !graphs_.contains(layout)) {
    auto oldest = graphs_.begin();
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
      if (it->second.last_used < oldest->second.last_used) oldest = it;
    }
    if (oldest->second.exec != nullptr) cudaGraphExecDestroy(oldest->second.exec);
    graphs_.erase(oldest);
  }
  Graph& graph = graphs_[layout];
  graph.last_used = ++graph_clock_;
  if (graph.exec != nullptr && graph.epoch == buffers_epoch_) {
    marks_ = graph.marks;
    last_mla_plan_ = graph.mla_plan;
    last_launch_ = StepLaunch::kReplay;
    return cuda::CudaStatus(cudaGraphLaunch(graph.exec, stream_), "cudaGraphLaunch");
  }
  if (graph.exec != nullptr) cudaGraphExecDestroy(std::exchange(graph.exec, nullptr));
  if (!graph.seen || graph.epoch != buffers_epoch_) {
    // First sight of the shape: eagerly, which also plans the GEMMs and the MLA op and sizes
    // every buffer, so that the capture next time needs no allocation and no synchronization.
    // The epoch is the one after the run: buffers it grew (the MLA workspace of a new plan) are
    // the ones the capture will use.
    graph.seen = true;
    std::vector<std::vector<float>> unused;
    const absl::Status ran = Layers(layout, nullptr, unused);
    graph.epoch = buffers_epoch_;
    return ran;
  }
  last_launch_ = StepLaunch::kCapture;
  TV_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  std::vector<std::vector<float>> unused;
  const absl::Status captured = Layers(layout, nullptr, unused);
  cudaGraph_t recorded = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_, &recorded);
  TV_RETURN_IF_ERROR(captured);
  TV_CUDA_RETURN_IF_ERROR(ended);
  const cudaError_t instantiated = cudaGraphInstantiate(&graph.exec, recorded, 0);
  cudaGraphDestroy(recorded);
  TV_CUDA_RETURN_IF_ERROR(instantiated);
  graph.marks = marks_;  // the phase marks the graph records
  graph.mla_plan = last_mla_plan_;
  return cuda::CudaStatus(cudaGraphLaunch(graph.exec, stream_), "cudaGraphLaunch");
}

absl::Status CudaForward::Layers(const StepLayout& layout, const std::vector<bool>* capture,
                                 std::vector<std::vector<float>>& hidden_states) {
  const ModelConfig& c = weights_.config;
  const int64_t rows = layout.rows;
  Activations& a = activations_;
  const int64_t hidden = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);

  TV_RETURN_IF_ERROR(
      cuda::Embedding({.token_ids = inputs_.token_ids,
                       .table = weights_.embedding.get(),
                       .out = a.residual.get(),
                       .tokens = rows,
                       .hidden = hidden,
                       .vocab_begin = static_cast<int32_t>(weights_.plan.vocab.begin),
                       .vocab_end = static_cast<int32_t>(weights_.plan.vocab.end)},
                      stream_));
  TV_RETURN_IF_ERROR(MarkBeforeNorm(StepPhase::kEmbed));
  TV_RETURN_IF_ERROR(AllReduce(a.residual.get(), rows * hidden));
  if (capture != nullptr && (*capture)[0]) {
    TV_RETURN_IF_ERROR(CopyToHost(a.residual.get(), step_rows_ * hidden, hidden_states[0]));
  }
  // The residual add of each branch is fused into the next norm: residual += branch, then
  // normed = norm(residual). The first layer's input norm has nothing to add.
  auto norm = [&](const Bf16* weight, bool add_branch) {
    return cuda::RmsNorm({.input = a.residual.get(),
                          .weight = weight,
                          .output = a.normed.get(),
                          .rows = rows,
                          .dim = hidden,
                          .eps = eps,
                          .add = add_branch ? a.branch.get() : nullptr,
                          .sum = add_branch ? a.residual.get() : nullptr},
                         stream_, TakeNormStamp());
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const DeviceLayerWeights& layer = weights_.layers[l];
    TV_RETURN_IF_ERROR(norm(layer.input_norm.get(), /*add_branch=*/l > 0));
    if (l > 0 && capture != nullptr && (*capture)[l]) {
      TV_RETURN_IF_ERROR(CopyToHost(a.residual.get(), step_rows_ * hidden, hidden_states[l]));
    }
    TV_RETURN_IF_ERROR(Attention(l, layout));
    TV_RETURN_IF_ERROR(MarkBeforeNorm(StepPhase::kAttention));
    TV_RETURN_IF_ERROR(AllReduce(a.branch.get(), rows * hidden));
    TV_RETURN_IF_ERROR(norm(layer.post_norm.get(), /*add_branch=*/true));
    TV_RETURN_IF_ERROR(Mlp(l, rows));
    TV_RETURN_IF_ERROR(MarkBeforeNorm(StepPhase::kMoe));
    TV_RETURN_IF_ERROR(AllReduce(a.branch.get(), rows * hidden));
  }
  TV_RETURN_IF_ERROR(norm(weights_.final_norm.get(), /*add_branch=*/c.num_hidden_layers > 0));
  if (capture != nullptr && (*capture)[c.num_hidden_layers]) {
    TV_RETURN_IF_ERROR(
        CopyToHost(a.residual.get(), step_rows_ * hidden, hidden_states[c.num_hidden_layers]));
  }

  const int64_t vocab_shard = weights_.plan.vocab.size();
  TV_RETURN_IF_ERROR(gemm_->Run({.x = a.normed.get(),
                                 .weight = weights_.lm_head.get(),
                                 .y = a.logits.get(),
                                 .m = rows,
                                 .n = vocab_shard,
                                 .k = hidden},
                                stream_));
  TV_RETURN_IF_ERROR(Mark(StepPhase::kLmHead));
  return absl::OkStatus();
}

absl::Status CudaForward::Attention(int64_t layer_index, const StepLayout& layout) {
  const ModelConfig& c = weights_.config;
  const DeviceAttentionWeights& w = weights_.layers[layer_index].attention;
  const int64_t heads = weights_.plan.heads.size();
  // Trees and short chains in the absorbed form (the sequences before the first long chain),
  // then the long chains in the MHA form (their rows' values overwrite the absorbed pass's). In
  // this order: the MHA form rotates q_pe in place, which the absorbed form reads unrotated.
  const int32_t absorbed = AbsorbedSequences(layout.sequences);
  // The KV path (kv_a, its norm, k_pe's rotation, the append) on the side stream beside the
  // query path (q_a, its norm, q_b; W_UK for the absorbed form, with q_pe's rotation forked onto
  // the side branch once q_b is done): neither reads the other's outputs, and both are chains of
  // small latency-bound kernels. Joined before the attention reads the cache.
  TV_RETURN_IF_ERROR(ForkSide());
  const absl::Status kv = AppendNewRows(layer_index, layout.rows, side_stream(), side_gemm());
  absl::Status queries = ProjectQueries(w, layout.rows);
  if (queries.ok() && absorbed > 0) queries = AbsorbedQueries(layer_index, layout.rows);
  const absl::Status joined = JoinSide();
  TV_RETURN_IF_ERROR(kv);
  TV_RETURN_IF_ERROR(queries);
  TV_RETURN_IF_ERROR(joined);
  if (absorbed > 0) {
    StepLayout absorbed_layout = layout;
    absorbed_layout.sequences = absorbed;
    // Before a prefill chain every sequence is live (the prefill path runs eagerly, exact).
    if (absorbed < layout.sequences) absorbed_layout.min_live_sequences = absorbed;
    TV_RETURN_IF_ERROR(AbsorbedAttention(layer_index, absorbed_layout));
  }
  if (!prefill_chains_.empty()) TV_RETURN_IF_ERROR(PrefillAttention(layer_index, layout));
  // o_proj: this rank's partial sum over its heads, all-reduced by the caller.
  return Project(*gemm_, w.o_proj,
                 {.x = activations_.values.get(),
                  .y = activations_.branch.get(),
                  .m = layout.rows,
                  .n = c.hidden_size,
                  .k = heads * c.v_head_dim},
                 stream_);
}

CudaForward::AttentionDims CudaForward::attention_dims() const {
  const ModelConfig& c = weights_.config;
  return {.heads = weights_.plan.heads.size(),
          .nope = c.qk_nope_head_dim,
          .rope = c.qk_rope_head_dim,
          .qk = c.qk_head_dim(),
          .lora = c.kv_lora_rank,
          .row_dim = c.kv_row_dim(),
          .v = c.v_head_dim};
}

// Queries [rows, heads, qk] from the (optionally low-rank) projection; q_pe not yet rotated.
absl::Status CudaForward::ProjectQueries(const DeviceAttentionWeights& w, int64_t rows) {
  const ModelConfig& c = weights_.config;
  Activations& a = activations_;
  const int64_t hidden = c.hidden_size;
  const int64_t heads = weights_.plan.heads.size();
  const int64_t qk = c.qk_head_dim();
  if (!c.q_lora_rank) {
    return Project(*gemm_, w.q_proj,
                   {.x = a.normed.get(), .y = a.q.get(), .m = rows, .n = heads * qk, .k = hidden},
                   stream_);
  }
  const int64_t q_lora = *c.q_lora_rank;
  TV_RETURN_IF_ERROR(Project(
      *gemm_, w.q_a_proj,
      {.x = a.normed.get(), .y = a.q_a.get(), .m = rows, .n = q_lora, .k = hidden}, stream_));
  TV_RETURN_IF_ERROR(cuda::RmsNorm({.input = a.q_a.get(),
                                    .weight = w.q_a_norm.get(),
                                    .output = a.q_a_normed.get(),
                                    .rows = rows,
                                    .dim = q_lora,
                                    .eps = kLatentNormEps},
                                   stream_));
  return Project(*gemm_, w.q_proj,
                 {.x = a.q_a_normed.get(), .y = a.q.get(), .m = rows, .n = heads * qk, .k = q_lora},
                 stream_);
}

// The new rows' latent KV: normalized latent and rotated shared key, into the cache.
absl::Status CudaForward::AppendNewRows(int64_t layer_index, int64_t rows, cudaStream_t stream,
                                        cuda::GemmRunner& gemm) {
  const ModelConfig& c = weights_.config;
  const DeviceAttentionWeights& w = weights_.layers[layer_index].attention;
  Activations& a = activations_;
  const int64_t lora = c.kv_lora_rank;
  const int64_t row_dim = c.kv_row_dim();
  TV_RETURN_IF_ERROR(
      Project(gemm, w.kv_a_proj,
              {.x = a.normed.get(), .y = a.kv_a.get(), .m = rows, .n = row_dim, .k = c.hidden_size},
              stream));
  TV_RETURN_IF_ERROR(cuda::RmsNorm({.input = a.kv_a.get(),
                                    .weight = w.kv_a_norm.get(),
                                    .output = a.kv_row.get(),
                                    .rows = rows,
                                    .dim = lora,
                                    .input_stride = row_dim,
                                    .output_stride = row_dim,
                                    .eps = kLatentNormEps},
                                   stream));
  TV_RETURN_IF_ERROR(
      cuda::Rope(kernels::RopeParamsOf<float, Bf16>{.x = a.kv_row.get() + lora,
                                                    .positions = inputs_.positions,
                                                    .inv_freq = weights_.rope_inv_freq.get(),
                                                    .rows = rows,
                                                    .heads = 1,
                                                    .rope_dim = c.qk_rope_head_dim,
                                                    .row_stride = row_dim,
                                                    .head_stride = row_dim,
                                                    .attention_factor = rope_attention_factor_,
                                                    .interleaved = c.rope_interleave,
                                                    .input = a.kv_a.get() + lora},
                 stream));
  return cuda::KvAppend({.rows = a.kv_row.get(),
                         .slots = inputs_.slots,
                         .cache = kv_rows_.layer_data(layer_index),
                         .count = rows,
                         .row_dim = row_dim,
                         .num_slots = kv_rows_.options().num_slots()},
                        stream);
}

// The absorbed query: q_nope through W_UK (one product per head) and the rotated q_pe.
absl::Status CudaForward::AbsorbedQueries(int64_t layer_index, int64_t rows) {
  const ModelConfig& c = weights_.config;
  const DeviceAttentionWeights& w = weights_.layers[layer_index].attention;
  Activations& a = activations_;
  const auto [heads, nope, rope, qk, lora, row_dim, v] = attention_dims();
  // q_pe's rotation on the side branch beside W_UK (bench/NOTES.md, step 106): both read q_b's
  // output and write disjoint columns of the absorbed rows; the caller's join orders both before
  // the attention.
  TV_RETURN_IF_ERROR(ForkSide());
  TV_RETURN_IF_ERROR(
      cuda::Rope(kernels::RopeParamsOf<Bf16, Bf16>{.x = a.q_attn.get() + lora,
                                                   .positions = inputs_.positions,
                                                   .inv_freq = weights_.rope_inv_freq.get(),
                                                   .rows = rows,
                                                   .heads = heads,
                                                   .rope_dim = rope,
                                                   .row_stride = heads * row_dim,
                                                   .head_stride = row_dim,
                                                   .attention_factor = rope_attention_factor_,
                                                   .interleaved = c.rope_interleave,
                                                   .input = a.q.get() + nope,
                                                   .input_row_stride = heads * qk,
                                                   .input_head_stride = qk},
                 side_stream()));
  return Project(*gemm_, w.w_uk_t,
                 {.x = a.q.get(),
                  .y = a.q_attn.get(),
                  .m = rows,
                  .n = lora,
                  .k = nope,
                  .x_stride = heads * qk,
                  .y_stride = heads * row_dim,
                  .batch = heads,
                  .x_batch_stride = qk,
                  .weight_batch_stride = lora * nope,
                  .y_batch_stride = row_dim},
                 stream_);
}

// The tree attention in the latent space: the MLA kernel attends over the cache with the
// absorbed queries; the latent output goes back through W_UV (one product per head) into
// a.values.
absl::Status CudaForward::AbsorbedAttention(int64_t layer_index, const StepLayout& layout) {
  Activations& a = activations_;
  const DeviceAttentionWeights& w = weights_.layers[layer_index].attention;
  const int64_t rows = layout.rows;
  const auto [heads, nope, rope, qk, lora, row_dim, v] = attention_dims();
  const KvCacheOptions& cache = kv_rows_.options();
  const cuda::MlaVerifyShape shape{.num_seqs = layout.sequences,
                                   .min_live_seqs = layout.min_live_sequences,
                                   .max_rows_per_seq = layout.max_rows_per_seq,
                                   .row_capacity = static_cast<int32_t>(a.capacity),
                                   .num_heads = static_cast<int32_t>(heads),
                                   .latent_dim = static_cast<int32_t>(lora),
                                   .rope_dim = static_cast<int32_t>(rope),
                                   .page_size = cache.page_size};
  TV_ASSIGN_OR_RETURN(const cuda::MlaVerifyPlan* plan, MlaPlanFor(shape));
  last_mla_plan_ = plan;
  TV_RETURN_IF_ERROR(cuda::MlaVerifyAttention(
      {.q = a.q_attn.get(),
       .kv_cache = kv_rows_.layer_data(layer_index),
       .page_table = inputs_.page_table,
       .committed_lengths = inputs_.committed_lengths,
       .row_offsets = inputs_.row_offsets,
       .ancestor_mask = inputs_.ancestor_mask,
       .out = a.latent_out.get(),
       .lse = a.lse.get(),
       .num_seqs = layout.sequences,
       .num_heads = static_cast<int32_t>(heads),
       .latent_dim = static_cast<int32_t>(lora),
       .rope_dim = static_cast<int32_t>(rope),
       .page_size = cache.page_size,
       .max_pages_per_seq = layout.max_pages,
       .num_pages = static_cast<int32_t>(cache.num_pages),
       .softmax_scale = softmax_scale_},
      shape, *plan, mla_workspace_.get(), mla_workspace_.size(), stream_, inputs_.live_sequences));
  return Project(*gemm_, w.w_uv,
                 {.x = a.latent_out.get(),
                  .y = a.values.get(),
                  .m = rows,
                  .n = v,
                  .k = lora,
                  .x_stride = heads * lora,
                  .y_stride = heads * v,
                  .batch = heads,
                  .x_batch_stride = lora,
                  .weight_batch_stride = v * lora,
                  .y_batch_stride = v},
                 stream_);
}

// The MHA form (cuda_forward.h): q_pe rotated in place; per chain its context's cache rows
// gathered, up-projected through kv_b_proj in blocks of keys, and attended causally by the flash
// kernel straight into a.values.
absl::Status CudaForward::PrefillAttention(int64_t layer_index, const StepLayout& layout) {
  const ModelConfig& c = weights_.config;
  const DeviceAttentionWeights& w = weights_.layers[layer_index].attention;
  Activations& a = activations_;
  const auto [heads, nope, rope, qk, lora, row_dim, v] = attention_dims();
  const int64_t up_width = heads * (nope + v);
  TV_RETURN_IF_ERROR(
      cuda::Rope(kernels::RopeParamsOf<Bf16, Bf16>{.x = a.q.get() + nope,
                                                   .positions = inputs_.positions,
                                                   .inv_freq = weights_.rope_inv_freq.get(),
                                                   .rows = layout.rows,
                                                   .heads = heads,
                                                   .rope_dim = rope,
                                                   .row_stride = heads * qk,
                                                   .head_stride = qk,
                                                   .attention_factor = rope_attention_factor_,
                                                   .interleaved = c.rope_interleave},
                 stream_));
  // The padding rows belong to no sequence: zeros, so that they stay finite through o_proj.
  const int64_t padding = layout.rows - step_rows_;
  TV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a.values.get() + step_rows_ * heads * v, 0,
                                          padding * heads * v * sizeof(Bf16), stream_));
  const KvCacheOptions& cache = kv_rows_.options();
  for (const PrefillChain& chain : prefill_chains_) {
    const int64_t keys = (chain.keys + kPrefillKeyAlign - 1) / kPrefillKeyAlign * kPrefillKeyAlign;
    TV_RETURN_IF_ERROR(cuda::KvGather(
        {.cache = kv_rows_.layer_data(layer_index),
         .page_table = inputs_.page_table + int64_t{chain.sequence} * layout.max_pages,
         .out = prefill_latent_.get(),
         .keys = chain.keys,
         .padded_keys = keys,
         .row_dim = row_dim,
         .page_size = cache.page_size,
         .num_pages = cache.num_pages},
        stream_));
    for (int64_t first = 0; first < keys; first += kPrefillKeyBlock) {
      TV_RETURN_IF_ERROR(Project(*gemm_, w.kv_b_proj,
                                 {.x = prefill_latent_.get() + first * row_dim,
                                  .y = prefill_kv_up_.get() + first * up_width,
                                  .m = std::min(kPrefillKeyBlock, keys - first),
                                  .n = up_width,
                                  .k = lora,
                                  .x_stride = row_dim},
                                 stream_));
    }
    TV_RETURN_IF_ERROR(
        cuda::MhaPrefillAttention({.q = a.q.get() + int64_t{chain.row_begin} * heads * qk,
                                   .kv_up = prefill_kv_up_.get(),
                                   .k_rope = prefill_latent_.get() + lora,
                                   .out = a.values.get() + int64_t{chain.row_begin} * heads * v,
                                   .rows = chain.rows,
                                   .keys = chain.keys,
                                   .heads = static_cast<int32_t>(heads),
                                   .nope_dim = static_cast<int32_t>(nope),
                                   .rope_dim = static_cast<int32_t>(rope),
                                   .v_dim = static_cast<int32_t>(v),
                                   .k_rope_stride = row_dim,
                                   .softmax_scale = softmax_scale_},
                                  stream_));
  }
  return absl::OkStatus();
}

int32_t CudaForward::AbsorbedSequences(int32_t sequences) const {
  return prefill_chains_.empty() ? sequences : prefill_chains_.front().sequence;
}

// The step's long chains and their workspaces (the longest context's). Should the workspaces not
// fit in device memory, the step runs every chain in the absorbed form instead.
absl::Status CudaForward::ReservePrefill(const BatchInputs& batch) {
  prefill_chains_ = PrefillChainsOf(batch);
  if (prefill_chains_.empty()) return absl::OkStatus();
  const ModelConfig& c = weights_.config;
  int64_t keys = 0;
  for (const PrefillChain& chain : prefill_chains_) keys = std::max<int64_t>(keys, chain.keys);
  keys = (keys + kPrefillKeyAlign - 1) / kPrefillKeyAlign * kPrefillKeyAlign;
  const int64_t up_width = weights_.plan.heads.size() * (c.qk_nope_head_dim + c.v_head_dim);
  if (prefill_latent_.size() >= keys * c.kv_row_dim() && prefill_kv_up_.size() >= keys * up_width) {
    return absl::OkStatus();
  }
  TV_RETURN_IF_ERROR(Synchronize());
  if (!Grow(prefill_latent_, keys * c.kv_row_dim()).ok() ||
      !Grow(prefill_kv_up_, keys * up_width).ok()) {
    prefill_latent_ = DeviceArray<Bf16>();
    prefill_kv_up_ = DeviceArray<Bf16>();
    prefill_chains_.clear();
  }
  return absl::OkStatus();
}

std::vector<CudaForward::PrefillChain> CudaForward::PrefillChainsOf(
    const BatchInputs& batch) const {
  const ModelConfig& c = weights_.config;
  // The kernels take the cache rows and their rope part in 16-byte units.
  if (!cuda::MhaPrefillSupported(static_cast<int32_t>(c.qk_nope_head_dim),
                                 static_cast<int32_t>(c.qk_rope_head_dim),
                                 static_cast<int32_t>(c.v_head_dim)) ||
      c.kv_lora_rank % 8 != 0 || c.kv_row_dim() % 8 != 0) {
    return {};
  }
  // A chain longer than a tree is exactly a sequence that later pieces continue; ModelRunner puts
  // such chains after every other sequence (if they are not, every sequence stays absorbed).
  std::vector<PrefillChain> chains;
  for (int32_t s = 0; s < batch.sequences(); ++s) {
    const int32_t rows = batch.row_offsets[s + 1] - batch.row_offsets[s];
    if (batch.continues_chain[s]) {
      if (chains.empty()) return {};  // a piece without its first: not a ModelRunner batch
      chains.back().rows += rows;
      chains.back().keys += rows;
    } else if (s + 1 < batch.sequences() && batch.continues_chain[s + 1]) {
      chains.push_back({.row_begin = batch.row_offsets[s],
                        .rows = rows,
                        .keys = batch.committed_lengths[s] + rows,
                        .sequence = s});
    } else if (!chains.empty()) {
      return {};  // a short sequence after a long chain
    }
  }
  return chains;
}

absl::Status CudaForward::Mlp(int64_t layer_index, int64_t rows) {
  const DeviceLayerWeights& layer = weights_.layers[layer_index];
  if (layer.is_moe) {
    return Moe(layer.moe, rows, account_steps_ ? active_experts_.get() + layer_index : nullptr);
  }
  return GatedMlp(layer.dense, rows, activations_.branch.get(), stream_, *gemm_);
}

absl::Status CudaForward::GatedMlp(const DeviceMlpWeights& mlp, int64_t rows, float* out,
                                   cudaStream_t stream, cuda::GemmRunner& gemm) {
  Activations& a = activations_;
  const int64_t hidden = weights_.config.hidden_size;
  TV_RETURN_IF_ERROR(Project(gemm, mlp.gate_up,
                             {.x = a.normed.get(),
                              .y = a.gate_up.get(),
                              .m = rows,
                              .n = 2 * mlp.intermediate,
                              .k = hidden},
                             stream));
  TV_RETURN_IF_ERROR(cuda::SiluMul(
      {.gate_up = a.gate_up.get(), .out = a.activated.get(), .rows = rows, .dim = mlp.intermediate},
      stream));
  return Project(gemm, mlp.down,
                 {.x = a.activated.get(), .y = out, .m = rows, .n = hidden, .k = mlp.intermediate},
                 stream);
}

absl::Status CudaForward::Moe(const DeviceMoeWeights& moe, int64_t rows, int32_t* active_count) {
  Activations& a = activations_;
  // The shared expert on the side stream beside the router, the routing and the routed experts
  // (all read only the normed rows): only the combine reads its output, so MoeExperts waits for
  // it there (shared_ready) and the grouping and the streams do not. The join after MoeExperts
  // then finds the side work done; it ends the side branch on every path, failed ones included.
  const bool shared = moe.shared.intermediate > 0;
  if (shared) TV_RETURN_IF_ERROR(ForkSide());
  const absl::Status shared_done =
      shared ? GatedMlp(moe.shared, rows, a.shared_out.get(), side_stream(), side_gemm())
             : absl::OkStatus();
  const absl::StatusOr<cuda::MoeGrouping> routed = Route(moe, rows, active_count);
  absl::Status experts = absl::OkStatus();
  cudaEvent_t shared_ready = nullptr;  // none where the shared expert ran on stream_ itself
  if (shared && side_ != nullptr && shared_done.ok() && routed.ok()) {
    absl::StatusOr<cudaEvent_t> ready = side_->ReadyEvent();
    if (ready.ok()) shared_ready = *ready;
    experts = ready.status();
  }
  if (shared_done.ok() && routed.ok() && experts.ok()) {
    experts = RoutedExperts(moe, rows, active_count, shared_ready, *routed);
  }
  const absl::Status joined = shared ? JoinSide() : absl::OkStatus();
  TV_RETURN_IF_ERROR(shared_done);
  TV_RETURN_IF_ERROR(routed.status());
  TV_RETURN_IF_ERROR(experts);
  return joined;
}

kernels::MoeExpertsParamsOf<cuda::Bf16, cuda::Bf16> CudaForward::ExpertsParams(
    const DeviceMoeWeights& moe, int64_t rows) const {
  const ModelConfig& c = weights_.config;
  const ShardingPlan& plan = weights_.plan;
  const Activations& a = activations_;
  const bool shared = moe.shared.intermediate > 0;
  kernels::MoeExpertsParamsOf<cuda::Bf16, cuda::Bf16> p{
      .x = a.normed.get(),
      .topk_ids = a.topk_ids.get(),
      .topk_weights = a.topk_weights.get(),
      .out = a.branch.get(),
      .tokens = rows,
      .top_k = static_cast<int32_t>(c.num_experts_per_tok),
      .hidden = c.hidden_size,
      .intermediate = plan.expert_intermediate.size(),
      .first_expert = static_cast<int32_t>(plan.experts.begin),
      .num_local_experts = static_cast<int32_t>(plan.experts.size()),
      .shared_out = shared ? a.shared_out.get() : nullptr};
  using Layout = DeviceMoeWeights::Layout;
  switch (moe.layout) {
    case Layout::kRows:
      p.gate_proj = moe.gate_ptrs.get();
      p.up_proj = moe.up_ptrs.get();
      p.down_proj = moe.down_ptrs.get();
      break;
    case Layout::kTiles:
      p.packed_gate = moe.gate.get();
      p.packed_up =
          moe.gate.get() +
          cuda::GateUpTileLayout(plan.expert_intermediate.size(), c.hidden_size).TileElements();
      p.packed_down = moe.down.get();
      break;
    case Layout::kInt4:
      p.int4_gate_up = moe.records_gate_up.get();
      p.int4_down = moe.records_down.get();
      break;
    case Layout::kFp8:
      p.fp8_gate_up = moe.records_gate_up.get();
      p.fp8_down = moe.records_down.get();
      break;
  }
  return p;
}

absl::Status CudaForward::RoutedExperts(const DeviceMoeWeights& moe, int64_t rows,
                                        int32_t* active_count, cudaEvent_t shared_ready,
                                        cuda::MoeGrouping grouping) {
  Activations& a = activations_;
  return cuda::MoeExperts(ExpertsParams(moe, rows), a.moe_workspace.get(), a.moe_workspace.size(),
                          stream_, active_count, shared_ready, grouping);
}

// The router's logits and each row's top-k experts and weights; at verify sizes the experts'
// grouping in the routing's kernel.
absl::StatusOr<cuda::MoeGrouping> CudaForward::Route(const DeviceMoeWeights& moe, int64_t rows,
                                                     int32_t* active_count) {
  const ModelConfig& c = weights_.config;
  Activations& a = activations_;
  const int32_t experts = static_cast<int32_t>(c.n_routed_experts);
  const int32_t top_k = static_cast<int32_t>(c.num_experts_per_tok);
  TV_RETURN_IF_ERROR(gemm_->Run({.x = a.normed.get(),
                                 .weight = moe.router.get(),
                                 .y = a.router_logits.get(),
                                 .m = rows,
                                 .n = experts,
                                 .k = c.hidden_size},
                                stream_));
  return cuda::MoeRoutingAndGrouping(
      {.router_logits = a.router_logits.get(),
       .correction_bias = moe.correction_bias.size() > 0 ? moe.correction_bias.get() : nullptr,
       .topk_ids = a.topk_ids.get(),
       .topk_weights = a.topk_weights.get(),
       .tokens = rows,
       .num_experts = experts,
       .top_k = top_k,
       .num_groups = static_cast<int32_t>(c.n_group),
       .topk_groups = static_cast<int32_t>(c.topk_group),
       .scoring = c.scoring_func,
       .method = c.topk_method,
       .normalize = c.norm_topk_prob,
       .routed_scaling_factor = static_cast<float>(c.routed_scaling_factor),
       .routed_tokens = inputs_.routed_rows},
      ExpertsParams(moe, rows), a.moe_workspace.get(), a.moe_workspace.size(), stream_,
      active_count);
}

}  // namespace treeverify::worker
