// cuDNN convolution on CUDA tensors: one handle per device bound to kiln's stream, and per pass,
// dtype and geometry a cached plan (descriptors plus the algorithms cuDNN ranks for it), with
// workspaces from the pool. Without the CUDA toolkit or cuDNN the entry points compile to a clear
// kiln::Error.
#include "backends/cuda/cudnn.h"

#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/flags.h"
#include "core/lasting_cache.h"
#include "memory/allocator.h"
#include "backends/cuda/cuda_runtime.h"
#include "backends/cuda/library_common.h"

#if KILN_WITH_CUDA && KILN_WITH_CUDNN
#include <cuda_runtime_api.h>
#include <cudnn.h>
#endif

namespace kiln::cuda {

namespace {

constexpr std::string_view kConvOp = "conv2d (cuDNN)";

bool is_conv_dtype(DType t) { return t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16; }

std::string describe_conv(int device, ConvPass pass, DType t, const ConvGeometry& g) {
  static constexpr std::string_view kPass[] = {"forward", "backward data", "backward weight"};
  const int64_t group_channels = g.groups > 0 ? g.C / g.groups : 0;
  return fmt::format("{} {} on cuda:{}: x ({}, {}, {}, {}), weight ({}, {}, {}, {}) -> ({}, {}, {}, {}), "
                     "stride ({}, {}), padding ({}, {}), dilation ({}, {}), groups {}",
                     kPass[static_cast<int>(pass)], dtype_name(t), device, g.N, g.C, g.H, g.W, g.OC, group_channels,
                     g.KH, g.KW, g.N, g.OC, g.OH, g.OW, g.stride[0], g.stride[1], g.padding[0], g.padding[1],
                     g.dilation[0], g.dilation[1], g.groups);
}

#if KILN_WITH_CUDA && KILN_WITH_CUDNN

// The legacy convolution API (tensor / filter / convolution descriptors): cuDNN 9 marks it
// deprecated, but its CUDNN_DEPRECATED attribute is empty unless CUDNN_WARN_DEPRECATED is defined,
// and it needs far less code than the graph API for three fixed passes over NCHW buffers.

// Algorithms needing more workspace than this are passed over for the next one in cuDNN's ranking.
constexpr size_t kConvWorkspaceLimit = size_t{512} << 20;

template <class Describe>
void check_cudnn(cudnnStatus_t s, const char* call, const Describe& describe) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  char detail[512] = {};
  cudnnGetLastErrorString(detail, sizeof(detail));
  KILN_FAIL(kConvOp, "{} failed: {}{}{}; {}", call, cudnnGetErrorString(s), detail[0] ? ": " : "", detail,
            describe());
}

cudnnDataType_t cudnn_type(DType t) {
  return t == DType::Float16 ? CUDNN_DATA_HALF : t == DType::BFloat16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
}

// One way to run a pass: a cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t, the math type the
// descriptor takes with it, and the workspace it needs.
struct ConvChoice {
  int algo = 0;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace_bytes = 0;
};

// Descriptors of x (N, C, H, W), w (OC, C / groups, KH, KW), y (N, OC, OH, OW) and the window, and
// the usable algorithms for one pass in cuDNN's ranking: the heuristics rank without running, so
// one may still answer NOT_SUPPORTED when called; it is dropped and the next one tried.
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  std::vector<ConvChoice> choices;
  size_t ranked = 0;    // how many cuDNN ranked, for the report when none is usable
  std::string refusals;  // what the dropped algorithms answered when called

  ConvPlan() = default;
  ConvPlan(const ConvPlan&) = delete;
  ConvPlan& operator=(const ConvPlan&) = delete;
  ~ConvPlan() {
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
};

// device, pass, dtype, tf32 | deterministic << 1, and the 16 numbers of the geometry.
using ConvKey = std::array<int64_t, 20>;

// A device's cuDNN handle, bound to kiln's stream and never destroyed (like cuBLASLt's). cuDNN
// handles must not be used by two threads at once, so the mutex is held from plan lookup to the
// queued call; it also guards the device's plans, whose algorithm lists shrink when one is refused.
struct ConvDevice {
  cudnnHandle_t handle = nullptr;
  std::mutex mutex;
};

template <class Describe>
std::unique_ptr<ConvDevice> make_conv_device(cudaStream_t stream, const Describe& describe) {
  auto d = std::make_unique<ConvDevice>();
  check_cudnn(cudnnCreate(&d->handle), "cudnnCreate", describe);
  const cudnnStatus_t bound = cudnnSetStream(d->handle, stream);
  if (bound != CUDNN_STATUS_SUCCESS) cudnnDestroy(d->handle);
  check_cudnn(bound, "cudnnSetStream", describe);
  return d;
}

LastingCache<int, ConvDevice>& conv_devices() {
  static auto& devices = *new LastingCache<int, ConvDevice>;
  return devices;
}

LastingCache<ConvKey, ConvPlan>& conv_plans() {
  static auto& plans = *new LastingCache<ConvKey, ConvPlan>;
  return plans;
}

// NOT_SUPPORTED answers that concern one algorithm on this problem, not the installation.
bool algorithm_refused(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_NOT_SUPPORTED:
    case CUDNN_STATUS_NOT_SUPPORTED_SHAPE:
    case CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE:
    case CUDNN_STATUS_NOT_SUPPORTED_LAYOUT:
    case CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT:
    case CUDNN_STATUS_NOT_SUPPORTED_PADDING:
    case CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM: return true;
    default: return false;
  }
}

