#include "treeverify/services/signal_waiter.h"

#include <pthread.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace treeverify::services {
namespace {

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// Blocks the signals in the calling thread; threads started later inherit the mask.
sigset_t BlockTerminationSignals() {
  const sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

[[noreturn]] void ExitNow(int signal_number, int status) {
  std::fprintf(stderr, "received %s: exiting now\n", strsignal(signal_number));
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(status);
}

}  // namespace

SignalWaiter::SignalWaiter() : signals_(BlockTerminationSignals()), thread_([this] { Loop(); }) {}

SignalWaiter::~SignalWaiter() {
  stopping_.store(true);
  // Wakes the waiter's sigwait with a signal aimed at that thread alone.
  pthread_kill(thread_.native_handle(), SIGTERM);
  thread_.join();
}

void SignalWaiter::SetExitImmediately(bool exit_immediately) {
  absl::MutexLock lock(&mutex_);
  exit_immediately_ = exit_immediately;
  if (exit_immediately_ && received_.HasBeenNotified()) ExitNow(signal_number_.load(), 0);
}

void SignalWaiter::Loop() {
  while (true) {
    int signal_number = 0;
    if (sigwait(&signals_, &signal_number) != 0) continue;
    if (stopping_.load()) return;
    if (received_.HasBeenNotified()) ExitNow(signal_number, 1);  // the second one
    absl::MutexLock lock(&mutex_);
    signal_number_.store(signal_number);
    received_.Notify();
    if (exit_immediately_) ExitNow(signal_number, 0);
    std::fprintf(stderr, "received %s: shutting down (send it again to exit at once)\n",
                 strsignal(signal_number));
  }
}

}  // namespace treeverify::services
