// Datasets and the DataLoader that turns one into shuffled batches of realized tensors.
//
//   kiln::nn::data::FashionMnist train(kiln::nn::data::default_fashion_mnist_dir(), kiln::nn::data::Split::Train);
//   kiln::nn::data::DataLoader loader(train, kiln::nn::data::DataLoaderOptions(128).seed(42));
//   for (int epoch = 0; epoch < 3; ++epoch)
//     for (kiln::nn::data::Batch& b : loader) {   // each range-for is one epoch, reshuffled from (seed, epoch)
//       Tensor loss = kiln::cross_entropy(model.forward(b.input), b.target);  // input (B, 784) f32, target (B) i64
//       ...
//     }
//
// A Dataset hands out examples as host data (float features, int64 targets). One that reads
// files or decodes has a background thread gather the next batch while the current one trains;
// the loader turns the gathered batch into kiln tensors on the consuming thread (one copy each,
// with kiln::from_vector). One held in memory (reads_from_memory) is gathered when its batch is
// asked for, by every thread, straight into the batch's tensor.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace kiln::nn::data {

// One example as realized tensors: input (input_shape()) float32, target (target_shape()) int64.
struct Example {
  Tensor input;
  Tensor target;
};

// Random access to N examples. read() is called from the loader's background thread, or (where
// reads_from_memory) from several threads at once, so it must be safe to call concurrently with
// other const member functions and itself (plain reads of held data are).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Shape input_shape() const = 0;             // one example's input, e.g. {784} or {1, 28, 28}
  virtual Shape target_shape() const { return {}; }  // one example's target; {} = a single label
  // Copies example i: numel(input_shape()) floats to `input`, numel(target_shape()) int64 to `target`.
  virtual void read(int64_t index, float* input, int64_t* target) const = 0;
  // The element type of the batches a DataLoader gathers: float32 (read), or uint8 for a dataset
  // that hands out its bytes (read_bytes) and turns them into floats inside the training step.
  virtual DType input_dtype() const { return DType::Float32; }
  // As read, the example's input as numel(input_shape()) bytes; for input_dtype() UInt8 only.
  virtual void read_bytes(int64_t index, uint8_t* input, int64_t* target) const;
  // True where read and read_bytes only copy out of memory the dataset holds (no files, no
  // decoding), and may run on several threads at once. The DataLoader then gathers each batch
  // when it is asked for, on all threads, into the batch's own tensor: on a machine of few cores,
  // waking a worker thread for such a gather costs more than the gather (the thread switch takes
  // a core from the step's kernels), and its batch would still be copied once more.
  virtual bool reads_from_memory() const { return false; }

  Example get(int64_t index) const;  // example `index` as realized tensors; checks the range
};

// A dataset held in memory: inputs (N, ...) float32 and targets (N, ...) int64.
class TensorDataset : public Dataset {
 public:
  // inputs: N * numel(input_shape) floats, example-major; targets: N * numel(target_shape) values.
  TensorDataset(std::vector<float> inputs, Shape input_shape, std::vector<int64_t> targets,
                Shape target_shape = {});
  // From tensors with a shared leading dim N (realizes them; inputs are cast to float32,
  // targets to int64).
  TensorDataset(const Tensor& inputs, const Tensor& targets);

  int64_t size() const override { return size_; }
  Shape input_shape() const override { return input_shape_; }
  Shape target_shape() const override { return target_shape_; }
  void read(int64_t index, float* input, int64_t* target) const override;
  // True for a TensorDataset itself; a subclass (whose read() may augment, draw numbers, ...)
  // keeps the worker thread unless it says otherwise.
  bool reads_from_memory() const override;

 private:
  std::vector<float> inputs_;    // (N, input_shape...)
  std::vector<int64_t> targets_;  // (N, target_shape...)
  Shape input_shape_, target_shape_;
  int64_t size_ = 0;
};

