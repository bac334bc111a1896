#include "nn/transformer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "core/autograd.h"
#include "core/error.h"
#include "core/flags.h"
#include "nn/checkpoint.h"
#include "nn/init.h"
#include "ops/ops.h"

namespace kiln::nn {

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                    double dropout_p, bool causal) {
  KILN_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim() && q.size(-1) == k.size(-1) &&
                 k.size(-2) == v.size(-2),
             "scaled_dot_product_attention",
             "needs q (..., Tq, d), k (..., Tk, d) and v (..., Tk, dv) of one rank; got {}, {} and {}", q.str(), k.str(),
             v.str());
  KILN_CHECK(dropout_p >= 0 && dropout_p < 1, "scaled_dot_product_attention", "dropout_p must be in [0, 1), got {}",
             dropout_p);
  const int64_t tq = q.size(-2), tk = k.size(-2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  // The fused kernel covers what a transformer asks for: no mask but the causal one, no dropout
  // on the weights; its tiles bound the head sizes it takes.
  constexpr int64_t kMaxFusedHead = 256;
  if (flags().fused_attention && !mask.defined() && dropout_p == 0 && (q.dim() == 3 || q.dim() == 4) &&
      q.size(-1) <= kMaxFusedHead && v.size(-1) <= kMaxFusedHead && q.size(0) == k.size(0) &&
      q.size(0) == v.size(0) && (q.dim() == 3 || (q.size(1) == k.size(1) && q.size(1) == v.size(1)))) {
    if (q.dim() == 4) return fused_attention(q, k, v, causal, scale);
    return fused_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), causal, scale).squeeze(1);
  }
  Tensor scores = matmul(q, transpose(k, -2, -1)) * scale;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (causal) {
    // Key j is in query i's future when j - i > tk - tq: the last query sees every key.
    const Shape square{tq, tk};
    const Tensor ahead = iota(square, 1, DType::Int64) - iota(square, 0, DType::Int64);
    scores = masked_fill(scores, gt(ahead, scalar(static_cast<double>(tk - tq), DType::Int64)), minus_inf);
  }
  if (mask.defined()) scores = mask.dtype() == DType::Bool ? masked_fill(scores, logical_not(mask), minus_inf)
                                                            : scores + mask.cast(scores.dtype());
  Tensor weights = softmax(scores, -1);
  if (dropout_p > 0) weights = dropout(weights, dropout_p);
  return matmul(weights, v);
}

MultiheadAttention::MultiheadAttention(const MultiheadAttentionOptions& o) : Module("MultiheadAttention"), options_(o) {
  KILN_CHECK(o.dim() > 0 && o.heads() > 0 && o.dim() % o.heads() == 0, "MultiheadAttention",
             "dim {} must be a positive multiple of heads {}", o.dim(), o.heads());
  const int64_t d = o.dim();
  if (o.fused_qkv()) {
    qkv = register_module("qkv", Linear(LinearOptions(d, 3 * d).bias(o.bias()).dtype(o.dtype())));
  } else {
    q_proj = register_module("q_proj", Linear(LinearOptions(d, d).bias(o.bias()).dtype(o.dtype())));
    k_proj = register_module("k_proj", Linear(LinearOptions(d, d).bias(o.bias()).dtype(o.dtype())));
    v_proj = register_module("v_proj", Linear(LinearOptions(d, d).bias(o.bias()).dtype(o.dtype())));
  }
  out_proj = register_module("out_proj", Linear(LinearOptions(d, d).bias(o.bias()).dtype(o.dtype())));
  set_extra_repr(fmt::format("dim={}, heads={}, causal={}, dropout={}", d, o.heads(), o.causal(), o.dropout()));
}

Tensor MultiheadAttention::attend(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t heads = options_.heads(), head_dim = options_.dim() / heads;
  // (B, T, dim) -> (B, heads, T, head_dim)
  auto split_heads = [&](const Tensor& t) {
    return permute(t.reshape({t.size(0), t.size(1), heads, head_dim}), {0, 2, 1, 3});
  };
  const double p = is_training() ? options_.dropout() : 0.0;
  Tensor y = scaled_dot_product_attention(split_heads(q), split_heads(k), split_heads(v), {}, p, options_.causal());
  y = permute(y, {0, 2, 1, 3});  // (B, T, heads, head_dim)
  return out_proj.forward(y.reshape({y.size(0), y.size(1), options_.dim()}));
}

Tensor MultiheadAttention::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 3 && x.size(2) == options_.dim(), "MultiheadAttention", "input {} is not (B, T, {})", x.str(),
             options_.dim());
  if (!options_.fused_qkv()) return forward(x, x, x);
  const std::vector<Tensor> parts = chunk(qkv.forward(x), 3, 2);
  return attend(parts[0], parts[1], parts[2]);
}

