#include "treeverify/worker/kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace treeverify::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

KvCacheOptions MakeOptions(int64_t num_pages, int32_t page_size, int64_t num_layers = 2,
                           int64_t row_dim = 3) {
  KvCacheOptions options;
  options.num_pages = num_pages;
  options.page_size = page_size;
  options.num_layers = num_layers;
  options.row_dim = row_dim;
  return options;
}

// A cache over host rows; *rows (when asked for) points at them.
std::unique_ptr<KvCache> MakeCache(const KvCacheOptions& options, CpuKvStorage** rows = nullptr) {
  auto storage = CpuKvStorage::Create(options);
  EXPECT_TRUE(storage.ok()) << storage.status();
  if (!storage.ok()) return nullptr;
  if (rows != nullptr) *rows = storage->get();
  auto cache = KvCache::Create(options, std::move(storage).value());
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(cache).value() : nullptr;
}

int64_t PagesFor(int64_t rows, int64_t page_size) { return (rows + page_size - 1) / page_size; }

// Slot of an absolute position, computed from the public page table.
int64_t SlotAt(const KvCache& cache, uint64_t seq, int64_t position) {
  const int64_t page_size = cache.options().page_size;
  return int64_t{cache.page_table(seq)[position / page_size]} * page_size + position % page_size;
}

// A value that differs for every (layer, node, element) and is never zero.
float NodeValue(int64_t layer, int64_t node, int64_t element) {
  return 1000.0f * static_cast<float>(layer + 1) + 10.0f * static_cast<float>(node) +
         static_cast<float>(element) + 0.5f;
}

void WriteRow(CpuKvStorage& rows, int64_t layer, int64_t slot, const std::vector<float>& row) {
  std::copy(row.begin(), row.end(), rows.layer_data(layer) + slot * rows.options().row_dim);
}

std::vector<float> ReadRow(const CpuKvStorage& rows, int64_t layer, int64_t slot) {
  const int64_t row_dim = rows.options().row_dim;
  const float* row = rows.layer_data(layer) + slot * row_dim;
  return std::vector<float>(row, row + row_dim);
}

std::vector<int32_t> AllNodes(int32_t count) {
  std::vector<int32_t> nodes(count);
  std::iota(nodes.begin(), nodes.end(), 0);
  return nodes;
}

uint32_t TestSeed() {
  if (const char* seed = std::getenv("TREEVERIFY_TEST_SEED")) {
    return static_cast<uint32_t>(std::strtoul(seed, nullptr, 10));
  }
  return std::random_device()();
}

TEST(KvCacheOptionsTest, ValidateNamesTheBadField) {
  EXPECT_TRUE(MakeOptions(8, 4).Validate().ok());

  struct Case {
    KvCacheOptions options;
    std::string field;
  };
  const std::vector<Case> cases = {
      {MakeOptions(0, 4), "num_pages"},
      {MakeOptions(-3, 4), "num_pages"},
      {MakeOptions(int64_t{1} << 31, 4), "num_pages"},
      {MakeOptions(8, 0), "page_size"},
      {MakeOptions(8, 4097), "page_size"},
      {MakeOptions(8, 4, 0), "num_layers"},
      {MakeOptions(8, 4, 2, 0), "row_dim"},
      {MakeOptions(1 << 30, 4096, 1 << 20, 576), "overflows"},
  };
  for (const Case& c : cases) {
    const absl::Status status = c.options.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
    EXPECT_EQ(CpuKvStorage::Create(c.options).status().code(), absl::StatusCode::kInvalidArgument)
        << c.field;
  }
  EXPECT_TRUE(MakeOptions(1, 4096).Validate().ok());
}

