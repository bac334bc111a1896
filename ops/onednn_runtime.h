// What every oneDNN call in ops/ shares: one CPU engine, one stream serialised by a mutex, and a
// guard that runs small primitives on one thread.
#pragma once
#include <mutex>

#include <dnnl.hpp>
#include <omp.h>

namespace kiln::onednn {

// oneDNN streams are not meant to be shared between threads without care, so execution is
// serialised on stream_mutex; each primitive already uses every core through OpenMP.
struct Runtime {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::mutex stream_mutex;
};

inline Runtime& runtime() {
  static Runtime r;
  return r;
}

// Below ~1 MFLOP a primitive is faster on one thread than waking (or, on a busy machine,
// waiting for) the OpenMP team, as the JIT's kernels do.
class SmallWorkOnOneThread {
 public:
  explicit SmallWorkOnOneThread(double flops) : saved_(flops < double(1 << 20) ? omp_get_max_threads() : 0) {
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

}  // namespace kiln::onednn
