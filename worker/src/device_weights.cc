#include "treeverify/worker/device_weights.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/cuda/block_fp8.h"
#include "treeverify/kernels/cuda/device_fill.h"
#include "treeverify/kernels/cuda/moe.h"
#include "treeverify/kernels/cuda/moe_fp8_tiles.h"
#include "treeverify/kernels/cuda/moe_int4_tiles.h"
#include "treeverify/kernels/cuda/moe_tiles.h"
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

// Whether this device's weight stream reads experts of these sizes as tiles.
absl::StatusOr<bool> ExpertsAsTiles(int64_t hidden, int64_t intermediate) {
  int device = 0, major = 0;
  TV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TV_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return kernels::cuda::MoeTilesReadable(hidden, intermediate, major);
}

using Layout = DeviceMoeWeights::Layout;

// The records the weight stream reads experts of this quantization as (kInt4: groups of 32; kFp8:
// blocks of 128 x 128), or kRows where it reads them as bf16.
Layout QuantizedExpertLayout(const WeightQuantization& q) {
  using Method = WeightQuantization::Method;
  if (q.method == Method::kInt4Group && q.group_size == kernels::cuda::MoeInt4Records::kGroup) {
    return Layout::kInt4;
  }
  if (q.method == Method::kFp8Block && q.block_rows == kernels::cuda::MoeFp8Records::kBlock &&
      q.block_cols == kernels::cuda::MoeFp8Records::kBlock) {
    return Layout::kFp8;
  }
  return Layout::kRows;
}

// One kind of matrix (gate, up or down) of every held quantized expert as the checkpoint stores
// it, on the device, experts one after another: INT4 words [rows, ceil(cols / 8)] (uint32) with
// bf16 scales [rows, ceil(cols / 32)], or FP8 bytes [rows, cols] with fp32 scales
// [ceil(rows / 128), ceil(cols / 128)].
struct DeviceQuantizedMatrices {
  DeviceArray<uint8_t> values;
  DeviceArray<uint8_t> scales;
};

// The quantized experts into the weight stream's records of `format` (kInt4 or kFp8, which
// `moe.layout` becomes); the checkpoint layout's arrays are no longer needed after.
absl::Status StageQuantizedExperts(Layout format, int64_t experts, int64_t hidden,
                                   int64_t intermediate, const DeviceQuantizedMatrices& gate,
                                   const DeviceQuantizedMatrices& up,
                                   const DeviceQuantizedMatrices& down, DeviceMoeWeights& moe) {
  namespace cuda = kernels::cuda;
  const bool int4 = format == Layout::kInt4;
  const cuda::MoeRecordLayout gate_up_layout = int4 ? cuda::Int4GateUpLayout(intermediate, hidden)
                                                    : cuda::Fp8GateUpLayout(intermediate, hidden);
  const cuda::MoeRecordLayout down_layout =
      int4 ? cuda::Int4DownLayout(hidden, intermediate) : cuda::Fp8DownLayout(hidden, intermediate);
  TV_ASSIGN_OR_RETURN(moe.records_gate_up,
                      DeviceArray<uint8_t>::Allocate(experts * gate_up_layout.ExpertBytes()));
  TV_ASSIGN_OR_RETURN(moe.records_down,
                      DeviceArray<uint8_t>::Allocate(experts * down_layout.ExpertBytes()));
  auto words = [](const DeviceQuantizedMatrices& m) {
    return reinterpret_cast<const uint32_t*>(m.values.get());
  };
  auto bf16_scales = [](const DeviceQuantizedMatrices& m) {
    return reinterpret_cast<const Bf16*>(m.scales.get());
  };
  auto fp32_scales = [](const DeviceQuantizedMatrices& m) {
    return reinterpret_cast<const float*>(m.scales.get());
  };
  if (int4) {
    TV_RETURN_IF_ERROR(cuda::PackInt4ExpertTilesOnDevice(
        {words(gate), words(up)}, {bf16_scales(gate), bf16_scales(up)}, experts, gate_up_layout,
        moe.records_gate_up.get(), nullptr));
    TV_RETURN_IF_ERROR(
        cuda::PackInt4ExpertTilesOnDevice({words(down), nullptr}, {bf16_scales(down), nullptr},
                                          experts, down_layout, moe.records_down.get(), nullptr));
  } else {
    TV_RETURN_IF_ERROR(cuda::PackFp8ExpertTilesOnDevice(
        {gate.values.get(), up.values.get()}, {fp32_scales(gate), fp32_scales(up)}, experts,
        gate_up_layout, moe.records_gate_up.get(), nullptr));
    TV_RETURN_IF_ERROR(
        cuda::PackFp8ExpertTilesOnDevice({down.values.get(), nullptr}, {fp32_scales(down), nullptr},
                                         experts, down_layout, moe.records_down.get(), nullptr));
  }
  TV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  moe.layout = format;
  return absl::OkStatus();
}

