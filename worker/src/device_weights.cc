#include "treeverify/worker/device_weights.h"

#include <cuda_bf16.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

template <typename T>
absl::StatusOr<DeviceArray<T>> Copy(const std::vector<T>& values) {
  TV_ASSIGN_OR_RETURN(DeviceArray<T> array,
                      DeviceArray<T>::Allocate(static_cast<int64_t>(values.size())));
  TV_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(array.get(), values.data(), array.bytes(), cudaMemcpyHostToDevice));
  return array;
}

// Rounded to bf16 (to nearest even), as the checkpoints' bf16 values already are.
absl::StatusOr<DeviceArray<Bf16>> ToDevice(const std::vector<float>& values) {
  std::vector<Bf16> rounded(values.size());
  for (size_t i = 0; i < values.size(); ++i) rounded[i] = __float2bfloat16_rn(values[i]);
  return Copy(rounded);
}

// Packs per-expert matrices into one array and returns pointers to each.
absl::Status Pack(const std::vector<std::vector<float>>& matrices, DeviceArray<Bf16>& packed,
                  DeviceArray<const Bf16*>& pointers) {
  std::vector<float> all;
  for (const std::vector<float>& m : matrices) all.insert(all.end(), m.begin(), m.end());
  TV_ASSIGN_OR_RETURN(packed, ToDevice(all));
  std::vector<const Bf16*> starts;
  int64_t offset = 0;
  for (const std::vector<float>& m : matrices) {
    starts.push_back(packed.get() + offset);
    offset += static_cast<int64_t>(m.size());
  }
  TV_ASSIGN_OR_RETURN(pointers, Copy(starts));
  return absl::OkStatus();
}

absl::StatusOr<DeviceMlpWeights> ToDevice(const MlpWeights& mlp) {
  DeviceMlpWeights device;
  device.intermediate = mlp.intermediate;
  TV_ASSIGN_OR_RETURN(device.gate_up, ToDevice(mlp.gate_up));
  TV_ASSIGN_OR_RETURN(device.down, ToDevice(mlp.down));
  return device;
}

}  // namespace

absl::StatusOr<DeviceWeights> UploadWeights(const ModelWeights& weights) {
  DeviceWeights device;
  device.config = weights.config;
  device.plan = weights.plan;
  TV_ASSIGN_OR_RETURN(device.embedding, ToDevice(weights.embedding));
  TV_ASSIGN_OR_RETURN(device.final_norm, ToDevice(weights.final_norm));
  TV_ASSIGN_OR_RETURN(device.lm_head, ToDevice(weights.lm_head));
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    const LayerWeights& layer = weights.layers[l];
    DeviceLayerWeights& out = device.layers.emplace_back();
    TV_ASSIGN_OR_RETURN(out.input_norm, ToDevice(layer.input_norm));
    TV_ASSIGN_OR_RETURN(out.post_norm, ToDevice(layer.post_norm));
    const AttentionWeights& a = layer.attention;
    DeviceAttentionWeights& d = out.attention;
    TV_ASSIGN_OR_RETURN(d.q_a_proj, ToDevice(a.q_a_proj));
    TV_ASSIGN_OR_RETURN(d.q_a_norm, ToDevice(a.q_a_norm));
    TV_ASSIGN_OR_RETURN(d.q_proj, ToDevice(a.q_proj));
    TV_ASSIGN_OR_RETURN(d.kv_a_proj, ToDevice(a.kv_a_proj));
    TV_ASSIGN_OR_RETURN(d.kv_a_norm, ToDevice(a.kv_a_norm));
    TV_ASSIGN_OR_RETURN(d.w_uk_t, ToDevice(a.w_uk_t));
    TV_ASSIGN_OR_RETURN(d.w_uv, ToDevice(a.w_uv));
    TV_ASSIGN_OR_RETURN(d.o_proj, ToDevice(a.o_proj));
    out.is_moe = layer.is_moe;
    if (!layer.is_moe) {
      TV_ASSIGN_OR_RETURN(out.dense, ToDevice(layer.dense));
      continue;
    }
    const MoeWeights& moe = layer.moe;
    TV_ASSIGN_OR_RETURN(out.moe.router, ToDevice(moe.router));
    TV_ASSIGN_OR_RETURN(out.moe.correction_bias, Copy(moe.correction_bias));
    TV_RETURN_IF_ERROR(Pack(moe.gate_proj, out.moe.gate, out.moe.gate_ptrs));
    TV_RETURN_IF_ERROR(Pack(moe.up_proj, out.moe.up, out.moe.up_ptrs));
    TV_RETURN_IF_ERROR(Pack(moe.down_proj, out.moe.down, out.moe.down_ptrs));
    TV_ASSIGN_OR_RETURN(out.moe.shared, ToDevice(moe.shared));
  }
  const std::vector<float> inv_freq = weights.config.rope_inv_freq();
  TV_ASSIGN_OR_RETURN(device.rope_inv_freq, Copy(inv_freq));
  return device;
}

}  // namespace treeverify::worker