TEST(KvCacheTest, RefusesRowStorageOfAnotherShape) {
  const KvCacheOptions options = MakeOptions(8, 4, 2, 3);
  EXPECT_EQ(KvCache::Create(options, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  for (const KvCacheOptions& other : {MakeOptions(9, 4, 2, 3), MakeOptions(8, 2, 2, 3),
                                      MakeOptions(8, 4, 3, 3), MakeOptions(8, 4, 2, 5)}) {
    auto storage = CpuKvStorage::Create(other);
    ASSERT_TRUE(storage.ok()) << storage.status();
    const absl::Status status = KvCache::Create(options, std::move(storage).value()).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("the row storage holds"));
  }
}

TEST(KvCacheTest, FreshCacheIsZeroAndEmpty) {
  CpuKvStorage* rows = nullptr;
  auto cache = MakeCache(MakeOptions(5, 4, 3, 7), &rows);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->free_pages(), 5);
  EXPECT_EQ(cache->used_pages(), 0);
  for (int64_t layer = 0; layer < 3; ++layer) {
    const float* data = rows->layer_data(layer);
    EXPECT_TRUE(std::all_of(data, data + 5 * 4 * 7, [](float x) { return x == 0.0f; }));
  }
  EXPECT_FALSE(cache->Contains(42));
  EXPECT_EQ(cache->committed_length(42), 0);
  EXPECT_EQ(cache->segment_length(42), 0);
  EXPECT_TRUE(cache->page_table(42).empty());
  EXPECT_TRUE(cache->SegmentSlots(42).empty());
}

class KvCachePageSizeTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(KvCachePageSizeTest, SlotsFollowThePageTableAcrossPageBoundaries) {
  const int32_t ps = GetParam();
  auto cache = MakeCache(MakeOptions(16, ps));
  ASSERT_NE(cache, nullptr);
  const uint64_t a = 0xA;
  const uint64_t b = 0xB;

  // a takes pages 0..2, b takes 3..4, so a's next pages are not contiguous with its first ones.
  ASSERT_TRUE(cache->ReserveSegment(a, 2 * ps + 1).ok());
  ASSERT_TRUE(cache->ReserveSegment(b, ps + 1).ok());
  EXPECT_THAT(cache->page_table(a), ElementsAre(0, 1, 2));
  EXPECT_THAT(cache->page_table(b), ElementsAre(3, 4));

  std::vector<int64_t> expected_a(2 * ps + 1);
  std::iota(expected_a.begin(), expected_a.end(), 0);
  EXPECT_THAT(cache->SegmentSlots(a), ElementsAreArray(expected_a));
  std::vector<int64_t> expected_b(ps + 1);
  std::iota(expected_b.begin(), expected_b.end(), int64_t{3} * ps);
  EXPECT_THAT(cache->SegmentSlots(b), ElementsAreArray(expected_b));

  ASSERT_TRUE(cache->Commit(a, AllNodes(2 * ps + 1)).ok());
  EXPECT_EQ(cache->committed_length(a), 2 * ps + 1);
  // Positions 2ps+1 .. 4ps: rest of page 2, then the fresh pages 5 and 6.
  ASSERT_TRUE(cache->ReserveSegment(a, 2 * ps).ok());
  EXPECT_THAT(cache->page_table(a), ElementsAre(0, 1, 2, 5, 6));
  std::vector<int64_t> slots_a;
  for (int64_t pos = 2 * ps + 1; pos < 3 * ps; ++pos) slots_a.push_back(2 * ps + pos % ps);
  for (int64_t row = 0; row < ps; ++row) slots_a.push_back(5 * ps + row);
  slots_a.push_back(6 * ps);
  EXPECT_THAT(cache->SegmentSlots(a), ElementsAreArray(slots_a));
  EXPECT_EQ(cache->used_pages(), 7);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, KvCachePageSizeTest, ::testing::Values(1, 4, 16));