template <typename T>
void AppendBytes(const std::vector<T>& values, std::vector<uint8_t>& bytes) {
  const auto* begin = reinterpret_cast<const uint8_t*>(values.data());
  bytes.insert(bytes.end(), begin, begin + values.size() * sizeof(T));
}

// A stored matrix's values: INT4 words, FP8 bytes.
const std::vector<uint32_t>& StoredValues(const Int4Matrix& m) { return m.words; }
const std::vector<uint8_t>& StoredValues(const Fp8Matrix& m) { return m.bytes; }

// A loaded kind of quantized matrix, every held expert's, to the device as stored.
template <typename Matrix>
absl::StatusOr<DeviceQuantizedMatrices> ToDevice(const std::vector<Matrix>& matrices) {
  std::vector<uint8_t> values, scales;
  for (const Matrix& m : matrices) {
    AppendBytes(StoredValues(m), values);
    AppendBytes(m.scales, scales);
  }
  DeviceQuantizedMatrices device;
  TV_ASSIGN_OR_RETURN(device.values, Copy(values));
  TV_ASSIGN_OR_RETURN(device.scales, Copy(scales));
  return device;
}

// The held experts' quantized form on the device where every one is stored in `format`.
absl::StatusOr<bool> UploadQuantizedExperts(const MoeWeights& moe, Layout format, int64_t hidden,
                                            int64_t intermediate, DeviceMoeWeights& device) {
  const int64_t experts = static_cast<int64_t>(moe.gate_proj.size());
  std::optional<DeviceQuantizedMatrices> gate, up, down;
  if (format == Layout::kInt4 && !moe.int4_gate.empty()) {
    TV_ASSIGN_OR_RETURN(gate, ToDevice(moe.int4_gate));
    TV_ASSIGN_OR_RETURN(up, ToDevice(moe.int4_up));
    TV_ASSIGN_OR_RETURN(down, ToDevice(moe.int4_down));
  } else if (format == Layout::kFp8 && !moe.fp8_gate.empty()) {
    TV_ASSIGN_OR_RETURN(gate, ToDevice(moe.fp8_gate));
    TV_ASSIGN_OR_RETURN(up, ToDevice(moe.fp8_up));
    TV_ASSIGN_OR_RETURN(down, ToDevice(moe.fp8_down));
  } else {
    return false;
  }
  TV_RETURN_IF_ERROR(
      StageQuantizedExperts(format, experts, hidden, intermediate, *gate, *up, *down, device));
  return true;
}

// The experts as the weight stream's tiles (`layout`), from row-major arrays on the device of
// every expert's matrix one after another: `row_major[m]` is interleaved matrix m (gate and up,
// or down alone). The arrays are no longer needed after.
absl::StatusOr<DeviceArray<Bf16>> PackTiles(int64_t experts,
                                            const std::vector<const DeviceArray<Bf16>*>& row_major,
                                            const kernels::cuda::MoeTileLayout& layout) {
  for (const DeviceArray<Bf16>* matrix : row_major) {
    if (matrix->size() != experts * layout.rows * layout.cols) {
      return absl::InvalidArgumentError(absl::StrCat("PackTiles: ", matrix->size(),
                                                     " elements for ", experts, " experts of ",
                                                     layout.rows, " x ", layout.cols));
    }
  }
  TV_ASSIGN_OR_RETURN(DeviceArray<Bf16> tiles,
                      DeviceArray<Bf16>::Allocate(experts * layout.ExpertElements()));
  TV_CUDA_RETURN_IF_ERROR(cudaMemset(tiles.get(), 0, tiles.bytes()));  // the padding, if any
  for (size_t m = 0; m < row_major.size(); ++m) {
    TV_RETURN_IF_ERROR(kernels::cuda::PackExpertTilesOnDevice(
        row_major[m]->get(), experts, layout, static_cast<int>(m), tiles.get(), nullptr));
  }
  TV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return tiles;
}

