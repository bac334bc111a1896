// IDX reading through zlib (which reads gzip and plain files alike) and the Fashion-MNIST dataset.
#include "nn/data/mnist.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <typeinfo>

#include <fmt/ranges.h>

#include "core/flags.h"
#include "ops/ops.h"

namespace kiln::nn::data {

namespace {

// Owns a gzFile; reads exactly or reports how much was there.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb")) {
    KILN_CHECK(file_ != nullptr, "read_idx", "{}: cannot open ({})", path, std::strerror(errno));
    gzbuffer(file_, 1 << 18);
  }
  ~GzReader() { gzclose(file_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to `count` bytes; returns how many arrived (fewer only at end of file).
  int64_t read(void* out, int64_t count) {
    int64_t done = 0;
    while (done < count) {
      unsigned chunk = static_cast<unsigned>(std::min<int64_t>(count - done, 1 << 30));
      int got = gzread(file_, static_cast<char*>(out) + done, chunk);
      if (got < 0) {
        int code = 0;
        const char* message = gzerror(file_, &code);
        KILN_FAIL("read_idx", "{}: corrupt or truncated gzip data after {} bytes ({})", path_, done,
                  message ? message : "unknown zlib error");
      }
      if (got == 0) break;
      done += got;
    }
    return done;
  }

  // After the last read: a gzip stream that ended early (zlib's Z_BUF_ERROR, "unexpected end of
  // file") is not an error to gzread, which hands out what it could inflate; without this check a
  // file missing its CRC-32 and length trailer would be accepted unverified.
  void require_complete(int64_t data_bytes) {
    int code = Z_OK;
    const char* message = gzerror(file_, &code);
    KILN_CHECK(code == Z_OK, "read_idx", "{}: the gzip stream ends early after {} data bytes ({}): the file is "
               "truncated (e.g. its checksum trailer is missing); download or copy it again", path_, data_bytes,
               message ? message : "unknown zlib error");
  }

 private:
  std::string path_;
  gzFile file_;
};

uint32_t big_endian_u32(const uint8_t* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

bool is_file(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

std::string split_name(Split split) { return split == Split::Train ? "train" : "test"; }

// dir/stem.gz if it exists, else dir/stem if it exists, else "".
std::string find_file(const std::string& dir, const std::string& stem) {
  std::string base = (std::filesystem::path(dir) / stem).string();
  if (is_file(base + ".gz")) return base + ".gz";
  if (is_file(base)) return base;
  return "";
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  KILN_CHECK(is_file(path), "read_idx", "{}: no such file", path);
  GzReader in(path);
  uint8_t magic[4];
  int64_t got = in.read(magic, 4);
  KILN_CHECK(got == 4, "read_idx", "{}: truncated: {} bytes, too short for the 4-byte IDX magic number", path,
             got);
  KILN_CHECK(magic[0] == 0 && magic[1] == 0 && magic[3] >= 1, "read_idx",
             "{}: bad magic number 0x{:08x}: not an IDX file (expected 0x000008NN, e.g. 0x00000803 for images)",
             path, big_endian_u32(magic));
  KILN_CHECK(magic[2] == 0x08, "read_idx",
             "{}: IDX type code 0x{:02x} is not supported (only 0x08, unsigned byte)", path, magic[2]);

  IdxArray array;
  int ndim = magic[3];
  std::vector<uint8_t> dim_bytes(4 * ndim);
  got = in.read(dim_bytes.data(), 4 * ndim);
  KILN_CHECK(got == 4 * ndim, "read_idx", "{}: truncated in the header: {} of {} dim bytes", path, got, 4 * ndim);
  int64_t total = 1;
  for (int d = 0; d < ndim; ++d) {
    array.dims.push_back(big_endian_u32(dim_bytes.data() + 4 * d));
    // Checked before multiplying: a dim near 2^32 times a large total would overflow int64.
    const int64_t dim = array.dims.back();
    KILN_CHECK(dim == 0 || total <= (int64_t{1} << 36) / dim, "read_idx", "{}: implausible dims {} (over 64 GiB of data)",
               path, shape_str(array.dims));
    total *= dim;
  }
  // Grown as the data arrives (doubling, from 1 MiB), never far past what the file holds: a
  // 30-byte file whose dims promise 6 GiB is an Error, not a 6 GiB allocation first.
  got = 0;
  while (got < total) {
    const int64_t want = std::min(total, std::max<int64_t>(2 * got, int64_t{1} << 20));
    array.data.resize(static_cast<size_t>(want));
    const int64_t arrived = in.read(array.data.data() + got, want - got);
    got += arrived;
    if (got < want) break;  // end of file
  }
  array.data.resize(static_cast<size_t>(got));
  KILN_CHECK(got == total, "read_idx", "{}: truncated: dims {} promise {} data bytes, the file holds {}", path,
             shape_str(array.dims), total, got);
  uint8_t extra;
  KILN_CHECK(in.read(&extra, 1) == 0, "read_idx",
             "{}: longer than its dims {} say ({} data bytes): trailing bytes after the data", path,
             shape_str(array.dims), total);
  in.require_complete(total);
  return array;
}

std::vector<std::string> fashion_mnist_files(Split split) {
  std::string prefix = split == Split::Train ? "train" : "t10k";
  return {prefix + "-images-idx3-ubyte", prefix + "-labels-idx1-ubyte"};
}

std::string default_fashion_mnist_dir() {
  if (const std::string& dir = flags().data_dir; !dir.empty()) {
    std::string nested = (std::filesystem::path(dir) / "fashion-mnist").string();
    std::error_code ec;
    return std::filesystem::is_directory(nested, ec) ? nested : dir;
  }
  return "/usr/share/datasets/fashion-mnist";
}

FashionMnist::FashionMnist(const std::string& dir, Split split, FashionMnistOptions options)
    : options_(options) {
  std::vector<std::string> stems = fashion_mnist_files(split), paths, missing;
  for (const std::string& stem : stems) {
    paths.push_back(find_file(dir, stem));
    if (paths.back().empty()) missing.push_back((std::filesystem::path(dir) / stem).string() + "[.gz]");
  }
  if (!missing.empty()) {
    KILN_FAIL("FashionMnist",
              "Fashion-MNIST {} files not found in '{}': looked for {}. Install them with "
              "`apt-get install dataset-fashion-mnist` (files go to /usr/share/datasets/fashion-mnist), "
              "or pass --data DIR (or set KILN_DATA_DIR) pointing at a folder with {} and {} (plain or .gz)",
              split_name(split), dir, fmt::join(missing, " and "), stems[0], stems[1]);
  }

  IdxArray images = read_idx(paths[0]);
  IdxArray labels = read_idx(paths[1]);
  KILN_CHECK(images.dims.size() == 3 && images.dims[1] == kRows && images.dims[2] == kCols, "FashionMnist",
             "{}: image dims {}, expected (N, 28, 28)", paths[0], shape_str(images.dims));
  KILN_CHECK(labels.dims.size() == 1, "FashionMnist", "{}: label dims {}, expected (N)", paths[1],
             shape_str(labels.dims));
  KILN_CHECK(images.dims[0] == labels.dims[0], "FashionMnist", "{} holds {} images but {} holds {} labels",
             paths[0], images.dims[0], paths[1], labels.dims[0]);

  float scale = 1.0f / 255.0f, shift = 0.0f;
  if (options_.normalize_) {
    KILN_CHECK(options_.stddev_ > 0, "FashionMnist", "normalize needs stddev > 0, got {}", options_.stddev_);
    scale /= options_.stddev_;
    shift = -options_.mean_ / options_.stddev_;
  }
  for (int b = 0; b < 256; ++b) value_[b] = static_cast<float>(b) * scale + shift;
  scale_ = scale;
  shift_ = shift;
  pixels_ = std::move(images.data);
  labels_.resize(labels.data.size());
  for (size_t i = 0; i < labels.data.size(); ++i) {
    KILN_CHECK(labels.data[i] < kClasses, "FashionMnist", "{}: label {} at index {} is outside 0..9", paths[1],
               labels.data[i], i);
    labels_[i] = labels.data[i];
  }
}

Shape FashionMnist::input_shape() const {
  return options_.image_shape_ ? Shape{1, kRows, kCols} : Shape{kRows * kCols};
}

bool FashionMnist::reads_from_memory() const { return typeid(*this) == typeid(FashionMnist); }

void FashionMnist::read_bytes(int64_t index, uint8_t* input, int64_t* target) const {
  std::memcpy(input, pixels_.data() + index * kRows * kCols, kRows * kCols);
  *target = labels_[index];
}

Tensor FashionMnist::to_float(const Tensor& bytes) const {
  KILN_CHECK(bytes.dtype() == DType::UInt8, "FashionMnist::to_float", "takes the uint8 pixels of a batch, got {}",
             bytes.str());
  // The same float operations as the table: the float32 product, rounded, plus the shift.
  return cast(bytes, DType::Float32) * static_cast<double>(scale_) + static_cast<double>(shift_);
}

void FashionMnist::read(int64_t index, float* input, int64_t* target) const {
  const uint8_t* pixel = pixels_.data() + index * kRows * kCols;
  for (int64_t i = 0; i < kRows * kCols; ++i) input[i] = value_[pixel[i]];
  *target = labels_[index];
}

const char* FashionMnist::class_name(int64_t label) {
  static const char* const names[kClasses] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                              "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  KILN_CHECK(label >= 0 && label < kClasses, "FashionMnist::class_name", "label {} is outside 0..9", label);
  return names[label];
}

}  // namespace kiln::nn::data
