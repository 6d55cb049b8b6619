// GPU MLA tree-verify attention against the CPU backend (the oracle): random queries and keys
// (never zeros), random trees, contexts that are not a multiple of the page size, pages permuted
// over a pool whose unused slots hold NaN, batches of sequences of different lengths and tree
// sizes, H in {1, 3, 8, 16, 128}, scores that keep growing along a sequence; both kernels, forced
// and planned NSPLIT; CUDA-graph replay.
#include "treeverify/kernels/cuda/mla_verify_attention.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_base.h"
#include "gtest/gtest.h"
#include "mla_verify_common.cuh"  // kernels/cuda: the split rule the kernels share

namespace treeverify::kernels::cuda {
namespace {

float RoundToBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& values) {
  std::vector<__nv_bfloat16> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = __float2bfloat16(values[i]);
  return out;
}

// A batch: per sequence a committed length and a tree (parents[i] < i, parents[0] = -1).
struct BatchSpec {
  int heads = 8;
  int latent = 512;
  int rope = 64;
  int page_size = 64;
  // Key k of a sequence's T keys is scaled by 1 + key_ramp * k / T: scores that grow along the
  // sequence, so that a row's running max keeps moving (0: plain random keys).
  float key_ramp = 0.f;
  std::vector<int32_t> committed;
  std::vector<std::vector<int32_t>> parents;
};

std::vector<int32_t> RandomTree(int nodes, std::mt19937& rng) {
  std::vector<int32_t> parents(nodes, -1);
  for (int i = 1; i < nodes; ++i) parents[i] = std::uniform_int_distribution<int>(0, i - 1)(rng);
  return parents;
}

// Host data in the layout the params struct describes, bf16-exact floats for the CPU oracle.
class Problem {
 public:
  Problem(const BatchSpec& spec, std::mt19937& rng) : spec_(spec) {
    const int seqs = static_cast<int>(spec.committed.size());
    const int dims = spec.latent + spec.rope;
    row_offsets_.push_back(0);
    for (int b = 0; b < seqs; ++b) {
      row_offsets_.push_back(row_offsets_.back() + static_cast<int32_t>(spec.parents[b].size()));
      const int32_t keys = spec.committed[b] + static_cast<int32_t>(spec.parents[b].size());
      max_pages_ = std::max(max_pages_, (keys + spec.page_size - 1) / spec.page_size);
      max_rows_ = std::max(max_rows_, static_cast<int32_t>(spec.parents[b].size()));
    }
    // Pages of all sequences plus a few spare ones, handed out in a random order.
    num_pages_ = seqs * max_pages_ + 3;
    std::vector<int32_t> pool(num_pages_);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    page_table_.assign(static_cast<size_t>(seqs) * max_pages_, -1);
    int next = 0;
    for (int b = 0; b < seqs; ++b) {
      const int32_t keys = spec.committed[b] + static_cast<int32_t>(spec.parents[b].size());
      for (int pg = 0; pg < (keys + spec.page_size - 1) / spec.page_size; ++pg) {
        page_table_[b * max_pages_ + pg] = pool[next++];
      }
    }
    // Every slot no sequence owns holds NaN: a kernel that lets one through fails.
    cache_.assign(static_cast<size_t>(num_pages_) * spec.page_size * dims, NAN);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int b = 0; b < seqs; ++b) {
      const int32_t keys = spec.committed[b] + static_cast<int32_t>(spec.parents[b].size());
      for (int32_t k = 0; k < keys; ++k) {
        const int64_t slot =
            int64_t{page_table_[b * max_pages_ + k / spec.page_size]} * spec.page_size +
            k % spec.page_size;
        const float gain = 1.f + spec.key_ramp * static_cast<float>(k) / static_cast<float>(keys);
        for (int d = 0; d < dims; ++d) cache_[slot * dims + d] = RoundToBf16(gain * normal(rng));
      }
    }
    const int64_t rows = row_offsets_.back();
    q_.resize(static_cast<size_t>(rows) * spec.heads * dims);
    for (float& v : q_) v = RoundToBf16(normal(rng));
    masks_.assign(static_cast<size_t>(rows) * kAncestorMaskWords, 0);
    for (int b = 0; b < seqs; ++b) {
      const std::vector<int32_t>& parents = spec.parents[b];
      for (size_t i = 0; i < parents.size(); ++i) {
        for (int32_t a = static_cast<int32_t>(i); a >= 0; a = parents[a]) {
          masks_[(row_offsets_[b] + i) * kAncestorMaskWords + a / 64] |= uint64_t{1} << (a % 64);
        }
      }
    }
    scale_ = 1.f / std::sqrt(192.f);
  }

  MlaVerifyShape Shape() const {
    return {.num_seqs = static_cast<int32_t>(spec_.committed.size()),
            .max_rows_per_seq = max_rows_,
            .row_capacity = row_offsets_.back(),
            .num_heads = spec_.heads,
            .latent_dim = spec_.latent,
            .rope_dim = spec_.rope,
            .page_size = spec_.page_size};
  }
  int64_t OutputSize() const { return int64_t{row_offsets_.back()} * spec_.heads * spec_.latent; }
  int64_t LseSize() const { return int64_t{row_offsets_.back()} * spec_.heads; }

  void RunCpu(std::vector<float>& out, std::vector<float>& lse) const {
    out.assign(OutputSize(), 0.f);
    lse.assign(LseSize(), 0.f);
    MlaVerifyParams<float> p;
    p.q = q_.data();
    p.kv_cache = cache_.data();
    p.page_table = page_table_.data();
    p.committed_lengths = spec_.committed.data();
    p.row_offsets = row_offsets_.data();
    p.ancestor_mask = masks_.data();
    p.out = out.data();
    p.lse = lse.data();
    FillDims(p);
    ASSERT_TRUE(cpu::MlaVerifyAttention(p).ok());
  }

