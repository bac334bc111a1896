// Attention and transformers: scaled_dot_product_attention, MultiheadAttention, a pre-LN
// TransformerBlock and a GPT (decoder-only language model) with tied embedding and head.
//
//   nn::GPT gpt(nn::GPTConfig().vocab(96).ctx(64).layers(4).heads(4).dim(128));
//   Tensor logits = gpt.forward(tokens);                     // (B, T) int64 -> (B, T, vocab)
//   Tensor loss = nn::cross_entropy(logits.reshape({-1, 96}), targets.reshape({-1}));
//   Tensor more = gpt.generate(prompt, 200, GenerateOptions().temperature(0.8).top_k(10));
//
// Attention runs as one fused kernel (kiln::fused_attention: no (T, T) matrix kept) where it
// applies — no mask but the causal one, no dropout on the weights — and otherwise as the
// composite matmul -> mask -> softmax -> matmul, which keeps the (T, T) weights for its backward.
#pragma once
#include <cstdint>

#include "core/options.h"
#include "core/tensor.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/module_list.h"
#include "nn/sequential.h"

namespace kiln::nn {

// softmax(q kᵀ / √d + mask) v over q (..., Tq, d), k (..., Tk, d), v (..., Tk, dv) -> (..., Tq, dv).
// `mask`: bool (true = may attend) or float (added to the scores), broadcast to (..., Tq, Tk).
// `causal`: query i attends to keys j <= i + (Tk - Tq) (the last query sees every key). Dropout
// on the attention weights with probability dropout_p (when dropout_p > 0).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask = {},
                                    double dropout_p = 0.0, bool causal = false);

class MultiheadAttentionOptions {
 public:
  MultiheadAttentionOptions(int64_t dim, int64_t heads) : dim_(dim), heads_(heads) {}
  KILN_OPTION(int64_t, dim, 0)
  KILN_OPTION(int64_t, heads, 1)
  KILN_OPTION(double, dropout, 0.0)   // on the attention weights, while training
  KILN_OPTION(bool, bias, true)
  KILN_OPTION(bool, causal, false)
  KILN_OPTION(bool, fused_qkv, true)  // one (dim -> 3 dim) projection instead of three
  KILN_OPTION(DType, dtype, DType::Float32)  // of every parameter
};

// Self-attention over x (B, T, dim) -> (B, T, dim), or attention of query (B, Tq, dim) over
// key/value (B, Tk, dim): `heads` heads of dim / heads each, then an output projection.
class MultiheadAttention : public Module {
 public:
  explicit MultiheadAttention(const MultiheadAttentionOptions& options);
  MultiheadAttention(int64_t dim, int64_t heads) : MultiheadAttention(MultiheadAttentionOptions(dim, heads)) {}
  Tensor forward(const Tensor& x) override;
  Tensor forward(const Tensor& query, const Tensor& key, const Tensor& value);
  const MultiheadAttentionOptions& options() const { return options_; }

  // qkv (dim -> 3 dim: query, key and value rows) with fused_qkv, else q_proj, k_proj and
  // v_proj; then out_proj. Only the ones in use are registered.
  Linear qkv{1, 1}, q_proj{1, 1}, k_proj{1, 1}, v_proj{1, 1}, out_proj{1, 1};

 private:
  Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v);
  MultiheadAttentionOptions options_;
};

class TransformerBlockOptions {
 public:
  TransformerBlockOptions(int64_t dim, int64_t heads) : dim_(dim), heads_(heads) {}
  KILN_OPTION(int64_t, dim, 0)
  KILN_OPTION(int64_t, heads, 1)
  KILN_OPTION(double, dropout, 0.0)  // attention weights and both residual branches
  KILN_OPTION(bool, causal, true)
  KILN_OPTION(int64_t, hidden, 0)    // the MLP's width; 0: 4 * dim
  KILN_OPTION(DType, dtype, DType::Float32)  // of every parameter
};

// Pre-LN: x + attn(ln1(x)), then + mlp(ln2(x)) with a GELU MLP of 4 * dim.
class TransformerBlock : public Module {
 public:
  explicit TransformerBlock(const TransformerBlockOptions& options);
  TransformerBlock(int64_t dim, int64_t heads) : TransformerBlock(TransformerBlockOptions(dim, heads)) {}
  Tensor forward(const Tensor& x) override;  // (B, T, dim)

  LayerNorm ln1{1}, ln2{1};
  MultiheadAttention attn{1, 1};
  Linear fc{1, 1}, proj{1, 1};

 private:
  double dropout_;
};

class GPTConfig {
 public:
  KILN_OPTION(int64_t, vocab, 256)
  KILN_OPTION(int64_t, ctx, 64)     // longest sequence (the positional table's size)
  KILN_OPTION(int64_t, layers, 4)
  KILN_OPTION(int64_t, heads, 4)
  KILN_OPTION(int64_t, dim, 128)
  KILN_OPTION(double, dropout, 0.0)
  KILN_OPTION(bool, tie_weights, true)  // the head is the token embedding's transpose
  KILN_OPTION(bool, checkpoint, false)   // recompute each block for the backward (nn::checkpoint)
  KILN_OPTION(DType, dtype, DType::Float32)  // of every parameter
};

class GenerateOptions {
 public:
  KILN_OPTION(double, temperature, 1.0)  // logits / temperature before sampling
  KILN_OPTION(int64_t, top_k, 0)         // sample among the k likeliest tokens (0: all)
};

// Decoder-only transformer: token + learned positional embeddings, `layers` causal blocks, a
// final LayerNorm and a head onto the vocabulary. Weights start N(0, 0.02), the residual
// projections N(0, 0.02 / √(2 layers)) (GPT-2's scheme), biases 0.
class GPT : public Module {
 public:
  explicit GPT(const GPTConfig& config);
  Tensor forward(const Tensor& tokens) override;  // (B, T) integer, T <= ctx -> (B, T, vocab)
  // Appends `steps` tokens to `prompt` (B, T0), each sampled from the model's distribution over
  // the last ctx tokens (multinomial). Runs without gradients; returns (B, T0 + steps) int64.
  Tensor generate(const Tensor& prompt, int64_t steps, const GenerateOptions& options = {});
  const GPTConfig& config() const { return config_; }
  // The model as layers for distributed::Pipeline, aliasing this model's modules: the token and
  // positional embeddings, each block, then the final LayerNorm with the head (`layers` + 2).
  // Needs untied weights (GPTConfig().tie_weights(false)): a pipeline holds the embedding and the
  // head on different stages.
  Sequential as_sequential() const;

  Embedding tokens{1, 1}, positions{1, 1};
  ModuleList blocks;
  LayerNorm ln_f{1};
  Linear head{1, 1};  // unused (no parameters registered) when the weights are tied

 private:
  GPTConfig config_;
};

}  // namespace kiln::nn