// Row-major experts (gate, up, down) into the weight stream's tiles: gate and up interleaved in
// `gate`, down in `down`; `up` freed.
absl::Status TileExperts(DeviceMoeWeights& moe, int64_t experts, int64_t hidden,
                         int64_t intermediate) {
  // One kind at a time, its row-major arrays freed before the next is packed: at most one kind's
  // bytes held twice.
  TV_ASSIGN_OR_RETURN(DeviceArray<Bf16> gate_up,
                      PackTiles(experts, {&moe.gate, &moe.up},
                                kernels::cuda::GateUpTileLayout(intermediate, hidden)));
  moe.gate = std::move(gate_up);
  moe.up = DeviceArray<Bf16>();
  TV_ASSIGN_OR_RETURN(
      DeviceArray<Bf16> down,
      PackTiles(experts, {&moe.down}, kernels::cuda::DownTileLayout(hidden, intermediate)));
  moe.down = std::move(down);
  moe.layout = DeviceMoeWeights::Layout::kTiles;
  return absl::OkStatus();
}

// The experts of one kind of matrix (gate, up or down) row-major in one array, and, where they
// stay so, pointers to each.
absl::Status PackRows(const std::vector<std::vector<float>>& matrices, DeviceArray<Bf16>& packed,
                      DeviceArray<const Bf16*>* pointers) {
  std::vector<float> all;
  for (const std::vector<float>& m : matrices) all.insert(all.end(), m.begin(), m.end());
  TV_ASSIGN_OR_RETURN(packed, ToDevice(all));
  if (pointers == nullptr) return absl::OkStatus();
  std::vector<const Bf16*> starts;
  int64_t offset = 0;
  for (const std::vector<float>& m : matrices) {
    starts.push_back(packed.get() + offset);
    offset += static_cast<int64_t>(m.size());
  }
  TV_ASSIGN_OR_RETURN(*pointers, Copy(starts));
  return absl::OkStatus();
}

constexpr int64_t kBlock = kernels::cuda::kFp8BlockSize;

bool KernelBlocks(const Fp8Matrix& m) { return m.block_rows == kBlock && m.block_cols == kBlock; }

// An FP8 slice as stored.
absl::StatusOr<DeviceProjection> ToDevice(const Fp8Matrix& m) {
  DeviceProjection p;
  TV_ASSIGN_OR_RETURN(p.fp8, Copy(m.bytes));
  TV_ASSIGN_OR_RETURN(p.fp8_scales, Copy(m.scales));
  return p;
}

// A projection's slice as stored where it is FP8 of the kernels' blocks, else its values in bf16.
absl::StatusOr<DeviceProjection> ToDevice(const std::vector<float>& values,
                                          const std::optional<Fp8Matrix>& fp8) {
  if (fp8 && KernelBlocks(*fp8)) return ToDevice(*fp8);
  DeviceProjection p;
  TV_ASSIGN_OR_RETURN(p.bf16, ToDevice(values));
  return p;
}

absl::StatusOr<DeviceMlpWeights> ToDevice(const MlpWeights& mlp) {
  DeviceMlpWeights device;
  device.intermediate = mlp.intermediate;
  TV_ASSIGN_OR_RETURN(device.gate_up, ToDevice(mlp.gate_up, mlp.fp8_gate_up));
  TV_ASSIGN_OR_RETURN(device.down, ToDevice(mlp.down, mlp.fp8_down));
  return device;
}

// W_UK^T [heads][lora, nope] and W_UV [heads][v, lora] of kv_b_proj's FP8 slice [heads * (nope +
// v), lora], block for block: each product's blocks are whole blocks of kv_b_proj (transposed for
// W_UK^T, the same scale) where nope, v and lora are multiples of 128 (DeepSeek-V3's 128, 128,
// 512); nullopt otherwise. As 2-D matrices of heads * lora (heads * v) rows their scales are the
// batch's, a head's after another's.
struct AbsorbedFp8 {
  Fp8Matrix w_uk_t, w_uv;
};
std::optional<AbsorbedFp8> SplitUpProjection(const Fp8Matrix& kv_b, int64_t heads, int64_t lora,
                                             int64_t nope, int64_t v) {
  if (!KernelBlocks(kv_b) || nope % kBlock != 0 || v % kBlock != 0 || lora % kBlock != 0 ||
      kv_b.rows != heads * (nope + v) || kv_b.cols != lora) {
    return std::nullopt;
  }
  const int64_t lora_blocks = lora / kBlock, nope_blocks = nope / kBlock, v_blocks = v / kBlock;
  AbsorbedFp8 out{.w_uk_t = {.rows = heads * lora, .cols = nope},
                  .w_uv = {.rows = heads * v, .cols = lora}};
  out.w_uk_t.bytes.resize(heads * lora * nope);
  out.w_uk_t.scales.resize(heads * lora_blocks * nope_blocks);
  out.w_uv.bytes.resize(heads * v * lora);
  out.w_uv.scales.resize(heads * v_blocks * lora_blocks);
  for (int64_t h = 0; h < heads; ++h) {
    const uint8_t* head = kv_b.bytes.data() + h * (nope + v) * lora;
    for (int64_t d = 0; d < nope; ++d) {
      for (int64_t l = 0; l < lora; ++l)
        out.w_uk_t.bytes[(h * lora + l) * nope + d] = head[d * lora + l];
    }
    std::copy_n(head + nope * lora, v * lora, out.w_uv.bytes.begin() + h * v * lora);
    const float* head_scales = kv_b.scales.data() + h * (nope_blocks + v_blocks) * lora_blocks;
    for (int64_t i = 0; i < lora_blocks; ++i) {
      for (int64_t j = 0; j < nope_blocks; ++j) {
        out.w_uk_t.scales[(h * lora_blocks + i) * nope_blocks + j] =
            head_scales[j * lora_blocks + i];
      }
    }
    std::copy_n(head_scales + nope_blocks * lora_blocks, v_blocks * lora_blocks,
                out.w_uv.scales.begin() + h * v_blocks * lora_blocks);
  }
  return out;
}

