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

// Fills a table of function pointers from a library: KILN_RESOLVE(lib, table, cublasLtCreate).
#define KILN_RESOLVE(library, table, function) \
  (table).function = reinterpret_cast<decltype((table).function)>((library).symbol(#function))

}  // namespace kiln::cuda
