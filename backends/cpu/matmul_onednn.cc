// oneDNN matmul: strided operand descriptors, a primitive cache keyed by shape and layout, and a
// packing fallback for layouts oneDNN would only run with its slow reference kernel.
#include "backends/cpu/matmul_onednn.h"

#include <cpuid.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/lasting_cache.h"
#include "backends/cpu/amx_matmul.h"
#include "backends/cpu/onednn_runtime.h"

namespace kiln::cpu {

namespace {

using dnnl::memory;

// One operand as oneDNN will see it. Strides of size-1 dims are rewritten to plain values, since
// oneDNN picks its kernel from strides even where they address nothing (a (1, K) row with row
// stride 0 would otherwise get the reference kernel). A broadcast batch (stride 0) or a batch of 1
// becomes batch dim 1: oneDNN broadcasts size-1 batch dims, but a stride-0 dim of full size only
// runs on the reference kernel.
struct Layout {
  int64_t batch;
  int64_t strides[3];  // {batch, row, col}
};

Layout normalize(int64_t batch, int64_t rows, int64_t cols, const int64_t s[3]) {
  Layout l{batch, {s[0], s[1], s[2]}};
  if (rows == 1 && cols == 1) {
    l.strides[1] = l.strides[2] = 1;
  } else if (cols == 1) {
    l.strides[2] = l.strides[1] == 1 ? rows : 1;  // a column: keep it column-major if it was
  } else if (rows == 1) {
    l.strides[1] = l.strides[2] == 1 ? cols : 1;  // a row: keep it row-major if it was
  }
  if (batch == 1 || s[0] == 0) {
    l.batch = 1;
    l.strides[0] = std::max(rows * l.strides[1], cols * l.strides[2]);  // one whole matrix
  }
  return l;
}

bool has_negative_stride(const Layout& l) {
  return l.strides[0] < 0 || l.strides[1] < 0 || l.strides[2] < 0;
}

// Everything a primitive depends on: dtype, sizes, and both operand layouts.
using Key = std::array<int64_t, 13>;

struct Plan {
  dnnl::matmul primitive;
  memory::desc a_desc, b_desc, c_desc;
  // Copy A / B to contiguous buffers first: their strides defeat oneDNN, or (A transposed) its
  // kernels are several times slower than the copy costs. The copies are oneDNN reorders
  // (vectorized, on every thread) unless a stride is negative, which oneDNN cannot describe.
  bool pack_a = false, pack_b = false;
  std::optional<dnnl::reorder> reorder_a, reorder_b;
  memory::desc a_source, b_source;  // the strided layouts the reorders read
};

// Primitive creation costs far more than a small matmul, so a training loop must not repeat it.
// A model has few distinct matmul shapes.
LastingCache<Key, Plan>& plan_cache() {
  static auto& cache = *new LastingCache<Key, Plan>;
  return cache;
}

memory::data_type to_dnnl(DType t) {
  return t == DType::BFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
}

memory::desc strided_desc(const Layout& l, int64_t rows, int64_t cols, memory::data_type dt) {
  return memory::desc({l.batch, rows, cols}, dt, {l.strides[0], l.strides[1], l.strides[2]});
}

memory::desc contiguous_desc(int64_t batch, int64_t rows, int64_t cols, memory::data_type dt) {
  return memory::desc({batch, rows, cols}, dt, {rows * cols, cols, 1});
}

// Throws dnnl::error when even the contiguous layout is refused.
Plan make_plan(DType t, const Layout& a, const Layout& b, int64_t M, int64_t K, int64_t N) {
  OnednnRuntime& rt = onednn_runtime();
  const memory::data_type dt = to_dnnl(t);
  Plan plan;
  // With both operands broadcast, oneDNN computes C[0] only; matmul() copies it to every batch.
  plan.c_desc = contiguous_desc(std::max(a.batch, b.batch), M, N, dt);
  auto create = [&](const memory::desc& a_desc, const memory::desc& b_desc) {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_desc, b_desc, plan.c_desc), rt.engine);
  };
  if (!has_negative_stride(a) && !has_negative_stride(b)) {
    // A column-major A (x^T in a weight gradient x^T @ dy) runs ~8x slower than a row-major one
    // in oneDNN 2.6's brgemm kernels once it is large; copying it is cheap next to that. In
    // bfloat16 at any size: a column block of a larger A (one tile of a weight gradient) sends
    // oneDNN to its older gemm, which never uses AMX (2-3x slower than the copy and brgemm).
    const bool transposed_a = a.strides[2] != 1 && (t == DType::BFloat16 || M * K >= (int64_t{1} << 16));
    try {
      memory::desc a_desc = transposed_a ? contiguous_desc(a.batch, M, K, dt) : strided_desc(a, M, K, dt);
      memory::desc b_desc = strided_desc(b, K, N, dt);
      auto pd = create(a_desc, b_desc);
      if (!onednn_is_reference(pd)) {
        plan.primitive = dnnl::matmul(pd);
        plan.a_desc = a_desc;
        plan.b_desc = b_desc;
        plan.pack_a = transposed_a;
        if (transposed_a) {
          plan.a_source = strided_desc(a, M, K, dt);
          plan.reorder_a = dnnl::reorder(dnnl::reorder::primitive_desc(rt.engine, plan.a_source, rt.engine, a_desc));
        }
        return plan;
      }
    } catch (const dnnl::error&) {
      // Fall through: the contiguous layout below is the one every implementation takes.
    }
  }
  plan.pack_a = plan.pack_b = true;
  plan.a_desc = contiguous_desc(a.batch, M, K, dt);
  plan.b_desc = contiguous_desc(b.batch, K, N, dt);
  plan.primitive = dnnl::matmul(create(plan.a_desc, plan.b_desc));
  auto reorder_to = [&](const Layout& l, int64_t rows, int64_t cols, const memory::desc& to,
                        memory::desc& source) -> std::optional<dnnl::reorder> {
    if (has_negative_stride(l)) return std::nullopt;
    try {
      source = strided_desc(l, rows, cols, dt);
      return dnnl::reorder(dnnl::reorder::primitive_desc(rt.engine, source, rt.engine, to));
    } catch (const dnnl::error&) {
      return std::nullopt;  // pack() below copies it
    }
  };
  plan.reorder_a = reorder_to(a, M, K, plan.a_desc, plan.a_source);
  plan.reorder_b = reorder_to(b, K, N, plan.b_desc, plan.b_source);
  return plan;
}

