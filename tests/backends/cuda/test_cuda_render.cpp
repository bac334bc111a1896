// The CUDA renderer and NVRTC, checked without a GPU: a broad set of graphs (every primitive over
// every dtype where it means something, casts, reductions, views, gather/scatter, random ops,
// composites and their gradients, an MLP and a CNN training step) is scheduled as the executor
// would, every generated kernel rendered to CUDA, and every one compiled to cubin for sm_80 and
// sm_90. Nothing runs on a device. Skips (visibly) when kiln was built without the CUDA toolkit.
//
//   KILN_CACHE_DIR=/tmp/kc ./kiln_tests "[cuda]"
#include <catch2/catch.hpp>
#include <kiln/kiln.h>

#include <chrono>
#include <functional>
#include <iostream>

#include "backends/cuda/nvrtc.h"
#include "backends/cuda/render_cuda.h"
#include "jit/executor.h"

using namespace kiln;

namespace {

const std::vector<DType> kFloatTypes = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
const std::vector<DType> kNumericTypes = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16,
                                          DType::Int32, DType::Int64};
const std::vector<DType> kAllTypes = {DType::Bool,     DType::UInt8,    DType::Int8,    DType::Int32,  DType::Int64,
                                      DType::Float16,  DType::BFloat16, DType::Float32, DType::Float64};

// A realized input of `dtype` holding small positive and negative values.
Tensor input(Shape shape, DType dtype, double scale = 0.1, double shift = 0.5) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<double> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = dtype == DType::Bool ? (i % 3 == 0) : scale * ((i * 37) % 23) - shift;
  if (!is_floating(dtype) && dtype != DType::Bool)
    for (double& v : values) v = std::floor(v * 10);
  if (dtype == DType::UInt8)
    for (double& v : values) v = std::abs(v);
  return from_doubles(values, shape, dtype);
}

// Labels in [0, classes).
Tensor labels(int64_t n, int64_t classes) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = (i * 7) % classes;
  return from_vector<int64_t>(v, {n});
}

// Collects the kernels of many pending graphs (renamed apart) and compiles them in batches.
class CudaCompileCheck {
 public:
  // Schedules `outputs` as one realize would and keeps its generated kernels.
  void add(const std::string& graph, const std::vector<Tensor>& outputs) {
    std::vector<NodePtr> targets;
    for (const Tensor& t : outputs) targets.push_back(t.node());
    jit::Program schedule = jit::lower_for(targets);
    graphs_++;
    // Row groups as a CUDA plan forms them (never across a library kernel or another graph).
    const std::vector<int> groups = cuda::cuda_row_groups(schedule.kernels);
    std::vector<int> position(schedule.kernels.size(), -1);
    for (size_t i = 0; i < schedule.kernels.size(); ++i) {
      jit::Kernel& k = schedule.kernels[i];
      if (jit::is_library(k.kind)) {
        library_kernels_++;
        continue;
      }
      k.name = fmt::format("g{}_{}", graphs_, k.name);
      position[i] = static_cast<int>(pending_.size());
      groups_.push_back(position[static_cast<size_t>(groups[i])]);
      row_groups_ += groups[i] != static_cast<int>(i) && groups[i] == static_cast<int>(i) - 1;
      pending_.push_back(std::move(k));
      names_.push_back(graph);
    }
    if (pending_.size() >= kBatch) flush();
  }
  // Builds a graph with `make`; a combination the op library refuses is counted, not fatal.
  void add(const std::string& graph, const std::function<std::vector<Tensor>()>& make) {
    std::vector<Tensor> outputs;
    try {
      outputs = make();
    } catch (const Error& e) {
      refused_.push_back(graph + ": " + e.what());
      return;
    }
    add(graph, outputs);
  }

