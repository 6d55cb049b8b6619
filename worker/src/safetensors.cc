#include "treeverify/worker/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

using Json = nlohmann::json;

// The data section is read and written as host-order integers; safetensors is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

// Same limit as the reference implementation (safetensors' MAX_HEADER_SIZE): a header this
// large is corruption, not a checkpoint.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::string_view kMetadataKey = "__metadata__";

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

// A short rendering of a JSON value for error messages (headers can be huge).
std::string Quote(const Json& value) {
  // Containers are named, not dumped: dump() recurses, and a hostile file can nest deeply.
  if (value.is_array()) return absl::StrCat("an array of ", value.size());
  if (value.is_object()) return absl::StrCat("an object of ", value.size(), " keys");
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > 80) text = absl::StrCat(text.substr(0, 77), "...");
  return text;
}

absl::Status TensorError(const std::string& path, const std::string& tensor,
                         absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor \"", tensor, "\": ", message));
}

absl::StatusOr<DType> ParseDType(const std::string& path, const std::string& tensor,
                                 const Json& dtype) {
  if (!dtype.is_string()) {
    return TensorError(path, tensor,
                       absl::StrCat("\"dtype\" must be a string, got ", Quote(dtype)));
  }
  const std::string& name = dtype.get_ref<const std::string&>();
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I32") return DType::kI32;
  if (name == "I64") return DType::kI64;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  return TensorError(path, tensor,
                     absl::StrCat("dtype \"", name,
                                  "\" is not supported (supported: BF16, F16, F32, F8_E4M3, I32, "
                                  "I64)"));
}

// Number of elements of `shape`, refusing negative entries and products past `limit` (so the
// byte size cannot overflow).
absl::StatusOr<uint64_t> CountElements(const std::string& path, const std::string& tensor,
                                       const std::vector<int64_t>& shape, uint64_t limit) {
  for (int64_t dim : shape) {
    if (dim < 0) {
      return TensorError(path, tensor,
                         absl::StrCat("shape ", ShapeString(shape), " has a negative dimension"));
    }
  }
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  uint64_t numel = 1;
  for (int64_t dim : shape) {
    if (static_cast<uint64_t>(dim) > limit / numel) {
      return TensorError(path, tensor, absl::StrCat("shape ", ShapeString(shape), " is too large"));
    }
    numel *= static_cast<uint64_t>(dim);
  }
  return numel;
}

absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& path, const std::string& tensor,
                                            const Json& entry, uint64_t data_size) {
  if (!entry.is_object()) {
    return TensorError(path, tensor, absl::StrCat("entry must be an object, got ", Quote(entry)));
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) {
      return TensorError(path, tensor, absl::StrCat("\"", key, "\" is missing"));
    }
  }
  TensorInfo info;
  TV_ASSIGN_OR_RETURN(info.dtype, ParseDType(path, tensor, entry["dtype"]));

  const Json& shape = entry["shape"];
  if (!shape.is_array()) {
    return TensorError(path, tensor,
                       absl::StrCat("\"shape\" must be an array, got ", Quote(shape)));
  }
  for (const Json& dim : shape) {
    if (dim.is_number_unsigned() && dim.get<uint64_t>() <= std::numeric_limits<int64_t>::max()) {
      info.shape.push_back(dim.get<int64_t>());
    } else if (dim.is_number_integer() && !dim.is_number_unsigned()) {
      info.shape.push_back(dim.get<int64_t>());  // negative: refused by CountElements
    } else {
      return TensorError(path, tensor,
                         absl::StrCat("\"shape\" entries must be integers, got ", Quote(shape)));
    }
  }

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    return TensorError(
        path, tensor,
        absl::StrCat("\"data_offsets\" must be [begin, end] with non-negative integers, got ",
                     Quote(offsets)));
  }
  info.begin = offsets[0].get<uint64_t>();
  info.end = offsets[1].get<uint64_t>();
  if (info.begin > info.end) {
    return TensorError(
        path, tensor,
        absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] begin after end"));
  }
  if (info.end > data_size) {
    return TensorError(
        path, tensor,
        absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                     "] run past the data section of ", data_size, " bytes (file truncated?)"));
  }

  const size_t element_size = DTypeSize(info.dtype);
  TV_ASSIGN_OR_RETURN(uint64_t numel, CountElements(path, tensor, info.shape,
                                                    std::numeric_limits<uint64_t>::max() / 8));
  if (info.end - info.begin != numel * element_size) {
    return TensorError(
        path, tensor,
        absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] hold ", info.end - info.begin,
                     " bytes, but shape ", ShapeString(info.shape), " of ", DTypeName(info.dtype),
                     " needs ", numel * element_size));
  }
  return info;
}