  template <typename Element>
  void FillDims(MlaVerifyParams<Element>& p) const {
    p.num_seqs = static_cast<int32_t>(spec_.committed.size());
    p.num_heads = spec_.heads;
    p.latent_dim = spec_.latent;
    p.rope_dim = spec_.rope;
    p.page_size = spec_.page_size;
    p.max_pages_per_seq = max_pages_;
    p.num_pages = num_pages_;
    p.softmax_scale = scale_;
  }

  // Points the device's entry `page` of sequence `seq` outside the cache (`outside`: at or past
  // num_pages, or negative), as a caller's bug would, and zeroes that page's rows in the oracle's
  // cache: the kernels read a page outside the cache as zeros.
  void MovePageOutsideTheCache(int seq, int page, int32_t outside) {
    if (device_page_table_.empty()) device_page_table_ = page_table_;
    const size_t entry = static_cast<size_t>(seq) * max_pages_ + page;
    const int dims = spec_.latent + spec_.rope;
    std::fill_n(cache_.begin() + int64_t{page_table_[entry]} * spec_.page_size * dims,
                spec_.page_size * dims, 0.f);
    device_page_table_[entry] = outside;
  }

  int32_t num_pages() const { return num_pages_; }
  // What the device gets: the oracle's page table unless a page was moved outside the cache.
  const std::vector<int32_t>& device_page_table() const {
    return device_page_table_.empty() ? page_table_ : device_page_table_;
  }
  const BatchSpec& spec() const { return spec_; }
  const std::vector<float>& q() const { return q_; }
  const std::vector<float>& cache() const { return cache_; }
  const std::vector<int32_t>& page_table() const { return page_table_; }
  const std::vector<int32_t>& row_offsets() const { return row_offsets_; }
  const std::vector<uint64_t>& masks() const { return masks_; }

 private:
  BatchSpec spec_;
  int32_t max_pages_ = 1;
  int32_t max_rows_ = 1;
  int32_t num_pages_ = 0;
  float scale_ = 1.f;
  std::vector<int32_t> row_offsets_;
  std::vector<int32_t> page_table_;
  std::vector<int32_t> device_page_table_;  // empty: page_table_
  std::vector<float> cache_;
  std::vector<float> q_;
  std::vector<uint64_t> masks_;
};

// The problem's buffers on the device, and a way to run the GPU op on them.
class DeviceProblem {
 public:
  explicit DeviceProblem(const Problem& problem)
      : problem_(problem),
        q_(problem.q().size()),
        cache_(problem.cache().size()),
        page_table_(problem.device_page_table().size()),
        committed_(problem.spec().committed.size()),
        row_offsets_(problem.row_offsets().size()),
        masks_(problem.masks().size()),
        out_(problem.OutputSize()),
        lse_(problem.LseSize()) {
    q_.CopyFrom(ToBf16(problem.q()));
    cache_.CopyFrom(ToBf16(problem.cache()));
    page_table_.CopyFrom(problem.device_page_table());
    committed_.CopyFrom(problem.spec().committed);
    row_offsets_.CopyFrom(problem.row_offsets());
    masks_.CopyFrom(problem.masks());
  }

  MlaVerifyParamsBf16 Params() const {
    MlaVerifyParamsBf16 p;
    p.q = q_.get();
    p.kv_cache = cache_.get();
    p.page_table = page_table_.get();
    p.committed_lengths = committed_.get();
    p.row_offsets = row_offsets_.get();
    p.ancestor_mask = masks_.get();
    p.out = out_.get();
    p.lse = lse_.get();
    problem_.FillDims(p);
    return p;
  }

  // NaN in every output byte, so an unwritten element cannot pass.
  void Poison() {
    ASSERT_EQ(cudaMemset(out_.get(), 0xFF, problem_.OutputSize() * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(lse_.get(), 0xFF, problem_.LseSize() * 4), cudaSuccess);
  }

  void Fetch(std::vector<float>& out, std::vector<float>& lse) const {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<__nv_bfloat16> raw = out_.ToHost();
    out.resize(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) out[i] = __bfloat162float(raw[i]);
    lse = lse_.ToHost();
  }

  std::vector<uint8_t> Bytes() const {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> bytes(problem_.OutputSize() * 2 + problem_.LseSize() * 4);
    EXPECT_EQ(
        cudaMemcpy(bytes.data(), out_.get(), problem_.OutputSize() * 2, cudaMemcpyDeviceToHost),
        cudaSuccess);
    EXPECT_EQ(cudaMemcpy(bytes.data() + problem_.OutputSize() * 2, lse_.get(),
                         problem_.LseSize() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return bytes;
  }

  int32_t* committed() { return committed_.get(); }

 private:
  const Problem& problem_;
  DeviceBuffer<__nv_bfloat16> q_;
  DeviceBuffer<__nv_bfloat16> cache_;
  DeviceBuffer<int32_t> page_table_;
  DeviceBuffer<int32_t> committed_;
  DeviceBuffer<int32_t> row_offsets_;
  DeviceBuffer<uint64_t> masks_;
  DeviceBuffer<__nv_bfloat16> out_;
  DeviceBuffer<float> lse_;
};

// The largest errors any comparison saw, printed when the test program ends: the margin under
// the tolerances, for whoever changes the kernels' numerics.
struct WorstErrors : testing::Environment {
  static inline double output = 0;
  static inline double lse = 0;
  void TearDown() override {
    if (output > 0) {
      std::printf(
          "worst relative L2 output error %.2e (tolerance 8e-3), worst LSE error %.2e "
          "(tolerance 2e-2)\n",
          output, lse);
    }
  }
};
[[maybe_unused]] testing::Environment* const kWorstErrors =
    testing::AddGlobalTestEnvironment(new WorstErrors);

// Relative L2 error of the outputs and the largest log-sum-exp difference; every GPU value finite.
void ExpectClose(const std::vector<float>& out, const std::vector<float>& lse,
                 const std::vector<float>& ref_out, const std::vector<float>& ref_lse) {
  ASSERT_EQ(out.size(), ref_out.size());
  double diff = 0, norm = 0;
  int64_t non_finite = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) ++non_finite;
    diff += (double(out[i]) - ref_out[i]) * (double(out[i]) - ref_out[i]);
    norm += double(ref_out[i]) * ref_out[i];
  }
  double lse_err = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (!std::isfinite(lse[i])) ++non_finite;
    lse_err = std::max(lse_err, std::abs(double(lse[i]) - ref_lse[i]));
  }
  WorstErrors::output = std::max(WorstErrors::output, std::sqrt(diff / norm));
  WorstErrors::lse = std::max(WorstErrors::lse, lse_err);
  EXPECT_EQ(non_finite, 0) << "unwritten or NaN outputs";
  EXPECT_LT(std::sqrt(diff / norm), 8e-3) << "relative L2 error of the outputs";
  EXPECT_LT(lse_err, 2e-2) << "log-sum-exp";
}

