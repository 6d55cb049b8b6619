#include "treeverify/services/serial_executor.h"

#include <utility>

namespace treeverify::services {

SerialExecutor::SerialExecutor() : thread_([this] { Loop(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

void SerialExecutor::Post(std::function<void()> task) {
  absl::MutexLock lock(&mutex_);
  tasks_.push_back(std::move(task));
}

void SerialExecutor::Loop() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mutex_);
      auto ready = [this]()
                       ABSL_SHARED_LOCKS_REQUIRED(mutex_) { return !tasks_.empty() || stopping_; };
      mutex_.Await(absl::Condition(&ready));
      if (tasks_.empty()) return;  // stopping, and nothing left to run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace treeverify::services
