// A child process for the integration tests: started with fork + exec in a process group of its
// own, stdout on a pipe the test reads lines from (with a deadline), stderr in a log file, and
// killed (the whole group) and reaped when the object goes away, so a test never leaves a process
// behind, whether it passes, fails an ASSERT or returns early.
//
// The child also gets PR_SET_PDEATHSIG(SIGKILL): if the test process itself dies (a crash, or
// ctest's timeout), the kernel kills the child. That signal follows the *thread* that forked, so
// start children from the test's main thread (as every test here does).
//
//   TV_ASSIGN_OR_RETURN(auto child, ChildProcess::Start({.argv = {"/bin/sleep", "5"}}));
//   TV_ASSIGN_OR_RETURN(std::string line, child->ReadLineContaining("listening", deadline));
//   child->Signal(SIGTERM);
//   TV_ASSIGN_OR_RETURN(int status, child->WaitForExit(absl::Seconds(10)));
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace treeverify::integration {

struct ChildProcessOptions {
  std::vector<std::string> argv;  // argv[0] is the executable's path
  // Added to (or replacing in) the test's own environment.
  std::vector<std::pair<std::string, std::string>> environment;
  std::string stderr_path;  // where the child's stderr goes; empty: /dev/null
  std::string name;         // for messages ("coordinator", "worker rank 1")
};

class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const ChildProcessOptions& options);

  // Kills the process group and reaps the child (bounded: SIGKILL cannot be ignored).
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& name() const { return options_.name; }

  // Reads stdout until a line containing `needle` (returned without its newline);
  // DEADLINE_EXCEEDED at `deadline`, FAILED_PRECONDITION if stdout closes first (the child died).
  absl::StatusOr<std::string> ReadLineContaining(absl::string_view needle, absl::Time deadline);

  // Sends `signal` to the child alone (not its group). No-op once reaped.
  void Signal(int signal);
  // The wait status (as waitpid gives it) once the child exits; DEADLINE_EXCEEDED if it is
  // still running after `timeout` (it is left running).
  absl::StatusOr<int> WaitForExit(absl::Duration timeout);
  // True while the child has not exited (reaps it if it has).
  bool Running();
  // SIGKILL to the whole process group, then reap. Idempotent.
  void Kill();

  // The exit status once reaped, for messages ("exited with 0", "killed by signal 9").
  std::optional<int> wait_status() const { return wait_status_; }
  // The last `max_bytes` of the child's stderr log.
  std::string StderrTail(size_t max_bytes = 4000) const;

 private:
  ChildProcess(ChildProcessOptions options, pid_t pid, int stdout_fd)
      : options_(std::move(options)), pid_(pid), stdout_fd_(stdout_fd) {}
  // Reaps the child if it exited; true when reaped (now or before).
  bool TryReap();

  const ChildProcessOptions options_;
  const pid_t pid_;
  int stdout_fd_;
  std::string stdout_buffer_;  // read but not yet returned
  std::optional<int> wait_status_;
};

// "exited with status 0", "killed by signal 9".
std::string DescribeWaitStatus(int wait_status);

}  // namespace treeverify::integration