template <class Describe>
[[noreturn]] void no_conv_algorithm(const ConvPlan& plan, const Describe& describe) {
  KILN_FAIL(kConvOp, "cuDNN offers no algorithm for this convolution ({} ranked, none usable with at most {} of "
            "workspace at this precision{}{}); {}", plan.ranked, memory::format_bytes(kConvWorkspaceLimit),
            flags().deterministic ? " and deterministic (KILN_DETERMINISTIC=1)" : "",
            plan.refusals.empty() ? "" : "; refused when called:" + plan.refusals, describe());
}

// cuDNN's ranked algorithms that passed its checks, keep the precision kiln asked for, and need
// at most kConvWorkspaceLimit, in rank order. cuDNN picks tensor-core kernels from the algorithm
// and the descriptor's math type together, so the descriptor takes the algorithm's math type;
// float32 without tf32 stays on FMA math (no TF32 rounding). Conversion math (inputs rounded to a
// narrower type) is never taken.
template <class Perf, class WorkspaceSize, class Describe>
void choose_algorithms(ConvPlan& plan, const Perf* perf, int count, bool fma_only, bool deterministic,
                       const WorkspaceSize& workspace_size, const Describe& describe) {
  plan.ranked = static_cast<size_t>(count);
  for (int i = 0; i < count; ++i) {
    const Perf& p = perf[i];
    if (p.status != CUDNN_STATUS_SUCCESS || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (fma_only && p.mathType == CUDNN_TENSOR_OP_MATH) continue;
    if (deterministic && p.determinism != CUDNN_DETERMINISTIC) continue;  // KILN_DETERMINISTIC: no atomics
    const cudnnMathType_t math = fma_only ? CUDNN_FMA_MATH : p.mathType;
    check_cudnn(cudnnSetConvolutionMathType(plan.conv, math), "cudnnSetConvolutionMathType", describe);
    size_t bytes = 0;
    if (workspace_size(p.algo, &bytes) != CUDNN_STATUS_SUCCESS || bytes > kConvWorkspaceLimit) continue;
    plan.choices.push_back({static_cast<int>(p.algo), math, bytes});
  }
  if (plan.choices.empty()) no_conv_algorithm(plan, describe);
}

template <class Describe>
std::unique_ptr<ConvPlan> make_conv_plan(cudnnHandle_t handle, ConvPass pass, DType t, bool tf32, bool deterministic,
                                         const ConvGeometry& g, const Describe& describe) {
  auto plan = std::make_unique<ConvPlan>();
  const cudnnDataType_t type = cudnn_type(t);
  const auto i = [](int64_t v) { return static_cast<int>(v); };
  check_cudnn(cudnnCreateTensorDescriptor(&plan->x), "cudnnCreateTensorDescriptor", describe);
  check_cudnn(cudnnCreateTensorDescriptor(&plan->y), "cudnnCreateTensorDescriptor", describe);
  check_cudnn(cudnnCreateFilterDescriptor(&plan->w), "cudnnCreateFilterDescriptor", describe);
  check_cudnn(cudnnCreateConvolutionDescriptor(&plan->conv), "cudnnCreateConvolutionDescriptor", describe);
  check_cudnn(cudnnSetTensor4dDescriptor(plan->x, CUDNN_TENSOR_NCHW, type, i(g.N), i(g.C), i(g.H), i(g.W)),
              "cudnnSetTensor4dDescriptor (x)", describe);
  check_cudnn(cudnnSetTensor4dDescriptor(plan->y, CUDNN_TENSOR_NCHW, type, i(g.N), i(g.OC), i(g.OH), i(g.OW)),
              "cudnnSetTensor4dDescriptor (y)", describe);
  check_cudnn(cudnnSetFilter4dDescriptor(plan->w, type, CUDNN_TENSOR_NCHW, i(g.OC), i(g.C / g.groups), i(g.KH),
                                         i(g.KW)),
              "cudnnSetFilter4dDescriptor", describe);
  // Half types accumulate in float (cuDNN's "pseudo half" configurations).
  check_cudnn(cudnnSetConvolution2dDescriptor(plan->conv, i(g.padding[0]), i(g.padding[1]), i(g.stride[0]),
                                              i(g.stride[1]), i(g.dilation[0]), i(g.dilation[1]),
                                              CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
              "cudnnSetConvolution2dDescriptor", describe);
  check_cudnn(cudnnSetConvolutionGroupCount(plan->conv, i(g.groups)), "cudnnSetConvolutionGroupCount", describe);
  const bool fma_only = t == DType::Float32 && !tf32;
  check_cudnn(cudnnSetConvolutionMathType(plan->conv, fma_only ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH),
              "cudnnSetConvolutionMathType", describe);

  // cuDNN's output size must be the caller's: a mismatch is a kiln bug, better named here than as
  // CUDNN_STATUS_BAD_PARAM from the call.
  int n = 0, c = 0, h = 0, w = 0;
  check_cudnn(cudnnGetConvolution2dForwardOutputDim(plan->conv, plan->x, plan->w, &n, &c, &h, &w),
              "cudnnGetConvolution2dForwardOutputDim", describe);
  KILN_CHECK(n == g.N && c == g.OC && h == g.OH && w == g.OW, kConvOp,
             "cuDNN computes the output ({}, {}, {}, {}) for this input, weight and window, not the one given; {}",
             n, c, h, w, describe());

  int found = 0;
  switch (pass) {
    case ConvPass::Forward: {
      cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT] = {};
      check_cudnn(cudnnGetConvolutionForwardAlgorithm_v7(handle, plan->x, plan->w, plan->conv, plan->y,
                                                         CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &found, perf),
                  "cudnnGetConvolutionForwardAlgorithm_v7", describe);
      choose_algorithms(*plan, perf, found, fma_only, deterministic,
                        [&](cudnnConvolutionFwdAlgo_t algo, size_t* bytes) {
        return cudnnGetConvolutionForwardWorkspaceSize(handle, plan->x, plan->w, plan->conv, plan->y, algo, bytes);
      }, describe);
      break;
    }
    case ConvPass::BackwardData: {
      cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT] = {};
      check_cudnn(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, plan->w, plan->y, plan->conv, plan->x,
                                                              CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &found, perf),
                  "cudnnGetConvolutionBackwardDataAlgorithm_v7", describe);
      choose_algorithms(*plan, perf, found, fma_only, deterministic,
                        [&](cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) {
        return cudnnGetConvolutionBackwardDataWorkspaceSize(handle, plan->w, plan->y, plan->conv, plan->x, algo,
                                                            bytes);
      }, describe);
      break;
    }
    case ConvPass::BackwardWeight: {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT] = {};
      check_cudnn(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, plan->x, plan->y, plan->conv, plan->w,
                                                                CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &found,
                                                                perf),
                  "cudnnGetConvolutionBackwardFilterAlgorithm_v7", describe);
      choose_algorithms(*plan, perf, found, fma_only, deterministic,
                        [&](cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, plan->x, plan->y, plan->conv, plan->w, algo,
                                                              bytes);
      }, describe);
      break;
    }
  }
  return plan;
}

