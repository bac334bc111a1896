// cuBLASLt matmul on CUDA tensors: one handle and workspace per device bound to kiln's stream, and
// per shape a cached plan (descriptors plus the algorithm cuBLASLt's heuristic picked), so that a
// training step pays only for queueing the call. Without the CUDA toolkit the entry points compile
// to a clear kiln::Error.
#include "backends/cuda/cublaslt.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "core/device.h"
#include "core/error.h"
#include "core/flags.h"
#include "core/lasting_cache.h"
#include "memory/allocator.h"
#include "backends/cuda/cuda_runtime.h"
#include "backends/cuda/library_common.h"
#include "backends/cuda/shared_library.h"

#if KILN_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

namespace kiln::cuda {

namespace {

constexpr std::string_view kMatmulOp = "matmul (cuBLASLt)";

bool is_matmul_dtype(DType t) {
  return t == DType::Float32 || t == DType::Float64 || t == DType::Float16 || t == DType::BFloat16;
}

std::string describe_matmul(int device, DType t, const int64_t a_strides[3], const int64_t b_strides[3],
                            int64_t batch, int64_t M, int64_t K, int64_t N) {
  return fmt::format("{} on cuda:{}: A ({}, {}, {}) strides {{{}, {}, {}}}, B ({}, {}, {}) strides {{{}, {}, {}}}",
                     dtype_name(t), device, batch, M, K, a_strides[0], a_strides[1], a_strides[2], batch, K, N,
                     b_strides[0], b_strides[1], b_strides[2]);
}

#if KILN_WITH_CUDA

#define KILN_CUBLASLT_FUNCTIONS(X)                                                                       \
  X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtGetStatusName) X(cublasLtGetStatusString) X(cublasLtMatmul) \
  X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy)               \
  X(cublasLtMatmulDescSetAttribute) X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy)     \
  X(cublasLtMatmulPreferenceSetAttribute)                                                                  \
  X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy) X(cublasLtMatrixLayoutSetAttribute)

// cuBLASLt's functions, resolved when the first CUDA matmul runs (backends/cuda/shared_library.h).
KILN_SHARED_LIBRARY_TABLE(CublasLtApi, lt, "cuBLASLt", KILN_CUBLASLT_LIBRARY, KILN_CUBLASLT_SONAME, KILN_CUBLASLT_FUNCTIONS)

// NVIDIA's suggested cuBLASLt workspace for Hopper; one per device, kept for the process.
constexpr size_t kMatmulWorkspaceBytes = size_t{32} << 20;

template <class Describe>
void check_cublas(cublasStatus_t s, const char* call, const Describe& describe) {
  if (s != CUBLAS_STATUS_SUCCESS)
    KILN_FAIL(kMatmulOp, "{} failed: {} ({}); {}", call, lt().cublasLtGetStatusName(s), lt().cublasLtGetStatusString(s),
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
    if (c) lt().cublasLtMatrixLayoutDestroy(c);
    if (b) lt().cublasLtMatrixLayoutDestroy(b);
    if (a) lt().cublasLtMatrixLayoutDestroy(a);
    if (op) lt().cublasLtMatmulDescDestroy(op);
  }
};

// dtype, compute type, sizes, both operand views and the three pointers' alignments.
using MatmulKey = std::array<int64_t, 15>;

// A device's handle and workspace, never destroyed: they must outlive every static that could
// still queue work at exit, and cublasLtDestroy after the runtime has shut down crashes.
struct MatmulDevice {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // device memory outside the pool: not tensor memory, never freed
  std::mutex mutex;           // serializes use of the handle and the workspace
};

template <class Describe>
std::unique_ptr<MatmulDevice> make_matmul_device(int device, const Describe& describe) {
  auto d = std::make_unique<MatmulDevice>();
  check_cublas(lt().cublasLtCreate(&d->handle), "cublasLtCreate", describe);
  d->workspace = cuda::device_malloc(device, kMatmulWorkspaceBytes);
  if (d->workspace == nullptr) {
    lt().cublasLtDestroy(d->handle);
    KILN_FAIL(kMatmulOp, "cuda:{} has no {} left for cuBLASLt's workspace; free tensors or call "
              "kiln::empty_cache()", device, memory::format_bytes(kMatmulWorkspaceBytes));
  }
  return d;
}

LastingCache<int, MatmulDevice>& matmul_devices() {
  static auto& devices = *new LastingCache<int, MatmulDevice>;
  return devices;
}

LastingCache<std::pair<int, MatmulKey>, MatmulPlan>& matmul_plans() {
  static auto& plans = *new LastingCache<std::pair<int, MatmulKey>, MatmulPlan>;
  return plans;
}

