#include "treeverify/kernels/mla_verify_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace treeverify::kernels {
namespace {

constexpr int kHeads = 3;
constexpr int kLatent = 20;
constexpr int kRope = 6;
constexpr int kRowDim = kLatent + kRope;
constexpr int kPageSize = 4;
constexpr float kScale = 0.3f;

// One sequence: a committed prefix and a segment (tree) after it, in a shared paged cache.
struct Sequence {
  int32_t committed = 0;
  std::vector<int32_t> parents;
  std::vector<int32_t> pages;
};

std::vector<uint64_t> AncestorMasks(const std::vector<int32_t>& parents) {
  std::vector<uint64_t> masks(parents.size() * kAncestorMaskWords, 0);
  for (size_t i = 0; i < parents.size(); ++i) {
    for (int32_t a = static_cast<int32_t>(i); a >= 0; a = parents[a]) {
      masks[i * kAncestorMaskWords + a / 64] |= uint64_t{1} << (a % 64);
    }
  }
  return masks;
}

class AttentionFixture {
 public:
  explicit AttentionFixture(unsigned seed) : rng_(seed) {}

  // Adds a sequence whose pages are taken at random from the pool (pages in any order).
  void AddSequence(int32_t committed, std::vector<int32_t> parents) {
    Sequence s{committed, std::move(parents), {}};
    const int32_t slots = committed + static_cast<int32_t>(s.parents.size());
    for (int32_t p = 0; p < (slots + kPageSize - 1) / kPageSize; ++p)
      s.pages.push_back(next_page_++);
    sequences_.push_back(std::move(s));
  }

  void Fill() {
    std::vector<int32_t> order(next_page_);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng_);
    for (Sequence& s : sequences_)
      for (int32_t& page : s.pages) page = order[page];
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    cache_.resize(size_t(next_page_) * kPageSize * kRowDim);
    for (float& v : cache_) v = dist(rng_);
    int64_t rows = 0;
    for (const Sequence& s : sequences_) rows += s.parents.size();
    q_.resize(rows * kHeads * kRowDim);
    for (float& v : q_) v = dist(rng_);
  }

  // Builds params over sequences [0, n) in order, optionally with other q rows.
  MlaVerifyParams<float> Params(const std::vector<Sequence>& sequences, const float* q) {
    max_pages_ = 0;
    for (const Sequence& s : sequences) max_pages_ = std::max<int32_t>(max_pages_, s.pages.size());
    page_table_.assign(sequences.size() * max_pages_, 0);
    committed_.clear();
    row_offsets_ = {0};
    masks_.clear();
    for (size_t b = 0; b < sequences.size(); ++b) {
      std::copy(sequences[b].pages.begin(), sequences[b].pages.end(),
                page_table_.begin() + b * max_pages_);
      committed_.push_back(sequences[b].committed);
      row_offsets_.push_back(row_offsets_.back() + sequences[b].parents.size());
      const std::vector<uint64_t> m = AncestorMasks(sequences[b].parents);
      masks_.insert(masks_.end(), m.begin(), m.end());
    }
    out_.assign(size_t(row_offsets_.back()) * kHeads * kLatent, NAN);
    lse_.assign(size_t(row_offsets_.back()) * kHeads, NAN);
    return MlaVerifyParams<float>{
        .q = q,
        .kv_cache = cache_.data(),
        .page_table = page_table_.data(),
        .committed_lengths = committed_.data(),
        .row_offsets = row_offsets_.data(),
        .ancestor_mask = masks_.data(),
        .out = out_.data(),
        .lse = lse_.data(),
        .num_seqs = static_cast<int32_t>(sequences.size()),
        .num_heads = kHeads,
        .latent_dim = kLatent,
        .rope_dim = kRope,
        .page_size = kPageSize,
        .max_pages_per_seq = max_pages_,
        .num_pages = static_cast<int32_t>(cache_.size() / (kPageSize * kRowDim)),
        .softmax_scale = kScale};
  }

  const float* KeyRow(const Sequence& s, int32_t slot) const {
    return cache_.data() +
           (size_t(s.pages[slot / kPageSize]) * kPageSize + slot % kPageSize) * kRowDim;
  }

  std::mt19937 rng_;
  std::vector<Sequence> sequences_;
  std::vector<float> cache_, q_, out_, lse_;
  std::vector<int32_t> page_table_, committed_, row_offsets_;
  std::vector<uint64_t> masks_;
  int32_t next_page_ = 0;
  int32_t max_pages_ = 0;
};

std::vector<int32_t> RandomTree(int nodes, std::mt19937& rng) {
  std::vector<int32_t> parents(nodes);
  for (int i = 0; i < nodes; ++i) parents[i] = std::uniform_int_distribution<int>(-1, i - 1)(rng);
  parents[0] = -1;
  return parents;
}

