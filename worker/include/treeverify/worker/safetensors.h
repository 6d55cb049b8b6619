// Reading (memory-mapped) and writing safetensors checkpoints.
//
// A SafetensorsFile maps one file and checks its header completely before any tensor is handed
// out: JSON well-formed, dtypes known, shapes non-negative, byte ranges inside the data section,
// sized dtype * shape, and not overlapping. A Checkpoint opens a directory holding either
// model.safetensors or a sharded model.safetensors.index.json and finds tensors by name.
// Tensors are read into fp32 (bf16, f16 and f32 are accepted), whole or as a row/column slice,
// so a tensor-parallel rank touches only the pages of its own slice.
//
//   TV_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open("/models/tiny"));
//   TV_ASSIGN_OR_RETURN(std::vector<float> w, ckpt->ReadRows("model.embed_tokens.weight", 0, 512));
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace treeverify::worker {

// kI32 / kI64 tensors (token ids in test fixtures, packed int4 weights and their shapes) can be
// opened and their raw bytes read; the float readers refuse them unless they are the parts of a
// quantized weight (quantized_weights.h). kF8E4M3 is FP8 e4m3fn (DeepSeek-V3's weights).
enum class DType { kF32, kF16, kBF16, kI32, kI64, kF8E4M3 };
size_t DTypeSize(DType dtype);
// "[2, 3]", for error messages.
std::string ShapeString(const std::vector<int64_t>& shape);

struct TensorInfo {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }
  // Raw bytes of a tensor (pointer into the mapping).
  absl::StatusOr<const uint8_t*> Data(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  const uint8_t* data_section_ = nullptr;
  std::map<std::string, TensorInfo> tensors_;
};

class Checkpoint {
 public:
  // dir holds model.safetensors, or model.safetensors.index.json and its shards.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  bool Has(const std::string& name) const;
  absl::StatusOr<TensorInfo> Info(const std::string& name) const;
  // A tensor's raw bytes (little-endian, Info's dtype and shape): what quantized formats read.
  absl::StatusOr<const uint8_t*> RawData(const std::string& name) const;
  // Whole tensor as fp32, checked against the expected shape.
  absl::StatusOr<std::vector<float>> Read(const std::string& name,
                                          const std::vector<int64_t>& expected_shape) const;
  // Rows [row_begin, row_end) of a 2-D tensor [rows, cols] (or a 1-D slice), as fp32.
  absl::StatusOr<std::vector<float>> ReadRows(const std::string& name,
                                              const std::vector<int64_t>& expected_shape,
                                              int64_t row_begin, int64_t row_end) const;
  // Columns [col_begin, col_end) of a 2-D tensor, as fp32 [rows, col_end - col_begin].
  absl::StatusOr<std::vector<float>> ReadColumns(const std::string& name,
                                                 const std::vector<int64_t>& expected_shape,
                                                 int64_t col_begin, int64_t col_end) const;

 private:
  // A tensor found by name: its file, header entry and first byte.
  struct Located {
    const SafetensorsFile* file;
    const TensorInfo* info;
    const uint8_t* data;
  };
  absl::StatusOr<Located> Locate(const std::string& name) const;
  absl::StatusOr<Located> LocateWithShape(const std::string& name,
                                          const std::vector<int64_t>& expected_shape) const;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> index_;
};

// Writes tensors to one safetensors file. Data is given as fp32 and stored in `dtype` (bf16 by
// round-to-nearest-even), or, for a tensor with its own `dtype` and `raw` bytes (the parts of a
// quantized weight: F8_E4M3 codes, packed I32 words, an I64 shape), stored as given. Used by the
// checkpoint generator and by tests.
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::optional<DType> dtype;  // this tensor's, instead of the file's
  std::string raw;             // with `dtype`: the stored bytes (values then unused)
};
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              DType dtype, const std::map<std::string, std::string>& metadata = {});

// bf16/f16 conversions (exact bit patterns; bf16 rounds to nearest even).
float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);
float F16ToFloat(uint16_t bits);
uint16_t FloatToF16(float value);
// FP8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, NaN when all
// exponent and mantissa bits are set; largest finite 448), exactly.
float Fp8E4M3ToFloat(uint8_t bits);
// The nearest FP8 e4m3fn value (ties to the even code), saturating at +-448; NaN stays NaN.
uint8_t FloatToFp8E4M3(float value);

}  // namespace treeverify::worker