// kv_b_proj [heads, nope + v, lora] from W_UK^T [heads, lora, nope] and W_UV [heads, v, lora],
// both already on the device (the bf16 values the absorbed path uses, so both forms share them).
absl::StatusOr<DeviceArray<Bf16>> UpProjection(const DeviceArray<Bf16>& w_uk_t,
                                               const DeviceArray<Bf16>& w_uv, int64_t heads,
                                               int64_t lora, int64_t nope, int64_t v) {
  std::vector<Bf16> uk(w_uk_t.size()), uv(w_uv.size());
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpy(uk.data(), w_uk_t.get(), w_uk_t.bytes(), cudaMemcpyDefault));
  TV_CUDA_RETURN_IF_ERROR(cudaMemcpy(uv.data(), w_uv.get(), w_uv.bytes(), cudaMemcpyDefault));
  std::vector<Bf16> kv_b(heads * (nope + v) * lora);
  for (int64_t h = 0; h < heads; ++h) {
    Bf16* head = kv_b.data() + h * (nope + v) * lora;
    for (int64_t d = 0; d < nope; ++d) {
      for (int64_t c = 0; c < lora; ++c) head[d * lora + c] = uk[(h * lora + c) * nope + d];
    }
    std::copy_n(uv.data() + h * v * lora, v * lora, head + nope * lora);
  }
  return Copy(kv_b);
}