TEST(KvCacheTest, CommitCompactsAcceptedRowsInEveryLayer) {
  const int32_t ps = 4;
  const int64_t layers = 3;
  const int64_t row_dim = 5;
  CpuKvStorage* rows = nullptr;
  auto cache = MakeCache(MakeOptions(8, ps, layers, row_dim), &rows);
  ASSERT_NE(cache, nullptr);
  const uint64_t seq = 7;

  // A committed prefix of 6 rows whose values must survive the commit below.
  ASSERT_TRUE(cache->ReserveSegment(seq, 6).ok());
  std::vector<int64_t> prefix_slots = cache->SegmentSlots(seq);
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t node = 0; node < 6; ++node) {
      std::vector<float> row(row_dim);
      for (int64_t e = 0; e < row_dim; ++e) row[e] = -NodeValue(layer, node, e);
      WriteRow(*rows, layer, prefix_slots[node], row);
    }
  }
  ASSERT_TRUE(cache->Commit(seq, AllNodes(6)).ok());

  // A 10-node segment over positions 6..15 (pages 1..3).
  ASSERT_TRUE(cache->ReserveSegment(seq, 10).ok());
  EXPECT_EQ(cache->used_pages(), 4);
  const std::vector<int64_t> slots = cache->SegmentSlots(seq);
  ASSERT_EQ(slots.size(), 10u);
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t node = 0; node < 10; ++node) {
      std::vector<float> row(row_dim);
      for (int64_t e = 0; e < row_dim; ++e) row[e] = NodeValue(layer, node, e);
      WriteRow(*rows, layer, slots[node], row);
    }
  }

  const std::vector<int32_t> accepted = {0, 2, 3, 7};
  ASSERT_TRUE(cache->Commit(seq, accepted).ok());
  EXPECT_EQ(cache->committed_length(seq), 10);
  EXPECT_EQ(cache->segment_length(seq), 0);
  EXPECT_EQ(cache->used_pages(), PagesFor(10, ps));
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t pos = 0; pos < 6; ++pos) {
      std::vector<float> expected(row_dim);
      for (int64_t e = 0; e < row_dim; ++e) expected[e] = -NodeValue(layer, pos, e);
      EXPECT_EQ(ReadRow(*rows, layer, SlotAt(*cache, seq, pos)), expected)
          << "layer " << layer << " prefix position " << pos;
    }
    for (size_t k = 0; k < accepted.size(); ++k) {
      std::vector<float> expected(row_dim);
      for (int64_t e = 0; e < row_dim; ++e) expected[e] = NodeValue(layer, accepted[k], e);
      EXPECT_EQ(ReadRow(*rows, layer, SlotAt(*cache, seq, 6 + k)), expected)
          << "layer " << layer << " accepted index " << k;
    }
  }

  // The next segment starts right after the new committed length: position 10 = page 2, row 2.
  ASSERT_TRUE(cache->ReserveSegment(seq, 3).ok());
  const std::vector<int64_t> next = cache->SegmentSlots(seq);
  ASSERT_EQ(next.size(), 3u);
  EXPECT_EQ(next[0], int64_t{cache->page_table(seq)[2]} * ps + 2);
  EXPECT_EQ(next[0], SlotAt(*cache, seq, 10));
  EXPECT_EQ(next[2], SlotAt(*cache, seq, 12));
}

TEST(KvCacheTest, CommitFreesPagesBeyondTheCommittedLength) {
  const int32_t ps = 4;
  auto cache = MakeCache(MakeOptions(16, ps));
  ASSERT_NE(cache, nullptr);
  const uint64_t seq = 1;

  ASSERT_TRUE(cache->ReserveSegment(seq, 20).ok());
  EXPECT_EQ(cache->used_pages(), 5);
  ASSERT_TRUE(cache->Commit(seq, {1, 4, 9}).ok());
  EXPECT_EQ(cache->committed_length(seq), 3);
  EXPECT_EQ(cache->used_pages(), 1);
  EXPECT_EQ(cache->free_pages(), 15);

  ASSERT_TRUE(cache->ReserveSegment(seq, 14).ok());
  EXPECT_EQ(cache->used_pages(), PagesFor(17, ps));
  // An empty accept list drops the segment and keeps the prefix.
  ASSERT_TRUE(cache->Commit(seq, {}).ok());
  EXPECT_EQ(cache->committed_length(seq), 3);
  EXPECT_EQ(cache->segment_length(seq), 0);
  EXPECT_EQ(cache->used_pages(), 1);

  // Reserving again replaces the segment rather than adding to it.
  ASSERT_TRUE(cache->ReserveSegment(seq, 20).ok());
  EXPECT_EQ(cache->used_pages(), PagesFor(23, ps));
  ASSERT_TRUE(cache->ReserveSegment(seq, 2).ok());
  EXPECT_EQ(cache->segment_length(seq), 2);
  EXPECT_EQ(cache->used_pages(), PagesFor(5, ps));
  ASSERT_TRUE(cache->ReserveSegment(seq, 0).ok());
  EXPECT_EQ(cache->used_pages(), 1);
  EXPECT_EQ(cache->committed_length(seq), 3);
}