void run_conv(int device, ConvPass pass, DType t, const ConvGeometry& g, const void* a,
              const void* b, void* out) {
  auto describe = [&] { return describe_conv(device, pass, t, g); };
  check_cuda(cudaSetDevice(device), kConvOp, "cudaSetDevice", describe);
  auto stream = static_cast<cudaStream_t>(cuda::stream(device));
  const bool tf32 = t == DType::Float32 && flags().tf32;
  const bool deterministic = flags().deterministic;

  ConvDevice& dev = conv_devices().get_or_create(device, [&] { return make_conv_device(stream, describe); });
  std::lock_guard<std::mutex> lock(dev.mutex);
  const cudnnHandle_t handle = dev.handle;
  const ConvKey key{device, static_cast<int64_t>(pass), static_cast<int64_t>(t),
                    int64_t{tf32} | int64_t{deterministic} << 1,
                    g.N, g.C, g.H, g.W, g.OC, g.KH, g.KW, g.OH, g.OW, g.stride[0], g.stride[1],
                    g.padding[0], g.padding[1], g.dilation[0], g.dilation[1], g.groups};
  ConvPlan& plan = conv_plans().get_or_create(
      key, [&] { return make_conv_plan(handle, pass, t, tf32, deterministic, g, describe); });
  // beta = 0: the output is overwritten and never read (it may hold NaN).
  const float one = 1.0f, zero = 0.0f;
  for (;;) {
    if (plan.choices.empty()) no_conv_algorithm(plan, describe);
    const ConvChoice choice = plan.choices.front();
    check_cudnn(cudnnSetConvolutionMathType(plan.conv, choice.math), "cudnnSetConvolutionMathType", describe);
    // Released when this call returns, with the convolution only queued: the pool hands it out
    // again to work queued later on the same stream.
    std::shared_ptr<Storage> workspace;
    if (choice.workspace_bytes > 0) workspace = memory::allocate_storage(choice.workspace_bytes, Device::cuda(device));
    void* const space = workspace ? workspace->data : nullptr;
    const size_t bytes = choice.workspace_bytes;
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    const char* call = "";
    switch (pass) {
      case ConvPass::Forward:  // a = x, b = w, out = y
        call = "cudnnConvolutionForward";
        status = cudnnConvolutionForward(handle, &one, plan.x, a, plan.w, b, plan.conv,
                                         static_cast<cudnnConvolutionFwdAlgo_t>(choice.algo), space, bytes, &zero,
                                         plan.y, out);
        break;
      case ConvPass::BackwardData:  // a = dy, b = w, out = dx
        call = "cudnnConvolutionBackwardData";
        status = cudnnConvolutionBackwardData(handle, &one, plan.w, b, plan.y, a, plan.conv,
                                              static_cast<cudnnConvolutionBwdDataAlgo_t>(choice.algo), space, bytes,
                                              &zero, plan.x, out);
        break;
      case ConvPass::BackwardWeight:  // a = x, b = dy, out = dw
        call = "cudnnConvolutionBackwardFilter";
        status = cudnnConvolutionBackwardFilter(handle, &one, plan.x, a, plan.y, b, plan.conv,
                                                static_cast<cudnnConvolutionBwdFilterAlgo_t>(choice.algo), space,
                                                bytes, &zero, plan.w, out);
        break;
    }
    // Refused before anything was queued: this algorithm never runs for this plan; try the next.
    // Refusals that name the installation (driver, runtime, a missing sub-library) would refuse
    // every algorithm alike: they are reported as they are.
    if (algorithm_refused(status)) {
      char detail[512] = {};
      cudnnGetLastErrorString(detail, sizeof(detail));
      plan.refusals += fmt::format(" algorithm {}: {}{}{};", choice.algo, cudnnGetErrorString(status),
                                   detail[0] ? ": " : "", detail);
      plan.choices.erase(plan.choices.begin());
      continue;
    }
    check_cudnn(status, call, describe);
    return;
  }
}