absl::Status CheckMetadata(const std::string& path, const Json& metadata) {
  if (!metadata.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": \"__metadata__\" must be an object of strings, got ", Quote(metadata)));
  }
  for (const auto& [key, value] : metadata.items()) {
    if (!value.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": \"__metadata__\" entry \"", key,
                                                     "\" must be a string, got ", Quote(value)));
    }
  }
  return absl::OkStatus();
}

// Tensors with bytes must occupy disjoint ranges; empty tensors occupy nothing.
absl::Status CheckNoOverlap(const std::string& path,
                            const std::map<std::string, TensorInfo>& tensors) {
  std::vector<std::tuple<uint64_t, uint64_t, const std::string*>> ranges;
  for (const auto& [name, info] : tensors) {
    if (info.end > info.begin) ranges.emplace_back(info.begin, info.end, &name);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    const auto& [prev_begin, prev_end, prev_name] = ranges[i - 1];
    const auto& [begin, end, name] = ranges[i];
    if (begin < prev_end) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor \"", *name, "\" (bytes [", begin, ", ", end, ")) overlaps tensor \"",
          *prev_name, "\" (bytes [", prev_begin, ", ", prev_end, "))"));
    }
  }
  return absl::OkStatus();
}

void ConvertToFloat(const uint8_t* source, DType dtype, size_t count, float* destination) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(destination, source, count * sizeof(float));
      return;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, source + 2 * i, 2);
        destination[i] = Bf16ToFloat(bits);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, source + 2 * i, 2);
        destination[i] = F16ToFloat(bits);
      }
      return;
    case DType::kI32:  // refused by LocateWithShape before any conversion, as are these
    case DType::kI64:
    case DType::kF8E4M3:
      return;
  }
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  std::string contents;
  char buffer[1 << 16];
  size_t read;
  while ((read = std::fread(buffer, 1, sizeof(buffer), file)) > 0) contents.append(buffer, read);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return absl::InvalidArgumentError(absl::StrCat(path, ": read error"));
  return contents;
}

// Shard names come from a file we do not control: keep them inside the checkpoint directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Conversions

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF8E4M3:
      return 1;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
  }
  return 1;
}

float Fp8E4M3ToFloat(uint8_t bits) {
  const float sign = (bits & 0x80) != 0 ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);  // subnormal
  return sign * std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
}

