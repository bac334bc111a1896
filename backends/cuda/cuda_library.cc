// cuBLASLt matmul and cuDNN convolution on CUDA tensors: one library handle per device bound to
// kiln's stream, and per shape a cached plan (descriptors plus the algorithm the library's
// heuristic picked), so that a training step pays only for queueing the call. Without the CUDA
// toolkit (or without cuDNN, for conv2d) the entry points compile to a clear kiln::Error.
#include "backends/cuda/cuda_library.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/flags.h"
#include "memory/allocator.h"
#include "backends/cuda/cuda_runtime.h"

#if KILN_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif
#if KILN_WITH_CUDA && KILN_WITH_CUDNN
#include <cudnn.h>
#endif

namespace kiln::cuda_library {

namespace {

constexpr std::string_view kMatmulOp = "matmul (cuBLASLt)";
constexpr std::string_view kConvOp = "conv2d (cuDNN)";

bool is_matmul_dtype(DType t) {
  return t == DType::Float32 || t == DType::Float64 || t == DType::Float16 || t == DType::BFloat16;
}

bool is_conv_dtype(DType t) { return t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16; }

std::string describe_matmul(int device, DType t, const int64_t a_strides[3], const int64_t b_strides[3],
                            int64_t batch, int64_t M, int64_t K, int64_t N) {
  return fmt::format("{} on cuda:{}: A ({}, {}, {}) strides {{{}, {}, {}}}, B ({}, {}, {}) strides {{{}, {}, {}}}",
                     dtype_name(t), device, batch, M, K, a_strides[0], a_strides[1], a_strides[2], batch, K, N,
                     b_strides[0], b_strides[1], b_strides[2]);
}

std::string describe_conv(int device, ConvPass pass, DType t, const ConvGeometry& g) {
  static constexpr std::string_view kPass[] = {"forward", "backward data", "backward weight"};
  const int64_t group_channels = g.groups > 0 ? g.C / g.groups : 0;
  return fmt::format("{} {} on cuda:{}: x ({}, {}, {}, {}), weight ({}, {}, {}, {}) -> ({}, {}, {}, {}), "
                     "stride ({}, {}), padding ({}, {}), dilation ({}, {}), groups {}",
                     kPass[static_cast<int>(pass)], dtype_name(t), device, g.N, g.C, g.H, g.W, g.OC, group_channels,
                     g.KH, g.KW, g.N, g.OC, g.OH, g.OW, g.stride[0], g.stride[1], g.padding[0], g.padding[1],
                     g.dilation[0], g.dilation[1], g.groups);
}

// A device this unit can queue library calls on: present, and a real GPU (the host emulator's
// "device memory" is host memory, which cuBLAS and cuDNN cannot read).
void check_library_device(int device, std::string_view op) {
  cuda::check_device(Device::cuda(device), op);
  KILN_CHECK(!cuda::emulated(), op, "cuda:{} is the host emulator (KILN_CUDA_EMULATOR=1); NVIDIA's libraries "
             "need a real GPU, so check cuda::emulated() and use the composite ops there", device);
}

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

#if KILN_WITH_CUDA

template <class Describe>
void check_cuda(cudaError_t e, std::string_view op, const char* call, const Describe& describe) {
  if (e != cudaSuccess)
    KILN_FAIL(op, "{} failed: {} ({}); {}", call, cudaGetErrorString(e), cudaGetErrorName(e), describe());
}

// ---------------------------------------------------------------------------------------------
// Matmul (cuBLASLt)
// ---------------------------------------------------------------------------------------------

// NVIDIA's suggested cuBLASLt workspace for Hopper; one per device, kept for the process.
constexpr size_t kMatmulWorkspaceBytes = size_t{32} << 20;

template <class Describe>
void check_cublas(cublasStatus_t s, const char* call, const Describe& describe) {
  if (s != CUBLAS_STATUS_SUCCESS)
    KILN_FAIL(kMatmulOp, "{} failed: {} ({}); {}", call, cublasLtGetStatusName(s), cublasLtGetStatusString(s),
              describe());
}

// One (rows, cols) operand as cuBLASLt will read it: a column-major matrix needs a unit row
// stride and ld >= rows, so a kiln operand is either row-major (col stride 1, row stride ld >=
// cols), column-major (row stride 1, col stride ld >= rows), or neither and copied to a
// row-major buffer first. A size-1 dim's stride addresses nothing and is not looked at.
struct MatrixView {
  bool row_major = true;
  bool packed = false;
  int64_t ld = 1;
  int64_t batch_stride = 0;  // elements; 0 broadcasts
};

MatrixView view_of(int64_t batch, int64_t rows, int64_t cols, const int64_t s[3]) {
  MatrixView v;
  const int64_t row_stride = s[1], col_stride = s[2];
  bool expressible = true;
  if (rows == 1 && cols == 1) {
    v = {true, false, 1, 0};
  } else if (rows == 1) {
    if (col_stride == 1) v = {true, false, cols, 0};
    else if (col_stride > 1) v = {false, false, col_stride, 0};  // a (1, cols) column-major matrix
    else expressible = false;
  } else if (cols == 1) {
    if (row_stride == 1) v = {false, false, rows, 0};
    else if (row_stride > 1) v = {true, false, row_stride, 0};
    else expressible = false;
  } else if (col_stride == 1 && row_stride >= cols) {
    v = {true, false, row_stride, 0};
  } else if (row_stride == 1 && col_stride >= rows) {
    v = {false, false, col_stride, 0};
  } else {
    expressible = false;
  }
  // Batches may overlap or repeat (stride 0): cuBLASLt only reads A and B. Negative strides
  // cannot be given to it.
  v.batch_stride = batch == 1 ? 0 : s[0];
  if (v.batch_stride < 0) expressible = false;
  if (!expressible) v = {true, true, cols, batch == 1 || s[0] == 0 ? 0 : rows * cols};
  return v;
}

// Copies `count` (rows, cols) matrices at element strides s into dst, contiguous. One
// cudaMemcpy2DAsync moves `height` runs of `width` bytes at a fixed source pitch, so a call covers
// the columns (as one run when they are contiguous, else one element per run) along one more dim
// whose stride is a valid pitch; the remaining dims loop. The layouts that land here (expanded or
// strided views) are rare, and this keeps the copy to the runtime API alone.
template <class Describe>
void pack(cudaStream_t stream, size_t es, const char* src, const int64_t s[3], int64_t count, int64_t rows,
          int64_t cols, char* dst, const Describe& describe) {
  const int64_t extent[3] = {count, rows, cols};
  const int64_t dst_stride[3] = {rows * cols, cols, 1};
  const bool contiguous_rows = s[2] == 1;
  const size_t width = contiguous_rows ? static_cast<size_t>(cols) * es : es;
  int height_dim = -1;
  for (int d = 0; d < (contiguous_rows ? 2 : 3); ++d) {
    // The runtime refuses pitches past 2^31 - 1 bytes (cudaDevAttrMaxPitch).
    const bool valid_pitch = s[d] > 0 && static_cast<size_t>(s[d]) * es >= width &&
                             std::max(s[d], dst_stride[d]) * int64_t(es) <= INT_MAX;
    if (valid_pitch && extent[d] > 1 && (height_dim < 0 || extent[d] > extent[height_dim])) height_dim = d;
  }
  int loop_dims[3], loops = 0;
  for (int d = 0; d < 3; ++d)
    if (d != height_dim && !(contiguous_rows && d == 2)) loop_dims[loops++] = d;
  const size_t height = height_dim < 0 ? 1 : static_cast<size_t>(extent[height_dim]);
  const size_t spitch = height_dim < 0 ? width : static_cast<size_t>(s[height_dim]) * es;
  const size_t dpitch = height_dim < 0 ? width : static_cast<size_t>(dst_stride[height_dim]) * es;
  int64_t calls = 1;
  for (int i = 0; i < loops; ++i) calls *= extent[loop_dims[i]];
  for (int64_t flat = 0; flat < calls; ++flat) {
    int64_t rest = flat, src_offset = 0, dst_offset = 0;
    for (int i = loops - 1; i >= 0; --i) {
      const int d = loop_dims[i];
      const int64_t index = rest % extent[d];
      rest /= extent[d];
      src_offset += index * s[d];
      dst_offset += index * dst_stride[d];
    }
    check_cuda(cudaMemcpy2DAsync(dst + dst_offset * int64_t(es), dpitch, src + src_offset * int64_t(es), spitch,
                                 width, height, cudaMemcpyDeviceToDevice, stream),
               kMatmulOp, "cudaMemcpy2DAsync (copying an operand to a contiguous buffer)", describe);
  }
}

// The largest power of two (up to 256, cuBLASLt's default) dividing the address: kernels that
// assume more alignment than a pointer has must not be chosen.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && address % (2 * a) == 0) a *= 2;
  return a;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::Float64: return CUDA_R_64F;
    case DType::Float16: return CUDA_R_16F;
    case DType::BFloat16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// Descriptors and the chosen algorithm of one matmul shape. cuBLASLt is column-major, so the
// row-major C = A @ B runs as the column-major C^T = B^T @ A^T: cuBLASLt's first operand is kiln's
// B, its second kiln's A, and C is an (N, M) column-major matrix with ld N.
struct MatmulPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // kiln's A, B and C (= D)
  cublasLtMatmulAlgo_t algo{};

