// IDX files (the MNIST family's format) and the Fashion-MNIST dataset installed by Debian's
// `dataset-fashion-mnist` package.
//
//   using namespace kiln::nn::data;
//   FashionMnist train(default_fashion_mnist_dir(), Split::Train);               // 60000 x (784)
//   FashionMnist test(dir, Split::Test, FashionMnistOptions().image_shape().normalize());  // (1, 28, 28)
//   DataLoader loader(train, DataLoaderOptions(128).seed(1));
//
// Files are read gzip-compressed (*.gz) or plain; a missing, truncated or malformed file throws
// kiln::Error naming the file and the problem. There is no fallback to random data.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "nn/data/dataset.h"

namespace kiln::nn::data {

// An IDX array of unsigned bytes (type code 0x08): magic 0x0000 08 <ndim>, ndim big-endian uint32
// dims, then the data row-major.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;  // (dims...)
};

// Reads an IDX file, gzip-compressed or plain (zlib reads both). Checks the magic number, the
// type code (only unsigned byte), the dims, and that the file holds exactly the data they promise.
IdxArray read_idx(const std::string& path);

enum class Split { Train, Test };

struct FashionMnistOptions {
  // Images as (N, 1, 28, 28) instead of (N, 784).
  FashionMnistOptions& image_shape(bool v = true) { image_shape_ = v; return *this; }
  // (x - mean) / std after scaling to [0, 1]; defaults are the training set's statistics.
  FashionMnistOptions& normalize(bool v = true) { normalize_ = v; return *this; }
  FashionMnistOptions& mean(float v) { mean_ = v; return *this; }
  FashionMnistOptions& stddev(float v) { stddev_ = v; return *this; }
  // Batches hold the pixels as uint8 (a quarter of the bytes to gather and keep); to_float()
  // scales (and normalizes) them inside the step, where the cast fuses into the first kernel.
  FashionMnistOptions& bytes(bool v = true) { bytes_ = v; return *this; }

  bool image_shape_ = false;
  bool normalize_ = false;
  bool bytes_ = false;
  float mean_ = 0.2860f;
  float stddev_ = 0.3530f;
};

// Fashion-MNIST: 28x28 grey images as float32 in [0, 1] (or normalized), labels int64 in 0..9.
// The images stay in memory as the bytes the files hold (47 MB for the training split, not 188 MB
// of floats); read() turns an example's bytes into floats (a 256-entry table) as the loader
// gathers a batch.
class FashionMnist : public Dataset {
 public:
  static constexpr int64_t kRows = 28, kCols = 28, kClasses = 10;

  // `dir` holds {train,t10k}-{images-idx3,labels-idx1}-ubyte, each plain or with .gz.
  FashionMnist(const std::string& dir, Split split, FashionMnistOptions options = {});

  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  Shape input_shape() const override;
  void read(int64_t index, float* input, int64_t* target) const override;
  DType input_dtype() const override { return options_.bytes_ ? DType::UInt8 : DType::Float32; }
  void read_bytes(int64_t index, uint8_t* input, int64_t* target) const override;
  bool reads_from_memory() const override;  // as TensorDataset's: true for this class itself
  // A batch of pixel bytes (any shape) as the floats read() gives, bit for bit: x * scale + shift
  // with read()'s float scale and shift, recorded lazily (it fuses into the step's first kernel).
  Tensor to_float(const Tensor& bytes) const;

  const std::vector<uint8_t>& pixels() const { return pixels_; }  // (N, 784), as in the files
  float value(uint8_t pixel) const { return value_[pixel]; }       // what read() gives for a pixel
  const std::vector<int64_t>& labels() const { return labels_; }   // (N)
  static const char* class_name(int64_t label);                   // "T-shirt/top", ...

 private:
  FashionMnistOptions options_;
  std::vector<uint8_t> pixels_;
  float value_[256] = {};  // pixel byte -> its scaled (and normalized) float
  float scale_ = 1, shift_ = 0;  // value_[b] = b * scale_ + shift_
  std::vector<int64_t> labels_;
};

// Where the Fashion-MNIST files are expected: $KILN_DATA_DIR if set (or its fashion-mnist/
// subfolder when that exists), else /usr/share/datasets/fashion-mnist (Debian's package).
std::string default_fashion_mnist_dir();

// The image and label file stems of a split ("train-images-idx3-ubyte", ...), without .gz.
std::vector<std::string> fashion_mnist_files(Split split);

}  // namespace kiln::nn::data