// Copies `batch` (rows, cols) matrices at element strides s into a contiguous buffer.
template <typename Element>
void pack_as(const void* src, const int64_t s[3], int64_t batch, int64_t rows, int64_t cols,
             std::vector<std::byte>& out) {
  out.resize(static_cast<size_t>(batch * rows * cols) * sizeof(Element));
  const auto* in = static_cast<const Element*>(src);
  auto* dst = reinterpret_cast<Element*>(out.data());
  // In tiles, so that a transposed source is read a cache line at a time.
  constexpr int64_t kTile = 32;
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t i0 = 0; i0 < rows; i0 += kTile)
      for (int64_t j0 = 0; j0 < cols; j0 += kTile)
        for (int64_t i = i0; i < std::min(rows, i0 + kTile); ++i)
          for (int64_t j = j0; j < std::min(cols, j0 + kTile); ++j)
            dst[(n * rows + i) * cols + j] = in[n * s[0] + i * s[1] + j * s[2]];
}

const void* pack(DType t, const void* src, const int64_t s[3], int64_t batch, int64_t rows,
                 int64_t cols, std::vector<std::byte>& out) {
  if (t == DType::BFloat16) pack_as<uint16_t>(src, s, batch, rows, cols, out);
  else pack_as<float>(src, s, batch, rows, cols, out);
  return out.data();
}

std::string describe(DType t, const int64_t a_strides[3], const int64_t b_strides[3],
                     int64_t batch, int64_t M, int64_t K, int64_t N) {
  return fmt::format("{} A ({}, {}, {}) strides {{{}, {}, {}}}, B ({}, {}, {}) strides {{{}, {}, {}}}",
                     dtype_name(t), batch, M, K, a_strides[0], a_strides[1], a_strides[2], batch,
                     K, N, b_strides[0], b_strides[1], b_strides[2]);
}

