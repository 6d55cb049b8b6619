// One rank's weights on the GPU, bf16, in the layouts of ModelWeights (model_weights.h): uploaded
// from a loaded checkpoint, or random (benchmarks of shapes no checkpoint here has). Norm weights
// are bf16 too, as the checkpoints store them. Quantized checkpoints' weights stay quantized where
// the kernels read them so: experts INT4 or FP8 (DeviceMoeWeights), dense projections FP8
// (DeviceProjection).
//
//   TV_ASSIGN_OR_RETURN(DeviceWeights device, UploadWeights(*weights));
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/kernels/cuda/bf16.h"
#include "treeverify/worker/device_array.h"
#include "treeverify/worker/model_config.h"
#include "treeverify/worker/model_weights.h"
#include "treeverify/worker/sharding_plan.h"

namespace treeverify::worker {

using kernels::cuda::Bf16;

// A dense projection's weight, [batch][rows, cols] (a batch of products: W_UK^T and W_UV, one a
// head): bf16, or FP8 as DeepSeek-V3 ships it, e4m3 bytes with each product's 128 x 128 blocks'
// scales (kernels/cuda/block_fp8.h), which GemmRunner streams as stored.
struct DeviceProjection {
  DeviceArray<Bf16> bf16;         // where not FP8
  DeviceArray<uint8_t> fp8;       // e4m3
  DeviceArray<float> fp8_scales;  // [batch][ceil(rows / 128), ceil(cols / 128)]
  bool is_fp8() const { return fp8.size() > 0; }
  int64_t bytes() const { return bf16.bytes() + fp8.bytes() + fp8_scales.bytes(); }
  int64_t elements() const { return is_fp8() ? fp8.size() : bf16.size(); }
};

struct DeviceMlpWeights {
  int64_t intermediate = 0;  // this rank's columns (0: absent)
  DeviceProjection gate_up;  // [2 * intermediate, hidden]
  DeviceProjection down;     // [hidden, intermediate]
};

// FP8 checkpoints' projections stay FP8; W_UK^T and W_UV (a head's product each) only where a
// head's rows of kv_b_proj start on blocks (qk_nope_head_dim and v_head_dim multiples of 128, as
// DeepSeek-V3's), else they are bf16 of the same values.
struct DeviceAttentionWeights {
  DeviceProjection q_a_proj;    // [q_lora_rank, hidden] (when q_lora_rank is set)
  DeviceArray<Bf16> q_a_norm;   // [q_lora_rank]
  DeviceProjection q_proj;      // [local_heads * qk_head_dim, q_lora_rank or hidden]
  DeviceProjection kv_a_proj;   // [kv_lora_rank + qk_rope_head_dim, hidden]
  DeviceArray<Bf16> kv_a_norm;  // [kv_lora_rank]
  DeviceProjection w_uk_t;      // [local_heads][kv_lora_rank, qk_nope_head_dim]
  DeviceProjection w_uv;        // [local_heads][v_head_dim, kv_lora_rank]
  // The same two as the checkpoint's kv_b_proj: [local_heads * (nope + v), kv_lora_rank], each
  // head's k_nope rows (W_UK) then its v rows (W_UV); the prefill path's up-projection.
  DeviceProjection kv_b_proj;
  DeviceProjection o_proj;  // [hidden, local_heads * v_head_dim]
};

struct DeviceMoeWeights {
  DeviceArray<Bf16> router;            // [n_routed_experts, hidden]
  DeviceArray<float> correction_bias;  // [n_routed_experts] (noaux_tc), else empty
  // The held experts, in expert order, intermediate being this rank's columns, in one of four
  // layouts. Where the device's weight stream reads them (cuda::MoeTilesReadable: every
  // production shape on sm_90 and later): quantized experts (a Kimi-K2-Thinking or DeepSeek-V3
  // checkpoint, or random weights of a config that says so) as its records (cuda/moe_records.h)
  // in `records_gate_up` and `records_down`, INT4 (kInt4) or FP8 (kFp8); others as its bf16 tiles
  // (cuda/moe_tiles.h: gate and up interleaved in `gate`, `up` empty). Otherwise row-major bf16,
  // [local, intermediate, hidden] (gate, up) and [local, hidden, intermediate] (down), with
  // pointer arrays into them.
  enum class Layout { kRows, kTiles, kInt4, kFp8 };
  Layout layout = Layout::kRows;
  DeviceArray<Bf16> gate, up, down;                        // kRows, kTiles
  DeviceArray<const Bf16*> gate_ptrs, up_ptrs, down_ptrs;  // [local], kRows
  DeviceArray<uint8_t> records_gate_up, records_down;      // kInt4, kFp8
  DeviceMlpWeights shared;                                 // intermediate 0 without shared
};

struct DeviceLayerWeights {
  DeviceArray<Bf16> input_norm;  // [hidden]
  DeviceArray<Bf16> post_norm;   // [hidden]
  DeviceAttentionWeights attention;
  bool is_moe = false;
  DeviceMlpWeights dense;  // when !is_moe
  DeviceMoeWeights moe;    // when is_moe
};

struct DeviceWeights {
  ModelConfig config;
  ShardingPlan plan;
  DeviceArray<Bf16> embedding;   // [vocab shard, hidden]
  DeviceArray<Bf16> final_norm;  // [hidden]
  DeviceArray<Bf16> lm_head;     // [vocab shard, hidden]
  std::vector<DeviceLayerWeights> layers;
  DeviceArray<float> rope_inv_freq;  // [qk_rope_head_dim / 2]
};

// The loaded weights rounded to bf16 (round to nearest even) on the current device; the
// correction bias stays fp32, as routing reads it. INT4 and FP8 experts (MoeWeights::int4_*,
// fp8_*) stay so where the weight stream reads them and their groups are of 32 (INT4) or their
// blocks 128 x 128 (FP8), the records' sizes; FP8 dense projections of 128 x 128 blocks stay FP8
// (DeviceAttentionWeights says where W_UK and W_UV do not).
absl::StatusOr<DeviceWeights> UploadWeights(const ModelWeights& weights);

// Random weights of this rank's shapes for benchmarks (the Kimi-K2 rank has no
// checkpoint here): projections uniform with std 1/sqrt(fan_in), the router twice that, norms 1,
// the correction bias within +-0.05, the LM head with std 8/sqrt(hidden) as the tiny models'.
// Where config.quantization says INT4 groups of 32 (or FP8 blocks of 128 x 128) and the stream
// reads them, the experts are INT4 (FP8): uniform nibbles (e4m3 of uniform values), scales that
// give the weights the same std; FP8 blocks of 128 x 128 make the dense projections FP8 as
// UploadWeights keeps them. Values depend on (seed, tensor), not on the launch.
absl::StatusOr<DeviceWeights> RandomDeviceWeights(const ModelConfig& config,
                                                  const ShardingPlan& plan, uint32_t seed);

}  // namespace treeverify::worker