class CudaMlaVerifyTest : public CudaTest {
 protected:
  // Plans, runs on poisoned outputs and workspace, and compares with the CPU oracle. (The merge
  // kernel loads every split slot of the workspace before it knows which ones the launch wrote:
  // NaN in the others must not reach the outputs.) An in-grid merge must leave its counters
  // zeroed for the next launch.
  MlaVerifyPlan RunAndCompare(const Problem& problem, const MlaVerifyOptions& options) {
    MlaVerifyPlan plan;
    absl::StatusOr<MlaVerifyPlan> planned = PlanMlaVerify(problem.Shape(), device_, options);
    EXPECT_TRUE(planned.ok()) << planned.status();
    if (!planned.ok()) return plan;
    plan = *planned;
    SCOPED_TRACE(plan.ToString());
    DeviceProblem device(problem);
    DeviceBuffer<uint8_t> workspace(std::max<int64_t>(plan.workspace_bytes, 256));
    device.Poison();
    EXPECT_EQ(cudaMemset(workspace.get(), 0xFF, plan.workspace_bytes), cudaSuccess);
    EXPECT_TRUE(PrepareMlaVerifyWorkspace(workspace.get(), plan.workspace_bytes, nullptr).ok());
    const absl::Status status = MlaVerifyAttention(device.Params(), problem.Shape(), plan,
                                                   workspace.get(), workspace.bytes(), nullptr);
    EXPECT_TRUE(status.ok()) << status;
    if (plan.merge_in_grid) {
      std::vector<uint32_t> counters(mla::kMaxMergeGroups * 2);
      EXPECT_EQ(
          cudaMemcpy(counters.data(), workspace.get(), counters.size() * 4, cudaMemcpyDeviceToHost),
          cudaSuccess);
      size_t left = 0;
      for (size_t g = 0; g < counters.size(); g += 2) left += counters[g] != 0 ? 1 : 0;
      EXPECT_EQ(left, 0u) << "merge groups whose arrivals were not reset";
    }
    std::vector<float> out, lse, ref_out, ref_lse;
    device.Fetch(out, lse);
    problem.RunCpu(ref_out, ref_lse);
    ExpectClose(out, lse, ref_out, ref_lse);
    return plan;
  }

  // RunAndCompare for each tensor-core kernel (TensorCoreKernels) at each forced NSPLIT; the wide
  // kernel with either merge forced (the in-grid one where the launch is one wave, the planner
  // refusing it elsewhere), the others with the planner's.
  void CompareEachKernel(const Problem& problem, std::initializer_list<int> nsplits) {
    using Merge = MlaVerifyOptions::Merge;
    for (MlaVerifyKernel kernel : TensorCoreKernels()) {
      for (int nsplit : nsplits) {
        std::vector<Merge> merges = {Merge::kAuto};
        if (kernel == MlaVerifyKernel::kWgmmaWide) {
          merges = {Merge::kSeparateKernel};
          const MlaVerifyOptions in_grid = {.min_split_keys = 64,
                                            .forced_nsplit = nsplit,
                                            .kernel = kernel,
                                            .merge = Merge::kInGrid};
          absl::StatusOr<MlaVerifyPlan> plan = PlanMlaVerify(problem.Shape(), device_, in_grid);
          if (plan.ok()) {
            merges.push_back(Merge::kInGrid);
          } else {
            EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
            EXPECT_GT(nsplit, device_.multiprocessors) << plan.status();
          }
        }
        for (Merge merge : merges) {
          SCOPED_TRACE(testing::Message()
                       << "nsplit " << nsplit << " kernel " << MlaVerifyKernelName(kernel)
                       << " merge " << static_cast<int>(merge));
          RunAndCompare(
              problem,
              {.min_split_keys = 64, .forced_nsplit = nsplit, .kernel = kernel, .merge = merge});
        }
      }
    }
  }

  bool HasWgmma() const {
    return device_.compute_capability_major == 9 && device_.compute_capability_minor == 0;
  }
  void CheckGraphReplay(MlaVerifyKernel kernel, bool overlap, MlaVerifyOptions::Merge merge);

  bool HasMma() const { return device_.compute_capability_major >= 8; }

  // The planner's choice, and on sm_90 each tensor-core kernel forced on the same inputs: the
  // wgmma ones and the mma.sync one (the planner's choice on other GPUs from sm_80 on).
  std::vector<MlaVerifyKernel> TensorCoreKernels() const {
    if (!HasWgmma()) return {MlaVerifyKernel::kAuto};
    return {MlaVerifyKernel::kAuto, MlaVerifyKernel::kWgmmaNarrow, MlaVerifyKernel::kWgmmaWide,
            MlaVerifyKernel::kMma};
  }
};

