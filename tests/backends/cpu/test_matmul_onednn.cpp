// oneDNN matmul against a naive triple loop in double, over the operand layouts kiln's views
// produce: contiguous, transposed, padded rows, no unit stride, reversed, and broadcast batches.
#include <catch2/catch.hpp>
#include <omp.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "backends/cpu/amx_matmul.h"
#include "backends/cpu/matmul_onednn.h"
#include "tests/backends/matmul_layouts.h"

using kiln::DType;
using namespace kiln::test;

namespace {

// A (batch, rows, cols) operand with random values in [-1, 1], already rounded to its dtype, so
// the double reference sees exactly what oneDNN reads. Unused slots hold NaN to catch bad strides.
struct Operand {
  DType dtype;
  std::vector<std::byte> storage;
  int64_t strides[3];
  int64_t base = 0;  // element offset of (0, 0, 0); nonzero for the reversed layout

  const void* data() const { return storage.data() + base * kiln::dtype_size(dtype); }
  double at(int64_t n, int64_t i, int64_t j) const {
    return kiln::load_as_double(storage.data(), dtype, base + n * strides[0] + i * strides[1] + j * strides[2]);
  }
};

Operand make_operand(DType t, int64_t batch, int64_t rows, int64_t cols, Layout layout,
                     bool broadcast, std::mt19937& rng) {
  const OperandShape shape = operand_shape(batch, rows, cols, layout, broadcast);
  Operand op{t, {}, {shape.strides[0], shape.strides[1], shape.strides[2]}, shape.base};
  const int64_t stored_batches = broadcast ? 1 : batch;
  const size_t count = static_cast<size_t>(shape.stored);
  op.storage.resize(count * kiln::dtype_size(t));
  for (size_t i = 0; i < count; ++i)
    kiln::store_from_double(op.storage.data(), t, i, std::numeric_limits<double>::quiet_NaN());
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  for (int64_t n = 0; n < stored_batches; ++n)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        kiln::store_from_double(op.storage.data(), t,
                                op.base + n * op.strides[0] + i * op.strides[1] + j * op.strides[2], dist(rng));
  return op;
}

// Runs one matmul and compares every element with the double reference. The bound scales with
// sum_k |a_ik * b_kj|, which is what rounding errors in the accumulation and the output scale with.
void check(const MatmulCase& cs, double rel_tol) {
  INFO(describe(cs));
  std::mt19937 rng(static_cast<unsigned>(cs.batch * 1000003 + cs.M * 10007 + cs.K * 101 + cs.N));
  const Operand a = make_operand(cs.dtype, cs.batch, cs.M, cs.K, cs.a_layout, cs.a_broadcast, rng);
  const Operand b = make_operand(cs.dtype, cs.batch, cs.K, cs.N, cs.b_layout, cs.b_broadcast, rng);
  const size_t c_count = static_cast<size_t>(cs.batch * cs.M * cs.N);
  std::vector<std::byte> c(c_count * kiln::dtype_size(cs.dtype));
  for (size_t i = 0; i < c_count; ++i)
    kiln::store_from_double(c.data(), cs.dtype, i, std::numeric_limits<double>::quiet_NaN());

  kiln::cpu::onednn_matmul(cs.dtype, a.data(), a.strides, b.data(), b.strides, c.data(), cs.batch, cs.M, cs.K, cs.N);

  int64_t bad = 0;
  double worst = 0;
  for (int64_t n = 0; n < cs.batch; ++n)
    for (int64_t i = 0; i < cs.M; ++i)
      for (int64_t j = 0; j < cs.N; ++j) {
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < cs.K; ++k) {
          sum += a.at(n, i, k) * b.at(n, k, j);
          magnitude += std::abs(a.at(n, i, k) * b.at(n, k, j));
        }
        const double got = kiln::load_as_double(c.data(), cs.dtype, static_cast<size_t>((n * cs.M + i) * cs.N + j));
        const double err = std::abs(got - sum);
        if (!(err <= rel_tol * magnitude + 1e-6)) ++bad;  // also counts NaN
        if (magnitude > 0) worst = std::max(worst, err / magnitude);
      }
  INFO("worst error relative to sum |a*b|: " << worst);
  CHECK(bad == 0);
}

