#include "backends/cuda/shared_library.h"

#include <dlfcn.h>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::cuda {

SharedLibrary::SharedLibrary(const std::string& what, const std::vector<std::string>& paths) : what_(what) {
  std::string reasons;
  for (const std::string& path : paths) {
    if (path.empty()) continue;
    handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_) return;
    const char* reason = dlerror();
    reasons += fmt::format("\n  {}: {}", path, reason ? reason : "not loaded");
  }
  KILN_FAIL("cuda", "{} could not be loaded; tried:{}\nInstall the CUDA toolkit's libraries or add their folder to "
            "LD_LIBRARY_PATH", what, reasons);
}

void* SharedLibrary::symbol(const char* name) const {
  dlerror();
  void* address = dlsym(handle_, name);
  KILN_CHECK(address != nullptr, "cuda", "{} has no function {}: it is older than the headers kiln was built with",
             what_, name);
  return address;
}

}  // namespace kiln::cuda
