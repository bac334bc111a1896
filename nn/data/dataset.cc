// Dataset, TensorDataset and the DataLoader's epoch: an order, a worker thread that gathers host
// batches into a bounded queue, and the consumer side that turns them into tensors (or, for a
// dataset in memory, reads each batch straight into its tensors).
#include "nn/data/dataset.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <omp.h>
#include <thread>
#include <typeinfo>

#include "core/flags.h"
#include "ops/ops.h"

namespace kiln::nn::data {

namespace {

Shape prepend(int64_t n, const Shape& shape) {
  Shape out{n};
  out.insert(out.end(), shape.begin(), shape.end());
  return out;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

// ---- Dataset, TensorDataset ----

Example Dataset::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), "Dataset::get", "index {} out of range for {} examples", index,
             size());
  std::vector<float> input(numel(input_shape()));
  std::vector<int64_t> target(numel(target_shape()));
  read(index, input.data(), target.data());
  return {from_vector(input, input_shape()), from_vector(target, target_shape())};
}

void Dataset::read_bytes(int64_t, uint8_t*, int64_t*) const {
  KILN_FAIL("Dataset", "read_bytes is for datasets whose input_dtype() is uint8; this one hands out {}",
            dtype_name(input_dtype()));
}

TensorDataset::TensorDataset(std::vector<float> inputs, Shape input_shape, std::vector<int64_t> targets,
                             Shape target_shape)
    : inputs_(std::move(inputs)),
      targets_(std::move(targets)),
      input_shape_(std::move(input_shape)),
      target_shape_(std::move(target_shape)) {
  int64_t per_input = numel(input_shape_), per_target = numel(target_shape_);
  KILN_CHECK(per_input > 0 && static_cast<int64_t>(inputs_.size()) % per_input == 0, "TensorDataset",
             "{} input values are not a whole number of examples of shape {}", inputs_.size(),
             shape_str(input_shape_));
  size_ = static_cast<int64_t>(inputs_.size()) / per_input;
  KILN_CHECK(static_cast<int64_t>(targets_.size()) == size_ * per_target, "TensorDataset",
             "{} examples of shape {} need {} target values of shape {}, got {}", size_,
             shape_str(input_shape_), size_ * per_target, shape_str(target_shape_), targets_.size());
}

TensorDataset::TensorDataset(const Tensor& inputs, const Tensor& targets) {
  KILN_CHECK(inputs.dim() >= 1 && targets.dim() >= 1 && inputs.size(0) == targets.size(0), "TensorDataset",
             "inputs {} and targets {} need the same leading (example) dim", shape_str(inputs.shape()),
             shape_str(targets.shape()));
  size_ = inputs.size(0);
  input_shape_.assign(inputs.shape().begin() + 1, inputs.shape().end());
  target_shape_.assign(targets.shape().begin() + 1, targets.shape().end());
  inputs_ = inputs.cast(DType::Float32).to_vector<float>();
  targets_ = targets.cast(DType::Int64).to_vector<int64_t>();
}

bool TensorDataset::reads_from_memory() const { return typeid(*this) == typeid(TensorDataset); }

void TensorDataset::read(int64_t index, float* input, int64_t* target) const {
  int64_t per_input = numel(input_shape_), per_target = numel(target_shape_);
  std::memcpy(input, inputs_.data() + index * per_input, per_input * sizeof(float));
  std::memcpy(target, targets_.data() + index * per_target, per_target * sizeof(int64_t));
}

// ---- epoch order ----

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  uint64_t state = seed;
  splitmix64(state);
  state ^= 0xD1B54A32D192ED03ull * static_cast<uint64_t>(epoch + 1);
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates; modulo bias is below 2^-40 for any real n
    int64_t j = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

// ---- one epoch in flight ----

namespace {
// A batch gathered on the host, before it becomes tensors.
struct HostBatch {
  int64_t index = 0;
  std::vector<int64_t> indices;  // (B)
  std::vector<float> input;      // (B, input_shape...), for float32 inputs
  std::vector<uint8_t> bytes;    // (B, input_shape...), for uint8 inputs
  std::vector<int64_t> target;   // (B, target_shape...)
};
}  // namespace