Tensor MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value) {
  const int64_t d = options_.dim();
  KILN_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && query.size(2) == d && key.size(2) == d &&
                 value.size(2) == d && key.size(1) == value.size(1) && query.size(0) == key.size(0) &&
                 key.size(0) == value.size(0),
             "MultiheadAttention", "needs query (B, Tq, {0}), key and value (B, Tk, {0}); got {1}, {2} and {3}", d,
             query.str(), key.str(), value.str());
  if (options_.fused_qkv()) {
    // The fused projection's three blocks of rows are the query, key and value weights.
    const Tensor w = qkv.weight, b = qkv.bias;
    auto project = [&](const Tensor& t, int64_t i) {
      return linear(t, slice(w, 0, i * d, (i + 1) * d), b.defined() ? slice(b, 0, i * d, (i + 1) * d) : Tensor());
    };
    return attend(project(query, 0), project(key, 1), project(value, 2));
  }
  return attend(q_proj.forward(query), k_proj.forward(key), v_proj.forward(value));
}

TransformerBlock::TransformerBlock(const TransformerBlockOptions& o) : Module("TransformerBlock"), dropout_(o.dropout()) {
  const int64_t d = o.dim(), hidden = o.hidden() > 0 ? o.hidden() : 4 * d;
  ln1 = register_module("ln1", LayerNorm(LayerNormOptions({d}).dtype(o.dtype())));
  attn = register_module("attn", MultiheadAttention(MultiheadAttentionOptions(d, o.heads())
                                                        .dropout(o.dropout())
                                                        .causal(o.causal())
                                                        .dtype(o.dtype())));
  ln2 = register_module("ln2", LayerNorm(LayerNormOptions({d}).dtype(o.dtype())));
  fc = register_module("fc", Linear(LinearOptions(d, hidden).dtype(o.dtype())));
  proj = register_module("proj", Linear(LinearOptions(hidden, d).dtype(o.dtype())));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  const double p = is_training() ? dropout_ : 0.0;
  Tensor h = x + dropout(attn.forward(ln1.forward(x)), p, p > 0);
  return h + dropout(proj.forward(gelu(fc.forward(ln2.forward(h)))), p, p > 0);
}

GPT::GPT(const GPTConfig& c) : Module("GPT"), config_(c) {
  KILN_CHECK(c.vocab() > 0 && c.ctx() > 0 && c.layers() > 0, "GPT", "vocab {}, ctx {} and layers {} must be positive",
             c.vocab(), c.ctx(), c.layers());
  KILN_CHECK(c.dim() > 0 && c.heads() > 0 && c.dim() % c.heads() == 0, "GPT",
             "dim {} must be a positive multiple of heads {}", c.dim(), c.heads());
  tokens = register_module("tokens", Embedding(EmbeddingOptions(c.vocab(), c.dim()).dtype(c.dtype())));
  positions = register_module("positions", Embedding(EmbeddingOptions(c.ctx(), c.dim()).dtype(c.dtype())));
  blocks = register_module("blocks", ModuleList());
  for (int64_t i = 0; i < c.layers(); ++i)
    blocks.push_back(
        TransformerBlock(TransformerBlockOptions(c.dim(), c.heads()).dropout(c.dropout()).dtype(c.dtype())));
  ln_f = register_module("ln_f", LayerNorm(LayerNormOptions({c.dim()}).dtype(c.dtype())));
  if (!c.tie_weights())
    head = register_module("head", Linear(LinearOptions(c.dim(), c.vocab()).bias(false).dtype(c.dtype())));
  // GPT-2's initialization: N(0, 0.02), the projections into the residual stream scaled down by
  // √(2 layers) so the stream's variance does not grow with depth; biases 0; LayerNorms 1 and 0.
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers()));
  for (auto& [name, p] : named_parameters()) {
    const bool residual = name.ends_with("out_proj.weight") || name.ends_with(".proj.weight");
    if (name.find("ln") != std::string::npos) continue;  // LayerNorms keep 1 and 0
    if (name.ends_with("bias")) init::zeros_(p);
    else init::normal_(p, 0.0, residual ? residual_std : 0.02);
  }
  set_extra_repr(fmt::format("vocab={}, ctx={}, layers={}, heads={}, dim={}, tied={}", c.vocab(), c.ctx(), c.layers(),
                             c.heads(), c.dim(), c.tie_weights()));
}

namespace {

// Token plus positional embedding of (B, T) integer tokens.
Tensor embed(Embedding& tokens, Embedding& positions, const Tensor& idx) {
  KILN_CHECK(idx.dim() == 2 && is_integral(idx.dtype()), "GPT", "tokens must be integer (B, T), got {}", idx.str());
  const int64_t t = idx.size(1), ctx = positions.weight.size(0);
  KILN_CHECK(t >= 1 && t <= ctx, "GPT",
             "a sequence of {} tokens does not fit the context of {} (the positional table); cut it to at most {}", t,
             ctx, ctx);
  return tokens.forward(idx) + positions.forward(iota({t}, 0, DType::Int64).to(idx.device()));
}

// The first and last layers of GPT::as_sequential.
class GPTEmbeddings : public Module {
 public:
  GPTEmbeddings(const Embedding& t, const Embedding& p) : Module("GPTEmbeddings") {
    tokens = register_module("tokens", t);
    positions = register_module("positions", p);
  }
  Tensor forward(const Tensor& idx) override { return embed(tokens, positions, idx); }
  Embedding tokens{1, 1}, positions{1, 1};
};

class GPTHead : public Module {
 public:
  GPTHead(const LayerNorm& norm, const Linear& linear) : Module("GPTHead") {
    ln_f = register_module("ln_f", norm);
    head = register_module("head", linear);
  }
  Tensor forward(const Tensor& h) override { return head.forward(ln_f.forward(h)); }
  LayerNorm ln_f{1};
  Linear head{1, 1};
};

}  // namespace