const double kFloat32Tol = 1e-5;
// bf16 inputs are exact in fp32, products too; the error is fp32 accumulation plus rounding the
// output to bf16 (8 significant bits, relative 2^-9 at best, 2^-8 worst case).
const double kBFloat16Tol = 1e-2;

void check_layouts(DType t, double tol) {
  const Layout layouts[] = {Layout::RowMajor, Layout::Transposed, Layout::Padded, Layout::Strided,
                            Layout::Reversed};
  for (Layout la : layouts)
    for (Layout lb : layouts) {
      MatmulCase cs{t, 2, 17, 65, 3, la, lb};
      check(cs, tol);
      cs.M = 65, cs.K = 3, cs.N = 17;
      check(cs, tol);
    }
}

void check_broadcast(DType t, double tol) {
  for (bool a_bc : {false, true})
    for (bool b_bc : {false, true})
      for (Layout l : {Layout::RowMajor, Layout::Transposed, Layout::Strided}) {
        check({t, 3, 17, 65, 3, l, Layout::RowMajor, a_bc, b_bc}, tol);
        check({t, 4, 3, 17, 65, Layout::RowMajor, l, a_bc, b_bc}, tol);
        check({t, 1, 65, 3, 17, l, l, a_bc, b_bc}, tol);
      }
}

}  // namespace

TEST_CASE("onednn matmul: float32 is always supported, integers never", "[ops][matmul][onednn]") {
  CHECK(kiln::cpu::onednn_supports_matmul(DType::Float32));
  CHECK_FALSE(kiln::cpu::onednn_supports_matmul(DType::Int32));
  CHECK_FALSE(kiln::cpu::onednn_supports_matmul(DType::Float64));
  const int64_t s[3] = {1, 1, 1};
  int32_t x = 1, y = 1, z = 0;
  CHECK_THROWS_AS(kiln::cpu::onednn_matmul(DType::Int32, &x, s, &y, s, &z, 1, 1, 1, 1), kiln::Error);
  float f = 1, g = 1, h = 0;
  CHECK_THROWS_AS(kiln::cpu::onednn_matmul(DType::Float32, &f, s, &g, s, &h, 1, -1, 1, 1), kiln::Error);
}

TEST_CASE("onednn matmul: float32 contiguous, odd sizes", "[ops][matmul][onednn]") {
  for (int64_t M : {1, 3, 17, 65})
    for (int64_t K : {1, 3, 17, 65})
      for (int64_t N : {1, 3, 17, 65}) check({DType::Float32, 1, M, K, N}, kFloat32Tol);
  check({DType::Float32, 1, 128, 256, 96}, kFloat32Tol);
}

TEST_CASE("onednn matmul: float32 transposed, padded, strided and reversed operands", "[ops][matmul][onednn]") {
  check_layouts(DType::Float32, kFloat32Tol);
  // Size-1 dims make some strides meaningless; they must not change the result.
  for (Layout l : {Layout::Transposed, Layout::Padded, Layout::Strided})
    for (int64_t M : {1, 3})
      for (int64_t N : {1, 3}) check({DType::Float32, 2, M, 17, N, l, l}, kFloat32Tol);
  // A large column-major A (a weight gradient's x^T): batch 1 goes to sgemm reading it
  // transposed, batches are first copied row-major by a reorder.
  for (Layout l : {Layout::RowMajor, Layout::Transposed, Layout::Padded, Layout::Strided, Layout::Reversed}) {
    check({DType::Float32, 1, 300, 260, 5, Layout::Transposed, l}, kFloat32Tol);
    check({DType::Float32, 2, 300, 260, 5, Layout::Transposed, l}, kFloat32Tol);
  }
  check({DType::Float32, 1, 300, 260, 5, Layout::Reversed, Layout::Strided}, kFloat32Tol);  // no reorder: copied by hand
}