uint8_t FloatToFp8E4M3(float value) {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float magnitude = std::fabs(value);
  // The finite codes 0x00..0x7E increase with their value: find the nearest by bisection.
  int low = 0, high = 0x7E;
  if (magnitude >= Fp8E4M3ToFloat(0x7E)) return static_cast<uint8_t>(sign | 0x7E);
  while (high - low > 1) {
    const int middle = (low + high) / 2;
    if (Fp8E4M3ToFloat(static_cast<uint8_t>(middle)) <= magnitude) {
      low = middle;
    } else {
      high = middle;
    }
  }
  const float below = magnitude - Fp8E4M3ToFloat(static_cast<uint8_t>(low));
  const float above = Fp8E4M3ToFloat(static_cast<uint8_t>(high)) - magnitude;
  const int nearest = below < above ? low : (above < below ? high : (low % 2 == 0 ? low : high));
  return static_cast<uint8_t>(sign | nearest);
}

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep the sign and top payload bits, and set the quiet bit so the payload cannot
    // truncate to zero (which would turn it into infinity).
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float F16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToF16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {
    if (magnitude == 0x7f800000u) return sign | 0x7c00u;                          // infinity
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));  // quiet NaN
  }
  // 65520 = 65504 + half an ulp rounds (to even) up to 2^16, past the largest f16.
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
  if (magnitude >= 0x38800000u) {
    // Normal f16: rebias the exponent (127 -> 15), then round the 13 dropped bits to nearest
    // even; a carry into the exponent is the correct result.
    const uint32_t rebased = magnitude - (112u << 23);
    return static_cast<uint16_t>(sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13));
  }
  const uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return sign;  // below 2^-25: rounds to zero
  // Subnormal f16: the value in units of 2^-24 is significand >> (126 - exponent).
  const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14 .. 24
  uint32_t result = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  struct stat file_stat;
  if (::fstat(fd, &file_stat) != 0) {
    const int error = errno;
    ::close(fd);
    return absl::ErrnoToStatus(error, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(file_stat.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(file_stat.st_size);
  if (file_size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is ", file_size,
                     " bytes, too short for the 8-byte header length of a safetensors file"));
  }

  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_error = errno;
  ::close(fd);  // the mapping keeps the file open
  if (mapping == MAP_FAILED) return absl::ErrnoToStatus(mmap_error, absl::StrCat(path, ": mmap"));
  file->mapping_ = mapping;
  file->mapping_size_ = file_size;
  const auto* bytes = static_cast<const uint8_t*>(mapping);

  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];
  if (header_size > file_size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_size,
                                                   " exceeds the file (", file_size, " bytes)"));
  }
  if (header_size >= kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_size,
                                                   " is over the limit of ", kMaxHeaderBytes,
                                                   " bytes"));
  }
  const uint64_t data_size = file_size - 8 - header_size;
  file->data_section_ = bytes + 8 + header_size;

  Json header;
  try {
    header = Json::parse(bytes + 8, bytes + 8 + header_size);
  } catch (const Json::exception& error) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header is not valid JSON: ", error.what()));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header must be a JSON object, got ", Quote(header)));
  }
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      TV_RETURN_IF_ERROR(CheckMetadata(path, entry));
      continue;
    }
    TV_ASSIGN_OR_RETURN(TensorInfo info, ParseTensorEntry(path, name, entry, data_size));
    file->tensors_.emplace(name, std::move(info));
  }
  TV_RETURN_IF_ERROR(CheckNoOverlap(path, file->tensors_));
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

absl::StatusOr<const uint8_t*> SafetensorsFile::Data(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor \"", name, "\""));
  }
  return data_section_ + it->second.begin;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  const std::filesystem::path root(dir);
  const std::string index_path = (root / "model.safetensors.index.json").string();
  const std::string single_path = (root / "model.safetensors").string();
  auto checkpoint = std::make_unique<Checkpoint>();
  checkpoint->dir_ = dir;
  std::error_code error;

  if (std::filesystem::exists(index_path, error)) {
    TV_ASSIGN_OR_RETURN(std::string index_text, ReadWholeFile(index_path));
    Json index;
    try {
      index = Json::parse(index_text);
    } catch (const Json::exception& parse_error) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": not valid JSON: ", parse_error.what()));
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": \"weight_map\" must be an object {tensor: shard file}"));
    }
    const Json& weight_map = index["weight_map"];
    if (weight_map.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": \"weight_map\" is empty"));
    }
    std::map<std::string, std::vector<std::string>> tensors_by_shard;
    for (const auto& [tensor, shard] : weight_map.items()) {
      if (!shard.is_string() || !IsPlainFileName(shard.get<std::string>())) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": tensor \"", tensor,
            "\" must map to a file name in the checkpoint directory, got ", Quote(shard)));
      }
      tensors_by_shard[shard.get<std::string>()].push_back(tensor);
    }
    for (const auto& [shard, tensors] : tensors_by_shard) {
      TV_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open((root / shard).string()));
      for (const std::string& tensor : tensors) {
        if (file->tensors().count(tensor) == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(index_path, ": tensor \"", tensor, "\" is mapped to shard \"", shard,
                           "\", but ", file->path(), " does not contain it"));
        }
        checkpoint->index_[tensor] = file.get();
      }
      checkpoint->files_.push_back(std::move(file));
    }
    return checkpoint;
  }

  if (std::filesystem::exists(single_path, error)) {
    TV_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(single_path));
    for (const auto& [tensor, info] : file->tensors()) checkpoint->index_[tensor] = file.get();
    checkpoint->files_.push_back(std::move(file));
    return checkpoint;
  }
  return absl::NotFoundError(absl::StrCat("no checkpoint in ", dir, ": neither ", index_path,
                                          " nor ", single_path, " exists"));
}