TEST_F(CudaMlaVerifyTest, ProductionDimsMatchTheCpuBackend) {
  std::mt19937 rng(4242);
  struct Case {
    int heads;
    int max_tree;
    int max_context;
  };
  for (const Case c : {Case{1, 40, 3000}, Case{3, 17, 2500}, Case{8, 33, 3000}, Case{16, 12, 2000},
                       Case{128, 3, 700}}) {
    for (int page_size : {16, 48, 64, 128}) {
      BatchSpec spec;
      spec.heads = c.heads;
      spec.page_size = page_size;
      const int seqs = 1 + static_cast<int>(rng() % 3);
      for (int b = 0; b < seqs; ++b) {
        spec.committed.push_back(std::uniform_int_distribution<int>(0, c.max_context)(rng));
        spec.parents.push_back(
            RandomTree(std::uniform_int_distribution<int>(1, c.max_tree)(rng), rng));
      }
      Problem problem(spec, rng);
      SCOPED_TRACE(testing::Message()
                   << "heads " << c.heads << " page " << page_size << " seqs " << seqs);
      for (MlaVerifyKernel kernel : TensorCoreKernels()) {
        for (int nsplit : {0, 1, 3}) {
          const MlaVerifyPlan plan = RunAndCompare(
              problem, {.min_split_keys = 64, .forced_nsplit = nsplit, .kernel = kernel});
          if (HasMma()) {
            EXPECT_NE(plan.kernel, MlaVerifyKernel::kSimt);
          }
        }
      }
    }
  }
}

TEST_F(CudaMlaVerifyTest, DeepTreesAndLongChains) {
  std::mt19937 rng(7);
  BatchSpec spec;
  spec.heads = 8;
  spec.committed = {5, 1000, 64};
  spec.parents = {RandomTree(255, rng), RandomTree(256, rng), {}};
  spec.parents[2].resize(200);
  for (int i = 0; i < 200; ++i) spec.parents[2][i] = i - 1;  // a chain: prefill-like
  Problem problem(spec, rng);
  for (MlaVerifyKernel kernel : TensorCoreKernels()) {
    RunAndCompare(problem, {.kernel = kernel});
    RunAndCompare(problem, {.min_split_keys = 64, .forced_nsplit = 5, .kernel = kernel});
  }
}

// The merge kernel's block follows NSPLIT (from one warp with a split per group to 16 groups of
// 16 splits), and so does the in-grid merge's lane layout (1, 2, 4 or 8 splits a lane): one of
// each size, on a context long enough for many real splits, for each kernel (the wide one leaves
// bf16 partials, the others fp32) and each merge.
TEST_F(CudaMlaVerifyTest, MergeKernelOfEverySize) {
  std::mt19937 rng(2024);
  BatchSpec spec;
  spec.heads = 8;
  spec.page_size = 64;
  spec.committed = {16000};
  spec.parents = {RandomTree(5, rng)};
  Problem problem(spec, rng);
  // Every variant of the merge kernel (2, 4 or 8 groups of one split; 16 groups of 1..16 splits)
  // once at its largest NSPLIT, and the planner's usual counts between.
  CompareEachKernel(problem, {2,  3,   4,   5,   8,   16,  32,  33,  44,  48,  64,  66, 80,
                              96, 112, 128, 132, 144, 160, 176, 192, 208, 224, 240, 256});
}

// Scores that grow along the sequence by many times the wide kernel's kMaxGrowth (2^8): its rows
// move their reference max and rescale O often, where on plain random keys they rarely do after
// the first tile. Both kernels, one split and several.
TEST_F(CudaMlaVerifyTest, ScoresThatKeepGrowing) {
  std::mt19937 rng(99);
  BatchSpec spec;
  spec.heads = 16;
  spec.key_ramp = 5.f;  // late keys score up to 6x the early ones: max log2 scores near 40
  spec.committed = {3000, 1200};
  spec.parents = {RandomTree(4, rng), RandomTree(3, rng)};
  Problem problem(spec, rng);
  CompareEachKernel(problem, {1, 3});
}

// Every row tile of the narrow kernel (8..32 packed rows, one instantiation each), each as the
// only row tile of its sequences: TP8 trees of 1..4 nodes, and 3 heads whose rows pad the tile.
// Contexts end inside a tile and a page, on pages of 48 keys (TMA boxes of 16).
TEST_F(CudaMlaVerifyTest, EveryNarrowRowTile) {
  if (!HasWgmma()) GTEST_SKIP() << "the narrow kernel needs sm_90a";
  std::mt19937 rng(32);
  for (int rows = 8; rows <= 32; rows += 8) {
    for (int heads : {8, 3}) {
      const int nodes = heads == 8 ? rows / 8 : (rows - 1) / 3;  // 3 heads: 2..10 nodes
      BatchSpec spec;
      spec.heads = heads;
      spec.page_size = 48;
      spec.committed = {3000 + static_cast<int>(rng() % 1000), static_cast<int>(rng() % 200)};
      spec.parents = {RandomTree(nodes, rng), RandomTree(std::max(1, nodes - 1), rng)};
      Problem problem(spec, rng);
      SCOPED_TRACE(testing::Message() << "rows " << rows << " heads " << heads);
      for (int nsplit : {1, 7}) {
        const MlaVerifyPlan plan =
            RunAndCompare(problem, {.min_split_keys = 64,
                                    .forced_nsplit = nsplit,
                                    .kernel = MlaVerifyKernel::kWgmmaNarrow});
        EXPECT_EQ(plan.kernel, MlaVerifyKernel::kWgmmaNarrow);
        EXPECT_EQ(plan.row_tile, rows);
        EXPECT_EQ(plan.row_tiles, 1);
      }
    }
  }
}

TEST_F(CudaMlaVerifyTest, PortableKernelAtProductionDims) {
  std::mt19937 rng(11);
  BatchSpec spec;
  spec.heads = 8;
  spec.page_size = 32;
  spec.committed = {777, 0};
  spec.parents = {RandomTree(9, rng), RandomTree(4, rng)};
  Problem problem(spec, rng);
  for (int nsplit : {1, 16}) {
    const MlaVerifyPlan plan = RunAndCompare(
        problem, {.min_split_keys = 64, .forced_nsplit = nsplit, .kernel = MlaVerifyKernel::kSimt});
    EXPECT_EQ(plan.kernel, MlaVerifyKernel::kSimt);
  }
}