TEST_CASE("onednn matmul: float32 batched and broadcast batches", "[ops][matmul][onednn]") {
  check({DType::Float32, 5, 17, 3, 65}, kFloat32Tol);
  check({DType::Float32, 3, 65, 65, 65, Layout::Transposed, Layout::Transposed}, kFloat32Tol);
  check_broadcast(DType::Float32, kFloat32Tol);
}

TEST_CASE("onednn matmul: empty sizes", "[ops][matmul][onednn]") {
  const int64_t s[3] = {0, 1, 1};
  std::vector<float> c(6, 7.0f);
  float unused = 0;
  // K == 0 is an empty sum: C must be all zeros.
  kiln::cpu::onednn_matmul(DType::Float32, &unused, s, &unused, s, c.data(), 2, 1, 0, 3);
  for (float v : c) CHECK(v == 0.0f);
  // Nothing to compute: C is left alone.
  std::vector<float> d(1, 7.0f);
  kiln::cpu::onednn_matmul(DType::Float32, &unused, s, &unused, s, d.data(), 0, 1, 1, 1);
  kiln::cpu::onednn_matmul(DType::Float32, &unused, s, &unused, s, d.data(), 1, 0, 1, 1);
  CHECK(d[0] == 7.0f);
}

TEST_CASE("onednn matmul: concurrent callers share the primitive cache", "[ops][matmul][onednn]") {
  // Catch's assertion macros are not thread-safe, so threads only record failures.
  std::vector<int> failures(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t, &failures] {
      const int64_t M = 3 + t, K = 17, N = 5;
      const int64_t as[3] = {M * K, K, 1}, bs[3] = {K * N, N, 1};
      std::vector<float> a(M * K, 1.0f), b(K * N, 2.0f), c(M * N);
      for (int rep = 0; rep < 20; ++rep) {
        kiln::cpu::onednn_matmul(DType::Float32, a.data(), as, b.data(), bs, c.data(), 1, M, K, N);
        for (float v : c) failures[t] += v != 2.0f * K;
      }
    });
  for (auto& th : threads) th.join();
  for (int f : failures) CHECK(f == 0);
}

TEST_CASE("onednn matmul: bfloat16", "[ops][matmul][onednn]") {
  if (!kiln::cpu::onednn_supports_matmul(DType::BFloat16)) {
    WARN("oneDNN has no native bfloat16 matmul on this CPU; skipped");
    return;
  }
  for (int64_t M : {1, 3, 17, 65})
    for (int64_t N : {1, 3, 17, 65}) check({DType::BFloat16, 1, M, 65, N}, kBFloat16Tol);
  check({DType::BFloat16, 1, 128, 256, 96}, kBFloat16Tol);
  check_layouts(DType::BFloat16, kBFloat16Tol);
  check_broadcast(DType::BFloat16, kBFloat16Tol);
}

// Parts of a product (jit/tile_matmul.h computes weight gradients a block of rows at a time) are
// its rows: offsets and strides right for every layout. oneDNN's sums depend on the problem's size,
// so parts are compared within rounding, not bits; the blocks are fixed per product instead.
TEST_CASE("onednn matmul: rows of a product are the whole product's rows", "[ops][matmul][onednn]") {
  struct Size {
    int64_t M, K, N, rows;
  };
  for (const Size& size : {Size{512, 128, 784, 80}, Size{784, 128, 512, 96}, Size{96, 40, 64, 16}})
    for (Layout la : {Layout::Transposed, Layout::RowMajor, Layout::Padded})
      for (Layout lb : {Layout::RowMajor, Layout::Transposed}) {
        const MatmulCase cs{DType::Float32, 1, size.M, size.K, size.N, la, lb};
        INFO(describe(cs) << ", parts of " << size.rows << " rows");
        std::mt19937 rng(7);
        const Operand a = make_operand(cs.dtype, 1, cs.M, cs.K, la, false, rng);
        const Operand b = make_operand(cs.dtype, 1, cs.K, cs.N, lb, false, rng);
        std::vector<float> whole(static_cast<size_t>(cs.M * cs.N)), parts(whole.size(), std::nanf(""));
        kiln::cpu::onednn_matmul(cs.dtype, a.data(), a.strides, b.data(), b.strides, whole.data(), 1, cs.M, cs.K,
                                 cs.N);
        for (int64_t row = 0; row < cs.M; row += size.rows)
          kiln::cpu::onednn_matmul_rows(cs.dtype, a.data(), a.strides, b.data(), b.strides,
                                        parts.data() + row * cs.N, cs.M, cs.K, cs.N, row,
                                        std::min(size.rows, cs.M - row));
        int64_t bad = 0;
        for (size_t i = 0; i < whole.size(); ++i) bad += !(std::abs(whole[i] - parts[i]) <= 1e-5f);  // NaN too
        CHECK(bad == 0);
      }
}

