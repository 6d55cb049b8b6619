#include "treeverify/worker/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace treeverify::worker {
namespace {

using ::testing::HasSubstr;

float FromBits(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t ToBits(float value) { return std::bit_cast<uint32_t>(value); }

// A fresh directory per test, under the test runner's temp dir.
class SafetensorsTest : public testing::Test {
 protected:
  void SetUp() override {
    const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::path(testing::TempDir()) /
           (std::string("safetensors_test_") + info->test_suite_name() + "_" + info->name() + "_" +
            std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  void WriteBytes(const std::string& name, const std::string& bytes) const {
    std::ofstream(Path(name), std::ios::binary) << bytes;
  }

  // A safetensors file with the given header text and data section.
  void WriteRaw(const std::string& name, const std::string& header, const std::string& data) const {
    std::string bytes;
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(header.size() >> (8 * i)));
    WriteBytes(name, bytes + header + data);
  }

  std::string ReadBytes(const std::string& name) const {
    std::ifstream file(Path(name), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(file), {});
  }

  // Opening `name` must fail with InvalidArgument and a message containing the file's path and
  // each of `parts`.
  void ExpectCorrupt(const std::string& name, const std::vector<std::string>& parts) const {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(Path(name));
    ASSERT_FALSE(file.ok()) << "accepted corrupt file " << name;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
    const std::string message(file.status().message());
    EXPECT_THAT(message, HasSubstr(Path(name)));
    for (const std::string& part : parts) EXPECT_THAT(message, HasSubstr(part));
  }

  std::filesystem::path dir_;
};

// [begin, end) pairs to slice with.
std::vector<std::pair<int64_t, int64_t>> Ranges(
    std::initializer_list<std::pair<int64_t, int64_t>> ranges) {
  return ranges;
}

std::vector<float> RandomValues(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

// ---------------------------------------------------------------------------------------------
// Conversions

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(FromBits(0x3f800000)), 0x3f80);  // 1.0 exact
  EXPECT_EQ(FloatToBf16(FromBits(0x3f807fff)), 0x3f80);  // just below half: down
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000)), 0x3f80);  // tie, even below: down
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001)), 0x3f81);  // just above half: up
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000)), 0x3f82);  // tie, odd below: up to even
  EXPECT_EQ(FloatToBf16(FromBits(0xbf818000)), 0xbf82);  // negative tie
  EXPECT_EQ(FloatToBf16(FromBits(0x3fffffff)), 0x4000);  // carry into the exponent
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7fffff)), 0x7f80);  // largest float rounds to infinity
  EXPECT_EQ(FloatToBf16(FromBits(0x80000000)), 0x8000);  // -0
  EXPECT_EQ(FloatToBf16(FromBits(0x00000001)), 0x0000);  // tiny subnormal
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000)), 0x0002);  // subnormal tie, odd below
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(Bf16Test, NanStaysNan) {
  // A payload only in the low bits must not truncate to infinity.
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    const uint16_t half = FloatToBf16(FromBits(bits));
    EXPECT_TRUE(std::isnan(Bf16ToFloat(half))) << std::hex << bits;
    EXPECT_EQ(half & 0x8000, (bits >> 16) & 0x8000) << std::hex << bits;  // sign kept
  }
}

TEST(Bf16Test, EveryPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float value = Bf16ToFloat(static_cast<uint16_t>(bits));
    EXPECT_EQ(ToBits(value), bits << 16);
    if (!std::isnan(value)) {
      EXPECT_EQ(FloatToBf16(value), bits) << std::hex << bits;
    }
  }
}