  void flush() {
    if (pending_.empty()) return;
    cuda::CudaSource cuda = cuda::render_cuda(pending_, groups_);
    for (const char* arch : {"sm_80", "sm_90"}) {
      try {
        auto cubin = cuda::compile_cuda_cached(cuda.source, arch, cuda.function_count);
        cached_ += cubin->from_disk;
        CHECK(!cubin->image.empty());
      } catch (const Error& e) {
        std::string graphs;
        for (size_t i = 0; i < names_.size(); ++i)
          if (i == 0 || names_[i] != names_[i - 1]) graphs += names_[i] + ", ";
        FAIL_CHECK("NVRTC rejected kernels of graphs [" << graphs << "] for " << arch << ":\n" << e.what());
        failures_++;
      }
      programs_++;
    }
    kernels_ += pending_.size();
    functions_ += cuda.function_count;
    for (size_t at = cuda.functions.find("kiln_vstore<"); at != std::string::npos; at = cuda.functions.find("kiln_vstore<", at + 1))
      vector_paths_++;
    for (const auto& launches : cuda.launches)
      for (const cuda::CudaLaunch& l : launches) split_functions_ += l.function.size() > 6 && l.function.substr(l.function.size() - 6) == "_parts";
    pending_.clear();
    groups_.clear();
    names_.clear();
  }

  int64_t graphs() const { return graphs_; }
  int64_t kernels() const { return kernels_; }
  int64_t functions() const { return functions_; }
  int64_t programs() const { return programs_; }
  int64_t cached() const { return cached_; }
  int64_t library_kernels() const { return library_kernels_; }
  int64_t row_groups() const { return row_groups_; }
  int64_t vector_paths() const { return vector_paths_; }
  int64_t split_functions() const { return split_functions_; }
  int64_t failures() const { return failures_; }
  const std::vector<std::string>& refused() const { return refused_; }

 private:
  static constexpr size_t kBatch = 160;  // kernels per NVRTC program: header parsing dominates small ones
  std::vector<jit::Kernel> pending_;
  std::vector<int> groups_;  // per pending kernel, the first of its row group
  std::vector<std::string> names_;
  std::vector<std::string> refused_;
  int64_t graphs_ = 0, kernels_ = 0, functions_ = 0, programs_ = 0, cached_ = 0, library_kernels_ = 0, failures_ = 0, row_groups_ = 0,
          vector_paths_ = 0, split_functions_ = 0;
};

void elementwise_graphs(CudaCompileCheck& check) {
  for (DType t : kFloatTypes) {
    const std::string name(dtype_name(t));
    check.add("unary " + name, [t] {
      Tensor a = input({7, 33}, t), p = input({7, 33}, t, 0.05, -0.1);
      return std::vector<Tensor>{neg(a), exp(a), log(p), sqrt(p), rsqrt(p), sin(a), cos(a), tanh(a), erf(a),
                                 abs(a), reciprocal(p), sign(a), floor(a), clamp(a, -0.2, 0.3)};
    });
    check.add("binary " + name, [t] {
      Tensor a = input({5, 40}, t), b = input({5, 40}, t, 0.07, 0.3), p = input({5, 40}, t, 0.05, -0.1);
      return std::vector<Tensor>{a + b, a - b, a * b, a / p, pow(p, b), pow(p, 2.5), maximum(a, b), minimum(a, b),
                                 lt(a, b), le(a, b), gt(a, b), ge(a, b), eq(a, b), ne(a, b),
                                 where(gt(a, b), a, b), a * 3.0 + 1.5};
    });
  }
  for (DType t : {DType::Int32, DType::Int64, DType::Int8, DType::UInt8}) {
    const std::string name(dtype_name(t));
    check.add("integer " + name, [t] {
      Tensor a = input({6, 17}, t), b = input({6, 17}, t, 0.3, 1.0);
      return std::vector<Tensor>{neg(a), abs(a), sign(a), a + b, a - b, a * b, maximum(a, b), minimum(a, b),
                                 lt(a, b), le(a, b), gt(a, b), ge(a, b), eq(a, b), ne(a, b), where(lt(a, b), a, b)};
    });
    check.add("integer division " + name, [t] {
      Tensor a = input({6, 17}, t), b = abs(input({6, 17}, t, 0.3, 1.0)) + ones({6, 17}, t);
      return std::vector<Tensor>{a / b};
    });
  }
  check.add("bool", [] {
    Tensor a = input({9, 13}, DType::Bool), b = logical_not(input({9, 13}, DType::Bool));
    return std::vector<Tensor>{logical_not(a), logical_and(a, b), logical_or(a, b), eq(a, b), ne(a, b),
                               where(a, b, logical_not(b))};
  });
  check.add("casts", [] {
    std::vector<Tensor> outputs;
    for (DType from : kAllTypes)
      for (DType to : kAllTypes)
        if (from != to) outputs.push_back(cast(input({4, 9}, from), to));
    return outputs;
  });
  check.add("fused chain of casts", [] {
    Tensor a = input({64, 128}, DType::Float32);
    Tensor h = cast(cast(a, DType::Float16) * 2.0, DType::BFloat16);
    return std::vector<Tensor>{cast(exp(cast(h, DType::Float32)) + 1.0, DType::Float16)};
  });
  check.add("iota and full", [] {
    return std::vector<Tensor>{iota({4, 6}, 1, DType::Int64), arange(50, DType::Int32) + 3,
                               arange(10, DType::Float32) * 0.5, full({3, 3}, 2.5, DType::Float16) + input({3, 3}, DType::Float16)};
  });
}

