// How a checkpoint stores its linear layers' weights, from config.json's `quantization_config`
// (model_config.cc parses it; quantized_weights.h reads the formats).
#pragma once

#include <cstdint>

namespace treeverify::worker {

struct WeightQuantization {
  enum class Method {
    kNone,       // bf16 / f16 / f32 as stored
    kFp8Block,   // DeepSeek-V3: F8_E4M3 weights, F32 scales per block
    kInt4Group,  // Kimi-K2-Thinking: compressed-tensors pack-quantized int4, BF16 group scales
  };
  Method method = Method::kNone;
  int64_t block_rows = 128;  // FP8: weight_block_size
  int64_t block_cols = 128;
  int64_t group_size = 32;  // INT4: along the input dimension
  bool operator==(const WeightQuantization&) const = default;
};

}  // namespace treeverify::worker