TEST(F16Test, DecodesHandPickedPatterns) {
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToFloat(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(F16ToFloat(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(F16ToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(ToBits(F16ToFloat(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(F16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7c01)));
}

TEST(F16Test, EncodesWithRoundToNearestEven) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, even below
  EXPECT_EQ(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, odd below
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);  // below the tie
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // tie rounds to 2^16
  EXPECT_EQ(FloatToF16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToF16(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToF16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToF16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp: tie, up
  EXPECT_EQ(FloatToF16(std::ldexp(5.0f, -25)), 0x0002);  // 2.5 ulp: tie, down
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)), 0x0400);  // up to normal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(FloatToF16(-std::ldexp(1.0f, -30)), 0x8000);
  EXPECT_EQ(FloatToF16(FromBits(0x00000001)), 0x0000);
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(FromBits(0x7f800001)))));
}

TEST(F16Test, EveryPatternRoundTrips) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float value = F16ToFloat(static_cast<uint16_t>(bits));
    if (!std::isnan(value)) {
      EXPECT_EQ(FloatToF16(value), bits) << std::hex << bits;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Writing and reading

TEST_F(SafetensorsTest, F32RoundTripIsExact) {
  const std::vector<float> values = {
      0.0f, -0.0f, 1.0f, -3.25f, 1e-40f, 3.4e38f, std::numeric_limits<float>::infinity()};
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"),
                               {{"w", {7}, values}, {"scalar", {}, {42.5f}}}, DType::kF32)
                  .ok());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  absl::StatusOr<std::vector<float>> read = (*checkpoint)->Read("w", {7});
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(ToBits((*read)[i]), ToBits(values[i]));
  EXPECT_EQ(*(*checkpoint)->Read("scalar", {}), std::vector<float>{42.5f});
  EXPECT_EQ((*checkpoint)->Info("w")->dtype, DType::kF32);
}

TEST_F(SafetensorsTest, Bf16RoundTrip) {
  // 1.00390625 = 1 + 2^-8 is not a bf16: it is a tie and rounds to 1.0.
  const std::vector<float> values = {1.0f, -2.5f, 0.15625f, 1.00390625f, 1.01171875f, 3e38f};
  ASSERT_TRUE(
      WriteSafetensors(Path("model.safetensors"), {{"b", {2, 3}, values}}, DType::kBF16).ok());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->Info("b")->dtype, DType::kBF16);
  EXPECT_EQ((*checkpoint)->Info("b")->end - (*checkpoint)->Info("b")->begin, 12u);
  const std::vector<float> read = *(*checkpoint)->Read("b", {2, 3});
  EXPECT_EQ(read[0], 1.0f);
  EXPECT_EQ(read[1], -2.5f);
  EXPECT_EQ(read[2], 0.15625f);
  EXPECT_EQ(read[3], 1.0f);       // tie to even
  EXPECT_EQ(read[4], 1.015625f);  // 1 + 3*2^-8: tie to the even 1 + 4*2^-8
  EXPECT_EQ(read[5], Bf16ToFloat(FloatToBf16(3e38f)));
}

TEST_F(SafetensorsTest, F16RoundTrip) {
  const std::vector<float> values = {1.0f, -0.5f, 65504.0f, std::ldexp(3.0f, -24), 0.1f, 70000.0f};
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"), {{"h", {6}, values}}, DType::kF16).ok());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const std::vector<float> read = *(*checkpoint)->Read("h", {6});
  EXPECT_EQ(read[0], 1.0f);
  EXPECT_EQ(read[1], -0.5f);
  EXPECT_EQ(read[2], 65504.0f);
  EXPECT_EQ(read[3], std::ldexp(3.0f, -24));                   // subnormal, exact
  EXPECT_EQ(read[4], 0.0999755859375f);                        // nearest f16 to 0.1
  EXPECT_EQ(read[5], std::numeric_limits<float>::infinity());  // past the f16 range
}