void reduction_graphs(CudaCompileCheck& check) {
  for (DType t : kNumericTypes) {
    const std::string name(dtype_name(t));
    check.add("reductions " + name, [t] {
      Tensor a = input({48, 130}, t), c = input({6, 5, 70}, t), s = input({4, 3}, t);
      return std::vector<Tensor>{
          sum(a, {1}), max(a, {1}),                      // rows (a block per row)
          sum(a, {0}), max(a, {0}),                      // columns
          sum(a), max(a),                                // scalars
          sum(c, {1}), max(c, {1}, true),                // a middle axis (columns of 70)
          sum(c, {0, 2}), max(c, {0, 1}),                // several axes
          sum(s, {1}), max(s, {1}),                      // short rows: a thread per output
          sum(input({3000}, t)), max(input({5000}, t)),  // long flat scalars
      };
    });
    check.add("split reductions " + name, [t] {
      Tensor flat = input({40000}, t), rows = input({2, 30000}, t), tall = input({9000, 40}, t);
      return std::vector<Tensor>{sum(flat), max(flat),                  // rows split into parts
                                 sum(rows, {1}), max(rows, {1}),
                                 sum(tall, {0}), max(tall, {0})};       // column tiles split
    });
    check.add("vector elementwise " + name, [t] {
      Tensor a = input({64, 128}, t), row = input({128}, t), odd = input({33, 127}, t), odd_row = input({127}, t);
      return std::vector<Tensor>{a * row + a, odd - odd_row, cast(a, DType::Float32) * 2.0};
    });
  }
  check.add("split bool reductions", [] {
    Tensor a = input({50000}, DType::Bool), tall = input({9000, 40}, DType::Bool);
    return std::vector<Tensor>{max(a), max(tall, {0})};
  });
  check.add("bool reductions", [] {
    Tensor a = input({8, 40}, DType::Bool);
    return std::vector<Tensor>{max(a, {1}), max(a, {0}), max(a), sum(a, {1})};
  });
  check.add("mean var argmax logsumexp", [] {
    Tensor a = input({16, 100}, DType::Float32);
    return std::vector<Tensor>{mean(a, {1}), var(a, {0}, false, true), argmax(a, 1), logsumexp(a, {1}), min(a, {0})};
  });
}

void view_graphs(CudaCompileCheck& check) {
  for (DType t : {DType::Float32, DType::Float16, DType::Int64}) {
    const std::string name(dtype_name(t));
    check.add("views " + name, [t] {
      Tensor a = input({4, 6, 8}, t), row = input({8}, t), col = input({4, 1, 1}, t);
      return std::vector<Tensor>{
          permute(a, {2, 0, 1}) + scalar_like(1.0, permute(a, {2, 0, 1})),
          slice(a, 2, 1, 7, 2) * slice(a, 2, 0, 3),
          pad(a, {{0, 0}, {1, 2}, {3, 0}}),
          pad(a, {{1, 1}, {0, 0}, {2, 2}}) + expand(reshape(input({6}, t), {1, 6, 1}), {6, 6, 12}),
          a + expand(row, {4, 6, 8}) + expand(col, {4, 6, 8}),
          reshape(permute(a, {1, 0, 2}), {6, 32}) + 1.0,
          transpose(reshape(a, {24, 8}), 0, 1) * 2.0,
          concat({a, a * 2.0}, 1),
          flatten(slice(a, 0, 1, 3)) - 1.0,
      };
    });
  }
}

