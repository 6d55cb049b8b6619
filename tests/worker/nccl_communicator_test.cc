// The NCCL communicator: sums on the device and through the host, CUDA graph capture, and the
// watchdog (a rank that never joins, a peer that stalls: a Status within the timeout, never a
// hang). One GPU covers W = 1 and the group that never forms; the two-rank tests need two GPUs
// (NCCL refuses two ranks on one device) and skip, saying so, with fewer.
#include "treeverify/worker/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "../kernels/cuda/cuda_test_base.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "treeverify/worker/rendezvous_store.h"

namespace treeverify::worker {
namespace {

using kernels::cuda::DeviceBuffer;
using kernels::cuda::VisibleGpus;

class NcclCommunicatorTest : public kernels::cuda::CudaTest {};

// Device memory holding `values`, freed at the end of the test.
std::unique_ptr<DeviceBuffer<float>> DeviceFloats(const std::vector<float>& values) {
  auto buffer = std::make_unique<DeviceBuffer<float>>(values.size());
  buffer->CopyFrom(values);
  return buffer;
}

// Captures one all-reduce of data[count] into a graph, launches it `launches` times and waits.
void ReplayAllReduceFromAGraph(NcclCommunicator& nccl, float* data, int64_t count,
                               cudaStream_t stream, int launches) {
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status enqueued = nccl.EnqueueAllReduceSum(data, count, stream);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(enqueued.ok()) << enqueued;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < launches; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  const absl::Status waited = nccl.WaitForStream(stream);
  EXPECT_TRUE(waited.ok()) << waited;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Runs fn(rank) in a thread per rank, each on its own GPU.
template <typename Fn>
void ForEachRank(int world_size, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&fn, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      fn(r);
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(NcclOptionsTest, RefusesBadOptions) {
  const NcclOptions rank_outside{.rank = 2, .world_size = 2};
  EXPECT_EQ(rank_outside.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclOptions{.device_ordinal = -1}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclOptions{.timeout = absl::ZeroDuration()}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(NcclOptions{}.Validate().ok());
  // A group of several ranks cannot meet without a store.
  const NcclOptions two_ranks{.rank = 0, .world_size = 2};
  EXPECT_EQ(NcclCommunicator::Create(two_ranks, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// In CI (no GPU) as on the GPU machine: a device that is not there is a FAILED_PRECONDITION.
TEST(NcclWithoutTheGpuTest, RefusesWithAFailedPrecondition) {
  const absl::StatusOr<std::unique_ptr<NcclCommunicator>> communicator =
      NcclCommunicator::Create({.device_ordinal = VisibleGpus()}, nullptr);
  EXPECT_EQ(communicator.status().code(), absl::StatusCode::kFailedPrecondition)
      << communicator.status();
}

TEST_F(NcclCommunicatorTest, OneRankIsTheIdentityOnTheDeviceThroughTheHostAndInAGraph) {
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> made = NcclCommunicator::Create({}, nullptr);
  ASSERT_TRUE(made.ok()) << made.status();
  NcclCommunicator& nccl = **made;
  std::vector<float> host = {1.5f, -2.0f, 3.25f};
  ASSERT_TRUE(nccl.AllReduceSum(absl::MakeSpan(host)).ok());
  EXPECT_EQ(host, (std::vector<float>{1.5f, -2.0f, 3.25f}));

  ASSERT_EQ(nccl.device_collectives(), &nccl);
  const std::vector<float> values = {0.5f, 7.0f, -1.0f, 2.0f};
  const auto data = DeviceFloats(values);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(nccl.EnqueueAllReduceSum(data->get(), 4, stream).ok());
  ASSERT_TRUE(nccl.WaitForStream(stream).ok());
  EXPECT_EQ(data->ToHost(), values);

  // Captured into a graph and replayed twice.
  ReplayAllReduceFromAGraph(nccl, data->get(), 4, stream, /*launches=*/2);
  EXPECT_EQ(data->ToHost(), values);
  cudaStreamDestroy(stream);
  EXPECT_TRUE(nccl.health().ok());
}

// Rank 0 publishes the unique id and waits for a rank 1 that never comes; a rank 1 of another
// epoch waits for an id that is never published. Both end within about the timeout.
TEST_F(NcclCommunicatorTest, ARankThatNeverJoinsIsADeadlineNotAHang) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> alone = NcclCommunicator::Create(
      {.rank = 0, .world_size = 2, .timeout = timeout, .key_prefix = "nccl/1/"}, &store);
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded) << alone.status();
  EXPECT_NE(alone.status().message().find("forming the group"), std::string::npos)
      << alone.status();
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(10));

  absl::StatusOr<std::unique_ptr<NcclCommunicator>> waiting = NcclCommunicator::Create(
      {.rank = 1, .world_size = 2, .timeout = timeout, .key_prefix = "nccl/2/"}, &store);
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kDeadlineExceeded) << waiting.status();
  EXPECT_NE(waiting.status().message().find("unique id"), std::string::npos) << waiting.status();
}

// Two ranks: the device sum and the host path give a + b (exact in either order with two terms),
// also from a captured graph.
TEST_F(NcclCommunicatorTest, SumsOnTheDeviceAndThroughTheHostOnTwoGpus) {
  RequireTwoGpus();
  InMemoryRendezvousStore store;
  std::vector<std::vector<float>> device_results(2), host_results(2);
  ForEachRank(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> made = NcclCommunicator::Create(
        {.rank = rank, .world_size = 2, .device_ordinal = rank, .key_prefix = "nccl/1/"}, &store);
    ASSERT_TRUE(made.ok()) << made.status();
    NcclCommunicator& nccl = **made;
    std::vector<float> values(1000);
    for (size_t i = 0; i < values.size(); ++i) values[i] = (rank + 1) * 0.25f * i - rank;
    const auto data = DeviceFloats(values);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    ReplayAllReduceFromAGraph(nccl, data->get(), 1000, stream, /*launches=*/1);
    device_results[rank] = data->ToHost();
    host_results[rank] = values;
    ASSERT_TRUE(nccl.AllReduceSum(absl::MakeSpan(host_results[rank])).ok());
    cudaStreamDestroy(stream);
  });
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(device_results[rank].size(), 1000u);
    ASSERT_EQ(host_results[rank].size(), 1000u);
    for (size_t i = 0; i < 1000; ++i) {
      const float expected = 0.25f * i + (2 * 0.25f * i - 1.0f);
      EXPECT_EQ(device_results[rank][i], expected) << "rank " << rank << " element " << i;
      EXPECT_EQ(host_results[rank][i], expected) << "rank " << rank << " element " << i;
    }
  }
}

// Enqueues an all-reduce and waits for it: the first error of either.
absl::Status AllReduceOnTheDevice(NcclCommunicator& nccl, float* data, int64_t count,
                                  cudaStream_t stream) {
  const absl::Status enqueued = nccl.EnqueueAllReduceSum(data, count, stream);
  if (!enqueued.ok()) return enqueued;
  return nccl.WaitForStream(stream);
}

// Rank 1 forms the group but does not join rank 0's all-reduce: rank 0's call ends with
// DEADLINE_EXCEEDED within about the timeout, the communicator is aborted, and every later call
// says so. NCCL connects the ranks on their first collective, so a peer that stalls there
// stalls the enqueue; later collectives are enqueued at once and stall in the wait. Both.
TEST_F(NcclCommunicatorTest, AStalledPeerIsADeadlineAndAbortsTheGroupOnTwoGpus) {
  RequireTwoGpus();
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(3);
  for (const bool first_collective : {true, false}) {
    SCOPED_TRACE(first_collective ? "the first collective" : "a later collective");
    const std::string prefix = first_collective ? "nccl/1/" : "nccl/2/";
    std::vector<std::unique_ptr<NcclCommunicator>> communicators(2);
    std::vector<std::unique_ptr<DeviceBuffer<float>>> data(2);
    std::vector<cudaStream_t> streams(2);
    ForEachRank(2, [&](int rank) {
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> made =
          NcclCommunicator::Create({.rank = rank,
                                    .world_size = 2,
                                    .device_ordinal = rank,
                                    .timeout = timeout,
                                    .key_prefix = prefix},
                                   &store);
      ASSERT_TRUE(made.ok()) << made.status();
      communicators[rank] = std::move(*made);
      data[rank] = DeviceFloats(std::vector<float>(256, 1.0f));
      ASSERT_EQ(cudaStreamCreateWithFlags(&streams[rank], cudaStreamNonBlocking), cudaSuccess);
      if (!first_collective) {
        const absl::Status warm =
            AllReduceOnTheDevice(*communicators[rank], data[rank]->get(), 256, streams[rank]);
        ASSERT_TRUE(warm.ok()) << warm;
      }
    });
    ASSERT_NE(communicators[0], nullptr);
    ASSERT_NE(communicators[1], nullptr);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    NcclCommunicator& nccl = *communicators[0];
    const absl::Time start = absl::Now();
    const absl::Status stalled = AllReduceOnTheDevice(nccl, data[0]->get(), 256, streams[0]);
    EXPECT_EQ(stalled.code(), absl::StatusCode::kDeadlineExceeded) << stalled;
    EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(5));
    EXPECT_EQ(nccl.health().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(nccl.EnqueueAllReduceSum(data[0]->get(), 256, streams[0]).code(),
              absl::StatusCode::kUnavailable);
    // The aborted all-reduce's kernel, if it was launched, has ended: the stream drains.
    EXPECT_EQ(cudaStreamSynchronize(streams[0]), cudaSuccess);
    communicators[0].reset();
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    communicators[1].reset();  // its peer is gone: a bounded finalize, then an abort
    for (cudaStream_t stream : streams) cudaStreamDestroy(stream);
  }
}

}  // namespace
}  // namespace treeverify::worker