TEST_F(SafetensorsTest, WrittenHeaderIsPaddedAndHoldsMetadata) {
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"),
                               {{"a", {3}, {1, 2, 3}}, {"bb", {1, 2}, {4, 5}}}, DType::kF32,
                               {{"format", "pt"}})
                  .ok());
  const std::string bytes = ReadBytes("model.safetensors");
  ASSERT_GE(bytes.size(), 8u);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | uint8_t(bytes[i]);
  EXPECT_EQ(header_size % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_size + 5 * sizeof(float));
  const std::string header = bytes.substr(8, header_size);
  EXPECT_THAT(header, HasSubstr(R"("__metadata__":{"format":"pt"})"));
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // only spaces after the JSON
  // Data in the order given, contiguous.
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().at("a").begin, 0u);
  EXPECT_EQ((*file)->tensors().at("a").end, 12u);
  EXPECT_EQ((*file)->tensors().at("bb").begin, 12u);
  EXPECT_EQ((*file)->tensors().at("bb").end, 20u);
  float first;
  std::memcpy(&first, *(*file)->Data("bb"), sizeof(first));
  EXPECT_EQ(first, 4.0f);
}

TEST_F(SafetensorsTest, WriteRefusesValueCountMismatch) {
  absl::Status status =
      WriteSafetensors(Path("model.safetensors"), {{"a", {2, 2}, {1, 2, 3}}}, DType::kF32);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"a\""));
  EXPECT_FALSE(std::filesystem::exists(Path("model.safetensors")));
}

TEST_F(SafetensorsTest, RowsAndColumnsMatchTheFullTensor) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t rows = 7, cols = 13;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(testing::Message() << "dtype " << static_cast<int>(dtype));
    ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"),
                                 {{"before", {3}, RandomValues(3, rng)},
                                  {"m", {rows, cols}, RandomValues(rows * cols, rng)},
                                  {"v", {11}, RandomValues(11, rng)}},
                                 dtype)
                    .ok());
    auto checkpoint = Checkpoint::Open(dir_.string());
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    const Checkpoint& ckpt = **checkpoint;
    const std::vector<float> full = *ckpt.Read("m", {rows, cols});

    for (auto [begin, end] : Ranges({{0, 7}, {0, 1}, {2, 5}, {6, 7}, {3, 3}})) {
      absl::StatusOr<std::vector<float>> slice = ckpt.ReadRows("m", {rows, cols}, begin, end);
      ASSERT_TRUE(slice.ok()) << slice.status();
      EXPECT_EQ(*slice, std::vector<float>(full.begin() + begin * cols, full.begin() + end * cols))
          << "rows [" << begin << ", " << end << ")";
    }
    for (auto [begin, end] : Ranges({{0, 13}, {0, 1}, {4, 9}, {12, 13}, {5, 5}})) {
      absl::StatusOr<std::vector<float>> slice = ckpt.ReadColumns("m", {rows, cols}, begin, end);
      ASSERT_TRUE(slice.ok()) << slice.status();
      std::vector<float> expected;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = begin; c < end; ++c) expected.push_back(full[r * cols + c]);
      }
      EXPECT_EQ(*slice, expected) << "columns [" << begin << ", " << end << ")";
    }
    // A 1-D tensor: ReadRows slices elements.
    const std::vector<float> vector = *ckpt.Read("v", {11});
    EXPECT_EQ(*ckpt.ReadRows("v", {11}, 4, 10),
              std::vector<float>(vector.begin() + 4, vector.begin() + 10));
  }
}

TEST_F(SafetensorsTest, SliceRangesAreChecked) {
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"),
                               {{"m", {7, 13}, std::vector<float>(91, 1.0f)},
                                {"v", {5}, std::vector<float>(5, 2.0f)}},
                               DType::kBF16)
                  .ok());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const Checkpoint& ckpt = **checkpoint;
  for (auto [begin, end] : Ranges({{0, 8}, {-1, 2}, {5, 4}})) {
    absl::StatusOr<std::vector<float>> rows = ckpt.ReadRows("m", {7, 13}, begin, end);
    EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument) << begin << " " << end;
    EXPECT_THAT(std::string(rows.status().message()), HasSubstr("m"));
  }
  for (auto [begin, end] : Ranges({{0, 14}, {-2, 1}, {9, 8}})) {
    EXPECT_EQ(ckpt.ReadColumns("m", {7, 13}, begin, end).status().code(),
              absl::StatusCode::kInvalidArgument)
        << begin << " " << end;
  }
  absl::StatusOr<std::vector<float>> columns_of_vector = ckpt.ReadColumns("v", {5}, 0, 1);
  EXPECT_EQ(columns_of_vector.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(columns_of_vector.status().message()), HasSubstr("2-D"));
}

