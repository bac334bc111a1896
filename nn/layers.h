// The standard layers. Each is an nn::Module (a value-like handle: copies alias the same
// parameters) overriding `Tensor forward(const Tensor&)`. Options are fixed at construction
// (read them with options(), p(), ...): a copy can never disagree with the original about them.
//
//   nn::Linear fc(784, 512);                                  // weight (512, 784), bias (512)
//   nn::Linear head(nn::LinearOptions(512, 10).bias(false));
//   nn::BatchNorm1d bn(nn::BatchNorm1dOptions(512).momentum(0.1));       // BatchNorm2d for (N, C, H, W)
//   Tensor y = head.forward(nn::ReLU().forward(bn.forward(fc.forward(x))));
//
// Parameters are public Tensor members (fc.weight, fc.bias) that share their variable with the
// registered entry, so assigning one (an optimizer step, nn::load) updates both.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "nn/module.h"
#include "core/options.h"

namespace kiln::nn {

class LinearOptions {
 public:
  LinearOptions(int64_t in_features, int64_t out_features) : in_features_(in_features), out_features_(out_features) {}
  KILN_OPTION(int64_t, in_features, 0)
  KILN_OPTION(int64_t, out_features, 0)
  KILN_OPTION(bool, bias, true)
  KILN_OPTION(DType, dtype, DType::Float32)
};

// y = x @ weight^T + bias. x (..., in) -> (..., out). weight (out, in) as in PyTorch, so
// checkpoints open there unchanged; initialized like PyTorch (kaiming uniform, a = sqrt(5);
// bias uniform in +-1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features) : Linear(LinearOptions(in_features, out_features)) {}
  explicit Linear(const LinearOptions& options);
  Tensor forward(const Tensor& x) override;
  const LinearOptions& options() const { return options_; }
  Tensor weight;  // (out, in)
  Tensor bias;    // (out), undefined without bias

 private:
  LinearOptions options_;
  // KILN_QUANTIZE: the int8 weight, quantized from the weight's value `of` (a new value after an
  // optimizer step is another node, so the cache misses). Shared by copies of the layer.
  struct QuantizedCache {
    std::weak_ptr<Node> of;
    int bits = 0;
    Tensor values, scales;
  };
  std::shared_ptr<QuantizedCache> quantized_ = std::make_shared<QuantizedCache>();
  // The int8 weight (a buffer of nn::quantize_dynamic, or the cache above) laid out for this
  // CPU's int8 matmul, made once per value it takes; not a buffer: it is not saved.
  struct PackedCache {
    std::weak_ptr<Node> of;
    Tensor packed;
  };
  std::shared_ptr<PackedCache> packed_ = std::make_shared<PackedCache>();
  Tensor packed_int8(const Tensor& values);
};

// Zeroes each element with probability p and scales the rest by 1/(1-p) while training;
// the identity in eval mode.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  double p() const { return p_; }

 private:
  double p_;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override;
};

class GELU : public Module {
 public:
  explicit GELU(bool tanh_approximation = false);
  Tensor forward(const Tensor& x) override;
  bool tanh_approximation() const { return tanh_approximation_; }

 private:
  bool tanh_approximation_;
};

class SiLU : public Module {
 public:
  SiLU() : Module("SiLU") {}
  Tensor forward(const Tensor& x) override;
};

class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& x) override;
};

class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override;
};

// Flattens dims start..end into one (default: everything after the batch dim).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1);
  Tensor forward(const Tensor& x) override;
  int64_t start_dim() const { return start_dim_; }
  int64_t end_dim() const { return end_dim_; }

 private:
  int64_t start_dim_, end_dim_;
};

class LayerNormOptions {
 public:
  LayerNormOptions(Shape normalized_shape) : normalized_shape_(std::move(normalized_shape)) {}
  KILN_OPTION(Shape, normalized_shape, {})
  KILN_OPTION(double, eps, 1e-5)
  KILN_OPTION(bool, elementwise_affine, true)
  KILN_OPTION(DType, dtype, DType::Float32)  // of weight and bias
};

