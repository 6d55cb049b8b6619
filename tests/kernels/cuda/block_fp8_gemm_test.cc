// FP8 block-scaled products (block_fp8.h) against the bf16 products of their dequantized weights:
// the verify step's shapes through the resident kernel (split reductions, a head's product each,
// blocks cut by the matrix's edge) and larger ones through the dequantized scratch and cuBLASLt;
// the dequantization against the host's e4m3 decoding; and the refusals.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cuda_test_base.h"
#include "gtest/gtest.h"
#include "treeverify/kernels/cuda/block_fp8.h"
#include "treeverify/kernels/cuda/gemm.h"
#include "treeverify/kernels/cuda/resident_gemm.h"

namespace treeverify::kernels::cuda {
namespace {

struct Fp8Weights {
  int64_t batch, n, k;
  std::vector<uint8_t> bytes;  // [batch][n, k]
  std::vector<float> scales;   // [batch][ceil(n / 128), ceil(k / 128)]
};

// Any e4m3 but NaN (0x7f, 0xff); scales of either sign, about 1/sqrt(k) (weights of unit-ish
// products).
Fp8Weights RandomFp8(std::mt19937& rng, int64_t batch, int64_t n, int64_t k) {
  Fp8Weights w{.batch = batch, .n = n, .k = k};
  w.bytes.resize(batch * n * k);
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : w.bytes) {
    do {
      b = static_cast<uint8_t>(byte(rng));
    } while ((b & 0x7f) == 0x7f);
  }
  w.scales.resize(batch * Fp8ScaleCount(n, k));
  std::uniform_real_distribution<float> scale(0.5f, 2.0f);
  for (float& s : w.scales) {
    s = scale(rng) / std::sqrt(static_cast<float>(k)) * (byte(rng) % 2 ? 1.0f : -1.0f);
  }
  return w;
}

// bf16(fp32(e4m3) x scale), decoded on the host.
std::vector<Bf16> HostDequantized(const Fp8Weights& w) {
  std::vector<Bf16> out(w.bytes.size());
  const int64_t columns = Fp8ScaleColumns(w.k);
  for (int64_t b = 0; b < w.batch; ++b) {
    for (int64_t r = 0; r < w.n; ++r) {
      for (int64_t c = 0; c < w.k; ++c) {
        const int64_t i = (b * w.n + r) * w.k + c;
        __nv_fp8_e4m3 value;
        value.__x = w.bytes[i];
        const float scale =
            w.scales[b * Fp8ScaleCount(w.n, w.k) + r / kFp8BlockSize * columns + c / kFp8BlockSize];
        out[i] = __float2bfloat16_rn(static_cast<float>(value) * scale);
      }
    }
  }
  return out;
}

std::vector<Bf16> RandomBf16(std::mt19937& rng, int64_t count) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<Bf16> v(count);
  for (Bf16& x : v) x = __float2bfloat16_rn(u(rng));
  return v;
}

template <typename T>
bool SameBytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

float ToFloat(Bf16 v) { return __bfloat162float(v); }
float ToFloat(float v) { return v; }

class BlockFp8GemmTest : public CudaTest {};