  MatmulPlan() = default;
  MatmulPlan(const MatmulPlan&) = delete;
  MatmulPlan& operator=(const MatmulPlan&) = delete;
  ~MatmulPlan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// dtype, compute type, sizes, both operand views and the three pointers' alignments.
using MatmulKey = std::array<int64_t, 15>;

struct MatmulDevice {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // device memory outside the pool: not tensor memory, never freed
};

// Never destroyed: handles and the workspaces must outlive every static that could still
// queue work at exit, and cublasLtDestroy after the runtime has shut down crashes.
struct MatmulState {
  std::mutex mutex;  // guards the maps and serializes use of a device's handle and workspace
  std::map<int, MatmulDevice> devices;
  std::map<std::pair<int, MatmulKey>, std::unique_ptr<MatmulPlan>> plans;  // never erased
};

MatmulState& matmul_state() {
  static auto* state = new MatmulState;
  return *state;
}

template <class Describe>
MatmulDevice& matmul_device(MatmulState& state, int device, const Describe& describe) {
  MatmulDevice& d = state.devices[device];
  if (!d.handle) check_cublas(cublasLtCreate(&d.handle), "cublasLtCreate", describe);
  if (!d.workspace) {
    d.workspace = cuda::device_malloc(device, kMatmulWorkspaceBytes);
    KILN_CHECK(d.workspace != nullptr, "matmul (cuBLASLt)", "cuda:{} has no {} left for cuBLASLt's workspace; free "
               "tensors or call kiln::empty_cache()", device, memory::format_bytes(kMatmulWorkspaceBytes));
  }
  return d;
}

// Creates `layout` (a plan member, so a failure further on still destroys it): (rows, cols, ld) in
// cuBLASLt's column-major terms, and the batch.
template <class Describe>
void make_layout(cublasLtMatrixLayout_t& layout, cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld,
                 int64_t batch, int64_t batch_stride, const Describe& describe) {
  check_cublas(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld), "cublasLtMatrixLayoutCreate", describe);
  if (batch == 1) return;
  const int32_t count = static_cast<int32_t>(batch);
  check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
               "cublasLtMatrixLayoutSetAttribute (batch count)", describe);
  check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
                                                sizeof(batch_stride)),
               "cublasLtMatrixLayoutSetAttribute (batch stride)", describe);
}

