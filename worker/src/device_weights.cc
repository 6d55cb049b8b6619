#include "treeverify/worker/device_weights.h"

#include <cuda_bf16.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

absl::StatusOr<DeviceArray<Bf16>> ToDevice(const std::vector<float>& values) {
  std::vector<Bf16> rounded(values.size());
  for (size_t i = 0; i < values.size(); ++i) rounded[i] = __float2bfloat16_rn(values[i]);
  TV_ASSIGN_OR_RETURN(DeviceArray<Bf16> array,
                      DeviceArray<Bf16>::Allocate(static_cast<int64_t>(rounded.size())));
  TV_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(array.get(), rounded.data(), array.bytes(), cudaMemcpyHostToDevice));
  return array;
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
    if (layer.is_moe) {
      return absl::UnimplementedError(absl::StrCat(
          "the CUDA backend does not run MoE layers yet (layer ", l, " is one; issue 5)"));
    }
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
    out.is_moe = false;
    TV_ASSIGN_OR_RETURN(out.dense, ToDevice(layer.dense));
  }
  const std::vector<float> inv_freq = weights.config.rope_inv_freq();
  TV_ASSIGN_OR_RETURN(device.rope_inv_freq,
                      DeviceArray<float>::Allocate(static_cast<int64_t>(inv_freq.size())));
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpy(device.rope_inv_freq.get(), inv_freq.data(),
                                     device.rope_inv_freq.bytes(), cudaMemcpyHostToDevice));
  return device;
}

}  // namespace treeverify::worker