TEST_F(SafetensorsTest, ReadChecksTheShape) {
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"),
                               {{"layers.0.w", {7, 13}, std::vector<float>(91, 1.0f)}}, DType::kF32)
                  .ok());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  absl::StatusOr<std::vector<float>> read = (*checkpoint)->Read("layers.0.w", {13, 7});
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(read.status().message()),
              HasSubstr("tensor layers.0.w has shape [7, 13], expected [13, 7]"));
  EXPECT_EQ((*checkpoint)->ReadRows("layers.0.w", {91}, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*checkpoint)->ReadColumns("layers.0.w", {7, 13, 1}, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, MissingTensorIsNotFound) {
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"), {{"a", {1}, {1.0f}}}, DType::kF32).ok());
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_TRUE((*checkpoint)->Has("a"));
  EXPECT_FALSE((*checkpoint)->Has("b"));
  absl::StatusOr<std::vector<float>> read = (*checkpoint)->Read("b", {1});
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("\"b\""));
  EXPECT_EQ((*checkpoint)->Info("b").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, EmptyDirectoryIsNotFoundNamingBothFiles) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(checkpoint.status().message()),
              HasSubstr(Path("model.safetensors.index.json")));
  EXPECT_THAT(std::string(checkpoint.status().message()), HasSubstr(Path("model.safetensors")));
}

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints

constexpr char kIndex[] = R"({
  "metadata": {"total_size": 40},
  "weight_map": {
    "embed": "model-00001-of-00002.safetensors",
    "norm": "model-00001-of-00002.safetensors",
    "head": "model-00002-of-00002.safetensors"
  }
})";

TEST_F(SafetensorsTest, ShardedCheckpoint) {
  ASSERT_TRUE(WriteSafetensors(Path("model-00001-of-00002.safetensors"),
                               {{"embed", {3, 2}, {1, 2, 3, 4, 5, 6}}, {"norm", {2}, {7, 8}}},
                               DType::kBF16)
                  .ok());
  ASSERT_TRUE(WriteSafetensors(Path("model-00002-of-00002.safetensors"),
                               {{"head", {2, 2}, {9, 10, 11, 12}}}, DType::kF16)
                  .ok());
  WriteBytes("model.safetensors.index.json", kIndex);
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const Checkpoint& ckpt = **checkpoint;
  EXPECT_TRUE(ckpt.Has("embed"));
  EXPECT_TRUE(ckpt.Has("norm"));
  EXPECT_TRUE(ckpt.Has("head"));
  EXPECT_EQ(*ckpt.Read("embed", {3, 2}), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(*ckpt.Read("norm", {2}), (std::vector<float>{7, 8}));
  EXPECT_EQ(*ckpt.ReadColumns("head", {2, 2}, 1, 2), (std::vector<float>{10, 12}));
  EXPECT_EQ(ckpt.Info("head")->dtype, DType::kF16);
}

TEST_F(SafetensorsTest, IndexNamingATensorItsShardLacks) {
  ASSERT_TRUE(WriteSafetensors(Path("model-00001-of-00002.safetensors"),
                               {{"embed", {3, 2}, {1, 2, 3, 4, 5, 6}}}, DType::kBF16)
                  .ok());
  ASSERT_TRUE(WriteSafetensors(Path("model-00002-of-00002.safetensors"),
                               {{"head", {2, 2}, {9, 10, 11, 12}}}, DType::kBF16)
                  .ok());
  WriteBytes("model.safetensors.index.json", kIndex);
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(checkpoint.status().message()), HasSubstr("\"norm\""));
  EXPECT_THAT(std::string(checkpoint.status().message()),
              HasSubstr("model-00001-of-00002.safetensors"));
}

