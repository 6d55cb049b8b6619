#include "treeverify/worker/quantized_weights.h"

#include <cstring>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A linear layer's weight, `<p>.weight`: the tensors the formats quantize.
constexpr char kWeight[] = ".weight";
bool IsLinearWeight(std::string_view name) {
  return name.size() > std::string_view(kWeight).size() && name.ends_with(kWeight);
}

// The bf16 nearest a dequantized product: the weight as the formats' own dequantization
// materialises it (DeepSeek-V3's weight_dequant writes bf16; compressed-tensors unpacks to the
// model's bf16), and as the GPU's streams compute it.
float ToBf16(float product) { return Bf16ToFloat(FloatToBf16(product)); }

// A slice boundary must fall on a block edge, or at the tensor's end.
absl::Status CheckAligned(const std::string& name, const char* what, int64_t begin, int64_t end,
                          int64_t size, int64_t block, const char* unit) {
  const bool aligned = begin % block == 0 && (end % block == 0 || end == size);
  if (aligned) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      name, ": the tensor-parallel split takes ", what, " [", begin, ", ", end, ") of ", size,
      ", which cuts a quantization ", unit, " of ", block,
      ": choose a world size (or expert sharding) whose slices are multiples of ", block));
}

}  // namespace

// w = bf16(fp8 x its block's scale), the product in fp32.
std::vector<float> Dequantized(const Fp8Matrix& m) {
  const int64_t scale_cols = CeilDiv(m.cols, m.block_cols);
  std::vector<float> values(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    const float* row_scales = m.scales.data() + (r / m.block_rows) * scale_cols;
    for (int64_t c = 0; c < m.cols; ++c) {
      values[r * m.cols + c] =
          ToBf16(Fp8E4M3ToFloat(m.bytes[r * m.cols + c]) * row_scales[c / m.block_cols]);
    }
  }
  return values;
}

// w = bf16((nibble - 8) x the group's scale), the product exact in fp32.
std::vector<float> Dequantized(const Int4Matrix& m) {
  const int64_t words = CeilDiv(m.cols, 8), groups = CeilDiv(m.cols, m.group_size);
  std::vector<float> values(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    for (int64_t c = 0; c < m.cols; ++c) {
      const uint32_t word = m.words[r * words + c / 8];
      const int nibble = static_cast<int>((word >> (4 * (c % 8))) & 0xF);
      const uint32_t scale_bits = uint32_t{m.scales[r * groups + c / m.group_size]} << 16;
      float scale;
      std::memcpy(&scale, &scale_bits, 4);
      values[r * m.cols + c] = ToBf16(static_cast<float>(nibble - 8) * scale);
    }
  }
  return values;
}

absl::StatusOr<std::vector<float>> WeightReader::Read(const std::string& name,
                                                      const std::vector<int64_t>& shape) const {
  if (shape.size() != 2) return checkpoint_.Read(name, shape);
  return Slice(name, shape, 0, shape[0], 0, shape[1], false, false);
}

absl::StatusOr<std::vector<float>> WeightReader::ReadRows(const std::string& name,
                                                          const std::vector<int64_t>& shape,
                                                          int64_t row_begin,
                                                          int64_t row_end) const {
  if (shape.size() != 2) return checkpoint_.ReadRows(name, shape, row_begin, row_end);
  return Slice(name, shape, row_begin, row_end, 0, shape[1], true, false);
}

absl::StatusOr<std::vector<float>> WeightReader::ReadColumns(const std::string& name,
                                                             const std::vector<int64_t>& shape,
                                                             int64_t col_begin,
                                                             int64_t col_end) const {
  return Slice(name, shape, 0, shape.size() == 2 ? shape[0] : 0, col_begin, col_end, false, true);
}

absl::StatusOr<std::vector<float>> WeightReader::Slice(const std::string& name,
                                                       const std::vector<int64_t>& shape,
                                                       int64_t r0, int64_t r1, int64_t c0,
                                                       int64_t c1, bool rows, bool columns) const {
  TV_ASSIGN_OR_RETURN(std::optional<Fp8Matrix> fp8, ReadFp8(name, shape, r0, r1, c0, c1));
  if (fp8) return Dequantized(*fp8);
  TV_ASSIGN_OR_RETURN(std::optional<Int4Matrix> int4, ReadInt4(name, shape, r0, r1, c0, c1));
  if (int4) return Dequantized(*int4);
  if (rows) return checkpoint_.ReadRows(name, shape, r0, r1);
  if (columns) return checkpoint_.ReadColumns(name, shape, c0, c1);
  return checkpoint_.Read(name, shape);
}