// A large column-major float32 A (x^T in a weight gradient x^T @ dy, batch 1): oneDNN's
// BLAS-style sgemm reads it transposed in place as fast as the matmul primitive reads a
// row-major one (2026-12: 250 GFLOP/s on 512 x 2048 x 128), where the primitive needs a
// row-major copy first (reorder + brgemm: ~1.8x the time). False when it does not apply.
// `whole_M`: the rows of the whole product when this call makes some of them (onednn_matmul_rows),
// so a part takes the routine the whole would.
bool transposed_sgemm(DType t, const Layout& a, const Layout& b, int64_t batch, int64_t M, int64_t K, int64_t N,
                      const void* A, const void* B, void* C, int64_t whole_M) {
  if (t != DType::Float32 || batch != 1 || whole_M * K < (int64_t{1} << 16)) return false;
  if (a.strides[1] != 1 || a.strides[2] < M) return false;  // A column-major: lda = its column stride
  char transb;
  int64_t ldb;
  if (b.strides[2] == 1 && b.strides[1] >= N) transb = 'N', ldb = b.strides[1];
  else if (b.strides[1] == 1 && b.strides[2] >= K) transb = 'T', ldb = b.strides[2];
  else return false;
  OnednnRuntime& rt = onednn_runtime();
  std::lock_guard<std::mutex> lock(rt.stream_mutex);  // one library call at a time, as the primitives
  const dnnl_status_t status = dnnl_sgemm('T', transb, M, N, K, 1.0f, static_cast<const float*>(A), a.strides[2],
                                          static_cast<const float*>(B), ldb, 0.0f, static_cast<float*>(C), N);
  KILN_CHECK(status == dnnl_success, "matmul", "oneDNN sgemm failed (status {}) on ({}, {}) x ({}, {})",
             static_cast<int>(status), M, K, K, N);
  return true;
}

}  // namespace

bool onednn_supports_matmul(DType t) {
  if (t == DType::Float32) return true;
  if (t != DType::BFloat16) return false;
  static const bool bf16 = onednn_has_native_kernel([] {
    memory::desc md = contiguous_desc(1, 16, 16, memory::data_type::bf16);
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(md, md, md), onednn_runtime().engine);
  });
  return bf16;
}

void onednn_matmul(DType t, const void* a, const int64_t a_strides[3], const void* b,
            const int64_t b_strides[3], void* c, int64_t batch, int64_t M, int64_t K, int64_t N) {
  KILN_CHECK(t == DType::Float32 || t == DType::BFloat16, "matmul",
             "oneDNN matmul takes float32 or bfloat16, got {}; check cpu::onednn_supports_matmul first",
             dtype_name(t));
  KILN_CHECK(batch >= 0 && M >= 0 && K >= 0 && N >= 0, "matmul", "negative size in {}",
             describe(t, a_strides, b_strides, batch, M, K, N));
  const size_t elem = dtype_size(t);
  const size_t c_matrix_bytes = static_cast<size_t>(M * N) * elem;
  if (batch == 0 || M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum; all-zero bits are 0.0 in float32 and bfloat16 alike
    std::memset(c, 0, static_cast<size_t>(batch) * c_matrix_bytes);
    return;
  }
  // Every bfloat16 product, whatever its size, so that a block of rows (onednn_matmul_rows) takes
  // the routine, hence the bits, of the whole product.
  if (t == DType::BFloat16 && amx_matmul_available()) {
    amx_matmul(a, a_strides, b, b_strides, c, batch, M, K, N);
    return;
  }
  const Layout la = normalize(batch, M, K, a_strides), lb = normalize(batch, K, N, b_strides);
  if (transposed_sgemm(t, la, lb, batch, M, K, N, a, b, c, M)) return;
  const Key key{static_cast<int64_t>(t), batch, M, K, N,
                la.batch, la.strides[0], la.strides[1], la.strides[2],
                lb.batch, lb.strides[0], lb.strides[1], lb.strides[2]};
  OnednnRuntime& rt = onednn_runtime();
  try {
    const Plan* plan = &plan_cache().get_or_create(key, [&] { return make_plan(t, la, lb, M, K, N); });
    std::vector<std::byte> a_packed, b_packed;
    if (plan->pack_a && !plan->reorder_a) a = pack(t, a, a_strides, la.batch, M, K, a_packed);
    if (plan->pack_b && !plan->reorder_b) b = pack(t, b, b_strides, lb.batch, K, N, b_packed);
    {
      std::lock_guard<std::mutex> lock(rt.stream_mutex);
      // oneDNN takes non-const handles but only reads src and weights.
      auto reordered = [&](const std::optional<dnnl::reorder>& reorder, const memory::desc& source,
                           const memory::desc& to, const void*& data, std::vector<std::byte>& buffer) {
        if (!reorder) return;
        buffer.resize(to.get_size());
        memory from(source, rt.engine, const_cast<void*>(data)), into(to, rt.engine, buffer.data());
        reorder->execute(rt.stream, from, into);
        data = buffer.data();
      };
      reordered(plan->reorder_a, plan->a_source, plan->a_desc, a, a_packed);
      reordered(plan->reorder_b, plan->b_source, plan->b_desc, b, b_packed);
      memory a_mem(plan->a_desc, rt.engine, const_cast<void*>(a));
      memory b_mem(plan->b_desc, rt.engine, const_cast<void*>(b));
      memory c_mem(plan->c_desc, rt.engine, c);
      SmallWorkOnOneThread small(2.0 * static_cast<double>(batch) * M * N * K);
      plan->primitive.execute(rt.stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
      rt.stream.wait();
    }
  } catch (const dnnl::error& e) {
    KILN_FAIL("matmul", "oneDNN failed: {} (status {}); shapes {}", e.what(), static_cast<int>(e.status),
              describe(t, a_strides, b_strides, batch, M, K, N));
  }
  if (batch > 1 && la.batch == 1 && lb.batch == 1) {  // see make_plan: only C[0] was computed
    auto* out = static_cast<std::byte*>(c);
    for (int64_t n = 1; n < batch; ++n) std::memcpy(out + n * c_matrix_bytes, out, c_matrix_bytes);
  }
}

// int8 ---------------------------------------------------------------------------------------

namespace {

struct QuantizedPlan {
  dnnl::matmul primitive;
  memory::desc a_desc, b_desc, c_desc;
};

// The weight layout oneDNN picks for (K, N) int8 weights when asked (format_tag::any), per
// shape; the same for every batch size here, so one packed copy serves all of them (the matmul
// for another batch size is created with this layout, not asked again).
LastingCache<std::array<int64_t, 2>, memory::desc>& packed_layouts() {
  static auto& cache = *new LastingCache<std::array<int64_t, 2>, memory::desc>;
  return cache;
}

const memory::desc& packed_layout(int64_t K, int64_t N) {
  return packed_layouts().get_or_create({K, N}, [&] {
    constexpr int64_t kTypicalBatch = 16;
    memory::desc a({kTypicalBatch, K}, memory::data_type::s8, {K, 1});
    memory::desc b({K, N}, memory::data_type::s8, memory::format_tag::any);
    memory::desc c({kTypicalBatch, N}, memory::data_type::f32, {N, 1});
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), onednn_runtime().engine).weights_desc();
  });
}