void index_graphs(CudaCompileCheck& check) {
  for (DType t : kNumericTypes) {
    const std::string name(dtype_name(t));
    check.add("gather scatter " + name, [t] {
      Tensor a = input({8, 12}, t), src = input({8, 5}, t);
      std::vector<int64_t> idx(8 * 5);
      for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>((i * 5) % 12);
      Tensor index = from_vector<int64_t>(idx, {8, 5});
      Tensor rows = from_vector<int64_t>({3, 0, 7, 7, 1}, {5});
      return std::vector<Tensor>{gather(a, 1, index), scatter_add({8, 12}, 1, index, src), index_select(a, 0, rows),
                                 scatter_add({12, 12}, 0, from_vector<int64_t>(std::vector<int64_t>(8 * 12, 4), {8, 12}), a)};
    });
  }
  check.add("scatter bool and bytes", [] {
    Tensor index = from_vector<int64_t>({0, 2, 1, 2}, {4});
    return std::vector<Tensor>{scatter_add({3}, 0, index, input({4}, DType::Bool)),
                               scatter_add({3}, 0, index, input({4}, DType::UInt8)),
                               scatter_add({3}, 0, index, input({4}, DType::Int8))};
  });
  check.add("one_hot", [] { return std::vector<Tensor>{one_hot(labels(10, 4), 4), one_hot(labels(10, 4), 4, DType::Float16)}; });
}

void random_graphs(CudaCompileCheck& check) {
  for (DType t : kFloatTypes) {
    const std::string name(dtype_name(t));
    check.add("random " + name, [t] {
      return std::vector<Tensor>{rand({16, 33}, t), randn({16, 33}, t), randn({7}, t) * 2.0 + rand({7}, t)};
    });
  }
  check.add("dropout", [] { return std::vector<Tensor>{dropout(input({32, 64}, DType::Float32), 0.25)}; });
}

void composite_graphs(CudaCompileCheck& check) {
  for (DType t : kFloatTypes) {
    const std::string name(dtype_name(t));
    check.add("composites " + name, [t] {
      Tensor x = input({12, 80}, t), w = input({80}, t, 0.01, 0.0), b = input({80}, t, 0.02, 0.1);
      return std::vector<Tensor>{softmax(x), log_softmax(x, 0), layer_norm(x, {80}, w, b), gelu(x), gelu(x, true),
                                 sigmoid(x), silu(x), relu(x), softmax(reshape(x, {12, 4, 20}), 1)};
    });
  }
  check.add("composite gradients", [] {
    Tensor x = input({12, 80}, DType::Float32).requires_grad_();
    Tensor w = input({80}, DType::Float32, 0.01, 0.0).requires_grad_();
    Tensor b = input({80}, DType::Float32, 0.02, 0.1).requires_grad_();
    Tensor y = layer_norm(x, {80}, w, b);
    Tensor loss = cross_entropy(y, labels(12, 80), CrossEntropyOptions().label_smoothing(0.1)) + sum(softmax(x) * gelu(x)) + mean(silu(x));
    std::vector<Tensor> outputs = grad(loss, {x, w, b});
    outputs.push_back(loss);
    return outputs;
  });
  check.add("pooling", [] {
    Tensor x = input({2, 3, 9, 9}, DType::Float32).requires_grad_();
    Tensor y = max_pool2d(x, {3, 3}, {2, 2}, {1, 1}) + avg_pool2d(x, {3, 3}, {2, 2}, {1, 1});
    std::vector<Tensor> outputs = grad(sum(y * y), {x});
    outputs.push_back(y);
    return outputs;
  });
}

