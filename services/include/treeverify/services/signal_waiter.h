// SIGTERM / SIGINT handling for the process mains without work in a signal handler: the signals
// are blocked in every thread and a dedicated thread takes them with sigwait(2).
//
// Construct it first thing in main, before any other thread exists (gRPC, Gloo and OpenMP start
// threads), so every thread inherits the blocked mask. A second signal ends the process at once
// (exit status 1), for a shutdown that hangs.
//
//   SignalWaiter signals;
//   ... start serving ...
//   while (!signals.WaitFor(absl::Milliseconds(200))) { ... watch health ... }
//   ... drain and shut down ...
#pragma once

#include <signal.h>

#include <atomic>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace treeverify::services {

class SignalWaiter {
 public:
  SignalWaiter();
  ~SignalWaiter();
  SignalWaiter(const SignalWaiter&) = delete;
  SignalWaiter& operator=(const SignalWaiter&) = delete;

  // True once SIGTERM or SIGINT arrived (waiting at most `timeout` for it).
  bool WaitFor(absl::Duration timeout) { return received_.WaitForNotificationWithTimeout(timeout); }
  bool received() const { return received_.HasBeenNotified(); }
  // The signal that arrived, 0 before.
  int signal_number() const { return signal_number_.load(); }

  // While set, a signal exits the process at once with status 0 (and one that already arrived
  // does so now): for start-up steps that cannot be interrupted (forming a group, loading a
  // model), when there is nothing to drain yet.
  void SetExitImmediately(bool exit_immediately) ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  void Loop();

  // First: blocking the signals happens before the waiter thread starts, so it inherits the mask.
  const sigset_t signals_;
  absl::Notification received_;
  std::atomic<int> signal_number_{0};
  std::atomic<bool> stopping_{false};
  absl::Mutex mutex_;
  bool exit_immediately_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;  // last
};

}  // namespace treeverify::services
