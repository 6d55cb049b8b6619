#include "treeverify/worker/communicator.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace treeverify::worker {

class InProcessGroup::Member final : public Communicator {
 public:
  Member(InProcessGroup* group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }

  // Two barrier phases per call, on every rank and on every path (the error path included), so
  // the phases of back-to-back collectives line up:
  //   publish span -> barrier 1 -> read all spans, sum into own scratch -> barrier 2 -> copy out.
  // Barrier 2 also guards the next call: no rank republishes its span (or overwrites the data
  // behind it) until every rank has finished reading the spans of this call.
  absl::Status AllReduceSum(absl::Span<float> data) override {
    const int world = world_size();
    if (world == 1) return absl::OkStatus();
    std::vector<absl::Span<float>>& buffers = group_->buffers_;
    buffers[rank_] = data;
    group_->barrier_.arrive_and_wait();

    // Every rank sees the same lengths, so every rank takes the same branch.
    for (int other = 0; other < world; ++other) {
      if (buffers[other].size() != buffers[0].size()) {
        const absl::Status mismatch = absl::InvalidArgumentError(
            absl::StrCat("AllReduceSum: ranks passed different lengths: rank 0 has ",
                         buffers[0].size(), " elements, rank ", other, " has ",
                         buffers[other].size(), " (this is rank ", rank_, ")"));
        group_->barrier_.arrive_and_wait();
        return mismatch;
      }
    }

    // Rank order, element by element: sum[i] = ((b0[i] + b1[i]) + b2[i]) + ... on every rank, so
    // all ranks hold bit-identical results.
    std::vector<float>& sum = group_->scratch_[rank_];
    sum.assign(buffers[0].begin(), buffers[0].end());
    for (int other = 1; other < world; ++other) {
      const float* addend = buffers[other].data();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += addend[i];
    }
    group_->barrier_.arrive_and_wait();

    std::copy(sum.begin(), sum.end(), data.begin());
    return absl::OkStatus();
  }

 private:
  InProcessGroup* group_;
  int rank_;
};

absl::StatusOr<std::unique_ptr<InProcessGroup>> InProcessGroup::Create(int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("an in-process group needs at least 1 rank, got ", world_size));
  }
  return std::unique_ptr<InProcessGroup>(new InProcessGroup(world_size));
}

InProcessGroup::InProcessGroup(int world_size)
    : barrier_(world_size), buffers_(world_size), scratch_(world_size) {
  members_.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    members_.push_back(std::make_unique<Member>(this, rank));
  }
}

}  // namespace treeverify::worker
