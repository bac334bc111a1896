// oneDNN convolution: one cached primitive per (pass, dtype, geometry), run in oneDNN's preferred
// blocked layouts with reorders from and to kiln's plain layouts. With plain layouts oneDNN
// falls back to im2col + GEMM, about 2.5x slower on AVX-512 than its direct kernels even after
// paying for the reorders.
#include "backends/cpu/conv_onednn.h"

#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <string_view>

#include "core/device.h"
#include "core/error.h"
#include "core/lasting_cache.h"
#include "memory/allocator.h"
#include "backends/cpu/onednn_runtime.h"

namespace kiln::cpu {

namespace {

using dnnl::memory;
using Tag = memory::format_tag;

// An operand in kiln's plain layout and in the layout the primitive wants.
struct Operand {
  memory::desc plain, inner;
  bool reordered() const { return plain != inner; }
};

struct Plan {
  dnnl::primitive primitive;
  Operand a, b, out;
  int a_arg = 0, b_arg = 0, out_arg = 0;
  std::optional<dnnl::reorder> a_in, b_in, out_back;  // set for reordered operands
};

using Key = std::array<int64_t, 18>;

// A model has few distinct convolutions.
LastingCache<Key, Plan>& plan_cache() {
  static auto& cache = *new LastingCache<Key, Plan>;
  return cache;
}

memory::data_type to_dnnl(DType t) {
  return t == DType::BFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
}

struct Descs {
  memory::desc x, w, y;
};

Descs make_descs(const ConvGeometry& g, memory::data_type dt, bool plain) {
  memory::dims x{g.N, g.C, g.H, g.W}, y{g.N, g.OC, g.OH, g.OW};
  memory::dims w = g.groups == 1 ? memory::dims{g.OC, g.C, g.KH, g.KW}
                                 : memory::dims{g.groups, g.OC / g.groups, g.C / g.groups, g.KH, g.KW};
  Tag w_tag = g.groups == 1 ? Tag::oihw : Tag::goihw;
  return {memory::desc(x, dt, plain ? Tag::nchw : Tag::any), memory::desc(w, dt, plain ? w_tag : Tag::any),
          memory::desc(y, dt, plain ? Tag::nchw : Tag::any)};
}

struct Window {
  memory::dims strides, dilates, pad_l, pad_r;
};

Window make_window(const ConvGeometry& g) {
  // oneDNN counts dilation as the gap between taps (PyTorch's minus one). Right padding equal to
  // the left gives oneDNN's output size the same floor as PyTorch's formula.
  return {{g.stride[0], g.stride[1]},
          {g.dilation[0] - 1, g.dilation[1] - 1},
          {g.padding[0], g.padding[1]},
          {g.padding[0], g.padding[1]}};
}

// The forward primitive in oneDNN's preferred layouts; also the hint the backward passes need.
dnnl::convolution_forward::primitive_desc forward_desc(const ConvGeometry& g, memory::data_type dt) {
  const Descs any = make_descs(g, dt, false);
  const Window win = make_window(g);
  return dnnl::convolution_forward::primitive_desc(
      dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, any.x,
                                      any.w, any.y, win.strides, win.dilates, win.pad_l, win.pad_r),
      onednn_runtime().engine);
}

Plan make_plan(ConvPass pass, DType t, const ConvGeometry& g) {
  const memory::data_type dt = to_dnnl(t);
  const Descs plain = make_descs(g, dt, true), any = make_descs(g, dt, false);
  const Window win = make_window(g);
  const dnnl::engine& engine = onednn_runtime().engine;
  using dnnl::algorithm;
  const dnnl::convolution_forward::primitive_desc fwd = forward_desc(g, dt);
  Plan plan;
  switch (pass) {
    case ConvPass::Forward:
      plan.primitive = dnnl::convolution_forward(fwd);
      plan.a = {plain.x, fwd.src_desc()};
      plan.b = {plain.w, fwd.weights_desc()};
      plan.out = {plain.y, fwd.dst_desc()};
      plan.a_arg = DNNL_ARG_SRC, plan.b_arg = DNNL_ARG_WEIGHTS, plan.out_arg = DNNL_ARG_DST;
      break;
    case ConvPass::BackwardData: {
      dnnl::convolution_backward_data::primitive_desc pd(
          dnnl::convolution_backward_data::desc(algorithm::convolution_direct, any.x, any.w, any.y, win.strides,
                                                win.dilates, win.pad_l, win.pad_r),
          engine, fwd);
      plan.primitive = dnnl::convolution_backward_data(pd);
      plan.a = {plain.y, pd.diff_dst_desc()};
      plan.b = {plain.w, pd.weights_desc()};
      plan.out = {plain.x, pd.diff_src_desc()};
      plan.a_arg = DNNL_ARG_DIFF_DST, plan.b_arg = DNNL_ARG_WEIGHTS, plan.out_arg = DNNL_ARG_DIFF_SRC;
      break;
    }
    case ConvPass::BackwardWeight: {
      dnnl::convolution_backward_weights::primitive_desc pd(
          dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, any.x, any.w, any.y,
                                                   win.strides, win.dilates, win.pad_l, win.pad_r),
          engine, fwd);
      plan.primitive = dnnl::convolution_backward_weights(pd);
      plan.a = {plain.x, pd.src_desc()};
      plan.b = {plain.y, pd.diff_dst_desc()};
      plan.out = {plain.w, pd.diff_weights_desc()};
      plan.a_arg = DNNL_ARG_SRC, plan.b_arg = DNNL_ARG_DIFF_DST, plan.out_arg = DNNL_ARG_DIFF_WEIGHTS;
      break;
    }
  }
  if (plan.a.reordered()) plan.a_in = dnnl::reorder(dnnl::reorder::primitive_desc(engine, plan.a.plain, engine, plan.a.inner));
  if (plan.b.reordered()) plan.b_in = dnnl::reorder(dnnl::reorder::primitive_desc(engine, plan.b.plain, engine, plan.b.inner));
  if (plan.out.reordered())
    plan.out_back = dnnl::reorder(dnnl::reorder::primitive_desc(engine, plan.out.inner, engine, plan.out.plain));
  return plan;
}