class EpochRun {
 public:
  EpochRun(const Dataset& dataset, const DataLoaderOptions& options, int64_t epoch, int64_t num_batches)
      : dataset_(dataset),
        options_(options),
        num_batches_(num_batches),
        in_place_(dataset.reads_from_memory()) {
    int64_t n = dataset.size();
    if (options.shuffle_) {
      order_ = epoch_order(n, options.seed_, epoch);
    } else {
      order_.resize(n);
      for (int64_t i = 0; i < n; ++i) order_[i] = i;
    }
    order_ = shard_order(order_, options.sampler_);
    if (options_.prefetch_ > 0 && num_batches_ > 0 && !in_place_)
      worker_ = std::thread([this] { work(); });
  }

  ~EpochRun() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  // The next batch as tensors, or null at the end of the epoch.
  std::shared_ptr<Batch> next() {
    if (delivered_ >= num_batches_) return nullptr;
    if (in_place_) {
      std::shared_ptr<Batch> batch = gather_in_place(delivered_);
      ++delivered_;  // after the batch: one that failed is read again by the next ++, as prefetch(0) does
      return batch;
    }
    HostBatch host;
    if (!worker_.joinable()) {
      try {
        host = gather(delivered_);
      } catch (...) {
        rethrow_as_error(std::current_exception(), delivered_);
      }
    } else {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [this] { return !queue_.empty() || error_; });
      if (queue_.empty()) rethrow_as_error(error_, delivered_);
      host = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      changed_.notify_all();
    }
    ++delivered_;
    auto batch = std::make_shared<Batch>();
    int64_t b = static_cast<int64_t>(host.indices.size());
    batch->input = dataset_.input_dtype() == DType::UInt8 ? from_vector(host.bytes, prepend(b, dataset_.input_shape()))
                                                          : from_vector(host.input, prepend(b, dataset_.input_shape()));
    batch->target = from_vector(host.target, prepend(b, dataset_.target_shape()));
    batch->index = host.index;
    batch->indices = std::move(host.indices);
    return batch;
  }

 private:
  // Positions [start, stop) of this epoch's order for batch `batch_index`.
  std::pair<int64_t, int64_t> span(int64_t batch_index) const {
    const int64_t n = static_cast<int64_t>(order_.size()), bs = options_.batch_size_;
    const int64_t start = batch_index * bs;
    return {start, std::min(n, start + bs)};
  }

  // Reads the examples `indices` into `input` (bytes or floats: Dataset::input_dtype) and
  // `target`, example k at row k; with `threads`, split over OpenMP's threads. An exception
  // thrown by a read comes out of this call.
  void read_examples(const std::vector<int64_t>& indices, void* input, int64_t* target, bool threads) const {
    const int64_t count = static_cast<int64_t>(indices.size());
    const int64_t per_input = numel(dataset_.input_shape()), per_target = numel(dataset_.target_shape());
    const bool bytes = dataset_.input_dtype() == DType::UInt8;  // a gather of bytes: a quarter of the floats
    std::exception_ptr error;
    // KILN_NUM_THREADS bounds these threads as it does the kernels' (the executor sets OpenMP's
    // count only when a plan runs: the first batch comes before).
    const int team = flags().num_threads > 0 ? flags().num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(team) if (threads && team > 1)
    for (int64_t k = 0; k < count; ++k) {
      try {
        if (bytes)
          dataset_.read_bytes(indices[k], static_cast<uint8_t*>(input) + k * per_input, target + k * per_target);
        else
          dataset_.read(indices[k], static_cast<float*>(input) + k * per_input, target + k * per_target);
      } catch (...) {
#pragma omp critical(kiln_data_read_error)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }

  HostBatch gather(int64_t batch_index) const {
    const auto [start, stop] = span(batch_index);
    const int64_t per_input = numel(dataset_.input_shape()), per_target = numel(dataset_.target_shape());
    HostBatch host;
    host.index = batch_index;
    host.indices.assign(order_.begin() + start, order_.begin() + stop);
    host.target.resize((stop - start) * per_target);
    void* input = nullptr;
    if (dataset_.input_dtype() == DType::UInt8) {
      host.bytes.resize((stop - start) * per_input);
      input = host.bytes.data();
    } else {
      host.input.resize((stop - start) * per_input);
      input = host.input.data();
    }
    read_examples(host.indices, input, host.target.data(), false);
    return host;
  }

  // A batch of a dataset held in memory, read into its input tensor's own storage by every
  // thread (one, below a few pages): on the CPU, each thread's rows then sit in its cache for the
  // first kernel that reads them (with KILN_USE_CUDA the tensor is then copied to cuda:0).
  std::shared_ptr<Batch> gather_in_place(int64_t batch_index) const {
    const auto [start, stop] = span(batch_index);
    auto batch = std::make_shared<Batch>();
    batch->index = batch_index;
    batch->indices.assign(order_.begin() + start, order_.begin() + stop);
    const int64_t b = stop - start;
    std::vector<int64_t> target(static_cast<size_t>(b * numel(dataset_.target_shape())));
    const Shape shape = prepend(b, dataset_.input_shape());
    // Below a few pages the threads' start costs more than their share of the copy.
    const bool threads = numel(shape) * static_cast<int64_t>(dtype_size(dataset_.input_dtype())) >= (int64_t{1} << 16);
    try {
      batch->input = written_on_host(dataset_.input_dtype(), shape, [&](void* input) {
        read_examples(batch->indices, input, target.data(), threads);
      });
    } catch (...) {
      rethrow_as_error(std::current_exception(), batch_index);
    }
    batch->target = from_vector(target, prepend(b, dataset_.target_shape()));
    return batch;
  }

  void work() {
    for (int64_t b = 0; b < num_batches_; ++b) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [this] { return stop_ || static_cast<int>(queue_.size()) < options_.prefetch_; });
        if (stop_) return;
      }
      HostBatch host;
      try {
        host = gather(b);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
        changed_.notify_all();
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(host));
      }
      changed_.notify_all();
    }
  }

  [[noreturn]] static void rethrow_as_error(std::exception_ptr error, int64_t batch_index) {
    try {
      std::rethrow_exception(error);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      KILN_FAIL("DataLoader", "gathering batch {} failed: {}", batch_index, e.what());
    } catch (...) {
      KILN_FAIL("DataLoader", "gathering batch {} failed with a non-standard exception", batch_index);
    }
  }

  const Dataset& dataset_;
  DataLoaderOptions options_;
  int64_t num_batches_;
  const bool in_place_;         // Dataset::reads_from_memory: batches read on the caller, into their tensors
  std::vector<int64_t> order_;  // (N) dataset index at each position of this epoch
  int64_t delivered_ = 0;       // batches handed to the consumer (consumer thread only)

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<HostBatch> queue_;  // gathered, not yet delivered; at most prefetch_ long
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;  // last member: started after everything it reads is constructed
};