// The wide path (eight bytes a thread) and the one-byte path (k not a multiple of 8) decode as
// the host does, scale blocks cut by the edges included.
TEST_F(BlockFp8GemmTest, DequantizesAsTheHostDecodes) {
  std::mt19937 rng(801);
  for (const auto& [batch, n, k] : {std::tuple<int64_t, int64_t, int64_t>{3, 200, 320},
                                    std::tuple<int64_t, int64_t, int64_t>{1, 40, 44}}) {
    SCOPED_TRACE(testing::Message() << batch << " x " << n << " x " << k);
    const Fp8Weights w = RandomFp8(rng, batch, n, k);
    DeviceBuffer<uint8_t> d_bytes(w.bytes.size());
    DeviceBuffer<float> d_scales(w.scales.size());
    DeviceBuffer<Bf16> d_out(w.bytes.size());
    d_bytes.CopyFrom(w.bytes);
    d_scales.CopyFrom(w.scales);
    ASSERT_TRUE(
        DequantizeBlockFp8(BlockFp8GemmParamsOf<Bf16>{.product = {.weight = d_bytes.get(),
                                                                  .n = n,
                                                                  .k = k,
                                                                  .batch = batch,
                                                                  .weight_batch_stride = n * k},
                                                      .scales = d_scales.get()},
                           d_out.get(), nullptr)
            .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(SameBytes(d_out.ToHost(), HostDequantized(w)));
  }
}

struct ProductCase {
  const char* name;
  int64_t m, n, k, batch;
  bool resident;  // whether the resident kernel takes it on an H200
};

// Every product of FP8 weights against cuBLASLt's product of the dequantized bf16 weights, within
// accumulation-order rounding; where the bf16 weights get the resident kernel's same plan, bit
// for bit the resident bf16 product (the FP8 kernel only adds the in-register dequantization).
template <typename Output>
void ExpectProductsOfTheDequantizedWeights(const ProductCase& c, GemmRunner& gemm,
                                           GemmRunner& cublas, const ResidentGemmDevice& device,
                                           std::mt19937& rng) {
  SCOPED_TRACE(testing::Message() << c.name << (std::is_same_v<Output, float> ? " fp32" : " bf16")
                                  << " out: " << c.m << " x " << c.n << " x " << c.k << " x "
                                  << c.batch);
  const Fp8Weights w = RandomFp8(rng, c.batch, c.n, c.k);
  DeviceBuffer<uint8_t> d_bytes(w.bytes.size());
  DeviceBuffer<float> d_scales(w.scales.size());
  DeviceBuffer<Bf16> d_weights(w.bytes.size()), d_x(c.batch * c.m * c.k);
  DeviceBuffer<Output> d_fp8(c.batch * c.m * c.n), d_resident(c.batch * c.m * c.n),
      d_cublas(c.batch * c.m * c.n);
  d_bytes.CopyFrom(w.bytes);
  d_scales.CopyFrom(w.scales);
  d_weights.CopyFrom(HostDequantized(w));
  d_x.CopyFrom(RandomBf16(rng, c.batch * c.m * c.k));
  const GemmParamsOf<Bf16, Bf16, Output> bf16{.x = d_x.get(),
                                              .weight = d_weights.get(),
                                              .y = d_resident.get(),
                                              .m = c.m,
                                              .n = c.n,
                                              .k = c.k,
                                              .batch = c.batch,
                                              .x_batch_stride = c.m * c.k,
                                              .weight_batch_stride = c.n * c.k,
                                              .y_batch_stride = c.m * c.n};
  BlockFp8GemmParamsOf<Output> fp8{.product = WithWeight(bf16, d_bytes.get()),
                                   .scales = d_scales.get()};
  fp8.product.y = d_fp8.get();
  const ResidentGemmScratch room{.tile_parts = 2048, .tiles = 2048};
  const ResidentGemmPlan fp8_plan = PlanResidentGemm(fp8.product, device, room);
  EXPECT_EQ(fp8_plan.blocks > 0, c.resident);
  const absl::Status ran = gemm.Run(fp8, nullptr);
  ASSERT_TRUE(ran.ok()) << ran;
  ASSERT_TRUE(gemm.Run(bf16, nullptr).ok());
  GemmParamsOf<Bf16, Bf16, Output> reference = bf16;
  reference.y = d_cublas.get();
  ASSERT_TRUE(cublas.Run(reference, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<Output> got = d_fp8.ToHost(), expected = d_cublas.ToHost();
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(double{ToFloat(got[i])} - ToFloat(expected[i])));
    scale = std::max(scale, std::abs(double{ToFloat(expected[i])}));
  }
  // bf16 outputs may differ by their last bit; fp32 ones by the sums' order.
  EXPECT_LE(worst, (std::is_same_v<Output, float> ? 1e-5 : 8e-3) * std::max(scale, 1.0));
  EXPECT_GT(scale, 0.0);
  const ResidentGemmPlan bf16_plan = PlanResidentGemm(bf16, device, room);
  if (fp8_plan.blocks > 0 && bf16_plan.blocks == fp8_plan.blocks &&
      bf16_plan.tiles_per_block == fp8_plan.tiles_per_block &&
      bf16_plan.slices == fp8_plan.slices && bf16_plan.k_parts == fp8_plan.k_parts) {
    EXPECT_TRUE(SameBytes(got, d_resident.ToHost())) << "the resident bf16 product's plan";
  }
}

TEST_F(BlockFp8GemmTest, ProductsAreThoseOfTheDequantizedWeights) {
  std::mt19937 rng(802);
  absl::StatusOr<std::unique_ptr<GemmRunner>> gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  absl::StatusOr<std::unique_ptr<GemmRunner>> cublas =
      GemmRunner::Create(32 << 20, /*resident_products=*/false);
  ASSERT_TRUE(cublas.ok()) << cublas.status();
  ASSERT_TRUE((*gemm)->ReserveDequantized(7168 * 2048).ok());  // the largest weight below
  absl::StatusOr<ResidentGemmDevice> device = PrepareResidentGemm();
  ASSERT_TRUE(device.ok()) << device.status();
  const bool sm90 = device->max_smem_bytes > 0;
  // DeepSeek-V3's projections at TP8 (16 heads), and cases of the tiny test models.
  for (const ProductCase& c : {
           ProductCase{"q_a (split over 4 blocks a tile)", 16, 1536, 7168, 1, sm90},
           ProductCase{"kv_a (a block cut at 576 rows)", 5, 576, 7168, 1, sm90},
           ProductCase{"q_b", 16, 3072, 1536, 1, sm90},
           ProductCase{"W_UK^T, a head each", 16, 512, 128, 16, sm90},
           ProductCase{"W_UV, a head each", 3, 128, 512, 16, sm90},
           ProductCase{"blocks larger than the matrix", 3, 48, 64, 1, sm90},
           ProductCase{"k one block and a half", 9, 64, 192, 1, sm90},
           ProductCase{"prefill rows (dequantized, cuBLASLt)", 40, 576, 7168, 1, false},
           ProductCase{"n not a multiple of 16 (dequantized, cuBLASLt)", 7, 40, 64, 1, false},
       }) {
    ExpectProductsOfTheDequantizedWeights<Bf16>(c, **gemm, **cublas, *device, rng);
  }
  for (const ProductCase& c : {
           ProductCase{"o_proj", 16, 7168, 2048, 1, sm90},
           ProductCase{"the shared expert's gate/up", 16, 512, 7168, 1, sm90},
           ProductCase{"the dense MLP's down", 2, 7168, 2304, 1, sm90},
           ProductCase{"prefill rows of o_proj (dequantized, cuBLASLt)", 100, 7168, 2048, 1, false},
       }) {
    ExpectProductsOfTheDequantizedWeights<float>(c, **gemm, **cublas, *device, rng);
  }
}

TEST_F(BlockFp8GemmTest, RefusesWhatItCannotRun) {
  absl::StatusOr<std::unique_ptr<GemmRunner>> gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  DeviceBuffer<uint8_t> d_bytes(64 * 128);
  DeviceBuffer<float> d_scales(1);
  DeviceBuffer<Bf16> d_x(40 * 128), d_y(40 * 64);
  BlockFp8GemmParamsOf<Bf16> p{
      .product =
          {.x = d_x.get(), .weight = d_bytes.get(), .y = d_y.get(), .m = 40, .n = 64, .k = 128},
      .scales = d_scales.get()};
  // More than 16 rows need the dequantized scratch, which this runner has not reserved.
  const absl::Status no_scratch = (*gemm)->Run(p, nullptr);
  EXPECT_EQ(no_scratch.code(), absl::StatusCode::kFailedPrecondition) << no_scratch;
  EXPECT_NE(no_scratch.message().find("ReserveDequantized"), std::string::npos) << no_scratch;
  BlockFp8GemmParamsOf<Bf16> strided = p;
  strided.product.weight_stride = 256;
  EXPECT_EQ((*gemm)->Run(strided, nullptr).code(), absl::StatusCode::kInvalidArgument);
  BlockFp8GemmParamsOf<Bf16> unscaled = p;
  unscaled.scales = nullptr;
  EXPECT_EQ((*gemm)->Run(unscaled, nullptr).code(), absl::StatusCode::kInvalidArgument);
  BlockFp8GemmParamsOf<Bf16> negative = p;
  negative.product.n = -16;
  EXPECT_EQ((*gemm)->Run(negative, nullptr).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*gemm)->ReserveDequantized(64 * 128).ok());
  EXPECT_TRUE((*gemm)->Run(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// FP8 weights take half the bf16 weights' shared memory: q_a and DeepSeek-V3's o_proj (16 heads a
// rank), which cuBLASLt runs in bf16, are resident products in FP8. Planning needs no GPU.
TEST(BlockFp8PlanTest, FitsProductsTheBf16WeightsDoNot) {
  const ResidentGemmDevice h200{.multiprocessors = 132, .max_smem_bytes = 227 * 1024};
  const ResidentGemmScratch room{.tile_parts = 2048, .tiles = 2048};
  alignas(16) static Bf16 x[16], w[16];
  alignas(16) static uint8_t bytes[16];
  auto shape = [](const ResidentGemmPlan& p) {
    return std::vector<int64_t>{p.blocks, p.tiles_per_block, p.slices, p.k_parts};
  };
  auto both = [&](int64_t n, int64_t k) {
    return std::pair{
        shape(PlanResidentGemm(
            GemmParamsOf<Bf16, Bf16, float>{.x = x, .weight = w, .m = 16, .n = n, .k = k}, h200,
            room)),
        shape(PlanResidentGemm(
            GemmParamsOf<Bf16, uint8_t, float>{.x = x, .weight = bytes, .m = 16, .n = n, .k = k},
            h200, room))};
  };
  const auto [q_a_bf16, q_a_fp8] = both(1536, 7168);
  EXPECT_EQ(q_a_bf16[0], 0);
  EXPECT_EQ(q_a_fp8, (std::vector<int64_t>{96, 4, 2, 4}));
  const auto [o_bf16, o_fp8] = both(7168, 2048);
  EXPECT_EQ(o_bf16[0], 0);
  EXPECT_EQ(o_fp8, (std::vector<int64_t>{112, 4, 2, 1}));
  // Where both fit, FP8 takes the most blocks, not the fewest splits of the reduction: the shared
  // expert's gate/up (Kimi-K2's at TP8) over 128 blocks, as bf16, where 64 would hold it.
  const auto [gate_up_bf16, gate_up_fp8] = both(512, 7168);
  EXPECT_EQ(gate_up_bf16, (std::vector<int64_t>{128, 1, 8, 4}));
  EXPECT_EQ(gate_up_fp8, (std::vector<int64_t>{128, 1, 8, 4}));
}

}  // namespace
}  // namespace treeverify::kernels::cuda
