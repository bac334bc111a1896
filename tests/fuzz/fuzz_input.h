// What the fuzz targets share: the input bytes as a file that kiln's readers can open by path
// (an anonymous in-memory file, so a run never touches the disk), and the rule that kiln::Error
// is the one acceptable outcome of bad input. Anything else escaping a target (another exception,
// a crash, a sanitizer report) is a finding: libFuzzer saves the input and stops.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "core/error.h"

namespace kiln::fuzz {

// The bytes as a readable file at path(): /proc/self/fd/N of a memfd.
class MemoryFile {
 public:
  MemoryFile(const uint8_t* data, size_t size) : fd_(::memfd_create("kiln-fuzz", MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();
    size_t done = 0;
    while (done < size) {
      ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemoryFile() { ::close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

// Runs `body`; a kiln::Error is a correct rejection. Any other exception aborts with its message
// (libFuzzer reports the abort as a crash and keeps the input).
template <typename Body>
void expect_only_kiln_errors(Body&& body) {
  try {
    body();
  } catch (const kiln::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: an exception other than kiln::Error escaped: %s\n", e.what());
    std::abort();
  }
}

}  // namespace kiln::fuzz