LastingCache<std::array<int64_t, 4>, QuantizedPlan>& quantized_cache() {
  static auto& cache = *new LastingCache<std::array<int64_t, 4>, QuantizedPlan>;
  return cache;
}

// int8 x int8 -> float32 (the int32 sums converted) with no attributes: oneDNN 2.6 runs that on
// its brgemm kernels (AMX or VNNI), while runtime output scales or a source zero point send it to
// a gemm that is 2-4x slower; the scales are applied by the JIT kernel that adds the bias.
QuantizedPlan make_quantized_plan(int64_t M, int64_t K, int64_t N, bool b_packed) {
  OnednnRuntime& rt = onednn_runtime();
  QuantizedPlan plan;
  plan.a_desc = memory::desc({M, K}, memory::data_type::s8, {K, 1});
  plan.b_desc = b_packed ? packed_layout(K, N) : memory::desc({K, N}, memory::data_type::s8, {N, 1});
  plan.c_desc = memory::desc({M, N}, memory::data_type::f32, {N, 1});
  plan.primitive = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(plan.a_desc, plan.b_desc, plan.c_desc), rt.engine));
  return plan;
}

}  // namespace

int64_t onednn_packed_int8_weight_bytes(int64_t K, int64_t N) {
  try {
    const memory::desc& packed = packed_layout(K, N);
    if (packed == memory::desc({K, N}, memory::data_type::s8, {N, 1})) return 0;
    return static_cast<int64_t>(packed.get_size());
  } catch (const dnnl::error& e) {
    KILN_FAIL("quantized_matmul", "oneDNN failed to pick an int8 weight layout for ({}, {}): {}", K, N, e.what());
  }
}

void onednn_pack_int8_weight(const void* plain, void* packed, int64_t K, int64_t N) {
  OnednnRuntime& rt = onednn_runtime();
  try {
    memory from(memory::desc({K, N}, memory::data_type::s8, {N, 1}), rt.engine, const_cast<void*>(plain));
    memory to(packed_layout(K, N), rt.engine, packed);
    std::lock_guard<std::mutex> lock(rt.stream_mutex);
    dnnl::reorder(from, to).execute(rt.stream, from, to);
    rt.stream.wait();
  } catch (const dnnl::error& e) {
    KILN_FAIL("quantized_matmul", "oneDNN failed to pack an int8 ({}, {}) weight: {}", K, N, e.what());
  }
}