// kiln's (rows, cols) operand as a cuBLASLt operand: a row-major one is the column-major
// (cols, rows) matrix with the same ld, used as is; a column-major one is transposed by the op.
struct LibraryOperand {
  uint64_t rows, cols;
  int32_t op;
};

LibraryOperand library_operand(const MatrixView& v, int64_t rows, int64_t cols) {
  if (v.row_major) return {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), CUBLAS_OP_N};
  return {static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), CUBLAS_OP_T};
}

template <class Describe>
std::unique_ptr<MatmulPlan> make_matmul_plan(cublasLtHandle_t handle, DType t, cublasComputeType_t compute,
                                             const MatrixView& va, const MatrixView& vb, int64_t batch, int64_t M,
                                             int64_t K, int64_t N, const uint32_t align[3],
                                             const Describe& describe) {
  auto plan = std::make_unique<MatmulPlan>();
  const cudaDataType_t type = cuda_type(t);
  const cudaDataType_t scale = t == DType::Float64 ? CUDA_R_64F : CUDA_R_32F;
  check_cublas(cublasLtMatmulDescCreate(&plan->op, compute, scale), "cublasLtMatmulDescCreate", describe);
  const LibraryOperand la = library_operand(va, M, K), lb = library_operand(vb, K, N);
  // op(first) must be B^T (N, K) and op(second) A^T (K, M).
  check_cublas(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &lb.op, sizeof(lb.op)),
               "cublasLtMatmulDescSetAttribute (TRANSA)", describe);
  check_cublas(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &la.op, sizeof(la.op)),
               "cublasLtMatmulDescSetAttribute (TRANSB)", describe);
  make_layout(plan->a, type, la.rows, la.cols, va.ld, batch, va.batch_stride, describe);
  make_layout(plan->b, type, lb.rows, lb.cols, vb.ld, batch, vb.batch_stride, describe);
  make_layout(plan->c, type, static_cast<uint64_t>(N), static_cast<uint64_t>(M), N, batch, M * N, describe);

  cublasLtMatmulPreference_t preference = nullptr;
  check_cublas(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate", describe);
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, cublasStatus_t (*)(cublasLtMatmulPreference_t)> guard(
      preference, cublasLtMatmulPreferenceDestroy);
  const uint64_t workspace = kMatmulWorkspaceBytes;
  check_cublas(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof(workspace)),
               "cublasLtMatmulPreferenceSetAttribute (workspace)", describe);
  // cuBLASLt's A is kiln's B; C and D are both kiln's C.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[1]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[0]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[2]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[2]}};
  for (const auto& [attribute, bytes] : alignments)
    check_cublas(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes)),
                 "cublasLtMatmulPreferenceSetAttribute (alignment)", describe);

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check_cublas(cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->b, plan->a, plan->c, plan->c, preference, 1,
                                              &result, &found),
               "cublasLtMatmulAlgoGetHeuristic", describe);
  KILN_CHECK(found > 0, kMatmulOp, "cuBLASLt's heuristic has no algorithm for this problem; {}", describe());
  check_cublas(result.state, "cublasLtMatmulAlgoGetHeuristic (its algorithm)", describe);
  plan->algo = result.algo;
  return plan;
}