absl::StatusOr<DeviceAttentionWeights> ToDevice(const AttentionWeights& a, const ModelConfig& c,
                                                const ShardingPlan& plan) {
  DeviceAttentionWeights d;
  const int64_t heads = plan.heads.size(), lora = c.kv_lora_rank;
  const int64_t nope = c.qk_nope_head_dim, v = c.v_head_dim;
  TV_ASSIGN_OR_RETURN(d.q_a_proj, ToDevice(a.q_a_proj, a.fp8_q_a_proj));
  TV_ASSIGN_OR_RETURN(d.q_a_norm, ToDevice(a.q_a_norm));
  TV_ASSIGN_OR_RETURN(d.q_proj, ToDevice(a.q_proj, a.fp8_q_proj));
  TV_ASSIGN_OR_RETURN(d.kv_a_proj, ToDevice(a.kv_a_proj, a.fp8_kv_a_proj));
  TV_ASSIGN_OR_RETURN(d.kv_a_norm, ToDevice(a.kv_a_norm));
  TV_ASSIGN_OR_RETURN(d.o_proj, ToDevice(a.o_proj, a.fp8_o_proj));
  const std::optional<AbsorbedFp8> absorbed =
      a.fp8_kv_b_proj ? SplitUpProjection(*a.fp8_kv_b_proj, heads, lora, nope, v) : std::nullopt;
  if (absorbed) {
    TV_ASSIGN_OR_RETURN(d.w_uk_t, ToDevice(absorbed->w_uk_t));
    TV_ASSIGN_OR_RETURN(d.w_uv, ToDevice(absorbed->w_uv));
  } else {
    TV_ASSIGN_OR_RETURN(d.w_uk_t.bf16, ToDevice(a.w_uk_t));
    TV_ASSIGN_OR_RETURN(d.w_uv.bf16, ToDevice(a.w_uv));
  }
  if (a.fp8_kv_b_proj && KernelBlocks(*a.fp8_kv_b_proj)) {
    TV_ASSIGN_OR_RETURN(d.kv_b_proj, ToDevice(*a.fp8_kv_b_proj));
  } else {
    TV_ASSIGN_OR_RETURN(d.kv_b_proj.bf16,
                        UpProjection(d.w_uk_t.bf16, d.w_uv.bf16, heads, lora, nope, v));
  }
  return d;
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
    TV_ASSIGN_OR_RETURN(out.attention, ToDevice(layer.attention, weights.config, weights.plan));
    out.is_moe = layer.is_moe;
    if (!layer.is_moe) {
      TV_ASSIGN_OR_RETURN(out.dense, ToDevice(layer.dense));
      continue;
    }
    const MoeWeights& moe = layer.moe;
    TV_ASSIGN_OR_RETURN(out.moe.router, ToDevice(moe.router));
    TV_ASSIGN_OR_RETURN(out.moe.correction_bias, Copy(moe.correction_bias));
    const int64_t hidden = weights.config.hidden_size;
    const int64_t intermediate = weights.plan.expert_intermediate.size();
    const int64_t experts = static_cast<int64_t>(moe.gate_proj.size());
    TV_ASSIGN_OR_RETURN(const bool tiles, ExpertsAsTiles(hidden, intermediate));
    DeviceMoeWeights& d_moe = out.moe;
    bool quantized = false;
    if (tiles) {
      TV_ASSIGN_OR_RETURN(
          quantized, UploadQuantizedExperts(moe, QuantizedExpertLayout(weights.config.quantization),
                                            hidden, intermediate, d_moe));
    }
    if (!quantized) {
      // Row-major with pointers where they stay so, else only on the way to the tiles.
      const bool keep_rows = !tiles;
      TV_RETURN_IF_ERROR(
          PackRows(moe.gate_proj, d_moe.gate, keep_rows ? &d_moe.gate_ptrs : nullptr));
      TV_RETURN_IF_ERROR(PackRows(moe.up_proj, d_moe.up, keep_rows ? &d_moe.up_ptrs : nullptr));
      TV_RETURN_IF_ERROR(
          PackRows(moe.down_proj, d_moe.down, keep_rows ? &d_moe.down_ptrs : nullptr));
      if (tiles) TV_RETURN_IF_ERROR(TileExperts(d_moe, experts, hidden, intermediate));
    }
    TV_ASSIGN_OR_RETURN(out.moe.shared, ToDevice(moe.shared));
  }
  const std::vector<float> inv_freq = weights.config.rope_inv_freq();
  TV_ASSIGN_OR_RETURN(device.rope_inv_freq, Copy(inv_freq));
  return device;
}

namespace {

// Allocates and fills random tensors, each from its own seed.
class RandomTensors {
 public:
  explicit RandomTensors(uint32_t seed) : seed_(seed) {}