// SGD with momentum, as optim::SGD records it: buf = m * buf + g; p -= lr * buf.
std::vector<Tensor> sgd_momentum(std::vector<Tensor>& params, std::vector<Tensor>& buffers, const Tensor& loss) {
  std::vector<Tensor> grads = grad(loss, params);
  NoGradGuard no_grad;
  std::vector<Tensor> outputs;
  for (size_t i = 0; i < params.size(); ++i) {
    buffers[i].assign(buffers[i] * 0.9 + grads[i] * 1.0);
    params[i].assign(params[i] - buffers[i] * 0.05);
    outputs.push_back(params[i]);
    outputs.push_back(buffers[i]);
  }
  outputs.push_back(loss);
  return outputs;
}

std::vector<Tensor> zeros_like_all(const std::vector<Tensor>& params) {
  std::vector<Tensor> buffers;
  for (const Tensor& p : params) buffers.push_back(zeros(p.shape(), p.dtype()).realize());
  return buffers;
}

void training_graphs(CudaCompileCheck& check) {
  check.add("MLP training step, SGD momentum", [] {
    std::vector<Tensor> params;
    for (auto [in, out] : {std::pair<int64_t, int64_t>{784, 128}, {128, 64}, {64, 10}}) {
      params.push_back((randn({in, out}) * 0.05).realize().requires_grad_());
      params.push_back(zeros({out}).realize().requires_grad_());
    }
    std::vector<Tensor> buffers = zeros_like_all(params);
    Tensor x = input({32, 784}, DType::Float32), h = x;
    for (size_t i = 0; i < params.size(); i += 2) {
      h = matmul(h, params[i]) + params[i + 1];
      if (i + 2 < params.size()) h = relu(h);
    }
    return sgd_momentum(params, buffers, cross_entropy(h, labels(32, 10)));
  });
  check.add("CNN training step, SGD momentum", [] {
    std::vector<Tensor> params = {
        (randn({8, 1, 3, 3}) * 0.1).realize().requires_grad_(), zeros({8}).realize().requires_grad_(),
        (randn({8 * 7 * 7, 10}) * 0.05).realize().requires_grad_(), zeros({10}).realize().requires_grad_()};
    std::vector<Tensor> buffers = zeros_like_all(params);
    Tensor x = input({16, 1, 28, 28}, DType::Float32);
    Tensor h = max_pool2d(relu(conv2d(x, params[0], params[1], {1, 1}, {1, 1})), {2, 2});  // (16, 8, 14, 14)
    h = max_pool2d(h, {2, 2});                                                              // (16, 8, 7, 7)
    Tensor logits = matmul(reshape(h, {16, 8 * 7 * 7}), params[2]) + params[3];
    return sgd_momentum(params, buffers, cross_entropy(logits, labels(16, 10)));
  });
  check.add("float64 conv step", [] {
    Tensor w = (randn({4, 2, 3, 3}, DType::Float64) * 0.1).realize().requires_grad_();
    Tensor x = input({2, 2, 8, 8}, DType::Float64);
    Tensor loss = sum(max_pool2d(tanh(conv2d(x, w, {}, {2, 2}, {1, 1})), {2, 2}));
    std::vector<Tensor> outputs = grad(loss, {w});
    outputs.push_back(loss);
    return outputs;
  });
  // Fused attention, forward and backward: float32 over strided views of one projection (causal,
  // several tiles), float64, and bfloat16 operands.
  for (DType t : {DType::Float32, DType::Float64, DType::BFloat16})
    for (bool causal : {false, true})
      check.add(fmt::format("fused attention {} {}", dtype_name(t), causal ? "causal" : "full"), [t, causal] {
        Tensor w = (randn({32, 96}) * 0.1).realize().cast(t).realize().requires_grad_();
        Tensor x = input({2, 70, 32}, t);
        std::vector<Tensor> qkv = chunk(matmul(x, w), 3, 2);
        auto heads = [](const Tensor& p) { return permute(reshape(p, {2, 70, 4, 8}), {0, 2, 1, 3}); };
        Tensor y = fused_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), causal, 0.35);
        Tensor loss = sum(y * y);
        std::vector<Tensor> outputs = grad(loss, {w});
        outputs.push_back(loss);
        return outputs;
      });
}

}  // namespace

