#include "child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace treeverify::integration {
namespace {

absl::Status ErrnoStatus(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// The test's environment with `overrides` replacing or adding variables.
std::vector<std::string> ChildEnvironment(
    const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const absl::string_view variable(*entry);
    bool replaced = false;
    for (const auto& [name, value] : overrides) {
      replaced |= absl::StartsWith(variable, absl::StrCat(name, "="));
    }
    if (!replaced) env.emplace_back(variable);
  }
  for (const auto& [name, value] : overrides) env.push_back(absl::StrCat(name, "=", value));
  return env;
}

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

// Only async-signal-safe calls between fork and exec: the test process has many threads.
[[noreturn]] void ExecChild(const char* path, char* const* argv, char* const* envp, int stdin_fd,
                            int stdout_fd, int stderr_fd, pid_t parent) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);  // the test died before prctl took effect
  if (dup2(stdin_fd, STDIN_FILENO) < 0 || dup2(stdout_fd, STDOUT_FILENO) < 0 ||
      dup2(stderr_fd, STDERR_FILENO) < 0) {
    _exit(127);
  }
  // The test blocks no signals, but gRPC threads might have: start from a clean mask.
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  execve(path, argv, envp);
  static const char kMessage[] = "child_process: execve failed\n";
  (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  _exit(127);
}

}  // namespace

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return absl::StrCat("killed by signal ", WTERMSIG(wait_status));
  return absl::StrCat("wait status ", wait_status);
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const ChildProcessOptions& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("argv is empty");
  std::vector<std::string> args = options.argv;
  std::vector<std::string> env = ChildEnvironment(options.environment);
  std::vector<char*> argv = CStrings(args);
  std::vector<char*> envp = CStrings(env);

  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return ErrnoStatus("pipe2");
  const int stdin_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const std::string stderr_path = options.stderr_path.empty() ? "/dev/null" : options.stderr_path;
  const int stderr_fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  auto close_all = [&] {
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    if (stdin_fd >= 0) close(stdin_fd);
    if (stderr_fd >= 0) close(stderr_fd);
  };
  if (stdin_fd < 0 || stderr_fd < 0) {
    absl::Status status = ErrnoStatus(absl::StrCat("opening /dev/null or ", stderr_path));
    close_all();
    return status;
  }

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    absl::Status status = ErrnoStatus("fork");
    close_all();
    return status;
  }
  if (pid == 0) {
    ExecChild(argv[0], argv.data(), envp.data(), stdin_fd, pipe_fds[1], stderr_fd, parent);
  }
  setpgid(pid, pid);  // also here: whichever runs first, the group exists before we signal it
  close(pipe_fds[1]);
  close(stdin_fd);
  close(stderr_fd);
  return std::unique_ptr<ChildProcess>(new ChildProcess(options, pid, pipe_fds[0]));
}

ChildProcess::~ChildProcess() {
  Kill();
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

absl::StatusOr<std::string> ChildProcess::ReadLineContaining(absl::string_view needle,
                                                             absl::Time deadline) {
  while (true) {
    size_t newline;
    while ((newline = stdout_buffer_.find('\n')) != std::string::npos) {
      std::string line = stdout_buffer_.substr(0, newline);
      stdout_buffer_.erase(0, newline + 1);
      if (absl::StrContains(line, needle)) return line;
    }
    if (stdout_fd_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(name(), ": stdout closed before a line containing '", needle, "'"));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat(name(), ": no line containing '", needle, "' on stdout in time"));
    }
    pollfd fd{.fd = stdout_fd_, .events = POLLIN, .revents = 0};
    const int ready = poll(&fd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno != EINTR) return ErrnoStatus("poll");
    if (ready <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // EOF: the child closed stdout (it exited)
      close(stdout_fd_);
      stdout_fd_ = -1;
      continue;
    }
    stdout_buffer_.append(chunk, static_cast<size_t>(n));
  }
}

bool ChildProcess::TryReap() {
  if (wait_status_.has_value()) return true;
  int status = 0;
  const pid_t reaped = waitpid(pid_, &status, WNOHANG);
  if (reaped == pid_) {
    wait_status_ = status;
    return true;
  }
  if (reaped < 0 && errno == ECHILD) {  // reaped elsewhere: nothing left to wait for
    wait_status_ = -1;
    return true;
  }
  return false;
}

void ChildProcess::Signal(int signal) {
  if (!TryReap()) kill(pid_, signal);
}

absl::StatusOr<int> ChildProcess::WaitForExit(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!TryReap()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          name(), " (pid ", pid_, ") still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return *wait_status_;
}

bool ChildProcess::Running() { return !TryReap(); }

void ChildProcess::Kill() {
  // Until the child is reaped its pid (and so its group id) cannot be reused: the group kill is
  // safe. Nothing here forks grandchildren, so after the reap there is nothing left to kill.
  if (TryReap()) return;
  kill(-pid_, SIGKILL);
  kill(pid_, SIGKILL);
  // SIGKILL cannot be caught; only a process stuck in the kernel could outlast this.
  (void)WaitForExit(absl::Seconds(30));
}

std::string ChildProcess::StderrTail(size_t max_bytes) const {
  if (options_.stderr_path.empty()) return "";
  std::ifstream in(options_.stderr_path);
  std::stringstream contents;
  contents << in.rdbuf();
  std::string text = contents.str();
  if (text.size() > max_bytes) text = "..." + text.substr(text.size() - max_bytes);
  return text;
}

}  // namespace treeverify::integration