// Pages that are not a multiple of 8 keys rule out the wgmma kernels (their TMA boxes); the mma
// kernel looks up every key row, so it takes them, also on sm_90.
TEST_F(CudaMlaVerifyTest, OddPageSizesTakeTheMmaKernel) {
  if (!HasMma()) GTEST_SKIP() << "the mma kernel needs sm_80 or later";
  std::mt19937 rng(14);
  for (int page_size : {12, 20}) {
    BatchSpec spec;
    spec.heads = 8;
    spec.page_size = page_size;
    spec.committed = {1000, 37};
    spec.parents = {RandomTree(9, rng), RandomTree(5, rng)};
    Problem problem(spec, rng);
    for (int nsplit : {0, 1, 5}) {
      const MlaVerifyPlan plan =
          RunAndCompare(problem, {.min_split_keys = 64, .forced_nsplit = nsplit});
      EXPECT_EQ(plan.kernel, MlaVerifyKernel::kMma) << "page size " << page_size;
    }
  }
}

// A page index outside the cache (a caller's bug) reads as a page of zeros in every kernel: no
// fault, which would end every session's work on the device. Pages past the end and negative
// ones, at page sizes the wgmma kernels (TMA) and the others (row lookups) take.
TEST_F(CudaMlaVerifyTest, PagesOutsideTheCacheReadZeros) {
  std::mt19937 rng(15);
  for (int page_size : {64, 20}) {
    BatchSpec spec;
    spec.heads = 8;
    spec.page_size = page_size;
    spec.committed = {900, 1500};
    spec.parents = {RandomTree(9, rng), RandomTree(5, rng)};
    Problem problem(spec, rng);
    problem.MovePageOutsideTheCache(0, 2, -1);
    problem.MovePageOutsideTheCache(1, 5, problem.num_pages() + 7);
    std::vector<MlaVerifyKernel> kernels = TensorCoreKernels();
    kernels.push_back(MlaVerifyKernel::kSimt);
    for (MlaVerifyKernel kernel : kernels) {
      if (page_size % 8 != 0 &&
          (kernel == MlaVerifyKernel::kWgmmaNarrow || kernel == MlaVerifyKernel::kWgmmaWide)) {
        continue;  // their TMA boxes need pages of a multiple of 8 keys
      }
      for (int nsplit : {1, 6}) {
        SCOPED_TRACE(testing::Message() << "page size " << page_size << " kernel "
                                        << MlaVerifyKernelName(kernel) << " nsplit " << nsplit);
        RunAndCompare(problem, {.min_split_keys = 64, .forced_nsplit = nsplit, .kernel = kernel});
      }
    }
  }
}

TEST_F(CudaMlaVerifyTest, TinyModelDimsUseThePortableKernel) {
  std::mt19937 rng(12);
  for (auto [latent, rope] : {std::pair{32, 8}, std::pair{64, 16}}) {
    BatchSpec spec;
    spec.heads = 4;
    spec.latent = latent;
    spec.rope = rope;
    spec.page_size = 16;
    spec.committed = {37, 300, 1};
    spec.parents = {RandomTree(7, rng), RandomTree(20, rng), RandomTree(1, rng)};
    Problem problem(spec, rng);
    const MlaVerifyPlan plan = RunAndCompare(problem, {.min_split_keys = 64});
    EXPECT_EQ(plan.kernel, MlaVerifyKernel::kSimt);
  }
}

// One capture per shape serves every step: the graph replays the same bytes as eager launches,
// and after the lengths change on the device it computes the new contexts. The graph holds four
// back-to-back launches on alternating lengths, so with overlap_predecessor each launch starts
// while the previous one finishes and must still leave exactly the last launch's result.
// A launch planned for a bucket of sequences (min_live_seqs under num_seqs) whose last ones are
// padding (no rows, no keys) gives the live sequences the bytes of an exact launch of them: each
// live count takes the NSPLIT its exact launch plans, read from the device. A bucket of 8 with 5
// to 8 live sequences, trees of 16 nodes (the wide kernel's 64-row tiles) and of 3 (narrow
// tiles), every kernel: equal bytes to the exact launch, and close to the CPU.
TEST_F(CudaMlaVerifyTest, PaddingSequencesGetTheBytesOfAnExactLaunch) {
  constexpr int kBucket = 8;
  std::vector<MlaVerifyKernel> kernels = TensorCoreKernels();
  kernels.push_back(MlaVerifyKernel::kSimt);
  for (int nodes : {16, 3}) {
    for (int live = kBucket / 2 + 1; live <= kBucket; ++live) {
      std::mt19937 rng(500 + live);
      BatchSpec spec;
      spec.heads = 8;
      for (int b = 0; b < kBucket; ++b) {
        const bool padding = b >= live;
        spec.committed.push_back(padding ? 0 : std::uniform_int_distribution<int>(2000, 9000)(rng));
        spec.parents.push_back(padding ? std::vector<int32_t>{} : RandomTree(nodes, rng));
      }
      const Problem problem(spec, rng);
      MlaVerifyShape padded = problem.Shape();
      padded.min_live_seqs = kBucket / 2 + 1;
      MlaVerifyShape exact = problem.Shape();
      exact.num_seqs = live;
      DeviceProblem device(problem);
      DeviceBuffer<int32_t> live_seqs(1);
      live_seqs.CopyFrom(std::vector<int32_t>{live});
      for (MlaVerifyKernel kernel : kernels) {
        SCOPED_TRACE(testing::Message() << "nodes " << nodes << " live " << live << " kernel "
                                        << MlaVerifyKernelName(kernel));
        const MlaVerifyOptions options = {.kernel = kernel};
        const absl::StatusOr<MlaVerifyPlan> padded_plan = PlanMlaVerify(padded, device_, options);
        const absl::StatusOr<MlaVerifyPlan> exact_plan = PlanMlaVerify(exact, device_, options);
        ASSERT_TRUE(padded_plan.ok()) << padded_plan.status();
        ASSERT_TRUE(exact_plan.ok()) << exact_plan.status();
        SCOPED_TRACE(padded_plan->ToString());
        ASSERT_EQ(padded_plan->live_nsplit.size(), kBucket / 2u);
        EXPECT_EQ(padded_plan->live_nsplit[live - padded.min_live_seqs], exact_plan->nsplit);
        DeviceBuffer<uint8_t> workspace(
            std::max<int64_t>({padded_plan->workspace_bytes, exact_plan->workspace_bytes, 256}));
        ASSERT_TRUE(PrepareMlaVerifyWorkspace(workspace.get(), workspace.bytes(), nullptr).ok());
        MlaVerifyParamsBf16 params = device.Params();
        params.num_seqs = live;
        device.Poison();
        absl::Status status = MlaVerifyAttention(params, exact, *exact_plan, workspace.get(),
                                                 workspace.bytes(), nullptr);
        ASSERT_TRUE(status.ok()) << status;
        const std::vector<uint8_t> from_exact = device.Bytes();
        device.Poison();
        status = MlaVerifyAttention(device.Params(), padded, *padded_plan, workspace.get(),
                                    workspace.bytes(), nullptr, live_seqs.get());
        ASSERT_TRUE(status.ok()) << status;
        EXPECT_TRUE(device.Bytes() == from_exact) << "the padded launch's bytes differ";
        std::vector<float> out, lse, ref_out, ref_lse;
        device.Fetch(out, lse);
        problem.RunCpu(ref_out, ref_lse);
        ExpectClose(out, lse, ref_out, ref_lse);
      }
    }
  }
}