bool Checkpoint::Has(const std::string& name) const { return index_.count(name) != 0; }

absl::StatusOr<Checkpoint::Located> Checkpoint::Locate(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": checkpoint has no tensor \"", name, "\""));
  }
  const SafetensorsFile* file = it->second;
  const TensorInfo& info = file->tensors().at(name);
  TV_ASSIGN_OR_RETURN(const uint8_t* data, file->Data(name));
  return Located{file, &info, data};
}

absl::StatusOr<Checkpoint::Located> Checkpoint::LocateWithShape(
    const std::string& name, const std::vector<int64_t>& expected_shape) const {
  TV_ASSIGN_OR_RETURN(Located tensor, Locate(name));
  if (tensor.info->shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat(tensor.file->path(), ": tensor ", name,
                                                   " has shape ", ShapeString(tensor.info->shape),
                                                   ", expected ", ShapeString(expected_shape)));
  }
  const DType dtype = tensor.info->dtype;
  if (dtype == DType::kI32 || dtype == DType::kI64 || dtype == DType::kF8E4M3) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor.file->path(), ": tensor ", name, " is ", DTypeName(dtype),
                     "; weights must be BF16, F16 or F32, or a quantized format config.json's "
                     "quantization_config names"));
  }
  return tensor;
}

absl::StatusOr<TensorInfo> Checkpoint::Info(const std::string& name) const {
  TV_ASSIGN_OR_RETURN(Located tensor, Locate(name));
  return *tensor.info;
}

absl::StatusOr<const uint8_t*> Checkpoint::RawData(const std::string& name) const {
  TV_ASSIGN_OR_RETURN(Located tensor, Locate(name));
  return tensor.data;
}

absl::StatusOr<std::vector<float>> Checkpoint::Read(
    const std::string& name, const std::vector<int64_t>& expected_shape) const {
  TV_ASSIGN_OR_RETURN(Located tensor, LocateWithShape(name, expected_shape));
  const size_t count = (tensor.info->end - tensor.info->begin) / DTypeSize(tensor.info->dtype);
  std::vector<float> values(count);
  ConvertToFloat(tensor.data, tensor.info->dtype, count, values.data());
  return values;
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadRows(const std::string& name,
                                                        const std::vector<int64_t>& expected_shape,
                                                        int64_t row_begin, int64_t row_end) const {
  TV_ASSIGN_OR_RETURN(Located tensor, LocateWithShape(name, expected_shape));
  const std::vector<int64_t>& shape = tensor.info->shape;
  if (shape.size() != 1 && shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(tensor.file->path(), ": tensor ", name,
                                                   " has shape ", ShapeString(shape),
                                                   "; ReadRows takes a 1-D or 2-D tensor"));
  }
  const int64_t rows = shape[0];
  const int64_t cols = shape.size() == 2 ? shape[1] : 1;
  if (row_begin < 0 || row_begin > row_end || row_end > rows) {
    return absl::InvalidArgumentError(absl::StrCat(tensor.file->path(), ": tensor ", name,
                                                   ": rows [", row_begin, ", ", row_end,
                                                   ") are not a range inside [0, ", rows, ")"));
  }
  const size_t element_size = DTypeSize(tensor.info->dtype);
  const size_t count = static_cast<size_t>((row_end - row_begin) * cols);
  std::vector<float> values(count);
  ConvertToFloat(tensor.data + static_cast<size_t>(row_begin * cols) * element_size,
                 tensor.info->dtype, count, values.data());
  return values;
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadColumns(
    const std::string& name, const std::vector<int64_t>& expected_shape, int64_t col_begin,
    int64_t col_end) const {
  TV_ASSIGN_OR_RETURN(Located tensor, LocateWithShape(name, expected_shape));
  const std::vector<int64_t>& shape = tensor.info->shape;
  if (shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(tensor.file->path(), ": tensor ", name,
                                                   " has shape ", ShapeString(shape),
                                                   "; ReadColumns takes a 2-D tensor"));
  }
  const int64_t rows = shape[0];
  const int64_t cols = shape[1];
  if (col_begin < 0 || col_begin > col_end || col_end > cols) {
    return absl::InvalidArgumentError(absl::StrCat(tensor.file->path(), ": tensor ", name,
                                                   ": columns [", col_begin, ", ", col_end,
                                                   ") are not a range inside [0, ", cols, ")"));
  }
  const size_t element_size = DTypeSize(tensor.info->dtype);
  const size_t width = static_cast<size_t>(col_end - col_begin);
  std::vector<float> values(static_cast<size_t>(rows) * width);
  // Row by row, so only the pages holding this column range are touched.
  for (int64_t row = 0; row < rows; ++row) {
    const size_t first = static_cast<size_t>(row * cols + col_begin);
    ConvertToFloat(tensor.data + first * element_size, tensor.info->dtype, width,
                   values.data() + static_cast<size_t>(row) * width);
  }
  return values;
}