TEST_F(SafetensorsTest, IndexNamingAMissingShard) {
  ASSERT_TRUE(WriteSafetensors(Path("model-00001-of-00002.safetensors"),
                               {{"embed", {3, 2}, {1, 2, 3, 4, 5, 6}}, {"norm", {2}, {7, 8}}},
                               DType::kBF16)
                  .ok());
  WriteBytes("model.safetensors.index.json", kIndex);
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(checkpoint.status().message()),
              HasSubstr("model-00002-of-00002.safetensors"));
}

TEST_F(SafetensorsTest, IndexShardOutsideTheDirectoryIsRefused) {
  WriteBytes("model.safetensors.index.json",
             R"({"weight_map": {"embed": "../elsewhere/model.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(checkpoint.status().message()), HasSubstr("\"embed\""));
}

TEST_F(SafetensorsTest, IndexThatIsNotJson) {
  WriteBytes("model.safetensors.index.json", R"({"weight_map": {"embed": )");
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(checkpoint.status().message()),
              HasSubstr("model.safetensors.index.json"));
}

// ---------------------------------------------------------------------------------------------
// Corrupt files: each is refused at Open with a message naming the file (and the tensor).

TEST_F(SafetensorsTest, CorruptEmptyFile) {
  WriteBytes("x.safetensors", "");
  ExpectCorrupt("x.safetensors", {"0 bytes"});
}

TEST_F(SafetensorsTest, CorruptTruncatedHeaderLength) {
  WriteBytes("x.safetensors", std::string("\x10\x00\x00\x00\x00", 5));
  ExpectCorrupt("x.safetensors", {"5 bytes"});
}

TEST_F(SafetensorsTest, CorruptHeaderLengthLargerThanFile) {
  WriteBytes("x.safetensors", std::string("\x00\x01\x00\x00\x00\x00\x00\x00{}", 10));
  ExpectCorrupt("x.safetensors", {"header length 256 exceeds the file"});
}

TEST_F(SafetensorsTest, CorruptHeaderLengthHuge) {
  WriteBytes("x.safetensors", std::string("\xff\xff\xff\xff\xff\xff\xff\xff{}", 10));
  ExpectCorrupt("x.safetensors", {"exceeds the file"});
}

TEST_F(SafetensorsTest, CorruptHeaderLengthOverLimit) {
  // A sparse file big enough to hold a 100 MB header: refused by the limit, not by the size.
  const uint64_t header_size = 100'000'000;
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(header_size >> (8 * i)));
  WriteBytes("x.safetensors", bytes + "{");
  std::filesystem::resize_file(Path("x.safetensors"), 8 + header_size + 16);
  ExpectCorrupt("x.safetensors", {"over the limit"});
}

TEST_F(SafetensorsTest, CorruptInvalidJson) {
  WriteRaw("x.safetensors", R"({"a": {"dtype": "F32", "shape": [1], )", "");
  ExpectCorrupt("x.safetensors", {"not valid JSON"});
}

TEST_F(SafetensorsTest, CorruptHeaderNotAnObject) {
  WriteRaw("x.safetensors", "[1, 2]", "");
  ExpectCorrupt("x.safetensors", {"must be a JSON object"});
}

TEST_F(SafetensorsTest, CorruptUnknownDtype) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}})",
           "ab");
  ExpectCorrupt("x.safetensors", {"\"w\"", "\"Q7\"", "not supported"});
}

TEST_F(SafetensorsTest, UnsupportedIntegerDtype) {
  WriteRaw("x.safetensors", R"({"ids": {"dtype": "U16", "shape": [1], "data_offsets": [0, 2]}})",
           "ab");
  ExpectCorrupt("x.safetensors",
                {"\"ids\"", "\"U16\"", "supported: BF16, F16, F32, F8_E4M3, I32, I64"});
}