// ---- DataLoader ----

DataLoader::DataLoader(const Dataset& dataset, DataLoaderOptions options)
    : dataset_(dataset), options_(options) {
  KILN_CHECK(options_.batch_size_ > 0, "DataLoader", "batch size must be positive, got {}",
             options_.batch_size_);
  KILN_CHECK(options_.prefetch_ >= 0, "DataLoader", "prefetch must be >= 0, got {}", options_.prefetch_);
  const DistributedSampler& s = options_.sampler_;
  KILN_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world, "DataLoader",
             "DistributedSampler needs 0 <= rank < world, got rank {} of world {}", s.rank, s.world);
}

DataLoader::~DataLoader() = default;

std::vector<int64_t> shard_order(const std::vector<int64_t>& order, const DistributedSampler& sampler) {
  if (sampler.world == 1 || order.empty()) return order;
  const int64_t n = static_cast<int64_t>(order.size()), per = (n + sampler.world - 1) / sampler.world;
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per));
  for (int64_t k = 0; k < per; ++k) mine.push_back(order[static_cast<size_t>((sampler.rank + k * sampler.world) % n)]);
  return mine;
}

int64_t DataLoader::size() const {
  const DistributedSampler& s = options_.sampler_;
  int64_t n = dataset_.size() == 0 ? 0 : (dataset_.size() + s.world - 1) / s.world, bs = options_.batch_size_;
  return options_.drop_last_ ? n / bs : (n + bs - 1) / bs;
}

void DataLoader::set_epoch(int64_t epoch) {
  KILN_CHECK(epoch >= 0, "DataLoader::set_epoch", "epoch must be >= 0, got {}", epoch);
  run_.reset();
  epoch_ = epoch;
}

DataLoader::Iterator DataLoader::begin() {
  run_.reset();  // stops and joins an unfinished epoch first
  run_ = std::make_unique<EpochRun>(dataset_, options_, epoch_++, size());
  return Iterator(run_.get());
}

DataLoader::Iterator::Iterator(EpochRun* run) : run_(run), batch_(run->next()) {}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  batch_ = run_->next();
  return *this;
}

}  // namespace kiln::nn::data
