// Small helpers the distributed benchmarks share: the median of timings and a model's bytes.
#pragma once
#include <kiln/kiln.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kiln::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

inline int64_t parameter_bytes(const std::vector<Tensor>& params) {
  int64_t bytes = 0;
  for (const Tensor& p : params) bytes += p.numel() * static_cast<int64_t>(dtype_size(p.dtype()));
  return bytes;
}

}  // namespace kiln::bench