absl::StatusOr<Fp8Matrix> WeightReader::Fp8(const std::string& name, const TensorInfo& info,
                                            const std::vector<int64_t>& shape, int64_t r0,
                                            int64_t r1, int64_t c0, int64_t c1) const {
  if (info.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has shape ", ShapeString(info.shape),
                                                   ", expected ", ShapeString(shape)));
  }
  const int64_t out = shape[0], in = shape[1];
  const int64_t br = quantization_.block_rows, bc = quantization_.block_cols;
  TV_RETURN_IF_ERROR(CheckAligned(name, "rows", r0, r1, out, br, "block"));
  TV_RETURN_IF_ERROR(CheckAligned(name, "columns", c0, c1, in, bc, "block"));
  TV_ASSIGN_OR_RETURN(std::vector<float> scales,
                      checkpoint_.Read(name + "_scale_inv", {CeilDiv(out, br), CeilDiv(in, bc)}));
  TV_ASSIGN_OR_RETURN(const uint8_t* bytes, checkpoint_.RawData(name));
  const int64_t scale_cols = CeilDiv(in, bc);
  Fp8Matrix slice{.rows = r1 - r0, .cols = c1 - c0, .block_rows = br, .block_cols = bc};
  slice.bytes.resize(static_cast<size_t>(slice.rows * slice.cols));
  for (int64_t r = r0; r < r1; ++r) {
    std::memcpy(slice.bytes.data() + (r - r0) * slice.cols, bytes + r * in + c0,
                static_cast<size_t>(slice.cols));
  }
  // The slice's blocks: it starts on block edges.
  for (int64_t r = r0 / br; r < CeilDiv(r1, br); ++r) {
    for (int64_t c = c0 / bc; c < CeilDiv(c1, bc); ++c)
      slice.scales.push_back(scales[r * scale_cols + c]);
  }
  return slice;
}

absl::StatusOr<Int4Matrix> WeightReader::Int4(const std::string& prefix,
                                              const std::vector<int64_t>& shape, int64_t r0,
                                              int64_t r1, int64_t c0, int64_t c1) const {
  const int64_t out = shape[0], in = shape[1];
  const int64_t group = quantization_.group_size;
  // The shape the checkpoint records for the weight must be the one the model expects.
  const std::string shape_name = prefix + ".weight_shape";
  TV_ASSIGN_OR_RETURN(TensorInfo shape_info, checkpoint_.Info(shape_name));
  if (shape_info.shape != std::vector<int64_t>{2} ||
      (shape_info.dtype != DType::kI32 && shape_info.dtype != DType::kI64)) {
    return absl::InvalidArgumentError(
        absl::StrCat(shape_name, " must be an I32 or I64 tensor of shape [2]"));
  }
  TV_ASSIGN_OR_RETURN(const uint8_t* shape_bytes, checkpoint_.RawData(shape_name));
  std::vector<int64_t> recorded(2);
  for (int i = 0; i < 2; ++i) {
    if (shape_info.dtype == DType::kI64) {
      std::memcpy(&recorded[i], shape_bytes + 8 * i, 8);
    } else {
      int32_t value;
      std::memcpy(&value, shape_bytes + 4 * i, 4);
      recorded[i] = value;
    }
  }
  if (recorded != shape) {
    return absl::InvalidArgumentError(absl::StrCat(shape_name, " says ", ShapeString(recorded),
                                                   ", but the model expects ", ShapeString(shape)));
  }
  const std::string packed_name = prefix + ".weight_packed";
  TV_ASSIGN_OR_RETURN(TensorInfo packed_info, checkpoint_.Info(packed_name));
  const std::vector<int64_t> packed_shape = {out, CeilDiv(in, 8)};
  if (packed_info.dtype != DType::kI32 || packed_info.shape != packed_shape) {
    return absl::InvalidArgumentError(absl::StrCat(packed_name, " must be I32 of shape ",
                                                   ShapeString(packed_shape), ", got ",
                                                   ShapeString(packed_info.shape)));
  }
  TV_RETURN_IF_ERROR(CheckAligned(prefix + ".weight", "columns", c0, c1, in, group, "group"));
  // The format's scales are BF16; their bits are kept as stored.
  const std::string scale_name = prefix + ".weight_scale";
  TV_ASSIGN_OR_RETURN(TensorInfo scale_info, checkpoint_.Info(scale_name));
  if (scale_info.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(scale_name, " must be BF16"));
  }
  TV_ASSIGN_OR_RETURN(std::vector<float> scales,
                      checkpoint_.Read(scale_name, {out, CeilDiv(in, group)}));
  TV_ASSIGN_OR_RETURN(const uint8_t* packed, checkpoint_.RawData(packed_name));
  const int64_t words = packed_shape[1];
  const int64_t groups = CeilDiv(in, group);
  Int4Matrix slice{.rows = r1 - r0, .cols = c1 - c0, .group_size = group};
  const int64_t slice_words = CeilDiv(slice.cols, 8), slice_groups = CeilDiv(slice.cols, group);
  slice.words.assign(static_cast<size_t>(slice.rows * slice_words), 0);
  slice.scales.resize(static_cast<size_t>(slice.rows * slice_groups));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = packed + r * words * 4;
    uint32_t* destination = slice.words.data() + (r - r0) * slice_words;
    if (c0 % 8 == 0) {
      std::memcpy(destination, row + c0 / 8 * 4, static_cast<size_t>(slice_words) * 4);
    } else {
      for (int64_t c = c0; c < c1; ++c) {
        uint32_t word;
        std::memcpy(&word, row + (c / 8) * 4, 4);
        const uint32_t nibble = (word >> (4 * (c % 8))) & 0xF;
        destination[(c - c0) / 8] |= nibble << (4 * ((c - c0) % 8));
      }
    }
    // Nibbles of the last word past the slice's end are the stored value of zero.
    const int64_t tail = slice.cols % 8;
    if (tail != 0) {
      uint32_t& last = destination[slice_words - 1];
      const uint32_t kept = (uint32_t{1} << (4 * tail)) - 1;
      last = (last & kept) | (0x88888888u & ~kept);
    }
    for (int64_t g = 0; g < slice_groups; ++g) {
      // bf16 values read as fp32 are exact: their bits are the top half.
      uint32_t bits;
      std::memcpy(&bits, &scales[r * groups + c0 / group + g], 4);
      slice.scales[(r - r0) * slice_groups + g] = static_cast<uint16_t>(bits >> 16);
    }
  }
  return slice;
}