// ---------------------------------------------------------------------------------------------
// Writing

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              DType dtype, const std::map<std::string, std::string>& metadata) {
  auto is_float = [](DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; };
  if (!is_float(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": WriteSafetensors converts to F32, F16 or BF16, not ", DTypeName(dtype)));
  }
  Json header = Json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorToWrite& tensor : tensors) {
    if (tensor.name.empty() || tensor.name == kMetadataKey || !names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor name \"", tensor.name,
                                                     "\" is empty, reserved or given twice"));
    }
    TV_ASSIGN_OR_RETURN(uint64_t numel, CountElements(path, tensor.name, tensor.shape,
                                                      std::numeric_limits<uint64_t>::max() / 8));
    const DType stored = tensor.dtype.value_or(dtype);
    const bool raw = !tensor.raw.empty() || (tensor.dtype.has_value() && !is_float(stored));
    if (raw ? tensor.raw.size() != numel * DTypeSize(stored) : numel != tensor.values.size()) {
      return TensorError(path, tensor.name,
                         absl::StrCat("shape ", ShapeString(tensor.shape), " has ", numel,
                                      " elements of ", DTypeName(stored), ", but ",
                                      raw ? absl::StrCat(tensor.raw.size(), " bytes")
                                          : absl::StrCat(tensor.values.size(), " values"),
                                      " were given"));
    }
    const uint64_t bytes = numel * DTypeSize(stored);
    header[tensor.name] = {{"dtype", DTypeName(stored)},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  // Padding to 8 bytes keeps the data section aligned for readers that cast in place.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  // Written beside the target and renamed, so a reader never sees a half-written file.
  const std::string partial_path = absl::StrCat(path, ".partial");
  std::FILE* file = std::fopen(partial_path.c_str(), "wb");
  if (file == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat(partial_path, ": cannot create"));
  }
  bool ok = true;
  uint8_t length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<uint8_t>(header_text.size() >> (8 * i));
  ok = ok && std::fwrite(length_bytes, 1, 8, file) == 8;
  ok = ok && std::fwrite(header_text.data(), 1, header_text.size(), file) == header_text.size();
  std::vector<uint16_t> halves;
  for (const TensorToWrite& tensor : tensors) {
    if (!ok) break;
    if (!tensor.raw.empty()) {
      ok = std::fwrite(tensor.raw.data(), 1, tensor.raw.size(), file) == tensor.raw.size();
      continue;
    }
    const std::vector<float>& values = tensor.values;
    const DType stored = tensor.dtype.value_or(dtype);
    if (stored == DType::kF32) {
      ok = std::fwrite(values.data(), sizeof(float), values.size(), file) == values.size();
      continue;
    }
    halves.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      halves[i] = stored == DType::kBF16 ? FloatToBf16(values[i]) : FloatToF16(values[i]);
    }
    ok = std::fwrite(halves.data(), sizeof(uint16_t), halves.size(), file) == halves.size();
  }
  int write_error = errno;
  if (std::fclose(file) != 0) {
    ok = false;
    write_error = errno;
  }
  if (!ok) {
    std::remove(partial_path.c_str());
    // errno is not always set by a short fwrite; never let a failure read as OK.
    return absl::ErrnoToStatus(write_error != 0 ? write_error : EIO,
                               absl::StrCat(partial_path, ": write failed"));
  }
  if (std::rename(partial_path.c_str(), path.c_str()) != 0) {
    const int rename_error = errno;
    std::remove(partial_path.c_str());
    return absl::ErrnoToStatus(rename_error, absl::StrCat(path, ": cannot rename into place"));
  }
  return absl::OkStatus();
}

}  // namespace treeverify::worker
