// The quantized formats read as fp32: FP8 128 x 128 blocks and INT4 groups of 32 dequantize to
// exactly value x scale of each element's block or group, whole or as tensor-parallel slices at
// odd sizes (partial last blocks and groups); splits that cut a block or group, scales of the
// wrong shape, a weight_shape that disagrees, and quantized tensors without the config that names
// them are refused with messages that say so.
#include "treeverify/worker/quantized_weights.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "treeverify/worker/safetensors.h"

namespace treeverify::worker {
namespace {

using testing::HasSubstr;

// One tensor of a raw safetensors file: its dtype name, shape and bytes.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

void WriteFile(const std::filesystem::path& path, const std::vector<RawTensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const RawTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << text << data;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

class QuantizedWeightsTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(testing::TempDir()) /
           ("quantized_weights_test_" + std::to_string(::getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<Checkpoint> Open(const std::vector<RawTensor>& tensors) {
    WriteFile(dir_ / "model.safetensors", tensors);
    auto checkpoint = Checkpoint::Open(dir_.string());
    EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
    return checkpoint.ok() ? *std::move(checkpoint) : nullptr;
  }

  std::filesystem::path dir_;
};

// The bf16 nearest a dequantized product: the weights the formats stand for.
float RoundToBf16(float product) { return Bf16ToFloat(FloatToBf16(product)); }

// A random FP8 block-scaled weight [out, in] (blocks of 128, the last ones partial) and the values
// it stands for, computed here element by element.
struct Fp8Weight {
  std::vector<RawTensor> tensors;
  std::vector<float> expected;  // [out, in]
};

Fp8Weight MakeFp8(int64_t out, int64_t in, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t block_rows = (out + 127) / 128, block_cols = (in + 127) / 128;
  std::vector<float> scales(block_rows * block_cols);
  for (float& s : scales) s = std::exp(normal(rng)) / 448.f;
  std::vector<uint8_t> codes(out * in);
  for (uint8_t& code : codes) code = FloatToFp8E4M3(normal(rng) * 100.f);
  Fp8Weight w;
  w.expected.resize(out * in);
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t c = 0; c < in; ++c) {
      w.expected[r * in + c] =
          RoundToBf16(Fp8E4M3ToFloat(codes[r * in + c]) * scales[(r / 128) * block_cols + c / 128]);
    }
  }
  w.tensors = {{"l.weight", "F8_E4M3", {out, in}, Bytes(codes)},
               {"l.weight_scale_inv", "F32", {block_rows, block_cols}, Bytes(scales)}};
  return w;
}

const WeightQuantization kFp8{.method = WeightQuantization::Method::kFp8Block};
const WeightQuantization kInt4{.method = WeightQuantization::Method::kInt4Group};

TEST(Fp8E4M3EncodingTest, RoundTripsEveryCodeAndRoundsToTheNearest) {
  for (int code = 0; code <= 0xFE; ++code) {
    if (code == 0x7F) continue;  // NaN
    const float value = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if (code == 0x80) continue;  // -0 encodes as -0: checked by the sign below
    EXPECT_EQ(FloatToFp8E4M3(value), code) << value;
  }
  EXPECT_EQ(FloatToFp8E4M3(1000.f), 0x7E);  // saturates
  EXPECT_EQ(FloatToFp8E4M3(-1000.f), 0xFE);
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(1.06f)), 1.0f);  // 1.0 and 1.125 around it
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(1.07f)), 1.125f);
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(1.0625f)), 1.0f);  // a tie: to the even code
}

TEST_F(QuantizedWeightsTest, Fp8BlocksDequantizeWholeAndInSlices) {
  const int64_t out = 300, in = 200;  // partial last blocks both ways
  const Fp8Weight w = MakeFp8(out, in, 7);
  auto checkpoint = Open(w.tensors);
  ASSERT_NE(checkpoint, nullptr);
  const WeightReader reader(*checkpoint, kFp8);
  auto whole = reader.Read("l.weight", {out, in});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(*whole, w.expected);
  auto rows = reader.ReadRows("l.weight", {out, in}, 128, 300);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(*rows, std::vector<float>(w.expected.begin() + 128 * in, w.expected.end()));
  auto columns = reader.ReadColumns("l.weight", {out, in}, 0, 128);
  ASSERT_TRUE(columns.ok()) << columns.status();
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t c = 0; c < 128; ++c) {
      ASSERT_EQ((*columns)[r * 128 + c], w.expected[r * in + c]) << r << ", " << c;
    }
  }
}