  // Uniform with std 1/sqrt(fan_in) * scale (a uniform in [-a, a) has std a/sqrt(3)).
  absl::StatusOr<DeviceArray<Bf16>> Projection(int64_t rows, int64_t fan_in, double scale = 1.0) {
    return Uniform(rows * fan_in, std::sqrt(3.0 / static_cast<double>(fan_in)) * scale);
  }
  absl::StatusOr<DeviceArray<Bf16>> Uniform(int64_t count, double half_width) {
    TV_ASSIGN_OR_RETURN(DeviceArray<Bf16> array, DeviceArray<Bf16>::Allocate(count));
    TV_RETURN_IF_ERROR(kernels::cuda::FillUniform(
        array.get(), count, static_cast<float>(half_width), ++seed_, nullptr));
    return array;
  }
  absl::StatusOr<DeviceArray<Bf16>> Ones(int64_t count) {
    TV_ASSIGN_OR_RETURN(DeviceArray<Bf16> array, DeviceArray<Bf16>::Allocate(count));
    TV_RETURN_IF_ERROR(kernels::cuda::FillConstant(array.get(), count, 1.0f, nullptr));
    return array;
  }
  // `count` matrices of rows x fan_in in one array, and their pointers.
  absl::Status Experts(int64_t count, int64_t rows, int64_t fan_in, DeviceArray<Bf16>& packed,
                       DeviceArray<const Bf16*>& pointers) {
    TV_ASSIGN_OR_RETURN(packed, Projection(count * rows, fan_in));
    std::vector<const Bf16*> starts;
    for (int64_t e = 0; e < count; ++e) starts.push_back(packed.get() + e * rows * fan_in);
    TV_ASSIGN_OR_RETURN(pointers, Copy(starts));
    return absl::OkStatus();
  }
  // `count` quantized matrices of rows x fan_in as a checkpoint stores them, the weights' std
  // 1/sqrt(fan_in): INT4, uniform nibbles (values -8..7, mean square 21.5) with bf16 scales
  // uniform in [-a, a); FP8, e4m3 of values uniform in [-1, 1) (std 1/sqrt(3)) with fp32 scales
  // uniform in [-a, a). One seed, as the bf16 experts take, so that later tensors (the routers)
  // are the same in every layout.
  absl::StatusOr<DeviceQuantizedMatrices> QuantizedExperts(Layout format, int64_t count,
                                                           int64_t rows, int64_t fan_in) {
    namespace cuda = kernels::cuda;
    DeviceQuantizedMatrices m;
    const uint32_t seed = ++seed_, scale_seed = seed ^ 0x9e3779b9u;
    const double fan = static_cast<double>(fan_in);
    if (format == Layout::kInt4) {
      const int64_t words = count * rows * ((fan_in + 7) / 8);
      const int64_t groups =
          (fan_in + cuda::MoeInt4Records::kGroup - 1) / cuda::MoeInt4Records::kGroup;
      TV_ASSIGN_OR_RETURN(m.values, DeviceArray<uint8_t>::Allocate(4 * words));
      TV_RETURN_IF_ERROR(
          cuda::FillRandomBits(reinterpret_cast<uint32_t*>(m.values.get()), words, seed, nullptr));
      TV_ASSIGN_OR_RETURN(m.scales, DeviceArray<uint8_t>::Allocate(2 * count * rows * groups));
      TV_RETURN_IF_ERROR(cuda::FillUniform(
          reinterpret_cast<Bf16*>(m.scales.get()), count * rows * groups,
          static_cast<float>(std::sqrt(3.0 / (21.5 * fan))), scale_seed, nullptr));
      return m;
    }
    const int64_t blocks = count * cuda::Fp8ScaleCount(rows, fan_in);
    TV_ASSIGN_OR_RETURN(m.values, DeviceArray<uint8_t>::Allocate(count * rows * fan_in));
    TV_ASSIGN_OR_RETURN(m.scales, DeviceArray<uint8_t>::Allocate(4 * blocks));
    TV_RETURN_IF_ERROR(FillFp8(m.values.get(), m.values.size(),
                               reinterpret_cast<float*>(m.scales.get()), blocks, fan_in, seed));
    return m;
  }

  // A dense projection of `batch` products of rows x fan_in, std 1/sqrt(fan_in): FP8 as
  // QuantizedExperts makes them where `fp8`, else bf16 as Projection. One seed either way.
  absl::StatusOr<DeviceProjection> DenseProjection(int64_t rows, int64_t fan_in, bool fp8,
                                                   int64_t batch = 1) {
    DeviceProjection p;
    if (!fp8) {
      TV_ASSIGN_OR_RETURN(p.bf16, Projection(batch * rows, fan_in));
      return p;
    }
    TV_ASSIGN_OR_RETURN(p.fp8, DeviceArray<uint8_t>::Allocate(batch * rows * fan_in));
    TV_ASSIGN_OR_RETURN(p.fp8_scales, DeviceArray<float>::Allocate(
                                          batch * kernels::cuda::Fp8ScaleCount(rows, fan_in)));
    TV_RETURN_IF_ERROR(FillFp8(p.fp8.get(), p.fp8.size(), p.fp8_scales.get(), p.fp8_scales.size(),
                               fan_in, ++seed_));
    return p;
  }
  absl::StatusOr<DeviceMlpWeights> Mlp(int64_t intermediate, int64_t hidden, bool fp8) {
    DeviceMlpWeights mlp;
    mlp.intermediate = intermediate;
    if (intermediate == 0) return mlp;
    TV_ASSIGN_OR_RETURN(mlp.gate_up, DenseProjection(2 * intermediate, hidden, fp8));
    TV_ASSIGN_OR_RETURN(mlp.down, DenseProjection(hidden, intermediate, fp8));
    return mlp;
  }

 private:
  // e4m3 of values uniform in [-1, 1) (std 1/sqrt(3)), fp32 scales uniform in [-a, a) with
  // a = 3/sqrt(fan_in): weights of std 1/sqrt(fan_in).
  static absl::Status FillFp8(uint8_t* values, int64_t count, float* scales, int64_t blocks,
                              int64_t fan_in, uint32_t seed) {
    TV_RETURN_IF_ERROR(kernels::cuda::FillUniformFp8E4M3(values, count, 1.0f, seed, nullptr));
    return kernels::cuda::FillUniform(
        scales, blocks, static_cast<float>(3.0 / std::sqrt(static_cast<double>(fan_in))),
        seed ^ 0x9e3779b9u, nullptr);
  }