std::string describe(ConvPass pass, DType t, const ConvGeometry& g) {
  static constexpr std::string_view kPass[] = {"forward", "backward data", "backward weight"};
  return fmt::format("{} {}: x ({}, {}, {}, {}), weight ({}, {}, {}, {}) -> ({}, {}, {}, {}), stride ({}, {}), "
                     "padding ({}, {}), dilation ({}, {}), groups {}",
                     kPass[static_cast<int>(pass)], dtype_name(t), g.N, g.C, g.H, g.W, g.OC, g.C / g.groups, g.KH,
                     g.KW, g.N, g.OC, g.OH, g.OW, g.stride[0], g.stride[1], g.padding[0], g.padding[1],
                     g.dilation[0], g.dilation[1], g.groups);
}

}  // namespace

bool onednn_supports_conv(DType t) {
  if (t == DType::Float32) return true;
  if (t != DType::BFloat16) return false;
  static const bool bf16 = onednn_has_native_kernel([] {
    return forward_desc({.N = 1, .C = 16, .H = 8, .W = 8, .OC = 16, .KH = 3, .KW = 3, .OH = 6, .OW = 6},
                        memory::data_type::bf16);
  });
  return bf16;
}

void onednn_conv2d(ConvPass pass, DType t, const ConvGeometry& g, const void* a, const void* b, void* out) {
  KILN_CHECK(t == DType::Float32 || t == DType::BFloat16, "conv2d",
             "oneDNN convolution takes float32 or bfloat16, got {}; check cpu::onednn_supports_conv first",
             dtype_name(t));
  if (g.N == 0 || g.C == 0 || g.OC == 0 || g.OH == 0 || g.OW == 0) {  // oneDNN rejects empty tensors
    const int64_t numel = pass == ConvPass::Forward        ? g.N * g.OC * g.OH * g.OW
                          : pass == ConvPass::BackwardData ? g.N * g.C * g.H * g.W
                                                           : g.OC * (g.C / g.groups) * g.KH * g.KW;
    std::memset(out, 0, static_cast<size_t>(numel) * dtype_size(t));  // empty sums; zero bits are 0.0
    return;
  }
  const Key key{static_cast<int64_t>(pass), static_cast<int64_t>(t), g.N, g.C, g.H, g.W, g.OC, g.KH, g.KW,
                g.OH, g.OW, g.stride[0], g.stride[1], g.padding[0], g.padding[1], g.dilation[0], g.dilation[1],
                g.groups};
  OnednnRuntime& rt = onednn_runtime();
  try {
    const Plan* plan = &plan_cache().get_or_create(key, [&] { return make_plan(pass, t, g); });
    // Reordered copies live in pooled memory, so they show in kiln's memory statistics and are
    // reused from one step to the next.
    std::shared_ptr<Storage> scratch[3];
    auto bind = [&](const Operand& op, const void* data, int i) {
      memory plain(op.plain, rt.engine, const_cast<void*>(data));  // oneDNN only reads inputs
      if (!op.reordered()) return std::pair{plain, plain};
      scratch[i] = kiln::memory::allocate_storage(op.inner.get_size(), Device::cpu());
      return std::pair{plain, memory(op.inner, rt.engine, scratch[i]->data)};
    };
    auto [a_plain, a_mem] = bind(plan->a, a, 0);
    auto [b_plain, b_mem] = bind(plan->b, b, 1);
    auto [out_plain, out_mem] = bind(plan->out, out, 2);
    std::lock_guard<std::mutex> lock(rt.stream_mutex);
    SmallWorkOnOneThread small(2.0 * static_cast<double>(g.N * g.OC * g.OH * g.OW) * (g.C / g.groups) * g.KH * g.KW);
    if (plan->a_in) plan->a_in->execute(rt.stream, a_plain, a_mem);
    if (plan->b_in) plan->b_in->execute(rt.stream, b_plain, b_mem);
    plan->primitive.execute(rt.stream, {{plan->a_arg, a_mem}, {plan->b_arg, b_mem}, {plan->out_arg, out_mem}});
    if (plan->out_back) plan->out_back->execute(rt.stream, out_mem, out_plain);
    rt.stream.wait();
  } catch (const dnnl::error& e) {
    KILN_FAIL("conv2d", "oneDNN failed: {} (status {}); {}", e.what(), static_cast<int>(e.status),
              describe(pass, t, g));
  }
}

}  // namespace kiln::cpu