TEST_F(QuantizedWeightsTest, Fp8SplitsThatCutABlockAndBadScalesAreRefused) {
  const Fp8Weight w = MakeFp8(256, 256, 8);
  auto checkpoint = Open(w.tensors);
  ASSERT_NE(checkpoint, nullptr);
  const WeightReader reader(*checkpoint, kFp8);
  const absl::Status cut = reader.ReadRows("l.weight", {256, 256}, 64, 192).status();
  EXPECT_EQ(cut.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(cut.message()), HasSubstr("cuts a quantization block of 128"));
  EXPECT_THAT(reader.ReadColumns("l.weight", {256, 256}, 0, 100).status().message(),
              HasSubstr("columns [0, 100)"));
  // The same tensors read without the config that names them.
  const WeightReader plain(*checkpoint, WeightQuantization{});
  EXPECT_THAT(plain.Read("l.weight", {256, 256}).status().message(), HasSubstr("does not say fp8"));
  // A scale tensor of the wrong shape.
  std::vector<RawTensor> bad = w.tensors;
  bad[1].shape = {1, 4};
  auto corrupt = Open(bad);
  ASSERT_NE(corrupt, nullptr);
  const absl::Status scale = WeightReader(*corrupt, kFp8).Read("l.weight", {256, 256}).status();
  EXPECT_EQ(scale.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(scale.message()), HasSubstr("l.weight_scale_inv has shape [1, 4]"));
}

// A random INT4 group-quantized weight [out, in]: packed words, BF16 scales, the recorded shape.
struct Int4Weight {
  std::vector<RawTensor> tensors;
  std::vector<float> expected;
};

Int4Weight MakeInt4(int64_t out, int64_t in, bool shape_i64, unsigned seed) {
  std::mt19937 rng(seed);
  const int64_t words = (in + 7) / 8, groups = (in + 31) / 32;
  std::vector<uint16_t> scales(out * groups);
  std::vector<float> scale_values(out * groups);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t i = 0; i < scales.size(); ++i) {
    scales[i] = FloatToBf16(std::exp(normal(rng)) * 0.01f);
    scale_values[i] = Bf16ToFloat(scales[i]);
  }
  std::vector<int32_t> packed(out * words, 0);
  Int4Weight w;
  w.expected.resize(out * in);
  std::uniform_int_distribution<int> value(-8, 7);
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t c = 0; c < in; ++c) {
      const int v = value(rng);
      uint32_t word = static_cast<uint32_t>(packed[r * words + c / 8]);
      word |= static_cast<uint32_t>(v + 8) << (4 * (c % 8));
      packed[r * words + c / 8] = static_cast<int32_t>(word);
      w.expected[r * in + c] =
          RoundToBf16(static_cast<float>(v) * scale_values[r * groups + c / 32]);
    }
  }
  w.tensors = {{"e.weight_packed", "I32", {out, words}, Bytes(packed)},
               {"e.weight_scale", "BF16", {out, groups}, Bytes(scales)}};
  if (shape_i64) {
    w.tensors.push_back({"e.weight_shape", "I64", {2}, Bytes(std::vector<int64_t>{out, in})});
  } else {
    w.tensors.push_back(
        {"e.weight_shape",
         "I32",
         {2},
         Bytes(std::vector<int32_t>{static_cast<int32_t>(out), static_cast<int32_t>(in)})});
  }
  return w;
}