TEST_CASE("every kernel of the test graphs renders to CUDA and compiles with NVRTC", "[cuda][jit]") {
  if (!cuda::nvrtc_available()) {
    WARN("SKIPPED: kiln was built without the CUDA toolkit (no NVRTC); CUDA kernels not compiled");
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  CudaCompileCheck check;
  elementwise_graphs(check);
  reduction_graphs(check);
  view_graphs(check);
  index_graphs(check);
  random_graphs(check);
  composite_graphs(check);
  training_graphs(check);
  check.flush();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::string refused;
  for (const std::string& r : check.refused()) refused += " '" + r + "'";
  std::cout << fmt::format(
                   "[cuda] NVRTC {}: {} kernels ({} CUDA functions) from {} graphs compiled for sm_80 and sm_90 in {} "
                   "programs ({} from the disk cache), {:.1f} s; {} row groups; {} elementwise kernels with a 16-byte vector path; {} split reductions; {} library kernels skipped; graphs the op "
                   "library refused:{}\n",
                   cuda::nvrtc_version(), check.kernels(), check.functions(), check.graphs(), check.programs(),
                   check.cached(), seconds, check.row_groups(), check.vector_paths(), check.split_functions(), check.library_kernels(), refused.empty() ? " none" : refused)
            << std::flush;
  CHECK(check.failures() == 0);
  CHECK(check.kernels() > 300);
  CHECK(check.library_kernels() > 0);
  CHECK(check.row_groups() > 0);  // softmax, layer norm, ... as one function each
  CHECK(check.vector_paths() > 0);
  CHECK(check.split_functions() > 0);
}

TEST_CASE("NVRTC reports a compile error with its log and the saved source", "[cuda][jit]") {
  if (!cuda::nvrtc_available()) {
    WARN("SKIPPED: kiln was built without the CUDA toolkit (no NVRTC)");
    return;
  }
  const std::string source = "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }\n";
  try {
    cuda::compile_cuda_cached(source, "sm_80", 1);
    FAIL("a broken kernel compiled");
  } catch (const Error& e) {
    const std::string message = e.what();
    CHECK(message.find("undeclared_name") != std::string::npos);
    CHECK(message.find(".cu") != std::string::npos);
  }
  CHECK_THROWS_AS(cuda::compile_cuda_cached(source, "compute_bogus", 1), Error);
}

TEST_CASE("NVRTC cubins are cached by source and architecture", "[cuda][jit]") {
  if (!cuda::nvrtc_available()) {
    WARN("SKIPPED: kiln was built without the CUDA toolkit (no NVRTC)");
    return;
  }
  Tensor a = input({10, 20}, DType::Float32);
  std::vector<NodePtr> targets = {(exp(a) + 1.0).node()};
  cuda::CudaSource cuda = cuda::render_cuda(jit::lower_for(targets).kernels);
  auto sm80 = cuda::compile_cuda_cached(cuda.source, "sm_80", cuda.function_count);
  auto sm90 = cuda::compile_cuda_cached(cuda.source, "sm_90", cuda.function_count);
  CHECK(sm80->key != sm90->key);
  CHECK(cuda::compile_cuda_cached(cuda.source, "sm_80", cuda.function_count) == sm80);  // memory
  cuda::clear_cuda_memory_cache();
  auto again = cuda::compile_cuda_cached(cuda.source, "sm_80", cuda.function_count);  // disk
  CHECK(again->image == sm80->image);
  CHECK(again->from_disk == flags().disk_cache);
  REQUIRE(cuda.launches.size() == 1);
  CHECK(cuda.launches[0].size() == 1);
  CHECK(cuda.launches[0][0].blocks >= 1);
}

namespace {

// The CUDA source of the one kernel that computes what `make` returns (its temporaries gone).
std::string cuda_function_of(const std::function<Tensor()>& make) {
  Tensor out = make();
  std::vector<NodePtr> targets = {out.node()};
  jit::Program schedule = jit::lower_for(targets);
  std::string kernels;
  for (const jit::Kernel& k : schedule.kernels) kernels += k.summary + "; ";
  INFO(kernels);
  REQUIRE(schedule.kernels.size() == 1);
  return cuda::render_cuda(schedule.kernels).functions;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) n++;
  return n;
}

}  // namespace