Tensor GPT::forward(const Tensor& idx) {
  Tensor h = embed(tokens, positions, idx);
  for (AnyModule& block : blocks) h = config_.checkpoint() ? nn::checkpoint(block, h) : block.forward(h);
  h = ln_f.forward(h);
  return config_.tie_weights() ? matmul(h, transpose(tokens.weight, 0, 1)) : head.forward(h);
}

Sequential GPT::as_sequential() const {
  KILN_CHECK(!config_.tie_weights(), "GPT::as_sequential",
             "the head is tied to the token embedding, and a pipeline puts them on different stages; build the "
             "GPT with GPTConfig().tie_weights(false)");
  Sequential layers;
  layers.push_back(GPTEmbeddings(tokens, positions));
  for (const AnyModule& block : blocks) layers.push_back(block);
  layers.push_back(GPTHead(ln_f, head));
  return layers;
}

namespace {
// Zeroes all but the k largest entries of each row of `rows` (R rows of v; ties at the k-th kept).
void keep_top_k(std::vector<double>& rows, int64_t v, int64_t k) {
  for (size_t r = 0; r < rows.size() / static_cast<size_t>(v); ++r) {
    auto row = rows.begin() + static_cast<std::ptrdiff_t>(r * static_cast<size_t>(v));
    std::vector<double> sorted(row, row + v);
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<double>());
    const double kth = sorted[static_cast<size_t>(k - 1)];
    for (int64_t j = 0; j < v; ++j)
      if (row[j] < kth) row[j] = 0;
  }
}
}  // namespace

Tensor GPT::generate(const Tensor& prompt, int64_t steps, const GenerateOptions& options) {
  KILN_CHECK(prompt.dim() == 2 && prompt.size(1) >= 1 && is_integral(prompt.dtype()), "GPT::generate",
             "the prompt must be integer (B, T) with T >= 1, got {}", prompt.str());
  KILN_CHECK(options.temperature() > 0, "GPT::generate", "temperature must be positive, got {}", options.temperature());
  KILN_CHECK(options.top_k() >= 0 && options.top_k() <= config_.vocab(), "GPT::generate",
             "top_k must be in [0, vocab {}], got {}", config_.vocab(), options.top_k());
  NoGradGuard no_grad;
  const bool was_training = is_training();
  eval();
  const int64_t rows = prompt.size(0), ctx = config_.ctx(), vocab = config_.vocab();
  std::vector<std::vector<int64_t>> seq(static_cast<size_t>(rows));
  const std::vector<int64_t> start = prompt.cast(DType::Int64).to_vector<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    seq[r].assign(start.begin() + r * prompt.size(1), start.begin() + (r + 1) * prompt.size(1));
  const Device device = tokens.weight.device();
  for (int64_t s = 0; s < steps; ++s) {
    // Always a full window of ctx tokens, assembled on the host, so that every step runs one
    // cached plan: a shorter sequence is padded on the right, where causal attention keeps the
    // padding out of the last real position.
    const int64_t used = std::min<int64_t>(static_cast<int64_t>(seq[0].size()), ctx);
    std::vector<int64_t> window(static_cast<size_t>(rows * ctx), 0);
    for (int64_t r = 0; r < rows; ++r)
      std::copy(seq[r].end() - used, seq[r].end(), window.begin() + r * ctx);
    const std::vector<double> probs =
        softmax(forward(from_vector<int64_t>(window, {rows, ctx}).to(device)) / options.temperature(), -1).to_doubles();
    std::vector<double> last(static_cast<size_t>(rows * vocab));
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(probs.begin() + (r * ctx + used - 1) * vocab, vocab, last.begin() + r * vocab);
    if (options.top_k() > 0) keep_top_k(last, vocab, options.top_k());
    const std::vector<int64_t> picked = multinomial(from_vector<double>(last, {rows, vocab}), 1).to_vector<int64_t>();
    for (int64_t r = 0; r < rows; ++r) seq[r].push_back(picked[r]);
  }
  if (was_training) train();
  std::vector<int64_t> flat;
  for (const auto& row : seq) flat.insert(flat.end(), row.begin(), row.end());
  return from_vector<int64_t>(flat, {rows, static_cast<int64_t>(seq[0].size())}).to(prompt.device());
}

}  // namespace kiln::nn