TEST_F(QuantizedWeightsTest, Int4GroupsDequantizeWholeAndInSlices) {
  for (bool shape_i64 : {true, false}) {
    SCOPED_TRACE(shape_i64 ? "weight_shape I64" : "weight_shape I32");
    const int64_t out = 19, in = 100;  // a partial last word and group
    const Int4Weight w = MakeInt4(out, in, shape_i64, 11);
    auto checkpoint = Open(w.tensors);
    ASSERT_NE(checkpoint, nullptr);
    const WeightReader reader(*checkpoint, kInt4);
    auto whole = reader.Read("e.weight", {out, in});
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(*whole, w.expected);
    auto rows = reader.ReadRows("e.weight", {out, in}, 3, 10);  // rows split freely
    ASSERT_TRUE(rows.ok()) << rows.status();
    EXPECT_EQ(*rows, std::vector<float>(w.expected.begin() + 3 * in, w.expected.begin() + 10 * in));
    auto columns = reader.ReadColumns("e.weight", {out, in}, 32, 100);
    ASSERT_TRUE(columns.ok()) << columns.status();
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t c = 32; c < 100; ++c) {
        ASSERT_EQ((*columns)[r * 68 + c - 32], w.expected[r * in + c]) << r << ", " << c;
      }
    }
    const absl::Status cut = reader.ReadColumns("e.weight", {out, in}, 16, 64).status();
    EXPECT_THAT(std::string(cut.message()), HasSubstr("cuts a quantization group of 32"));
  }
}

// ReadFp8 gives the slice as stored: its bytes and its blocks' scales dequantize to Read's
// values; plain tensors are not FP8 (nullopt).
TEST_F(QuantizedWeightsTest, Fp8SlicesReadAsStored) {
  const int64_t out = 300, in = 200;
  const Fp8Weight w = MakeFp8(out, in, 8);
  std::vector<RawTensor> tensors = w.tensors;
  tensors.push_back({"n.weight", "F32", {1, 2}, Bytes(std::vector<float>{1.f, 2.f})});
  auto checkpoint = Open(tensors);
  ASSERT_NE(checkpoint, nullptr);
  const WeightReader reader(*checkpoint, kFp8);
  struct Slice {
    int64_t r0, r1, c0, c1;
  };
  for (const Slice& s : {Slice{0, out, 0, in}, Slice{128, 300, 0, in}, Slice{0, out, 128, 200},
                         Slice{256, 300, 0, 128}}) {
    SCOPED_TRACE(testing::Message() << "rows [" << s.r0 << ", " << s.r1 << ") columns [" << s.c0
                                    << ", " << s.c1 << ")");
    auto stored = reader.ReadFp8("l.weight", {out, in}, s.r0, s.r1, s.c0, s.c1);
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_TRUE(stored->has_value());
    const Fp8Matrix& m = **stored;
    const int64_t block_cols = (m.cols + 127) / 128;
    ASSERT_EQ(m.rows, s.r1 - s.r0);
    ASSERT_EQ(m.cols, s.c1 - s.c0);
    ASSERT_EQ(m.bytes.size(), static_cast<size_t>(m.rows * m.cols));
    ASSERT_EQ(m.scales.size(), static_cast<size_t>((m.rows + 127) / 128 * block_cols));
    for (int64_t r = 0; r < m.rows; ++r) {
      for (int64_t c = 0; c < m.cols; ++c) {
        const float value = RoundToBf16(Fp8E4M3ToFloat(m.bytes[r * m.cols + c]) *
                                        m.scales[(r / 128) * block_cols + c / 128]);
        ASSERT_EQ(value, w.expected[(s.r0 + r) * in + s.c0 + c]) << r << ", " << c;
      }
    }
  }
  auto plain = reader.ReadFp8("n.weight", {1, 2}, 0, 1, 0, 2);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->has_value());
  EXPECT_THAT(std::string(reader.ReadFp8("l.weight", {out, in}, 64, 300, 0, in).status().message()),
              HasSubstr("cuts a quantization block of 128"));
}