// A batch: input (B, input_shape...) float32 (or uint8: Dataset::input_dtype), target
// (B, target_shape...) int64, both realized.
// B is the batch size except for a last partial batch (when drop_last is off).
struct Batch {
  Tensor input;
  Tensor target;
  int64_t index = 0;             // position of this batch within the epoch
  std::vector<int64_t> indices;  // (B) dataset indices of the examples, in batch order
};

// Which share of each epoch a loader visits when `world` processes train together (data
// parallel): the same seeded permutation on every rank, padded by its first elements to a
// multiple of the world, then every world-th position from `rank` on (PyTorch's
// DistributedSampler). Every rank gets ceil(n / world) examples; pass
// distributed::rank() and world_size().
struct DistributedSampler {
  int64_t rank = 0, world = 1;
};

// Chainable options: DataLoaderOptions(128).seed(1).drop_last(true).
struct DataLoaderOptions {
  explicit DataLoaderOptions(int64_t batch_size = 64) : batch_size_(batch_size) {}
  DataLoaderOptions& batch_size(int64_t v) { batch_size_ = v; return *this; }
  DataLoaderOptions& shuffle(bool v) { shuffle_ = v; return *this; }
  DataLoaderOptions& seed(uint64_t v) { seed_ = v; return *this; }
  DataLoaderOptions& drop_last(bool v) { drop_last_ = v; return *this; }
  // Gather batches on a background thread, up to `prefetch` ahead; 0 = gather on the caller.
  // A dataset held in memory (Dataset::reads_from_memory) is always gathered on the caller.
  DataLoaderOptions& prefetch(int v) { prefetch_ = v; return *this; }
  // Visit only this rank's share of each epoch (see DistributedSampler).
  DataLoaderOptions& sampler(DistributedSampler v) { sampler_ = v; return *this; }

  int64_t batch_size_;
  bool shuffle_ = true;
  uint64_t seed_ = 0;
  bool drop_last_ = false;
  int prefetch_ = 2;
  DistributedSampler sampler_;
};

// The permutation of 0..n-1 that epoch `epoch` visits with `seed` (identity when not shuffling).
// Fixed algorithm (splitmix64 + Fisher-Yates), so the order is the same with every standard library.
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch);
// This rank's share of an epoch's order (see DistributedSampler); `order` itself for a world of 1.
std::vector<int64_t> shard_order(const std::vector<int64_t>& order, const DistributedSampler& sampler);

class EpochRun;  // one epoch in flight: the order, the worker thread and its queue (dataset.cc)

// Iterates a dataset in batches, one epoch per range-for. Keeps a reference to the dataset, which
// must outlive the loader. Starting a new epoch (or destroying the loader) stops the previous
// one's worker cleanly, so breaking out of the loop early is fine. An exception thrown while
// gathering a batch is re-thrown, as kiln::Error, by the ++ that would have delivered it.
class DataLoader {
 public:
  DataLoader(const Dataset& dataset, DataLoaderOptions options = DataLoaderOptions());
  DataLoader(const Dataset&& dataset, DataLoaderOptions options = DataLoaderOptions()) = delete;
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  int64_t size() const;                        // batches per epoch
  int64_t epoch() const { return epoch_; }     // the epoch the next begin() starts
  void set_epoch(int64_t epoch);               // e.g. to resume a run at a given epoch
  const DataLoaderOptions& options() const { return options_; }

  struct End {};
  class Iterator {
   public:
    Batch& operator*() const { return *batch_; }
    Batch* operator->() const { return batch_.get(); }
    Iterator& operator++();
    bool operator==(End) const { return batch_ == nullptr; }
    bool operator!=(End) const { return batch_ != nullptr; }

   private:
    friend class DataLoader;
    explicit Iterator(EpochRun* run);
    EpochRun* run_;
    std::shared_ptr<Batch> batch_;  // null at the end of the epoch
  };

  Iterator begin();  // starts the next epoch (stopping any unfinished one)
  End end() const { return {}; }

 private:
  const Dataset& dataset_;
  DataLoaderOptions options_;
  int64_t epoch_ = 0;
  std::unique_ptr<EpochRun> run_;
};

}  // namespace kiln::nn::data