// Renderer only (no NVRTC): which operands of an elementwise kernel become 16-byte vector loads.
// Whether the kernels compute the right thing on every path is checked on the emulator
// (test_cuda_ops.cpp), which also faults on a misaligned vector access.
TEST_CASE("contiguous elementwise kernels read and write 16-byte vectors", "[cuda][jit][vector]") {
  Tensor x = input({64, 128}, DType::Float32), bias = input({128}, DType::Float32);
  std::string f = cuda_function_of([&] { return x * 2.0 + bias; });
  CHECK(count(f, "kiln_vload<4>(") == 2);  // x and the bias row: 4 floats of one row
  CHECK(count(f, "kiln_vstore<4>(") == 1);

  Tensor h = input({64, 128}, DType::Float16);
  f = cuda_function_of([&] { return exp(h); });
  CHECK(count(f, "kiln_vload<8>(") == 1);  // 8 halves in 16 bytes
  f = cuda_function_of([&] { return cast(h, DType::Float32) + x; });
  CHECK(count(f, "kiln_vload<4>(") == 2);  // 4 floats, and 4 halves in 8 bytes
  f = cuda_function_of([] { return input({64, 128}, DType::Float64) * 3.0; });
  CHECK(count(f, "kiln_vload<2>(") == 1);

  // Rows of 127: a bias read at i is not contiguous across rows, x (read at the flat index) is.
  Tensor odd = input({33, 127}, DType::Float32), odd_bias = input({127}, DType::Float32);
  f = cuda_function_of([&] { return odd + odd_bias; });
  CHECK(count(f, "kiln_vload<4>(") == 1);
  CHECK(count(f, "kiln_vstore<4>(") == 1);

  // A slice starting one element in: the alignment check includes the offset.
  Tensor flat = input({8193}, DType::Float32);
  f = cuda_function_of([&] { return slice(flat, 0, 1, 8193) + 1.0; });
  CHECK(f.find("% 16") != std::string::npos);
  CHECK(f.find("+ 1) % 16") != std::string::npos);

  // Transposed reads, and small kernels, keep the scalar path.
  CHECK(count(cuda_function_of([&] { return permute(x, {1, 0}) + 1.0; }), "kiln_vload") == 0);
  CHECK(count(cuda_function_of([] { return input({100}, DType::Float32) + 1.0; }), "kiln_vload") == 0);
}

TEST_CASE("reductions of long rows into few outputs render as parts and a fold of the parts", "[cuda][jit][split]") {
  Tensor flat = input({1 << 20}, DType::Float32), rows = input({4, 100000}, DType::Float16);
  Tensor tall = input({65536, 64}, DType::Float32);
  // Parts per output: min(ceil(1024 blocks / outputs), elements / 2048, 1024); scratch holds one
  // accumulator (float for half types) per part, 32 per part of a column tile.
  const std::vector<std::tuple<std::string, std::function<Tensor()>, int64_t, int64_t>> cases = {
      {"sum of 2^20", [&] { return sum(flat); }, 512, 512 * 4},                       // 1 output, 512 parts
      {"max of 4 rows of 100000 halves", [&] { return max(rows, {1}); }, 4 * 48, 4 * 48 * 4},  // 48 parts a row
      {"column sum of 65536 x 64", [&] { return sum(tall, {0}); }, 2 * 512, 2 * 512 * 32 * 4},  // 2 tiles, 512 parts
  };
  for (const auto& [name, make, blocks, scratch] : cases) {
    INFO(name);
    Tensor out = make();
    std::vector<NodePtr> targets = {out.node()};
    jit::Program schedule = jit::lower_for(targets);
    REQUIRE(schedule.kernels.size() == 1);
    cuda::CudaSource cuda = cuda::render_cuda(schedule.kernels);
    REQUIRE(cuda.launches[0].size() == 2);
    CHECK(cuda.launches[0][1].function == cuda.launches[0][0].function + "_parts");
    CHECK(cuda.launches[0][0].blocks == blocks);  // every SM busy, not one block per output
    CHECK(cuda.scratch_bytes == scratch);
  }
  // Many outputs keep a block each; no scratch.
  Tensor many = input({512, 2048}, DType::Float32);
  Tensor out = sum(many, {1});
  std::vector<NodePtr> targets = {out.node()};
  cuda::CudaSource cuda = cuda::render_cuda(jit::lower_for(targets).kernels);
  CHECK(cuda.launches[0].size() == 1);
  CHECK(cuda.scratch_bytes == 0);
}