  uint32_t seed_;
};

// kv_b_proj's FP8 slice [heads * (nope + v), lora] from W_UK^T and W_UV as SplitUpProjection
// makes them (its inverse), on the device.
absl::StatusOr<DeviceProjection> JoinUpProjection(const DeviceProjection& w_uk_t,
                                                  const DeviceProjection& w_uv, int64_t heads,
                                                  int64_t lora, int64_t nope, int64_t v) {
  auto host = [](const DeviceProjection& p, int64_t rows,
                 int64_t cols) -> absl::StatusOr<Fp8Matrix> {
    Fp8Matrix m{.rows = rows, .cols = cols};
    m.bytes.resize(p.fp8.size());
    m.scales.resize(p.fp8_scales.size());
    TV_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(m.bytes.data(), p.fp8.get(), p.fp8.bytes(), cudaMemcpyDefault));
    TV_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(m.scales.data(), p.fp8_scales.get(), p.fp8_scales.bytes(), cudaMemcpyDefault));
    return m;
  };
  TV_ASSIGN_OR_RETURN(const Fp8Matrix uk, host(w_uk_t, heads * lora, nope));
  TV_ASSIGN_OR_RETURN(const Fp8Matrix uv, host(w_uv, heads * v, lora));
  const int64_t lora_blocks = lora / kBlock, nope_blocks = nope / kBlock, v_blocks = v / kBlock;
  Fp8Matrix kv_b{.rows = heads * (nope + v), .cols = lora};
  kv_b.bytes.resize(kv_b.rows * lora);
  kv_b.scales.resize(heads * (nope_blocks + v_blocks) * lora_blocks);
  for (int64_t h = 0; h < heads; ++h) {
    uint8_t* head = kv_b.bytes.data() + h * (nope + v) * lora;
    for (int64_t d = 0; d < nope; ++d) {
      for (int64_t l = 0; l < lora; ++l) head[d * lora + l] = uk.bytes[(h * lora + l) * nope + d];
    }
    std::copy_n(uv.bytes.begin() + h * v * lora, v * lora, head + nope * lora);
    float* head_scales = kv_b.scales.data() + h * (nope_blocks + v_blocks) * lora_blocks;
    for (int64_t i = 0; i < lora_blocks; ++i) {
      for (int64_t j = 0; j < nope_blocks; ++j) {
        head_scales[j * lora_blocks + i] = uk.scales[(h * lora_blocks + i) * nope_blocks + j];
      }
    }
    std::copy_n(uv.scales.begin() + h * v_blocks * lora_blocks, v_blocks * lora_blocks,
                head_scales + nope_blocks * lora_blocks);
  }
  return ToDevice(kv_b);
}

}  // namespace

