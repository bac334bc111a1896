// What every oneDNN call in backends/cpu/ shares: one CPU engine, one stream serialised by a mutex, and a
// guard that runs small primitives on one thread.
#pragma once
#include <mutex>
#include <string_view>

#include <dnnl.hpp>
#include <omp.h>

namespace kiln::cpu {

// oneDNN streams are not meant to be shared between threads without care, so execution is
// serialised on stream_mutex; each primitive already uses every core through OpenMP.
struct OnednnRuntime {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::mutex stream_mutex;
};

inline OnednnRuntime& onednn_runtime() {
  static OnednnRuntime r;
  return r;
}

// Whether oneDNN picked its slow reference implementation for a primitive descriptor.
template <class PrimitiveDesc> bool onednn_is_reference(const PrimitiveDesc& pd) {
  return std::string_view(pd.impl_info_str()).starts_with("ref");
}

// Whether `make_pd()` (the descriptor of a small problem) gets a native kernel; false when oneDNN
// refuses it. oneDNN accepts bf16 on any x86 CPU but without avx512_bf16/AMX only with its
// reference kernel, which is no faster than kiln's own loops, so that counts as unsupported.
template <class MakePd> bool onednn_has_native_kernel(MakePd make_pd) {
  try {
    return !onednn_is_reference(make_pd());
  } catch (const dnnl::error&) {
    return false;
  }
}

// Below ~1 MFLOP (2 per multiply-add) a primitive is faster on one thread than waking (or, on a
// busy machine, waiting for) the OpenMP team, as the JIT's kernels do. (Above it, both threads:
// the MLP's last layer, 128 x 512 x 10 = 1.3 MFLOP, took 23-26 us on one and 14-18 on two.)
inline constexpr double kOneThreadFlops = double(1 << 20);

// Runs the calls of its scope on one thread when their work is below kOneThreadFlops.
class SmallWorkOnOneThread {
 public:
  explicit SmallWorkOnOneThread(double flops) : saved_(flops < kOneThreadFlops ? omp_get_max_threads() : 0) {
    if (saved_ > 0) omp_set_num_threads(1);
  }
  ~SmallWorkOnOneThread() {
    if (saved_ > 0) omp_set_num_threads(saved_);
  }
  SmallWorkOnOneThread(const SmallWorkOnOneThread&) = delete;
  SmallWorkOnOneThread& operator=(const SmallWorkOnOneThread&) = delete;

 private:
  int saved_;
};

}  // namespace kiln::cpu