// I32 tensors (token ids in fixtures) open and give their bytes, but are never read as weights.
TEST_F(SafetensorsTest, I32TensorsOpenButAreNotWeights) {
  const int32_t ids[2] = {7, -3};
  WriteRaw("model.safetensors",
           R"({"ids": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})",
           std::string(reinterpret_cast<const char*>(ids), sizeof(ids)));
  auto file = SafetensorsFile::Open(Path("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  auto data = (*file)->Data("ids");
  ASSERT_TRUE(data.ok());
  int32_t read[2];
  std::memcpy(read, *data, sizeof(read));
  EXPECT_EQ(read[0], 7);
  EXPECT_EQ(read[1], -3);
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const absl::Status status = (*checkpoint)->Read("ids", {2}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("is I32"));
}

// FP8 and I64 tensors open (the parts of quantized weights) but are not read as plain weights.
TEST_F(SafetensorsTest, Fp8AndI64TensorsOpenButAreNotPlainWeights) {
  WriteRaw("model.safetensors",
           R"({"q_proj": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]},)"
           R"( "shape": {"dtype": "I64", "shape": [2], "data_offsets": [8, 24]}})",
           std::string("\x38\x40\xb8\x7e", 4) + std::string(4, '\0') + std::string(16, '\0'));
  auto checkpoint = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  for (const char* name : {"q_proj", "shape"}) {
    const absl::Status status =
        (*checkpoint)
            ->Read(name, name == std::string("q_proj") ? std::vector<int64_t>{2, 2}
                                                       : std::vector<int64_t>{2})
            .status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(status.message()), HasSubstr("quantization_config")) << name;
  }
  auto info = (*checkpoint)->Info("q_proj");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->dtype, DType::kF8E4M3);
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
}

TEST(Fp8E4M3Test, DecodesHandPickedPatterns) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x00), 0.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);  // exponent 7 (the bias), mantissa 0
  EXPECT_EQ(Fp8E4M3ToFloat(0x40), 2.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xB8), -1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x3C), 1.5f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);  // the largest finite value
  EXPECT_EQ(Fp8E4M3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), 0.015625f);         // the smallest normal, 2^-6
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0.001953125f);      // the smallest subnormal, 2^-9
  EXPECT_EQ(Fp8E4M3ToFloat(0x07), 7 * 0.001953125f);  // the largest subnormal
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7F)));      // e4m3fn: no infinities
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xFF)));
}

TEST(Fp8E4M3Test, PositiveCodesIncreaseAndNegativesMirrorThem) {
  for (int code = 1; code <= 0x7E; ++code) {
    EXPECT_GT(Fp8E4M3ToFloat(static_cast<uint8_t>(code)),
              Fp8E4M3ToFloat(static_cast<uint8_t>(code - 1)))
        << code;
    EXPECT_EQ(Fp8E4M3ToFloat(static_cast<uint8_t>(code | 0x80)),
              -Fp8E4M3ToFloat(static_cast<uint8_t>(code)));
  }
}

TEST_F(SafetensorsTest, CorruptOffsetsOutOfRange) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
           std::string(12, '\0'));
  ExpectCorrupt("x.safetensors", {"\"w\"", "past the data section of 12 bytes"});
}

TEST_F(SafetensorsTest, CorruptOffsetsReversed) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})",
           std::string(8, '\0'));
  ExpectCorrupt("x.safetensors", {"\"w\"", "begin after end"});
}

TEST_F(SafetensorsTest, CorruptNegativeOffset) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})",
           std::string(8, '\0'));
  ExpectCorrupt("x.safetensors", {"\"w\"", "data_offsets"});
}

TEST_F(SafetensorsTest, CorruptOverlappingTensors) {
  WriteRaw("x.safetensors",
           R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
           R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
           std::string(12, '\0'));
  ExpectCorrupt("x.safetensors", {"\"a\"", "\"b\"", "overlaps"});
}