// Normalizes over the trailing `normalized_shape` dims; weight (ones) and bias (zeros) of that shape.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(const LayerNormOptions& options);
  LayerNorm(int64_t features) : LayerNorm(LayerNormOptions({features})) {}
  Tensor forward(const Tensor& x) override;
  const LayerNormOptions& options() const { return options_; }
  Tensor weight, bias;

 private:
  LayerNormOptions options_;
};

class EmbeddingOptions {
 public:
  EmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  KILN_OPTION(int64_t, num_embeddings, 0)
  KILN_OPTION(int64_t, embedding_dim, 0)
  KILN_OPTION(DType, dtype, DType::Float32)  // of the table
};

// A table of num_embeddings vectors of size embedding_dim, initialized N(0, 1).
// indices (...) integer -> (..., embedding_dim) (kiln::embedding).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim) : Embedding(EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit Embedding(const EmbeddingOptions& options);
  Tensor forward(const Tensor& indices) override;
  const EmbeddingOptions& options() const { return options_; }
  Tensor weight;  // (num_embeddings, embedding_dim)

 private:
  EmbeddingOptions options_;
};

// Options of BatchNorm1d and BatchNorm2d (one class, as PyTorch's BatchNormOptions).
class BatchNormOptions {
 public:
  BatchNormOptions(int64_t features) : features_(features) {}
  KILN_OPTION(int64_t, features, 0)
  KILN_OPTION(double, eps, 1e-5)
  KILN_OPTION(double, momentum, 0.1)  // running = (1 - momentum) * running + momentum * batch
  KILN_OPTION(bool, affine, true)
  KILN_OPTION(bool, track_running_stats, true)
  KILN_OPTION(DType, dtype, DType::Float32)  // of weight, bias and the running statistics
};
using BatchNorm1dOptions = BatchNormOptions;
using BatchNorm2dOptions = BatchNormOptions;

// What BatchNorm1d and BatchNorm2d share: parameters, running statistics and the
// normalization over every axis but the channel axis 1 (kiln::batch_norm). Training: normalizes
// with the batch mean and (biased) variance and updates running_mean / running_var (unbiased
// variance) lazily through assign. Eval: uses the running statistics. Include buffers() in whatever you sync
// after a step, so the update chain is realized each step.
class BatchNormBase : public Module {
 public:
  const BatchNormOptions& options() const { return options_; }
  Tensor weight, bias;                   // (C), ones / zeros
  Tensor running_mean, running_var;      // (C), zeros / ones
  Tensor num_batches_tracked;            // int64 scalar

 protected:
  BatchNormBase(const char* name, const BatchNormOptions& options);
  // x (N, C, ...) with the rank the caller checked; normalizes over axes 0, 2, 3, ...
  Tensor normalize(const Tensor& x) const;

 private:
  BatchNormOptions options_;
};

// x (N, C) or (N, C, L); statistics over N (and L).
class BatchNorm1d : public BatchNormBase {
 public:
  explicit BatchNorm1d(const BatchNormOptions& options) : BatchNormBase("BatchNorm1d", options) {}
  BatchNorm1d(int64_t features) : BatchNorm1d(BatchNormOptions(features)) {}
  Tensor forward(const Tensor& x) override;
};

// x (N, C, H, W); statistics over N, H and W, one pair per channel.
//   nn::BatchNorm2d bn(32);   // after a Conv2d with 32 output channels
class BatchNorm2d : public BatchNormBase {
 public:
  explicit BatchNorm2d(const BatchNormOptions& options) : BatchNormBase("BatchNorm2d", options) {}
  BatchNorm2d(int64_t features) : BatchNorm2d(BatchNormOptions(features)) {}
  Tensor forward(const Tensor& x) override;
};

}  // namespace kiln::nn