TEST(KvCacheTest, CommitRejectsBadNodeListsWithoutChangingAnything) {
  auto cache = MakeCache(MakeOptions(8, 4));
  ASSERT_NE(cache, nullptr);
  const uint64_t seq = 3;
  ASSERT_TRUE(cache->ReserveSegment(seq, 6).ok());
  const std::vector<int32_t> pages = cache->page_table(seq);

  EXPECT_EQ(cache->Commit(seq, {0, 6}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Commit(seq, {-1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Commit(seq, {2, 2}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Commit(seq, {3, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Commit(99, {0}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->ReserveSegment(seq, -1).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(cache->committed_length(seq), 0);
  EXPECT_EQ(cache->segment_length(seq), 6);
  EXPECT_EQ(cache->page_table(seq), pages);
  EXPECT_EQ(cache->used_pages(), 2);
}

TEST(KvCacheTest, ReleaseReturnsEveryPage) {
  auto cache = MakeCache(MakeOptions(32, 4));
  ASSERT_NE(cache, nullptr);
  for (uint64_t seq = 1; seq <= 5; ++seq) {
    ASSERT_TRUE(cache->ReserveSegment(seq, static_cast<int64_t>(3 * seq + 1)).ok());
    if (seq % 2 == 1) {
      ASSERT_TRUE(cache->Commit(seq, {0, 1}).ok());
    }
  }
  ASSERT_TRUE(cache->ReserveSegment(1, 9).ok());
  EXPECT_GT(cache->used_pages(), 0);

  for (uint64_t seq = 1; seq <= 5; ++seq) {
    ASSERT_TRUE(cache->Release(seq).ok());
    EXPECT_FALSE(cache->Contains(seq));
    EXPECT_TRUE(cache->page_table(seq).empty());
  }
  EXPECT_EQ(cache->free_pages(), 32);
  EXPECT_EQ(cache->used_pages(), 0);
  EXPECT_EQ(cache->Release(1).code(), absl::StatusCode::kNotFound);

  // A released id starts over as a new, empty sequence.
  ASSERT_TRUE(cache->ReserveSegment(1, 4).ok());
  EXPECT_EQ(cache->committed_length(1), 0);
  EXPECT_EQ(cache->segment_length(1), 4);
  EXPECT_EQ(cache->page_table(1).size(), 1u);
}

TEST(KvCacheTest, FullCacheFailsOnlyTheSequenceThatAsked) {
  const int32_t ps = 4;
  const int64_t layers = 2;
  const int64_t row_dim = 3;
  CpuKvStorage* rows = nullptr;
  auto cache = MakeCache(MakeOptions(8, ps, layers, row_dim), &rows);
  ASSERT_NE(cache, nullptr);
  const uint64_t a = 0x1111;
  const uint64_t b = 0x2222;
  const uint64_t c = 0x3333;

  // a: 10 committed rows and a 5-row segment (4 pages); b: a 6-row segment (2 pages).
  ASSERT_TRUE(cache->ReserveSegment(a, 10).ok());
  ASSERT_TRUE(cache->Commit(a, AllNodes(10)).ok());
  ASSERT_TRUE(cache->ReserveSegment(a, 5).ok());
  ASSERT_TRUE(cache->ReserveSegment(b, 6).ok());
  ASSERT_EQ(cache->free_pages(), 2);
  // Fill the whole pool with distinct values so any stray write shows up.
  for (int64_t layer = 0; layer < layers; ++layer) {
    float* data = rows->layer_data(layer);
    for (int64_t i = 0; i < 8 * ps * row_dim; ++i) data[i] = static_cast<float>(layer * 1e5 + i);
  }
  const std::vector<float> storage_before(rows->layer_data(0),
                                          rows->layer_data(0) + layers * 8 * ps * row_dim);
  const std::vector<int32_t> pages_a = cache->page_table(a);
  const std::vector<int32_t> pages_b = cache->page_table(b);
  const std::vector<int64_t> slots_a = cache->SegmentSlots(a);
  const std::vector<int64_t> slots_b = cache->SegmentSlots(b);

  // b holds 2 pages and asks for 5: 3 more, but only 2 are free.
  absl::Status status = cache->ReserveSegment(b, 20);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("KV cache full"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("needs 3 more pages, 2 free"));
  // Larger than the whole pool.
  EXPECT_EQ(cache->ReserveSegment(b, 1000).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->ReserveSegment(b, std::numeric_limits<int64_t>::max()).code(),
            absl::StatusCode::kResourceExhausted);

  EXPECT_EQ(cache->committed_length(a), 10);
  EXPECT_EQ(cache->segment_length(a), 5);
  EXPECT_EQ(cache->page_table(a), pages_a);
  EXPECT_EQ(cache->SegmentSlots(a), slots_a);
  EXPECT_EQ(cache->committed_length(b), 0);
  EXPECT_EQ(cache->segment_length(b), 6);
  EXPECT_EQ(cache->page_table(b), pages_b);
  EXPECT_EQ(cache->SegmentSlots(b), slots_b);
  EXPECT_EQ(cache->free_pages(), 2);

  // A new sequence that does not fit is not left behind.
  EXPECT_EQ(cache->ReserveSegment(c, 12).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(cache->Contains(c));
  EXPECT_EQ(cache->free_pages(), 2);

  const std::vector<float> storage_after(rows->layer_data(0),
                                         rows->layer_data(0) + layers * 8 * ps * row_dim);
  EXPECT_EQ(storage_after, storage_before);

  // Exactly what is left still fits.
  EXPECT_TRUE(cache->ReserveSegment(b, 16).ok());
  EXPECT_EQ(cache->free_pages(), 0);
}

// The reference model of one sequence: row values per layer, committed and segment.
struct ReferenceSequence {
  std::vector<std::vector<std::vector<float>>> committed;  // [layer][position][element]
  std::vector<std::vector<std::vector<float>>> segment;    // [layer][node][element]
};

TEST(KvCacheTest, RandomOperationsMatchAReferenceModel) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed, " (rerun with TREEVERIFY_TEST_SEED=", seed, ")"));
  std::cout << "RandomOperationsMatchAReferenceModel seed " << seed << "\n";
  std::mt19937_64 rng(seed);

  for (const int32_t ps : {1, 3, 4, 16}) {
    SCOPED_TRACE(absl::StrCat("page_size ", ps));
    const int64_t layers = 2;
    const int64_t row_dim = 2;
    const int64_t num_pages = 192 / ps;
    CpuKvStorage* rows = nullptr;
    auto cache = MakeCache(MakeOptions(num_pages, ps, layers, row_dim), &rows);
    ASSERT_NE(cache, nullptr);
    // Ranks replay the same requests and must pick the same pages: a twin sees every call too.
    auto twin = MakeCache(MakeOptions(num_pages, ps, layers, row_dim));
    ASSERT_NE(twin, nullptr);
    std::map<uint64_t, ReferenceSequence> reference;
    std::uniform_real_distribution<float> value(-100.0f, 100.0f);
    int64_t exhausted = 0;
    int64_t commits = 0;

    auto reference_pages = [&](const ReferenceSequence& sequence) {
      return PagesFor(
          static_cast<int64_t>(sequence.committed[0].size() + sequence.segment[0].size()), ps);
    };

    for (int step = 0; step < 4000; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      // Spread-out ids, so hashing order has nothing to do with page order.
      const uint64_t seq = (rng() % 12 + 1) * 0x9E3779B97F4A7C15ull;
      const int op = static_cast<int>(rng() % 10);
      auto it = reference.find(seq);

      if (op < 5) {
        const int64_t count = static_cast<int64_t>(rng() % 33);
        int64_t used = 0;
        for (const auto& [id, sequence] : reference) used += reference_pages(sequence);
        const int64_t committed =
            it == reference.end() ? 0 : static_cast<int64_t>(it->second.committed[0].size());
        const int64_t held = it == reference.end() ? 0 : reference_pages(it->second);
        const bool fits = PagesFor(committed + count, ps) - held <= num_pages - used;
        const absl::Status status = cache->ReserveSegment(seq, count);
        ASSERT_EQ(twin->ReserveSegment(seq, count).code(), status.code());
        if (!fits) {
          ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
          ++exhausted;
        } else {
          ASSERT_TRUE(status.ok()) << status;
          ReferenceSequence& sequence = reference[seq];
          sequence.committed.resize(layers);
          sequence.segment.assign(layers, {});
          const std::vector<int64_t> slots = cache->SegmentSlots(seq);
          ASSERT_EQ(static_cast<int64_t>(slots.size()), count);
          for (int64_t layer = 0; layer < layers; ++layer) {
            for (int64_t node = 0; node < count; ++node) {
              std::vector<float> row(row_dim);
              for (float& x : row) x = value(rng);
              WriteRow(*rows, layer, slots[node], row);
              sequence.segment[layer].push_back(row);
            }
          }
        }
      } else if (op < 9) {
        if (it == reference.end()) {
          ASSERT_EQ(cache->Commit(seq, {}).code(), absl::StatusCode::kNotFound);
          continue;
        }
        ReferenceSequence& sequence = it->second;
        const int32_t segment = static_cast<int32_t>(sequence.segment[0].size());
        std::vector<int32_t> accepted;
        for (int32_t node = 0; node < segment; ++node) {
          if (rng() % 2 == 0) accepted.push_back(node);
        }
        if (accepted.size() >= 2 && rng() % 8 == 0) {
          // A bad list must change nothing.
          std::swap(accepted.front(), accepted.back());
          ASSERT_EQ(cache->Commit(seq, accepted).code(), absl::StatusCode::kInvalidArgument);
          continue;
        }
        ASSERT_TRUE(cache->Commit(seq, accepted).ok());
        ASSERT_TRUE(twin->Commit(seq, accepted).ok());
        ++commits;
        for (int64_t layer = 0; layer < layers; ++layer) {
          for (int32_t node : accepted) {
            sequence.committed[layer].push_back(sequence.segment[layer][node]);
          }
          sequence.segment[layer].clear();
        }
      } else {
        const absl::Status status = cache->Release(seq);
        ASSERT_EQ(twin->Release(seq).code(), status.code());
        if (it == reference.end()) {
          ASSERT_EQ(status.code(), absl::StatusCode::kNotFound);
        } else {
          ASSERT_TRUE(status.ok()) << status;
          reference.erase(it);
        }
      }

      // Page accounting: every page owned once, owned + free = total.
      std::set<int32_t> owned;
      int64_t owned_count = 0;
      for (const auto& [id, sequence] : reference) {
        ASSERT_TRUE(cache->Contains(id));
        const std::vector<int32_t>& pages = cache->page_table(id);
        ASSERT_EQ(static_cast<int64_t>(pages.size()), reference_pages(sequence));
        ASSERT_EQ(twin->page_table(id), pages) << "the twin chose other pages";
        for (int32_t page : pages) {
          ASSERT_GE(page, 0);
          ASSERT_LT(page, num_pages);
          owned.insert(page);
        }
        owned_count += static_cast<int64_t>(pages.size());
      }
      ASSERT_EQ(static_cast<int64_t>(owned.size()), owned_count) << "a page is owned twice";
      ASSERT_EQ(cache->used_pages(), owned_count);
      ASSERT_EQ(cache->free_pages() + owned_count, num_pages);

      // Data: every committed and segment row of every sequence, in every layer.
      for (const auto& [id, sequence] : reference) {
        const int64_t committed = static_cast<int64_t>(sequence.committed[0].size());
        ASSERT_EQ(cache->committed_length(id), committed);
        ASSERT_EQ(cache->segment_length(id), static_cast<int64_t>(sequence.segment[0].size()));
        const std::vector<int64_t> slots = cache->SegmentSlots(id);
        for (int64_t layer = 0; layer < layers; ++layer) {
          for (int64_t pos = 0; pos < committed; ++pos) {
            ASSERT_EQ(ReadRow(*rows, layer, SlotAt(*cache, id, pos)),
                      sequence.committed[layer][pos])
                << "sequence " << id << " layer " << layer << " position " << pos;
          }
          for (size_t node = 0; node < slots.size(); ++node) {
            ASSERT_EQ(slots[node], SlotAt(*cache, id, committed + static_cast<int64_t>(node)));
            ASSERT_EQ(ReadRow(*rows, layer, slots[node]), sequence.segment[layer][node])
                << "sequence " << id << " layer " << layer << " node " << node;
          }
        }
      }
    }
    // The run must have exercised both the full-pool path and compaction.
    EXPECT_GT(exhausted, 0);
    EXPECT_GT(commits, 0);
  }
}

}  // namespace
}  // namespace treeverify::worker