namespace {
// AVX-VNNI or AMX-INT8. clang before 16 (Debian's clang 14 builds the fuzzers, tests/fuzz) knows
// neither name in __builtin_cpu_supports; CPUID leaf 7 says the same: subleaf 1 EAX bit 4
// (AVX-VNNI), subleaf 0 EDX bit 25 (AMX-INT8).
bool has_avxvnni_or_amx_int8() {
#if defined(__clang__) && __clang_major__ < 16
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  bool amx = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 25 & 1);
  bool vnni = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 4 & 1);
  return amx || vnni;
#else
  return __builtin_cpu_supports("avxvnni") || __builtin_cpu_supports("amx-int8");
#endif
}
}  // namespace

int onednn_int8_weight_limit() {
  static const int limit = __builtin_cpu_supports("avx512vnni") || has_avxvnni_or_amx_int8() ? 127 : 63;
  return limit;
}

void onednn_quantized_matmul(const void* a, const void* b, float* c, int64_t M, int64_t K, int64_t N, bool b_packed) {
  KILN_CHECK(M >= 0 && K >= 0 && N >= 0, "quantized_matmul", "negative size in ({}, {}) x ({}, {})", M, K, K, N);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::memset(c, 0, static_cast<size_t>(M * N) * sizeof(float));
    return;
  }
  OnednnRuntime& rt = onednn_runtime();
  try {
    const QuantizedPlan& plan =
        quantized_cache().get_or_create({M, K, N, b_packed}, [&] { return make_quantized_plan(M, K, N, b_packed); });
    memory a_mem(plan.a_desc, rt.engine, const_cast<void*>(a));
    memory b_mem(plan.b_desc, rt.engine, const_cast<void*>(b));
    memory c_mem(plan.c_desc, rt.engine, c);
    std::lock_guard<std::mutex> lock(rt.stream_mutex);
    SmallWorkOnOneThread small(static_cast<double>(M) * N * K);
    plan.primitive.execute(rt.stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
    rt.stream.wait();
  } catch (const dnnl::error& e) {
    KILN_FAIL("quantized_matmul", "oneDNN failed: {} (status {}); int8 ({}, {}) x int8 ({}, {}){}", e.what(),
              static_cast<int>(e.status), M, K, K, N, b_packed ? " packed" : "");
  }
}

std::string onednn_quantized_matmul_impl(int64_t M, int64_t K, int64_t N) {
  const QuantizedPlan& plan = quantized_cache().get_or_create({M, K, N, 0}, [&] { return make_quantized_plan(M, K, N, false); });
  const char* impl = nullptr;
  dnnl_primitive_desc_query(plan.primitive.get_primitive_desc(), dnnl_query_impl_info_str, 0, &impl);
  return impl ? impl : "";
}

void onednn_matmul_rows(DType t, const void* a, const int64_t a_strides[3], const void* b, const int64_t b_strides[3],
                        void* c, int64_t M, int64_t K, int64_t N, int64_t row0, int64_t rows) {
  KILN_CHECK(row0 >= 0 && rows >= 0 && row0 + rows <= M, "matmul", "rows [{}, {}) of a product of {} rows", row0,
             row0 + rows, M);
  const void* a_rows = static_cast<const char*>(a) + row0 * a_strides[1] * static_cast<int64_t>(dtype_size(t));
  if (rows > 0 && K > 0 && N > 0 &&
      transposed_sgemm(t, normalize(1, rows, K, a_strides), normalize(1, K, N, b_strides), 1, rows, K, N, a_rows, b,
                       c, M))
    return;
  onednn_matmul(t, a_rows, a_strides, b, b_strides, c, 1, rows, K, N);
}

void onednn_matmul_k_part(const float* a, int64_t lda, const float* b_rows, int64_t ldb, float* c, int64_t M,
                          int64_t N, int64_t k0, int64_t rows) {
  KILN_CHECK(k0 >= 0 && rows > 0 && M > 0 && N > 0 && lda >= M && ldb >= N, "matmul",
             "rows [{}, {}) of the sum of a ({}, K) x (K, {}) product (lda {}, ldb {})", k0, k0 + rows, M, N, lda, ldb);
  OnednnRuntime& rt = onednn_runtime();
  std::lock_guard<std::mutex> lock(rt.stream_mutex);
  const dnnl_status_t status = dnnl_sgemm('T', 'N', M, N, rows, 1.0f, a + k0 * lda, lda, b_rows, ldb,
                                          k0 == 0 ? 0.0f : 1.0f, c, N);
  KILN_CHECK(status == dnnl_success, "matmul", "oneDNN sgemm failed (status {}) on rows [{}, {}) of the sum of ({}, K) x (K, {})",
             static_cast<int>(status), k0, k0 + rows, M, N);
}

}  // namespace kiln::cpu