TEST_F(SafetensorsTest, EmptyTensorsDoNotOverlap) {
  WriteRaw("x.safetensors",
           R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
           R"( "e": {"dtype": "BF16", "shape": [0, 5], "data_offsets": [4, 4]}})",
           std::string(8, '\0'));
  auto file = SafetensorsFile::Open(Path("x.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 2u);
}

TEST_F(SafetensorsTest, CorruptSizeMismatchWithShape) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 8]}})",
           std::string(12, '\0'));
  ExpectCorrupt("x.safetensors", {"\"w\"", "hold 8 bytes", "[3, 2]", "needs 12"});
}

TEST_F(SafetensorsTest, CorruptTruncatedDataSection) {
  ASSERT_TRUE(WriteSafetensors(Path("x.safetensors"),
                               {{"a", {4}, {1, 2, 3, 4}}, {"b", {4}, {5, 6, 7, 8}}}, DType::kF32)
                  .ok());
  const std::string bytes = ReadBytes("x.safetensors");
  WriteBytes("x.safetensors", bytes.substr(0, bytes.size() - 5));
  ExpectCorrupt("x.safetensors", {"\"b\"", "file truncated?"});
}

TEST_F(SafetensorsTest, CorruptNegativeShape) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 8]}})",
           std::string(8, '\0'));
  ExpectCorrupt("x.safetensors", {"\"w\"", "negative"});
}

TEST_F(SafetensorsTest, CorruptHugeShapeDoesNotOverflow) {
  // 2^32 * 2^32 elements wraps to 0 in 64 bits; it must be refused, not accepted as empty.
  WriteRaw("x.safetensors",
           R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
           "");
  ExpectCorrupt("x.safetensors", {"\"w\"", "too large"});
}

TEST_F(SafetensorsTest, CorruptMissingKey) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "F32", "shape": [1]}})", std::string(4, '\0'));
  ExpectCorrupt("x.safetensors", {"\"w\"", "\"data_offsets\" is missing"});
}

TEST_F(SafetensorsTest, CorruptShapeNotIntegers) {
  WriteRaw("x.safetensors", R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})",
           std::string(4, '\0'));
  ExpectCorrupt("x.safetensors", {"\"w\"", "\"shape\""});
}

TEST_F(SafetensorsTest, CorruptMetadataNotStrings) {
  WriteRaw("x.safetensors", R"({"__metadata__": {"format": 3}})", "");
  ExpectCorrupt("x.safetensors", {"__metadata__", "\"format\""});
}

// Deep nesting where a dtype belongs: refused with a message, never a stack overflow.
TEST_F(SafetensorsTest, CorruptDeeplyNestedValue) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  WriteRaw("x.safetensors",
           R"({"w": {"dtype": )" + deep + R"(, "shape": [1], "data_offsets": [0, 4]}})", "abcd");
  ExpectCorrupt("x.safetensors", {"\"w\"", "dtype", "an array of 1"});
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(Path("absent.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(file.status().message()), HasSubstr(Path("absent.safetensors")));
}

TEST_F(SafetensorsTest, RandomCorruptionNeverCrashes) {
  // Flip and truncate bytes of a valid file: Open may succeed or fail, but must not crash, and
  // whatever it accepts must stay inside the mapping.
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ASSERT_TRUE(
      WriteSafetensors(Path("good.safetensors"),
                       {{"a", {3, 5}, RandomValues(15, rng)}, {"b", {7}, RandomValues(7, rng)}},
                       DType::kBF16)
          .ok());
  const std::string good = ReadBytes("good.safetensors");
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    if (rng() % 3 == 0) bytes.resize(rng() % bytes.size());
    WriteBytes("bad.safetensors", bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
        SafetensorsFile::Open(Path("bad.safetensors"));
    if (!file.ok()) {
      EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
      continue;
    }
    for (const auto& [name, info] : (*file)->tensors()) {
      EXPECT_LE(info.end, bytes.size()) << name;
    }
  }
}

}  // namespace
}  // namespace treeverify::worker
