// One thread that runs posted tasks one at a time, in the order they were posted. The worker
// service runs every call into its ModelRunner here: the runner is not thread safe, and every
// rank must enter its collectives in the same order as the others.
//
//   SerialExecutor executor;
//   executor.Post([&] { reactor->Finish(Run(request)); });
#pragma once

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace treeverify::services {

class SerialExecutor {
 public:
  SerialExecutor();
  // Runs the tasks already posted, then stops the thread.
  ~SerialExecutor();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  void Loop();

  absl::Mutex mutex_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace treeverify::services