namespace {

// Lines of `ptx` inside the .entry of `function` that contain `what`.
size_t count_in_entry(const std::string& ptx, const std::string& function, const std::string& what) {
  const size_t begin = ptx.find(".entry " + function + "(");
  REQUIRE(begin != std::string::npos);
  const size_t end = ptx.find(".entry ", begin + 1);
  return count(ptx.substr(begin, end == std::string::npos ? std::string::npos : end - begin), what);
}

}  // namespace

// What NVRTC makes of the kernels, read from their PTX: the vector path's loads and stores are
// 128-bit instructions, and a row group's loops (stepping by the block size as a constant) are
// unrolled so that each thread has several loads in flight.
TEST_CASE("the PTX of vector and row-group kernels has 128-bit and unrolled loads", "[cuda][jit][vector]") {
  if (!cuda::nvrtc_available()) {
    WARN("SKIPPED: kiln was built without the CUDA toolkit (no NVRTC)");
    return;
  }
  Tensor x = input({256, 1024}, DType::Float32), y = input({256, 1024}, DType::Float32);
  Tensor h = input({256, 1024}, DType::Float16);
  for (const auto& [name, make, width] : std::vector<std::tuple<std::string, std::function<Tensor()>, std::string>>{
           {"float", [&] { return exp(x) * y + 1.0; }, "ld.global.v4.f32"},
           {"half", [&] { return h * h; }, "ld.global.v4.u32"}}) {
    INFO(name);
    Tensor out = make();
    std::vector<NodePtr> targets = {out.node()};
    cuda::CudaSource cuda = cuda::render_cuda(jit::lower_for(targets).kernels);
    const std::string ptx = cuda::cuda_ptx(cuda.source, "compute_90");
    CHECK(count_in_entry(ptx, cuda.launches[0][0].function, width) >= 2);
    CHECK(count_in_entry(ptx, cuda.launches[0][0].function, "st.global.v4") >= 1);
  }
  Tensor out = softmax(x, 1);
  std::vector<NodePtr> targets = {out.node()};
  jit::Program schedule = jit::lower_for(targets);
  cuda::CudaSource cuda = cuda::render_cuda(schedule.kernels, cuda::cuda_row_groups(schedule.kernels));
  REQUIRE(cuda.launches[0].size() == 1);
  const std::string ptx = cuda::cuda_ptx(cuda.source, "compute_90");
  // Three passes over a row of 1024 by 256 threads: 4 loads a pass at least, not 1 in a loop.
  CHECK(count_in_entry(ptx, cuda.launches[0][0].function, "ld.global.f32") >= 12);
  CHECK_THROWS_AS(cuda::cuda_ptx(cuda.source, "sm_90"), Error);
}

// KILN_DETERMINISTIC: a scatter-add (an embedding's gradient) renders without atomics, each
// output's additions from one thread in a fixed order; by default it adds atomically.
TEST_CASE("KILN_DETERMINISTIC renders scatter-adds without atomics", "[cuda][jit][deterministic]") {
  Tensor rows = input({40, 16}, DType::Float32);
  Tensor idx = from_vector<int64_t>({3, 0, 5, 5, 1, 2, 3, 3}, {8}).realize();
  auto scatter = [&] { return scatter_add({6, 16}, 0, expand(reshape(idx, {8, 1}), {8, 16}), slice(rows, 0, 0, 8)); };
  CHECK(count(cuda_function_of(scatter), "kiln_atomic_add(") == 1);
  FlagsGuard guard;
  flags().deterministic = true;
  const std::string ordered = cuda_function_of(scatter);
  CHECK(count(ordered, "kiln_atomic_add(") == 0);
  CHECK(count(ordered, "_zero") == 1);  // the output is still cleared first
}