TEST_F(CudaMlaVerifyTest, GraphReplayMatchesEagerAsContextsGrow) {
  for (MlaVerifyKernel kernel : TensorCoreKernels()) {
    for (bool overlap : {false, true}) {
      for (MlaVerifyOptions::Merge merge :
           {MlaVerifyOptions::Merge::kAuto, MlaVerifyOptions::Merge::kSeparateKernel}) {
        SCOPED_TRACE(testing::Message() << MlaVerifyKernelName(kernel) << " overlap " << overlap
                                        << " merge " << static_cast<int>(merge));
        CheckGraphReplay(kernel, overlap, merge);
      }
    }
  }
}

void CudaMlaVerifyTest::CheckGraphReplay(MlaVerifyKernel kernel, bool overlap,
                                         MlaVerifyOptions::Merge merge) {
  std::mt19937 rng(13);
  BatchSpec spec;
  spec.heads = 8;
  spec.page_size = 64;
  spec.committed = {1500, 3000};
  spec.parents = {RandomTree(9, rng), RandomTree(9, rng)};
  Problem longer(spec, rng);
  const MlaVerifyShape shape = longer.Shape();
  absl::StatusOr<MlaVerifyPlan> plan = PlanMlaVerify(
      shape, device_,
      {.min_split_keys = 64, .kernel = kernel, .overlap_predecessor = overlap, .merge = merge});
  ASSERT_TRUE(plan.ok()) << plan.status();
  DeviceProblem device(longer);
  DeviceBuffer<uint8_t> workspace(std::max<int64_t>(plan->workspace_bytes, 256));
  ASSERT_TRUE(PrepareMlaVerifyWorkspace(workspace.get(), plan->workspace_bytes, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the launches below use their own stream
  // The same cache and trees with shorter committed prefixes: another step of the sequences.
  const std::vector<int32_t> shorter = {700, 2100};
  DeviceBuffer<int32_t> other_lengths(2);
  other_lengths.CopyFrom(shorter);
  const MlaVerifyParamsBf16 main_params = device.Params();
  MlaVerifyParamsBf16 other_params = main_params;
  other_params.committed_lengths = other_lengths.get();

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto eager = [&](const MlaVerifyParamsBf16& params) {
    device.Poison();
    EXPECT_TRUE(
        MlaVerifyAttention(params, shape, *plan, workspace.get(), workspace.bytes(), stream).ok());
    return device.Bytes();
  };
  const std::vector<uint8_t> eager_long = eager(main_params);
  const std::vector<uint8_t> eager_short = eager(other_params);

  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  for (int i = 0; i < 4; ++i) {
    const MlaVerifyParamsBf16& params = i % 2 == 0 ? other_params : main_params;
    ASSERT_TRUE(
        MlaVerifyAttention(params, shape, *plan, workspace.get(), workspace.bytes(), stream).ok());
  }
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  device.Poison();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(device.Bytes() == eager_long) << "graph replay differs from the eager launch";
  std::vector<float> out, lse, ref_out, ref_lse;
  device.Fetch(out, lse);
  longer.RunCpu(ref_out, ref_lse);
  ExpectClose(out, lse, ref_out, ref_lse);

  // The lengths change on the device; the same graph now computes the shorter contexts last.
  ASSERT_EQ(cudaMemcpy(device.committed(), shorter.data(), 8, cudaMemcpyHostToDevice), cudaSuccess);
  device.Poison();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(device.Bytes() == eager_short) << "replay after the lengths changed";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The planner fills the machine from the shape alone and reports what it chose.
TEST_F(CudaMlaVerifyTest, PlannerFillsTheMachine) {
  MlaVerifyShape shape{.num_seqs = 1,
                       .max_rows_per_seq = 9,
                       .row_capacity = 9,
                       .num_heads = 8,
                       .latent_dim = 512,
                       .rope_dim = 64,
                       .page_size = 64};
  absl::StatusOr<MlaVerifyPlan> plan = PlanMlaVerify(shape, device_, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GE(plan->blocks, device_.multiprocessors * plan->blocks_per_sm * 9 / 10);
  EXPECT_LE(plan->waves, 1.0);
  EXPECT_GT(plan->workspace_bytes, 0);
  EXPECT_TRUE(plan->stagger_first_tiles) << "72 packed rows are memory-bound";
  // The split blocks merge themselves only up to 40 splits (66 on an H200: the merge kernel).
  EXPECT_EQ(plan->merge_in_grid, HasWgmma() && plan->nsplit <= 40);
  // Two wide row tiles share every key tile: splits of at least two tiles, unless asked otherwise.
  EXPECT_EQ(plan->min_split_keys, plan->kernel == MlaVerifyKernel::kSimt ? 64 : 128);
  EXPECT_EQ(PlanMlaVerify(shape, device_, {.min_split_keys = 64})->min_split_keys, 64);
  EXPECT_EQ(PlanMlaVerify(shape, device_, {.min_split_keys = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  shape.max_rows_per_seq = 1;
  shape.row_capacity = 1;
  EXPECT_EQ(PlanMlaVerify(shape, device_, {})->min_split_keys, 64) << "one row tile";
  shape.max_rows_per_seq = 64;
  shape.row_capacity = 64;
  plan = PlanMlaVerify(shape, device_, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LE(plan->nsplit, 40);
  EXPECT_EQ(plan->merge_in_grid, HasWgmma()) << "8 wide row tiles of few splits merge in the grid";
  shape.num_seqs = 64;
  shape.max_rows_per_seq = 64;
  shape.row_capacity = 64 * 64;
  plan = PlanMlaVerify(shape, device_, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->nsplit, 1);
  EXPECT_EQ(plan->workspace_bytes, 0);
  EXPECT_FALSE(plan->stagger_first_tiles) << "512 packed rows are compute-bound";
  // Split blocks that are not all resident at once cannot wait for each other.
  plan = PlanMlaVerify(shape, device_,
                       {.forced_nsplit = 4, .merge = MlaVerifyOptions::Merge::kInGrid});
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition) << plan.status();
  plan = PlanMlaVerify(shape, device_, {.forced_nsplit = 4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->waves, 1.0);
  EXPECT_FALSE(plan->merge_in_grid);
}

// The split rule (host and device code): the splits of a sequence cover its key tiles exactly
// once, in order, never more than NSPLIT of them, every non-empty one but the last of the same
// size and at least min_split_keys long; a tree's keys past whole tiles add a short last split
// (4096 + 9 keys: 65 splits of one tile, not 33 of two). Runs without a GPU.
TEST(MlaVerifySplitTest, SplitsCoverEveryTileOnce) {
  for (int32_t keys : {1, 63, 64, 65, 127, 1000, 4097, 16385, 46009, 131081}) {
    for (int32_t nsplit : {1, 2, 7, 44, 132, 256}) {
      for (int32_t min_split_keys : {1, 64, 128, 1000, 1 << 30, INT32_MAX}) {
        SCOPED_TRACE(testing::Message()
                     << keys << " keys, nsplit " << nsplit << ", min " << min_split_keys);
        const int32_t tiles = mla::CeilDiv(keys, kMlaKeyTile);
        const int32_t splits = mla::NumSplits(keys, nsplit, min_split_keys);
        ASSERT_GE(splits, 1);
        ASSERT_LE(splits, nsplit);
        int32_t next = 0;
        int32_t size = -1;
        for (int32_t s = 0; s < nsplit; ++s) {
          const mla::SplitTiles range = mla::SplitRange(keys, nsplit, min_split_keys, s);
          if (s >= splits) {
            EXPECT_EQ(range.begin, range.end) << "split " << s << " past the last has keys";
            continue;
          }
          EXPECT_EQ(range.begin, next);
          EXPECT_GT(range.end, range.begin);
          if (s + 1 < splits) {
            if (size < 0) size = range.end - range.begin;
            EXPECT_EQ(range.end - range.begin, size);
            EXPECT_GE(size * kMlaKeyTile, min_split_keys) << "split " << s << " is too short";
          }
          next = range.end;
        }
        EXPECT_EQ(next, tiles);
      }
    }
  }
  // The tree's tail: one more split, not twice the tiles per split.
  EXPECT_EQ(mla::NumSplits(4096 + 9, 66, 64), 65);
  EXPECT_EQ(mla::SplitRange(4096 + 9, 66, 64, 64).begin, 64);
  EXPECT_EQ(mla::NumSplits(4096 + 1, 132, 64), 65);
  EXPECT_EQ(mla::NumSplits(16384 + 1, 132, 64), 129);  // 257 tiles: 2 per split either way
}

// The split count packs blocks into waves (host code, no GPU): few base blocks fill exactly one
// wave; a batch whose base blocks fill most of a wave, or just overflow one, gets the splits that
// make every wave but the last nearly full; many waves of one split each stay unsplit.
TEST(MlaVerifySplitTest, SplitCountPacksWaves) {
  constexpr int64_t kSlots = 132;
  for (int64_t base : {1, 2, 3, 8, 16, 32}) {
    EXPECT_EQ(ChooseSplitCount(base, kSlots), kSlots / base) << base << " base blocks";
  }
  // 72 = batch 8 x 9 row tiles (one split: 0.55 waves), 144 = batch 8 x 18 (1.09 waves).
  for (int64_t base : {72, 96, 144, 288}) {
    const int64_t nsplit = ChooseSplitCount(base, kSlots);
    const int64_t blocks = base * nsplit;
    const int64_t waves = (blocks + kSlots - 1) / kSlots;
    EXPECT_GT(nsplit, 1) << base << " base blocks";
    EXPECT_GE(static_cast<double>(blocks) / static_cast<double>(waves * kSlots), 0.8)
        << base << " base blocks: " << nsplit << " splits in " << waves << " waves";
  }
  for (int64_t base : {128, 256, 1024, 4096}) {
    EXPECT_EQ(ChooseSplitCount(base, kSlots), 1) << base << " base blocks";
  }
  for (int64_t base = 1; base <= 5000; base += 7) {
    const int32_t nsplit = ChooseSplitCount(base, kSlots);
    ASSERT_GE(nsplit, 1);
    ASSERT_LE(nsplit, 256);
  }
}

// Shape errors are caught on the host, before any device work (these run without a GPU).
TEST(MlaVerifyShapeTest, BadShapesAreInvalidArguments) {
  DeviceInfo device;
  device.multiprocessors = 132;
  device.compute_capability_major = 9;
  const MlaVerifyShape good{.num_seqs = 1,
                            .max_rows_per_seq = 9,
                            .row_capacity = 9,
                            .num_heads = 8,
                            .latent_dim = 512,
                            .rope_dim = 64,
                            .page_size = 64};
  for (auto mutate : std::vector<void (*)(MlaVerifyShape&)>{
           [](MlaVerifyShape& s) { s.num_seqs = 0; },
           [](MlaVerifyShape& s) { s.max_rows_per_seq = 257; },
           [](MlaVerifyShape& s) { s.row_capacity = 3; },
           [](MlaVerifyShape& s) { s.latent_dim = 1024; },
           [](MlaVerifyShape& s) { s.latent_dim = 30; },
           [](MlaVerifyShape& s) { s.page_size = 0; },
           [](MlaVerifyShape& s) { s.num_seqs = 65536; },  // a grid dimension's limit
           [](MlaVerifyShape& s) { s.num_heads = 4097; },
           [](MlaVerifyShape& s) { s.rope_dim = 513; },
           [](MlaVerifyShape& s) { s.min_live_seqs = -1; },
           [](MlaVerifyShape& s) { s.min_live_seqs = 2; },  // more than num_seqs
           [](MlaVerifyShape& s) {                          // 65 live counts, 64..128
             s.num_seqs = 128;
             s.min_live_seqs = 64;
           },
       }) {
    MlaVerifyShape shape = good;
    mutate(shape);
    const absl::StatusOr<MlaVerifyPlan> plan = PlanMlaVerify(shape, device, {});
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  }
}

// A launch that its plan does not fit is refused before any device work (these run without a
// GPU: the buffers below are never touched).
TEST(MlaVerifyShapeTest, LaunchesTheirPlanDoesNotFitAreInvalidArguments) {
  const MlaVerifyShape shape{.num_seqs = 1,
                             .max_rows_per_seq = 9,
                             .row_capacity = 9,
                             .num_heads = 8,
                             .latent_dim = 512,
                             .rope_dim = 64,
                             .page_size = 64};
  MlaVerifyPlan plan;  // as the planner makes one for `shape` with two splits
  plan.shape = shape;
  plan.blocks = 132;
  plan.nsplit = 2;
  plan.workspace_bytes = 4096;
  auto at = [](uintptr_t address) { return reinterpret_cast<__nv_bfloat16*>(address); };
  MlaVerifyParamsBf16 params;
  params.q = at(0x10000);
  params.kv_cache = at(0x20000);
  params.page_table = reinterpret_cast<const int32_t*>(0x30000);
  params.committed_lengths = reinterpret_cast<const int32_t*>(0x40000);
  params.row_offsets = reinterpret_cast<const int32_t*>(0x50000);
  params.ancestor_mask = reinterpret_cast<const uint64_t*>(0x60000);
  params.out = at(0x70000);
  params.lse = reinterpret_cast<float*>(0x80000);
  params.num_seqs = 1;
  params.num_heads = 8;
  params.latent_dim = 512;
  params.rope_dim = 64;
  params.page_size = 64;
  params.num_pages = 4;
  params.max_pages_per_seq = 2;
  void* workspace = reinterpret_cast<void*>(0x100000);
  auto expect_refused = [&](const MlaVerifyParamsBf16& p, const MlaVerifyShape& s,
                            const MlaVerifyPlan& pl, void* ws, int64_t ws_bytes,
                            const std::string& names) {
    const absl::Status status = MlaVerifyAttention(p, s, pl, ws, ws_bytes, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(names), std::string::npos) << status;
  };
  expect_refused(params, shape, MlaVerifyPlan{}, workspace, 4096, "plan each shape");
  MlaVerifyShape taller = shape;
  taller.max_rows_per_seq = 17;
  taller.row_capacity = 17;
  expect_refused(params, taller, plan, workspace, 4096, "plan each shape");
  MlaVerifyParamsBf16 other_heads = params;
  other_heads.num_heads = 16;
  expect_refused(other_heads, shape, plan, workspace, 4096, "do not match");
  MlaVerifyParamsBf16 misaligned = params;
  misaligned.q = at(0x10000 + 2);
  expect_refused(misaligned, shape, plan, workspace, 4096, "aligned");
  misaligned = params;
  misaligned.out = at(0x70000 + 8);
  expect_refused(misaligned, shape, plan, workspace, 4096, "aligned");
  expect_refused(params, shape, plan, nullptr, 4096, "workspace");
  expect_refused(params, shape, plan, workspace, 4095, "workspace");
  expect_refused(params, shape, plan, reinterpret_cast<void*>(0x100000 + 128), 8192, "workspace");
  // A shape with padding sequences needs the device's live count.
  MlaVerifyShape padded = shape;
  padded.num_seqs = 4;
  padded.min_live_seqs = 3;
  MlaVerifyPlan padded_plan = plan;
  padded_plan.shape = padded;
  padded_plan.live_nsplit = {2, 2};
  MlaVerifyParamsBf16 four = params;
  four.num_seqs = 4;
  expect_refused(four, padded, padded_plan, workspace, 4096, "live_seqs");
}

}  // namespace
}  // namespace treeverify::kernels::cuda