// ReadInt4 gives the slice as stored (for the GPU's quantized stream): each element's nibble and
// its group's bf16 scale dequantize to Read's value; nibbles past the slice's end in its last
// word are the stored zero (8); plain tensors are not INT4 (nullopt); scales other than BF16 are
// refused.
TEST_F(QuantizedWeightsTest, Int4SlicesReadAsStored) {
  const int64_t out = 19, in = 100;
  const Int4Weight w = MakeInt4(out, in, true, 13);
  std::vector<RawTensor> tensors = w.tensors;
  tensors.push_back({"n.weight", "F32", {2}, Bytes(std::vector<float>{1.f, 2.f})});
  auto checkpoint = Open(tensors);
  ASSERT_NE(checkpoint, nullptr);
  const WeightReader reader(*checkpoint, kInt4);
  struct Slice {
    int64_t r0, r1, c0, c1;
  };
  for (const Slice& s :
       {Slice{0, out, 0, in}, Slice{3, 10, 0, in}, Slice{0, out, 32, 100}, Slice{5, 6, 64, 96}}) {
    SCOPED_TRACE(testing::Message() << "rows [" << s.r0 << ", " << s.r1 << ") columns [" << s.c0
                                    << ", " << s.c1 << ")");
    auto stored = reader.ReadInt4("e.weight", {out, in}, s.r0, s.r1, s.c0, s.c1);
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_TRUE(stored->has_value());
    const Int4Matrix& m = **stored;
    const int64_t cols = s.c1 - s.c0, words = (cols + 7) / 8, groups = (cols + 31) / 32;
    ASSERT_EQ(m.rows, s.r1 - s.r0);
    ASSERT_EQ(m.cols, cols);
    ASSERT_EQ(m.words.size(), static_cast<size_t>(m.rows * words));
    ASSERT_EQ(m.scales.size(), static_cast<size_t>(m.rows * groups));
    for (int64_t r = 0; r < m.rows; ++r) {
      for (int64_t c = 0; c < words * 8; ++c) {
        const int nibble = static_cast<int>(m.words[r * words + c / 8] >> (4 * (c % 8)) & 0xF);
        if (c >= cols) {
          EXPECT_EQ(nibble, 8) << "past the end, row " << r << ", column " << c;
          continue;
        }
        const float value = RoundToBf16(static_cast<float>(nibble - 8) *
                                        Bf16ToFloat(m.scales[r * groups + c / 32]));
        ASSERT_EQ(value, w.expected[(s.r0 + r) * in + s.c0 + c]) << r << ", " << c;
      }
    }
  }
  auto plain = reader.ReadInt4("n.weight", {1, 2}, 0, 1, 0, 2);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->has_value());
  std::vector<RawTensor> f32_scales = w.tensors;
  std::vector<float> scales(out * 4, 0.5f);
  f32_scales[1] = {"e.weight_scale", "F32", {out, 4}, Bytes(scales)};
  auto other = Open(f32_scales);
  ASSERT_NE(other, nullptr);
  EXPECT_THAT(WeightReader(*other, kInt4).Read("e.weight", {out, in}).status().message(),
              HasSubstr("e.weight_scale must be BF16"));
}

TEST_F(QuantizedWeightsTest, Int4ShapeMismatchesAndMissingConfigAreRefused) {
  const Int4Weight w = MakeInt4(8, 64, true, 12);
  auto checkpoint = Open(w.tensors);
  ASSERT_NE(checkpoint, nullptr);
  const absl::Status shape = WeightReader(*checkpoint, kInt4).Read("e.weight", {8, 96}).status();
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(shape.message()), HasSubstr("e.weight_shape says [8, 64]"));
  EXPECT_THAT(
      WeightReader(*checkpoint, WeightQuantization{}).Read("e.weight", {8, 64}).status().message(),
      HasSubstr("does not say compressed-tensors"));
  std::vector<RawTensor> bad = w.tensors;
  bad[1].shape = {8, 1};
  bad[1].bytes = bad[1].bytes.substr(0, 16);
  auto corrupt = Open(bad);
  ASSERT_NE(corrupt, nullptr);
  EXPECT_THAT(WeightReader(*corrupt, kInt4).Read("e.weight", {8, 64}).status().message(),
              HasSubstr("e.weight_scale has shape [8, 1], expected [8, 2]"));
}

// Plain tensors read as the checkpoint's own readers give them.
TEST_F(QuantizedWeightsTest, PlainTensorsPassThrough) {
  const std::vector<float> values = {1.f, -2.f, 3.5f, 4.f, 5.f, 6.f};
  auto checkpoint =
      Open({{"n.weight", "F32", {6}, Bytes(values)}, {"p.weight", "F32", {2, 3}, Bytes(values)}});
  ASSERT_NE(checkpoint, nullptr);
  const WeightReader reader(*checkpoint, kInt4);
  EXPECT_EQ(*reader.Read("n.weight", {6}), values);
  EXPECT_EQ(*reader.ReadColumns("p.weight", {2, 3}, 1, 2), (std::vector<float>{-2.f, 5.f}));
}

}  // namespace
}  // namespace treeverify::worker
