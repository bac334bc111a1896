// Links against NVRTC and cuBLASLt at build time (kiln itself maps them on first use): a toolkit
// without them fails the build instead of the first CUDA kernel.
#include <cublasLt.h>
#include <nvrtc.h>

int main() {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  return major > 0 && cublasLtGetVersion() > 0 ? 0 : 1;
}