// kiln's AMX kernel (backends/cpu/amx_matmul.h) takes every bfloat16 product where the CPU has AMX:
// its packing of each layout (the transposing paths take whole 16 x 32 tiles, the others the
// edges too), against float64, and its row blocks against the whole.
TEST_CASE("onednn matmul: bfloat16 products on kiln's AMX kernel", "[ops][matmul][onednn][amx]") {
  if (!kiln::cpu::amx_matmul_available()) {
    WARN("this CPU has no AMX-BF16; kiln's AMX kernel is not used and not tested here");
    return;
  }
  const Layout layouts[] = {Layout::RowMajor, Layout::Transposed, Layout::Padded, Layout::Strided, Layout::Reversed};
  for (Layout la : layouts)
    for (Layout lb : layouts) {
      check({DType::BFloat16, 2, 33, 65, 47, la, lb}, kBFloat16Tol);
      check({DType::BFloat16, 1, 64, 96, 64, la, lb}, kBFloat16Tol);
    }
  check({DType::BFloat16, 1, 128, 784, 512, Layout::RowMajor, Layout::Transposed}, kBFloat16Tol);
  check({DType::BFloat16, 1, 512, 128, 784, Layout::Transposed, Layout::RowMajor}, kBFloat16Tol);
  check({DType::BFloat16, 1, 600, 40, 160}, kBFloat16Tol);  // more rows than one packed chunk of A
  // Long row-major rows packed (rows split between threads, every share with all 8 panels; K tail
  // 8), padded too; and a panel split with edge blocks, whose C lines are fetched ahead.
  for (Layout la : {Layout::RowMajor, Layout::Padded}) check({DType::BFloat16, 1, 600, 136, 256, la}, kBFloat16Tol);
  check({DType::BFloat16, 1, 70, 200, 2100}, kBFloat16Tol);
  for (bool a_bc : {false, true})
    for (bool b_bc : {false, true}) {
      check({DType::BFloat16, 3, 40, 64, 36, Layout::Transposed, Layout::RowMajor, a_bc, b_bc}, kBFloat16Tol);
      check({DType::BFloat16, 3, 40, 64, 36, Layout::Repeated, Layout::Transposed, a_bc, b_bc}, kBFloat16Tol);
    }

  // Blocks of rows have the whole product's bits, and oneDNN's AMX kernels sum in the same order.
  for (Layout la : {Layout::Transposed, Layout::RowMajor})
    for (Layout lb : {Layout::RowMajor, Layout::Transposed}) {
      const MatmulCase cs{DType::BFloat16, 1, 200, 784, 96, la, lb};
      INFO(describe(cs));
      std::mt19937 rng(11);
      const Operand a = make_operand(cs.dtype, 1, cs.M, cs.K, la, false, rng);
      const Operand b = make_operand(cs.dtype, 1, cs.K, cs.N, lb, false, rng);
      const size_t count = static_cast<size_t>(cs.M * cs.N);
      std::vector<uint16_t> whole(count), parts(count, 0x7fc0), library(count);
      kiln::cpu::onednn_matmul(cs.dtype, a.data(), a.strides, b.data(), b.strides, whole.data(), 1, cs.M, cs.K, cs.N);
      for (int64_t row = 0; row < cs.M; row += 48)
        kiln::cpu::onednn_matmul_rows(cs.dtype, a.data(), a.strides, b.data(), b.strides, parts.data() + row * cs.N,
                                      cs.M, cs.K, cs.N, row, std::min<int64_t>(48, cs.M - row));
      CHECK(parts == whole);
      {
        struct OneDnnOnly {
          bool was = kiln::cpu::amx_matmul_enable(false);
          ~OneDnnOnly() { kiln::cpu::amx_matmul_enable(was); }
        } library_only;
        kiln::cpu::onednn_matmul(cs.dtype, a.data(), a.strides, b.data(), b.strides, library.data(), 1, cs.M, cs.K,
                                 cs.N);
      }
      int64_t apart = 0;  // more than one unit in the last place
      for (size_t i = 0; i < count; ++i) apart += std::abs(int(whole[i]) - int(library[i])) > 1;
      CHECK(apart == 0);
    }
}