#endif  // KILN_WITH_CUDA && KILN_WITH_CUDNN

}  // namespace

bool cudnn_supports_conv(DType t) { return KILN_WITH_CUDA && KILN_WITH_CUDNN && is_conv_dtype(t); }

void cudnn_conv2d(int device, ConvPass pass, DType t, const ConvGeometry& g, const void* a,
            const void* b, void* out) {
  KILN_CHECK(is_conv_dtype(t), kConvOp, "CUDA convolution takes float32, float16 or bfloat16, got {}; check "
             "cuda::cudnn_supports_conv first", dtype_name(t));
  KILN_CHECK(KILN_WITH_CUDA && KILN_WITH_CUDNN, kConvOp, "kiln was built without {} (CMake did not find it); "
             "check cuda::cudnn_supports_conv first", KILN_WITH_CUDA ? "cuDNN" : "the CUDA toolkit");
  const int64_t sizes[] = {g.N, g.C, g.H, g.W, g.OC, g.KH, g.KW, g.OH, g.OW, g.stride[0], g.stride[1],
                           g.padding[0], g.padding[1], g.dilation[0], g.dilation[1], g.groups};
  bool valid = g.groups >= 1 && g.stride[0] >= 1 && g.stride[1] >= 1 && g.dilation[0] >= 1 && g.dilation[1] >= 1;
  for (int64_t v : sizes) valid = valid && fits_int(v);
  KILN_CHECK(valid && g.C % g.groups == 0 && g.OC % g.groups == 0, kConvOp,
             "sizes must be in [0, {}], strides, dilations and groups positive, and groups must divide both channel "
             "counts; {}", INT_MAX, describe_conv(device, pass, t, g));
  check_library_device(device, kConvOp);
  if (g.N == 0 || g.C == 0 || g.OC == 0 || g.OH == 0 || g.OW == 0) {  // cuDNN rejects empty tensors
    const int64_t numel = pass == ConvPass::Forward        ? g.N * g.OC * g.OH * g.OW
                          : pass == ConvPass::BackwardData ? g.N * g.C * g.H * g.W
                                                           : g.OC * (g.C / g.groups) * g.KH * g.KW;
    if (numel > 0) cuda::fill_bytes(device, out, 0, static_cast<size_t>(numel) * dtype_size(t));  // empty sums
    return;
  }
#if KILN_WITH_CUDA && KILN_WITH_CUDNN
  run_conv(device, pass, t, g, a, b, out);
#else
  (void)a, (void)b;
#endif
}

}  // namespace kiln::cuda