TEST(MlaVerifyAttentionTest, MatchesDoublePrecisionReference) {
  const unsigned seed = 77;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  AttentionFixture f(seed);
  f.AddSequence(0, {-1});                     // first token of a sequence: only itself
  f.AddSequence(7, RandomTree(19, f.rng_));   // crosses page boundaries
  f.AddSequence(33, RandomTree(1, f.rng_));   // a plain decode step
  f.AddSequence(5, RandomTree(130, f.rng_));  // masks beyond the first 64-bit word
  f.Fill();
  ASSERT_TRUE(cpu::MlaVerifyAttention(f.Params(f.sequences_, f.q_.data())).ok());

  int64_t row = 0;
  for (const Sequence& s : f.sequences_) {
    const std::vector<uint64_t> masks = AncestorMasks(s.parents);
    for (size_t i = 0; i < s.parents.size(); ++i, ++row) {
      std::vector<int32_t> slots(s.committed);
      std::iota(slots.begin(), slots.end(), 0);
      for (size_t j = 0; j < s.parents.size(); ++j)
        if (masks[i * kAncestorMaskWords + j / 64] >> (j % 64) & 1)
          slots.push_back(s.committed + j);
      for (int h = 0; h < kHeads; ++h) {
        const float* q = f.q_.data() + (row * kHeads + h) * kRowDim;
        std::vector<double> scores;
        double max_score = -INFINITY;
        for (int32_t slot : slots) {
          double dot = 0.0;
          for (int d = 0; d < kRowDim; ++d) dot += double{q[d]} * f.KeyRow(s, slot)[d];
          scores.push_back(dot * kScale);
          max_score = std::max(max_score, scores.back());
        }
        double sum = 0.0;
        for (double& sc : scores) sum += (sc = std::exp(sc - max_score));
        EXPECT_NEAR(f.lse_[row * kHeads + h], max_score + std::log(sum), 1e-5);
        for (int c = 0; c < kLatent; ++c) {
          double expected = 0.0;
          for (size_t j = 0; j < slots.size(); ++j)
            expected += scores[j] / sum * f.KeyRow(s, slots[j])[c];
          ASSERT_NEAR(f.out_[(row * kHeads + h) * kLatent + c], expected, 1e-5)
              << "row " << row << " head " << h << " dim " << c;
        }
      }
    }
  }
}

// A tree node's result is bit-identical to the last node of a chain made of its path, and to
// the same node computed in a batch with other sequences.
TEST(MlaVerifyAttentionTest, TreeNodeEqualsChainOfItsPathBitForBit) {
  const unsigned seed = 1234;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  AttentionFixture f(seed);
  f.AddSequence(9, RandomTree(40, f.rng_));
  f.AddSequence(3, RandomTree(11, f.rng_));
  f.Fill();
  ASSERT_TRUE(cpu::MlaVerifyAttention(f.Params(f.sequences_, f.q_.data())).ok());
  const std::vector<float> batched_out = f.out_;
  const std::vector<float> batched_lse = f.lse_;

  const Sequence tree = f.sequences_[0];
  for (int node = 0; node < static_cast<int>(tree.parents.size()); ++node) {
    std::vector<int32_t> path;
    for (int32_t a = node; a >= 0; a = tree.parents[a]) path.insert(path.begin(), a);
    // The chain: prefix = the tree's prefix, rows = the path, each path node's KV copied to the
    // chain position it would hold, in fresh pages appended to the pool.
    Sequence chain{tree.committed, {}, {}};
    for (size_t i = 0; i < path.size(); ++i) chain.parents.push_back(static_cast<int32_t>(i) - 1);
    const int32_t slots = chain.committed + static_cast<int32_t>(path.size());
    const int32_t first_new_page = static_cast<int32_t>(f.cache_.size() / (kPageSize * kRowDim));
    const int32_t pages = (slots + kPageSize - 1) / kPageSize;
    f.cache_.resize(f.cache_.size() + size_t(pages) * kPageSize * kRowDim);
    for (int32_t p = 0; p < pages; ++p) chain.pages.push_back(first_new_page + p);
    for (int32_t slot = 0; slot < slots; ++slot) {
      const int32_t source =
          slot < tree.committed ? slot : tree.committed + path[slot - tree.committed];
      std::memcpy(const_cast<float*>(f.KeyRow(chain, slot)), f.KeyRow(tree, source),
                  kRowDim * sizeof(float));
    }
    std::vector<float> q(path.size() * kHeads * kRowDim);
    for (size_t i = 0; i < path.size(); ++i)
      std::memcpy(q.data() + i * kHeads * kRowDim, f.q_.data() + size_t(path[i]) * kHeads * kRowDim,
                  kHeads * kRowDim * sizeof(float));
    ASSERT_TRUE(cpu::MlaVerifyAttention(f.Params({chain}, q.data())).ok());
    const size_t last = path.size() - 1;
    EXPECT_EQ(0, std::memcmp(f.out_.data() + last * kHeads * kLatent,
                             batched_out.data() + size_t(node) * kHeads * kLatent,
                             kHeads * kLatent * sizeof(float)))
        << "node " << node;
    EXPECT_EQ(0, std::memcmp(f.lse_.data() + last * kHeads,
                             batched_lse.data() + size_t(node) * kHeads, kHeads * sizeof(float)))
        << "node " << node;
  }
}

TEST(MlaVerifyAttentionTest, RejectsBadShapes) {
  AttentionFixture f(1);
  f.AddSequence(4, {-1, 0});
  f.Fill();
  MlaVerifyParams<float> p = f.Params(f.sequences_, f.q_.data());
  p.max_pages_per_seq = 1;  // 6 slots do not fit in one page of 4
  EXPECT_EQ(cpu::MlaVerifyAttention(p).code(), absl::StatusCode::kInvalidArgument);
  p = f.Params(f.sequences_, f.q_.data());
  p.num_heads = 0;
  EXPECT_EQ(cpu::MlaVerifyAttention(p).code(), absl::StatusCode::kInvalidArgument);
  p = f.Params(f.sequences_, f.q_.data());
  p.ancestor_mask = nullptr;
  EXPECT_EQ(cpu::MlaVerifyAttention(p).code(), absl::StatusCode::kInvalidArgument);
  p = f.Params(f.sequences_, f.q_.data());
  p.num_pages -= 1;  // the highest page id in use is now out of range
  EXPECT_EQ(cpu::MlaVerifyAttention(p).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace treeverify::kernels