// Creates `layout` (a plan member, so a failure further on still destroys it): (rows, cols, ld) in
// cuBLASLt's column-major terms, and the batch.
template <class Describe>
void make_layout(cublasLtMatrixLayout_t& layout, cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld,
                 int64_t batch, int64_t batch_stride, const Describe& describe) {
  check_cublas(lt().cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld), "cublasLtMatrixLayoutCreate", describe);
  if (batch == 1) return;
  const int32_t count = static_cast<int32_t>(batch);
  check_cublas(lt().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
               "cublasLtMatrixLayoutSetAttribute (batch count)", describe);
  check_cublas(lt().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
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
  check_cublas(lt().cublasLtMatmulDescCreate(&plan->op, compute, scale), "cublasLtMatmulDescCreate", describe);
  const LibraryOperand la = library_operand(va, M, K), lb = library_operand(vb, K, N);
  // op(first) must be B^T (N, K) and op(second) A^T (K, M).
  check_cublas(lt().cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &lb.op, sizeof(lb.op)),
               "cublasLtMatmulDescSetAttribute (TRANSA)", describe);
  check_cublas(lt().cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &la.op, sizeof(la.op)),
               "cublasLtMatmulDescSetAttribute (TRANSB)", describe);
  make_layout(plan->a, type, la.rows, la.cols, va.ld, batch, va.batch_stride, describe);
  make_layout(plan->b, type, lb.rows, lb.cols, vb.ld, batch, vb.batch_stride, describe);
  make_layout(plan->c, type, static_cast<uint64_t>(N), static_cast<uint64_t>(M), N, batch, M * N, describe);

  cublasLtMatmulPreference_t preference = nullptr;
  check_cublas(lt().cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate", describe);
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, cublasStatus_t (*)(cublasLtMatmulPreference_t)> guard(
      preference, lt().cublasLtMatmulPreferenceDestroy);
  const uint64_t workspace = kMatmulWorkspaceBytes;
  check_cublas(lt().cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof(workspace)),
               "cublasLtMatmulPreferenceSetAttribute (workspace)", describe);
  // cuBLASLt's A is kiln's B; C and D are both kiln's C.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[1]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[0]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[2]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[2]}};
  for (const auto& [attribute, bytes] : alignments)
    check_cublas(lt().cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes)),
                 "cublasLtMatmulPreferenceSetAttribute (alignment)", describe);

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check_cublas(lt().cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->b, plan->a, plan->c, plan->c, preference, 1,
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

  MatmulDevice& dev = matmul_devices().get_or_create(device, [&] { return make_matmul_device(device, describe); });
  std::lock_guard<std::mutex> lock(dev.mutex);
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
  const MatmulPlan& plan = matmul_plans().get_or_create({device, key}, [&] {
    return make_matmul_plan(dev.handle, t, compute, va, vb, batch, M, K, N, align, describe);
  });
  // alpha and beta are read from the host at queue time, in the scale type.
  const float one_f = 1.0f, zero_f = 0.0f;
  const double one_d = 1.0, zero_d = 0.0;
  const void* alpha = t == DType::Float64 ? static_cast<const void*>(&one_d) : &one_f;
  const void* beta = t == DType::Float64 ? static_cast<const void*>(&zero_d) : &zero_f;
  check_cublas(lt().cublasLtMatmul(dev.handle, plan.op, alpha, b, plan.b, a, plan.a, beta, c, plan.c, c, plan.c,
                              &plan.algo, dev.workspace, kMatmulWorkspaceBytes, stream),
               "cublasLtMatmul", describe);
}

#endif  // KILN_WITH_CUDA

}  // namespace

bool cublaslt_supports_matmul(DType t) { return KILN_WITH_CUDA && is_matmul_dtype(t); }

void cublaslt_load() {
#if KILN_WITH_CUDA
  (void)lt();
#else
  KILN_FAIL(kMatmulOp, "kiln was built without the CUDA toolkit (CMake did not find CUDAToolkit)");
#endif
}

void cublaslt_matmul(int device, DType t, const void* a, const int64_t a_strides[3], const void* b,
            const int64_t b_strides[3], void* c, int64_t batch, int64_t M, int64_t K, int64_t N) {
  KILN_CHECK(is_matmul_dtype(t), kMatmulOp, "CUDA matmul takes float32, float64, float16 or bfloat16, got {}; "
             "check cuda::cublaslt_supports_matmul first", dtype_name(t));
  KILN_CHECK(KILN_WITH_CUDA, kMatmulOp, "kiln was built without the CUDA toolkit (CMake did not find "
             "CUDAToolkit); check cuda::cublaslt_supports_matmul first");
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

}  // namespace kiln::cuda