void run_matmul(int device, DType t, const void* a, const int64_t a_strides[3], const void* b,
                const int64_t b_strides[3], void* c, int64_t batch, int64_t M, int64_t K, int64_t N) {
  auto describe = [&] { return describe_matmul(device, t, a_strides, b_strides, batch, M, K, N); };
  const size_t es = dtype_size(t);
  check_cuda(cudaSetDevice(device), kMatmulOp, "cudaSetDevice", describe);
  auto stream = static_cast<cudaStream_t>(cuda::stream(device));
  const MatrixView va = view_of(batch, M, K, a_strides), vb = view_of(batch, K, N, b_strides);

  MatmulState& state = matmul_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  MatmulDevice& dev = matmul_device(state, device, describe);
  // Packed copies are released when this call returns, with the matmul only queued: the pool
  // hands them out again to work queued later on the same stream, so nothing reads them early.
  std::shared_ptr<Storage> packed_a, packed_b;
  auto pack_operand = [&](const MatrixView& v, const void* src, const int64_t s[3], int64_t rows, int64_t cols,
                          std::shared_ptr<Storage>& buffer) {
    if (!v.packed) return src;
    const int64_t count = v.batch_stride == 0 ? 1 : batch;
    buffer = memory::allocate_storage(static_cast<size_t>(count * rows * cols) * es, Device::cuda(device));
    pack(stream, es, static_cast<const char*>(src), s, count, rows, cols, static_cast<char*>(buffer->data),
         describe);
    return static_cast<const void*>(buffer->data);
  };
  a = pack_operand(va, a, a_strides, M, K, packed_a);
  b = pack_operand(vb, b, b_strides, K, N, packed_b);

  const bool tf32 = t == DType::Float32 && flags().tf32;
  const cublasComputeType_t compute = t == DType::Float64 ? CUBLAS_COMPUTE_64F
                                      : tf32              ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                          : CUBLAS_COMPUTE_32F;
  const uint32_t align[3] = {alignment_of(a), alignment_of(b), alignment_of(c)};
  const MatmulKey key{static_cast<int64_t>(t), static_cast<int64_t>(compute), batch, M, K, N,
                      va.row_major, va.ld, va.batch_stride, vb.row_major, vb.ld, vb.batch_stride,
                      align[0], align[1], align[2]};
  auto it = state.plans.find({device, key});
  if (it == state.plans.end())
    it = state.plans
             .emplace(std::pair{device, key},
                      make_matmul_plan(dev.handle, t, compute, va, vb, batch, M, K, N, align, describe))
             .first;
  const MatmulPlan& plan = *it->second;
  // alpha and beta are read from the host at queue time, in the scale type.
  const float one_f = 1.0f, zero_f = 0.0f;
  const double one_d = 1.0, zero_d = 0.0;
  const void* alpha = t == DType::Float64 ? static_cast<const void*>(&one_d) : &one_f;
  const void* beta = t == DType::Float64 ? static_cast<const void*>(&zero_d) : &zero_f;
  check_cublas(cublasLtMatmul(dev.handle, plan.op, alpha, b, plan.b, a, plan.a, beta, c, plan.c, c, plan.c,
                              &plan.algo, dev.workspace, kMatmulWorkspaceBytes, stream),
               "cublasLtMatmul", describe);
}

