// A shared library mapped on first use, with its functions resolved by name: cuBLASLt and NVRTC
// are loaded only when a program first runs a CUDA matmul or compiles a CUDA kernel, so a
// CPU-only program never maps them (cuBLASLt's relocations alone cost ~210 MiB of resident memory).
#pragma once
#include <string>
#include <vector>

namespace kiln::cuda {

class SharedLibrary {
 public:
  // Tries each path (a full path, then a bare soname for the loader's search) in turn; throws
  // kiln::Error naming `what`, every path tried and the loader's reason when none loads.
  SharedLibrary(const std::string& what, const std::vector<std::string>& paths);
  // The function `name` exports; throws kiln::Error when the library lacks it (a version older
  // than the headers kiln was built against).
  void* symbol(const char* name) const;

 private:
  std::string what_;
  void* handle_ = nullptr;  // never closed: resolved functions stay valid for the process
};

// A table of a library's functions, mapped and resolved on the first call of `getter`:
//   #define MY_FUNCTIONS(X) X(nvrtcVersion) X(nvrtcGetErrorString)
//   KILN_SHARED_LIBRARY_TABLE(NvrtcApi, rtc, "NVRTC", path, soname, MY_FUNCTIONS)
//   rtc().nvrtcVersion(&major, &minor);
#define KILN_LIBRARY_MEMBER(function) decltype(&::function) function = nullptr;
#define KILN_LIBRARY_RESOLVE(function) \
  table.function = reinterpret_cast<decltype(table.function)>(library.symbol(#function));
#define KILN_SHARED_LIBRARY_TABLE(Type, getter, what, path, soname, FUNCTIONS)       \
  struct Type {                                                                      \
    FUNCTIONS(KILN_LIBRARY_MEMBER)                                                   \
  };                                                                                 \
  const Type& getter() {                                                             \
    static const Type api = [] {                                                     \
      static const ::kiln::cuda::SharedLibrary library(what, {path, soname});        \
      Type table;                                                                    \
      FUNCTIONS(KILN_LIBRARY_RESOLVE)                                                \
      return table;                                                                  \
    }();                                                                             \
    return api;                                                                      \
  }

}  // namespace kiln::cuda