absl::StatusOr<std::optional<Int4Matrix>> WeightReader::ReadInt4(const std::string& name,
                                                                 const std::vector<int64_t>& shape,
                                                                 int64_t r0, int64_t r1, int64_t c0,
                                                                 int64_t c1) const {
  if (!IsLinearWeight(name)) return std::nullopt;
  const std::string prefix = name.substr(0, name.size() - std::string_view(kWeight).size());
  if (checkpoint_.Has(name) || !checkpoint_.Has(prefix + ".weight_packed")) return std::nullopt;
  if (quantization_.method != WeightQuantization::Method::kInt4Group) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix,
                     ".weight_packed is int4, but config.json's quantization_config does not say "
                     "compressed-tensors pack-quantized"));
  }
  if (shape.size() != 2 || r0 < 0 || r0 > r1 || r1 > shape[0] || c0 < 0 || c0 > c1 ||
      c1 > shape[1]) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the slice is outside ", ShapeString(shape)));
  }
  TV_ASSIGN_OR_RETURN(Int4Matrix slice, Int4(prefix, shape, r0, r1, c0, c1));
  return slice;
}

absl::StatusOr<std::optional<Fp8Matrix>> WeightReader::ReadFp8(const std::string& name,
                                                               const std::vector<int64_t>& shape,
                                                               int64_t r0, int64_t r1, int64_t c0,
                                                               int64_t c1) const {
  if (!IsLinearWeight(name) || !checkpoint_.Has(name)) return std::nullopt;
  TV_ASSIGN_OR_RETURN(TensorInfo info, checkpoint_.Info(name));
  if (info.dtype != DType::kF8E4M3 || shape.size() != 2) return std::nullopt;
  if (quantization_.method != WeightQuantization::Method::kFp8Block) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is F8_E4M3, but config.json's quantization_config does not say fp8"));
  }
  if (r0 < 0 || r0 > r1 || r1 > shape[0] || c0 < 0 || c0 > c1 || c1 > shape[1]) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the slice is outside ", ShapeString(shape)));
  }
  TV_ASSIGN_OR_RETURN(Fp8Matrix slice, Fp8(name, info, shape, r0, r1, c0, c1));
  return slice;
}

}  // namespace treeverify::worker