#endif  // KILN_WITH_CUDA

#if KILN_WITH_CUDA && KILN_WITH_CUDNN

// ---------------------------------------------------------------------------------------------
// Convolution (cuDNN)
// ---------------------------------------------------------------------------------------------
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

// device, pass, dtype, tf32, and the 16 numbers of the geometry.
using ConvKey = std::array<int64_t, 20>;

// Never destroyed, like MatmulState. cuDNN handles must not be used by two threads at once, so
// the mutex is held from plan lookup to the queued call.
struct ConvState {
  std::mutex mutex;
  std::map<int, cudnnHandle_t> handles;
  std::map<ConvKey, std::unique_ptr<ConvPlan>> plans;  // never erased
};

ConvState& conv_state() {
  static auto* state = new ConvState;
  return *state;
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
            "workspace at this precision{}); {}", plan.ranked, memory::format_bytes(kConvWorkspaceLimit),
            plan.refusals.empty() ? "" : "; refused when called:" + plan.refusals, describe());
}

// cuDNN's ranked algorithms that passed its checks, keep the precision kiln asked for, and need
// at most kConvWorkspaceLimit, in rank order. cuDNN picks tensor-core kernels from the algorithm
// and the descriptor's math type together, so the descriptor takes the algorithm's math type;
// float32 without tf32 stays on FMA math (no TF32 rounding). Conversion math (inputs rounded to a
// narrower type) is never taken.
template <class Perf, class WorkspaceSize, class Describe>
void choose_algorithms(ConvPlan& plan, const Perf* perf, int count, bool fma_only, const WorkspaceSize& workspace_size,
                       const Describe& describe) {
  plan.ranked = static_cast<size_t>(count);
  for (int i = 0; i < count; ++i) {
    const Perf& p = perf[i];
    if (p.status != CUDNN_STATUS_SUCCESS || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (fma_only && p.mathType == CUDNN_TENSOR_OP_MATH) continue;
    const cudnnMathType_t math = fma_only ? CUDNN_FMA_MATH : p.mathType;
    check_cudnn(cudnnSetConvolutionMathType(plan.conv, math), "cudnnSetConvolutionMathType", describe);
    size_t bytes = 0;
    if (workspace_size(p.algo, &bytes) != CUDNN_STATUS_SUCCESS || bytes > kConvWorkspaceLimit) continue;
    plan.choices.push_back({static_cast<int>(p.algo), math, bytes});
  }
  if (plan.choices.empty()) no_conv_algorithm(plan, describe);
}

template <class Describe>
std::unique_ptr<ConvPlan> make_conv_plan(cudnnHandle_t handle, ConvPass pass, DType t, bool tf32,
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
      choose_algorithms(*plan, perf, found, fma_only, [&](cudnnConvolutionFwdAlgo_t algo, size_t* bytes) {
        return cudnnGetConvolutionForwardWorkspaceSize(handle, plan->x, plan->w, plan->conv, plan->y, algo, bytes);
      }, describe);
      break;
    }
    case ConvPass::BackwardData: {
      cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT] = {};
      check_cudnn(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, plan->w, plan->y, plan->conv, plan->x,
                                                              CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &found, perf),
                  "cudnnGetConvolutionBackwardDataAlgorithm_v7", describe);
      choose_algorithms(*plan, perf, found, fma_only, [&](cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) {
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
      choose_algorithms(*plan, perf, found, fma_only, [&](cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
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

  ConvState& state = conv_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  cudnnHandle_t& handle = state.handles[device];
  if (!handle) {
    check_cudnn(cudnnCreate(&handle), "cudnnCreate", describe);
    check_cudnn(cudnnSetStream(handle, stream), "cudnnSetStream", describe);
  }
  const ConvKey key{device, static_cast<int64_t>(pass), static_cast<int64_t>(t), tf32,
                    g.N, g.C, g.H, g.W, g.OC, g.KH, g.KW, g.OH, g.OW, g.stride[0], g.stride[1],
                    g.padding[0], g.padding[1], g.dilation[0], g.dilation[1], g.groups};
  auto it = state.plans.find(key);
  if (it == state.plans.end()) it = state.plans.emplace(key, make_conv_plan(handle, pass, t, tf32, g, describe)).first;
  ConvPlan& plan = *it->second;
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

bool supports_matmul(DType t) { return KILN_WITH_CUDA && is_matmul_dtype(t); }

bool supports_conv(DType t) { return KILN_WITH_CUDA && KILN_WITH_CUDNN && is_conv_dtype(t); }

void matmul(int device, DType t, const void* a, const int64_t a_strides[3], const void* b,
            const int64_t b_strides[3], void* c, int64_t batch, int64_t M, int64_t K, int64_t N) {
  KILN_CHECK(is_matmul_dtype(t), kMatmulOp, "CUDA matmul takes float32, float64, float16 or bfloat16, got {}; "
             "check cuda_library::supports_matmul first", dtype_name(t));
  KILN_CHECK(KILN_WITH_CUDA, kMatmulOp, "kiln was built without the CUDA toolkit (CMake did not find "
             "CUDAToolkit); check cuda_library::supports_matmul first");
  // cuBLASLt takes sizes and the batch count as 32-bit integers.
  KILN_CHECK(fits_int(batch) && fits_int(M) && fits_int(K) && fits_int(N), kMatmulOp,
             "sizes must be in [0, {}]: {}", INT_MAX, describe_matmul(device, t, a_strides, b_strides, batch, M, K, N));
  check_library_device(device, kMatmulOp);
  if (batch == 0 || M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum; all-zero bits are 0.0 in every floating type
    cuda::fill_bytes(device, c, 0, static_cast<size_t>(batch * M * N) * dtype_size(t));
    return;
  }
#if KILN_WITH_CUDA
  run_matmul(device, t, a, a_strides, b, b_strides, c, batch, M, K, N);
#else
  (void)a, (void)b, (void)c;
#endif
}

void conv2d(int device, ConvPass pass, DType t, const ConvGeometry& g, const void* a,
            const void* b, void* out) {
  KILN_CHECK(is_conv_dtype(t), kConvOp, "CUDA convolution takes float32, float16 or bfloat16, got {}; check "
             "cuda_library::supports_conv first", dtype_name(t));
  KILN_CHECK(KILN_WITH_CUDA && KILN_WITH_CUDNN, kConvOp, "kiln was built without {} (CMake did not find it); "
             "check cuda_library::supports_conv first", KILN_WITH_CUDA ? "cuDNN" : "the CUDA toolkit");
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

}  // namespace kiln::cuda_library
