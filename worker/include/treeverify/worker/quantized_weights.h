// The quantized formats the target models ship in, read as fp32 for the CPU backend (the
// oracle) and the loaders:
//
// - FP8 block-scaled (DeepSeek-V3 / R1; config.json `quantization_config` with `quant_method:
//   fp8`, `weight_block_size: [128, 128]`): `<p>.weight` is F8_E4M3 (e4m3fn) [out, in] and
//   `<p>.weight_scale_inv` F32 [ceil(out / 128), ceil(in / 128)]; w = fp8 x scale_inv of its
//   128 x 128 block (a multiply, whatever the name says), rounded to bf16.
// - INT4 group-quantized (Kimi-K2-Thinking style compressed-tensors `pack-quantized`, 4-bit
//   symmetric int, groups of 32 along the input dimension): `<p>.weight_packed` I32
//   [out, ceil(in / 8)], element 8j + i in bits 4i..4i+3 of word j, stored as value + 8;
//   `<p>.weight_scale` BF16 [out, ceil(in / 32)]; `<p>.weight_shape` I32 or I64 [2] = {out, in};
//   w = (nibble - 8) x scale of its group, rounded to bf16.
//
// The rounding is the formats' own: their publishers' dequantization materialises bf16 weights
// (DeepSeek-V3's weight_dequant computes the product in fp32 and stores bf16; compressed-tensors
// unpacks to the model's bf16), and the GPU's quantized streams compute exactly these values, so
// the CPU oracle and the GPU hold the same weights (docs/checkpoints.md).
// Tensors the checkpoint stores plainly (bf16, f16, f32) read as before, so one reader serves
// every weight. A tensor-parallel slice must not cut a quantization block (FP8: 128 rows or
// columns) or group (INT4: 32 columns): such a split is refused with the sizes that would fit.
//
//   WeightReader reader(*checkpoint, config.quantization);  // ModelConfig parses it
//   TV_ASSIGN_OR_RETURN(auto rows, reader.ReadRows("model.layers.3.mlp.experts.7.up_proj.weight",
//                                                  {2048, 7168}, 0, 256));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "treeverify/worker/safetensors.h"
#include "treeverify/worker/weight_quantization.h"

namespace treeverify::worker {

// A slice of an INT4 weight as the checkpoint stores it, for a backend that computes on the
// quantized form (the GPU's expert stream).
struct Int4Matrix {
  int64_t rows = 0, cols = 0;    // of the slice
  int64_t group_size = 32;       // columns per scale
  std::vector<uint32_t> words;   // [rows, ceil(cols / 8)]: column 8j + i in bits 4i.. of word j, +8
  std::vector<uint16_t> scales;  // bf16 bits, [rows, ceil(cols / group_size)]
};

// A slice of an FP8 weight as the checkpoint stores it (the slice starts on block edges, so its
// blocks are the checkpoint's).
struct Fp8Matrix {
  int64_t rows = 0, cols = 0;  // of the slice
  int64_t block_rows = 128, block_cols = 128;
  std::vector<uint8_t> bytes;  // e4m3fn, [rows, cols]
  std::vector<float> scales;   // [ceil(rows / block_rows), ceil(cols / block_cols)]
};

// The weights a stored slice stands for (rounded to bf16, as above): what Read gives for it.
std::vector<float> Dequantized(const Int4Matrix& m);
std::vector<float> Dequantized(const Fp8Matrix& m);

class WeightReader {
 public:
  // `checkpoint` must outlive the reader.
  WeightReader(const Checkpoint& checkpoint, WeightQuantization quantization)
      : checkpoint_(checkpoint), quantization_(quantization) {}

  // As Checkpoint's readers, for a plain tensor or a quantized `<p>.weight` (2-D [out, in]).
  absl::StatusOr<std::vector<float>> Read(const std::string& name,
                                          const std::vector<int64_t>& shape) const;
  absl::StatusOr<std::vector<float>> ReadRows(const std::string& name,
                                              const std::vector<int64_t>& shape, int64_t row_begin,
                                              int64_t row_end) const;
  absl::StatusOr<std::vector<float>> ReadColumns(const std::string& name,
                                                 const std::vector<int64_t>& shape,
                                                 int64_t col_begin, int64_t col_end) const;

  // Rows [r0, r1) x columns [c0, c1) of the INT4 weight `name` (`<p>.weight`, stored as
  // `<p>.weight_packed` with its scales) as stored, checked as Read checks it; nullopt where the
  // checkpoint stores `name` otherwise. Read of the same slice is this, dequantized.
  absl::StatusOr<std::optional<Int4Matrix>> ReadInt4(const std::string& name,
                                                     const std::vector<int64_t>& shape, int64_t r0,
                                                     int64_t r1, int64_t c0, int64_t c1) const;

  // The same for an FP8 weight (`name` stored F8_E4M3 with `<name>_scale_inv`).
  absl::StatusOr<std::optional<Fp8Matrix>> ReadFp8(const std::string& name,
                                                   const std::vector<int64_t>& shape, int64_t r0,
                                                   int64_t r1, int64_t c0, int64_t c1) const;

  const WeightQuantization& quantization() const { return quantization_; }

 private:
  // Rows [r0, r1) x columns [c0, c1) of `name`, dequantized when it is stored quantized; plain
  // tensors go to the checkpoint's readers (`rows` / `columns` says which slice was asked).
  absl::StatusOr<std::vector<float>> Slice(const std::string& name,
                                           const std::vector<int64_t>& shape, int64_t r0,
                                           int64_t r1, int64_t c0, int64_t c1, bool rows,
                                           bool columns) const;
  absl::StatusOr<Fp8Matrix> Fp8(const std::string& name, const TensorInfo& info,
                                const std::vector<int64_t>& shape, int64_t r0, int64_t r1,
                                int64_t c0, int64_t c1) const;
  absl::StatusOr<Int4Matrix> Int4(const std::string& prefix, const std::vector<int64_t>& shape,
                                  int64_t r0, int64_t r1, int64_t c0, int64_t c1) const;

  const Checkpoint& checkpoint_;
  const WeightQuantization quantization_;
};

}  // namespace treeverify::worker
