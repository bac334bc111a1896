// Fault tests that need other processes (killed mid-write, racing on one cache directory) start
// this test binary again, running one hidden test case, rather than fork(): a forked copy of a
// process that has run OpenMP kernels may hang in the OpenMP runtime.
//
//   pid_t child = kiln::testing::spawn_test_child("save loop (child)", {"KILN_TEST_PATH=/tmp/m"}, ready_fd);
//   ...
//   int status = kiln::testing::wait_child(child);   // the exit code, or 128 + the signal
//
// A hidden case ("[.]" tag) runs only when named; it reads its orders from environment variables
// and, given none, does nothing.
#pragma once
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

extern char** environ;

namespace kiln::testing {

// Starts this binary running only the test case `name` (no commas: Catch splits on them), with
// `env` added to the environment. `fd3`, if >= 0, is the child's descriptor 3 (a pipe end to
// talk over); every other descriptor of ours that is close-on-exec stays out of the child.
// `output`, if given, is a file that receives the child's stdout and stderr. Returns the child's
// pid, or -1.
inline pid_t spawn_test_child(const std::string& name, const std::vector<std::string>& env, int fd3 = -1,
                              const std::string& output = "") {
  std::vector<std::string> environment = env;
  for (char** e = environ; *e != nullptr; ++e) environment.push_back(*e);  // ours after: the first wins
  std::vector<char*> envp;
  for (std::string& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string program = "/proc/self/exe", quiet = "--reporter", compact = "compact", test = name;
  std::vector<char*> argv = {program.data(), test.data(), quiet.data(), compact.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  // Through a copy numbered above 3: dup2 onto itself would keep the descriptor close-on-exec.
  const int high = fd3 >= 0 ? fcntl(fd3, F_DUPFD_CLOEXEC, 10) : -1;
  if (high >= 0) posix_spawn_file_actions_adddup2(&actions, high, 3);
  if (!output.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  }
  pid_t pid = -1;
  const int error = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (high >= 0) close(high);
  return error == 0 ? pid : -1;
}

// Waits for `pid`: its exit code, or 128 + the signal that ended it.
inline int wait_child(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Kills and reaps a child still running when a test ends early (a failed REQUIRE).
struct ChildGuard {
  pid_t pid = -1;
  ~ChildGuard() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      wait_child(pid);
    }
  }
};

}  // namespace kiln::testing