// Where the panels are split, each thread claims its own and then the others' (backends/cpu/
// amx_matmul.cc, PanelClaims). Called from inside a parallel region, the kernel asks for threads
// and gets one: that thread must claim every panel, its own range and the ranges of the threads
// that never came. Each element's bits do not depend on who computed it.
TEST_CASE("onednn matmul: the AMX kernel's panels are all claimed when fewer threads come than it asks for",
          "[ops][matmul][onednn][amx]") {
  if (!kiln::cpu::amx_matmul_available()) {
    WARN("this CPU has no AMX-BF16; kiln's AMX kernel is not used and not tested here");
    return;
  }
  struct OneActiveLevel {  // a region inside another gets one thread
    int saved = omp_get_max_active_levels();
    OneActiveLevel() { omp_set_max_active_levels(1); }
    ~OneActiveLevel() { omp_set_max_active_levels(saved); }
  } one_level;
  std::mt19937 rng(5);
  // One chunk of rows (a layer's product on a batch of 128), several chunks, two batches with a K
  // tail, and 3 panels for 2 owners: a claim of 2 taken from the larger range by the thread that
  // owns 1 (its B scratch must hold a claim, not its own range).
  const MatmulCase cases[] = {{DType::BFloat16, 1, 128, 784, 512, Layout::RowMajor, Layout::Transposed},
                              {DType::BFloat16, 1, 520, 2048, 900, Layout::RowMajor, Layout::RowMajor},
                              {DType::BFloat16, 2, 40, 72, 300, Layout::Transposed, Layout::RowMajor},
                              {DType::BFloat16, 1, 64, 256, 96, Layout::RowMajor, Layout::RowMajor}};
  for (const MatmulCase& cs : cases) {
    INFO(describe(cs));
    const Operand a = make_operand(cs.dtype, cs.batch, cs.M, cs.K, cs.a_layout, false, rng);
    const Operand b = make_operand(cs.dtype, cs.batch, cs.K, cs.N, cs.b_layout, false, rng);
    const size_t count = static_cast<size_t>(cs.batch * cs.M * cs.N);
    std::vector<uint16_t> whole(count);
    kiln::cpu::onednn_matmul(cs.dtype, a.data(), a.strides, b.data(), b.strides, whole.data(), cs.batch, cs.M, cs.K,
                             cs.N);
    std::vector<uint16_t> alone(count, 0x7fc0);  // NaN where nothing wrote
    int inner_threads = 0, inner_max = 0;
    std::string failure;  // an exception must not leave the parallel region
#pragma omp parallel num_threads(2)
    if (omp_get_thread_num() == 0) {
      inner_max = omp_get_max_threads();
#pragma omp parallel
      inner_threads = omp_get_num_threads();
      try {
        kiln::cpu::onednn_matmul(cs.dtype, a.data(), a.strides, b.data(), b.strides, alone.data(), cs.batch, cs.M,
                                 cs.K, cs.N);
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    if (inner_max < 2) {  // e.g. OMP_NUM_THREADS=2,1: the kernel asks for one thread and splits nothing
      WARN("OpenMP offers one thread inside a parallel region here: the kernel does not split the panels");
      return;
    }
    CHECK(failure.empty());
    CHECK(inner_threads == 1);
    CHECK(alone == whole);
  }
}