absl::StatusOr<DeviceWeights> RandomDeviceWeights(const ModelConfig& c, const ShardingPlan& plan,
                                                  uint32_t seed) {
  RandomTensors random(seed);
  DeviceWeights device;
  device.config = c;
  device.plan = plan;
  const int64_t hidden = c.hidden_size;
  const int64_t heads = plan.heads.size();
  const int64_t lora = c.kv_lora_rank;
  // FP8 projections as UploadWeights keeps a DeepSeek-V3 checkpoint's.
  const bool fp8 = QuantizedExpertLayout(c.quantization) == Layout::kFp8;
  const bool fp8_absorbed =
      fp8 && c.qk_nope_head_dim % kBlock == 0 && c.v_head_dim % kBlock == 0 && lora % kBlock == 0;
  TV_ASSIGN_OR_RETURN(device.embedding, random.Uniform(plan.vocab.size() * hidden, 1.7));
  TV_ASSIGN_OR_RETURN(device.final_norm, random.Ones(hidden));
  TV_ASSIGN_OR_RETURN(device.lm_head, random.Projection(plan.vocab.size(), hidden, 8.0));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    DeviceLayerWeights& layer = device.layers.emplace_back();
    TV_ASSIGN_OR_RETURN(layer.input_norm, random.Ones(hidden));
    TV_ASSIGN_OR_RETURN(layer.post_norm, random.Ones(hidden));
    DeviceAttentionWeights& a = layer.attention;
    const int64_t qk = c.qk_head_dim(), nope = c.qk_nope_head_dim, v = c.v_head_dim;
    if (c.q_lora_rank) {
      TV_ASSIGN_OR_RETURN(a.q_a_proj, random.DenseProjection(*c.q_lora_rank, hidden, fp8));
      TV_ASSIGN_OR_RETURN(a.q_a_norm, random.Ones(*c.q_lora_rank));
      TV_ASSIGN_OR_RETURN(a.q_proj, random.DenseProjection(heads * qk, *c.q_lora_rank, fp8));
    } else {
      TV_ASSIGN_OR_RETURN(a.q_proj, random.DenseProjection(heads * qk, hidden, fp8));
    }
    TV_ASSIGN_OR_RETURN(a.kv_a_proj, random.DenseProjection(c.kv_row_dim(), hidden, fp8));
    TV_ASSIGN_OR_RETURN(a.kv_a_norm, random.Ones(lora));
    TV_ASSIGN_OR_RETURN(a.w_uk_t, random.DenseProjection(lora, nope, fp8_absorbed, heads));
    TV_ASSIGN_OR_RETURN(a.w_uv, random.DenseProjection(v, lora, fp8_absorbed, heads));
    TV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the fills run on the default stream
    if (fp8_absorbed) {
      TV_ASSIGN_OR_RETURN(a.kv_b_proj, JoinUpProjection(a.w_uk_t, a.w_uv, heads, lora, nope, v));
    } else {
      TV_ASSIGN_OR_RETURN(a.kv_b_proj.bf16,
                          UpProjection(a.w_uk_t.bf16, a.w_uv.bf16, heads, lora, nope, v));
    }
    TV_ASSIGN_OR_RETURN(a.o_proj, random.DenseProjection(hidden, heads * v, fp8));
    layer.is_moe = c.is_moe_layer(l);
    if (!layer.is_moe) {
      TV_ASSIGN_OR_RETURN(layer.dense, random.Mlp(plan.dense_intermediate.size(), hidden, fp8));
      continue;
    }
    DeviceMoeWeights& moe = layer.moe;
    TV_ASSIGN_OR_RETURN(moe.router, random.Projection(c.n_routed_experts, hidden, 2.0));
    if (c.topk_method == kernels::MoeTopkMethod::kNoauxTc) {
      TV_ASSIGN_OR_RETURN(moe.correction_bias, DeviceArray<float>::Allocate(c.n_routed_experts));
      TV_RETURN_IF_ERROR(kernels::cuda::FillUniform(moe.correction_bias.get(), c.n_routed_experts,
                                                    0.05f, seed ^ l, nullptr));
    }
    const int64_t local = plan.experts.size();
    const int64_t intermediate = plan.expert_intermediate.size();
    TV_ASSIGN_OR_RETURN(const bool tiles, ExpertsAsTiles(hidden, intermediate));
    const Layout quantized = QuantizedExpertLayout(c.quantization);
    if (tiles && quantized != Layout::kRows) {
      TV_ASSIGN_OR_RETURN(const DeviceQuantizedMatrices gate,
                          random.QuantizedExperts(quantized, local, intermediate, hidden));
      TV_ASSIGN_OR_RETURN(const DeviceQuantizedMatrices up,
                          random.QuantizedExperts(quantized, local, intermediate, hidden));
      TV_ASSIGN_OR_RETURN(const DeviceQuantizedMatrices down,
                          random.QuantizedExperts(quantized, local, hidden, intermediate));
      TV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the fills run on the default stream
      TV_RETURN_IF_ERROR(
          StageQuantizedExperts(quantized, local, hidden, intermediate, gate, up, down, moe));
      TV_ASSIGN_OR_RETURN(moe.shared, random.Mlp(plan.shared_intermediate.size(), hidden, fp8));
      continue;
    }
    // Row-major first, from the same seeds either way, so that a benchmark's routing does not
    // depend on the layout; then the tiles where the stream reads them.
    TV_RETURN_IF_ERROR(random.Experts(local, intermediate, hidden, moe.gate, moe.gate_ptrs));
    TV_RETURN_IF_ERROR(random.Experts(local, intermediate, hidden, moe.up, moe.up_ptrs));
    TV_RETURN_IF_ERROR(random.Experts(local, hidden, intermediate, moe.down, moe.down_ptrs));
    if (tiles) {
      TV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the fills run on the default stream
      for (auto* pointers : {&moe.gate_ptrs, &moe.up_ptrs, &moe.down_ptrs}) {
        *pointers = DeviceArray<const Bf16*>();
      }
      TV_RETURN_IF_ERROR(TileExperts(moe, local, hidden, intermediate));
    }
    TV_ASSIGN_OR_RETURN(moe.shared, random.Mlp(plan.shared_intermediate.size(), hidden, fp8));
  }
  const std::vector<float> inv_freq = c.rope_inv_freq();
  TV_ASSIGN_OR_RETURN(device.rope_inv_freq, Copy(inv_freq));
  TV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return device;
}

}  // namespace treeverify::worker
