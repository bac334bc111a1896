// Data loading: DataLoader order, coverage, early exit, background vs synchronous gathering, an
// in-memory dataset read into its batches on every thread, and worker errors; the IDX reader on
// small synthetic files (gzip and plain) and its rejections; Fashion-MNIST itself only when the
// Debian package's files are installed.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/flags.h"
#include "nn/data/dataset.h"
#include "nn/data/mnist.h"
#include "ops/ops.h"

namespace fs = std::filesystem;
using Catch::Contains;
using kiln::DType;
using kiln::Tensor;
using namespace kiln::nn::data;

namespace {

// N examples; example i has input {i, -i} and target i % 10, so a batch says which examples it holds.
TensorDataset numbered_dataset(int64_t n) {
  std::vector<float> inputs;
  std::vector<int64_t> targets;
  for (int64_t i = 0; i < n; ++i) {
    inputs.push_back(static_cast<float>(i));
    inputs.push_back(-static_cast<float>(i));
    targets.push_back(i % 10);
  }
  return TensorDataset(std::move(inputs), {2}, std::move(targets));
}

// The dataset indices of every batch of one epoch, in order.
std::vector<std::vector<int64_t>> one_epoch(DataLoader& loader) {
  std::vector<std::vector<int64_t>> batches;
  for (Batch& b : loader) batches.push_back(b.indices);
  return batches;
}

std::vector<int64_t> flat(const std::vector<std::vector<int64_t>>& batches) {
  std::vector<int64_t> out;
  for (const auto& b : batches) out.insert(out.end(), b.begin(), b.end());
  return out;
}

// A fresh empty folder under the temp dir, removed when the test ends.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    path = fs::temp_directory_path() / ("kiln-test-data-" + name + "-" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// IDX bytes: magic 0x000008<ndim>, big-endian dims, data.
std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(d >> shift));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void write_plain(const std::string& path, const std::vector<uint8_t>& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size());
  std::fclose(f);
}

void write_gzip(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

// A tiny Fashion-MNIST-shaped split: n images where image i is filled with byte 10*i, label i % 10.
void write_fake_mnist(const TempDir& dir, const std::string& prefix, int n, bool gzip) {
  std::vector<uint8_t> pixels, labels;
  for (int i = 0; i < n; ++i) {
    pixels.insert(pixels.end(), 28 * 28, static_cast<uint8_t>(10 * i));
    labels.push_back(static_cast<uint8_t>(i % 10));
  }
  auto write = gzip ? write_gzip : write_plain;
  std::string ext = gzip ? ".gz" : "";
  write(dir.file(prefix + "-images-idx3-ubyte" + ext), idx_bytes({uint32_t(n), 28, 28}, pixels));
  write(dir.file(prefix + "-labels-idx1-ubyte" + ext), idx_bytes({uint32_t(n)}, labels));
}

// Another dataset's examples, as if read from files: the loader gathers them on its worker thread.
class FromFiles : public Dataset {
 public:
  explicit FromFiles(const Dataset& inner) : inner_(inner) {}
  int64_t size() const override { return inner_.size(); }
  kiln::Shape input_shape() const override { return inner_.input_shape(); }
  kiln::Shape target_shape() const override { return inner_.target_shape(); }
  void read(int64_t index, float* input, int64_t* target) const override { inner_.read(index, input, target); }
  DType input_dtype() const override { return inner_.input_dtype(); }
  void read_bytes(int64_t index, uint8_t* input, int64_t* target) const override {
    inner_.read_bytes(index, input, target);
  }

 private:
  const Dataset& inner_;
};

// N images of 1024 bytes held in memory, each byte a function of (example, position), and targets
// (2): a batch of 96 is 96 KiB, which the loader reads on every thread.
class ByteImages : public Dataset {
 public:
  explicit ByteImages(int64_t unreadable = -1) : unreadable_(unreadable) {}
  static uint8_t pixel(int64_t index, int64_t at) { return static_cast<uint8_t>((index * 131 + at * 7) % 251); }
  int64_t size() const override { return 300; }
  kiln::Shape input_shape() const override { return {32, 32}; }
  kiln::Shape target_shape() const override { return {2}; }
  DType input_dtype() const override { return DType::UInt8; }
  void read(int64_t, float*, int64_t*) const override { FAIL("ByteImages hands out bytes"); }
  void read_bytes(int64_t index, uint8_t* input, int64_t* target) const override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      readers_.insert(std::this_thread::get_id());
    }
    if (index == unreadable_) throw std::runtime_error("bad sector");
    for (int64_t at = 0; at < 1024; ++at) input[at] = pixel(index, at);
    target[0] = index, target[1] = -index;
  }
  bool reads_from_memory() const override { return true; }
  // The threads that have read an example.
  std::set<std::thread::id> readers() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return readers_;
  }

 private:
  int64_t unreadable_;  // an example whose read throws (-1: none)
  mutable std::mutex mutex_;
  mutable std::set<std::thread::id> readers_;
};

// Reads example `index` and throws at one bad index: a dataset whose worker fails mid-epoch.
class FailingDataset : public Dataset {
 public:
  explicit FailingDataset(bool kiln_error, bool in_memory = false) : kiln_error_(kiln_error), in_memory_(in_memory) {}
  bool reads_from_memory() const override { return in_memory_; }
  int64_t size() const override { return 40; }
  kiln::Shape input_shape() const override { return {1}; }
  void read(int64_t index, float* input, int64_t* target) const override {
    if (index == 17) {
      if (kiln_error_) KILN_FAIL("FailingDataset", "example {} is unreadable", index);
      throw std::runtime_error("disk on fire");
    }
    *input = static_cast<float>(index);
    *target = index;
  }

 private:
  bool kiln_error_, in_memory_;
};

}  // namespace

// ---- DataLoader ----

TEST_CASE("DataLoader: the same seed gives the same order, a new epoch or seed a new one", "[data]") {
  TensorDataset dataset = numbered_dataset(103);
  DataLoader a(dataset, DataLoaderOptions(10).seed(7)), b(dataset, DataLoaderOptions(10).seed(7));
  DataLoader c(dataset, DataLoaderOptions(10).seed(8));
  auto a0 = one_epoch(a), a1 = one_epoch(a);
  auto b0 = one_epoch(b), b1 = one_epoch(b);
  auto c0 = one_epoch(c);
  CHECK(a0 == b0);
  CHECK(a1 == b1);
  CHECK(flat(a0) != flat(a1));  // each epoch reshuffles
  CHECK(flat(a0) != flat(c0));  // another seed, another order
  std::vector<int64_t> identity(103);
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(flat(a0) != identity);

  // set_epoch replays a given epoch: resuming a run sees the same order.
  DataLoader d(dataset, DataLoaderOptions(10).seed(7));
  d.set_epoch(1);
  CHECK(one_epoch(d) == a1);
  CHECK(d.epoch() == 2);

  // Without shuffle every epoch is 0..N-1.
  DataLoader plain(dataset, DataLoaderOptions(10).shuffle(false));
  CHECK(flat(one_epoch(plain)) == identity);
  CHECK(flat(one_epoch(plain)) == identity);
}

TEST_CASE("DataLoader: every example exactly once per epoch", "[data]") {
  for (int64_t n : {1, 100, 103}) {
    for (int64_t batch : {1, 7, 10, 200}) {
      for (bool drop_last : {false, true}) {
        CAPTURE(n, batch, drop_last);
        TensorDataset dataset = numbered_dataset(n);
        DataLoader loader(dataset, DataLoaderOptions(batch).seed(3).drop_last(drop_last));
        int64_t expected_batches = drop_last ? n / batch : (n + batch - 1) / batch;
        CHECK(loader.size() == expected_batches);
        for (int epoch = 0; epoch < 2; ++epoch) {
          int64_t count = 0;
          std::vector<int64_t> seen;
          for (Batch& b : loader) {
            CHECK(b.index == count++);
            int64_t rows = static_cast<int64_t>(b.indices.size());
            if (drop_last) CHECK(rows == batch);
            CHECK(b.input.shape() == kiln::Shape{rows, 2});
            CHECK(b.target.shape() == kiln::Shape{rows});
            CHECK(b.input.dtype() == kiln::DType::Float32);
            CHECK(b.target.dtype() == kiln::DType::Int64);
            CHECK(b.input.is_realized());
            // The rows are the examples the indices name.
            std::vector<float> input = b.input.to_vector<float>();
            std::vector<int64_t> target = b.target.to_vector<int64_t>();
            for (int64_t k = 0; k < rows; ++k) {
              CHECK(input[2 * k] == static_cast<float>(b.indices[k]));
              CHECK(input[2 * k + 1] == -static_cast<float>(b.indices[k]));
              CHECK(target[k] == b.indices[k] % 10);
            }
            seen.insert(seen.end(), b.indices.begin(), b.indices.end());
          }
          CHECK(count == expected_batches);
          std::set<int64_t> unique(seen.begin(), seen.end());
          CHECK(unique.size() == seen.size());  // nothing twice
          CHECK(static_cast<int64_t>(seen.size()) == (drop_last ? (n / batch) * batch : n));
          if (!seen.empty()) CHECK((*unique.begin() >= 0 && *unique.rbegin() < n));
        }
      }
    }
  }
}

TEST_CASE("DistributedSampler: the ranks' shards cover the epoch, padded to a multiple of the world", "[data][distributed]") {
  for (int64_t n : {1, 10, 103}) {
    for (int64_t world : {1, 2, 3, 4}) {
      CAPTURE(n, world);
      TensorDataset dataset = numbered_dataset(n);
      const int64_t per = (n + world - 1) / world;
      std::vector<int64_t> all;
      for (int64_t rank = 0; rank < world; ++rank) {
        DataLoader loader(dataset, DataLoaderOptions(4).seed(5).sampler({rank, world}));
        loader.set_epoch(2);
        CHECK(loader.size() == (per + 3) / 4);
        std::vector<int64_t> mine;
        for (Batch& b : loader) mine.insert(mine.end(), b.indices.begin(), b.indices.end());
        CHECK(static_cast<int64_t>(mine.size()) == per);
        all.insert(all.end(), mine.begin(), mine.end());
      }
      // Every example at least once; the padding repeats only the first world*per - n ones.
      std::set<int64_t> unique(all.begin(), all.end());
      CHECK(static_cast<int64_t>(unique.size()) == n);
      CHECK(static_cast<int64_t>(all.size()) == per * world);
      // The same permutation on every rank, dealt out round-robin.
      std::vector<int64_t> order = epoch_order(n, 5, 2);
      std::vector<int64_t> rank1 = shard_order(order, {world - 1, world});
      CHECK(rank1.front() == order[static_cast<size_t>(world - 1) % order.size()]);
    }
  }
  TensorDataset dataset = numbered_dataset(4);
  CHECK_THROWS_WITH(DataLoader(dataset, DataLoaderOptions(2).sampler({2, 2})), Catch::Contains("0 <= rank < world"));
}

TEST_CASE("DataLoader: the background thread delivers what a synchronous pass does", "[data]") {
  TensorDataset numbered = numbered_dataset(257);
  FromFiles dataset(numbered);
  for (int prefetch : {1, 2, 8}) {
    CAPTURE(prefetch);
    DataLoader background(dataset, DataLoaderOptions(16).seed(11).prefetch(prefetch));
    DataLoader synchronous(dataset, DataLoaderOptions(16).seed(11).prefetch(0));
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::vector<std::vector<float>> inputs_bg, inputs_sync;
      std::vector<std::vector<int64_t>> targets_bg, targets_sync;
      for (Batch& b : background) {
        inputs_bg.push_back(b.input.to_vector<float>());
        targets_bg.push_back(b.target.to_vector<int64_t>());
      }
      for (Batch& b : synchronous) {
        inputs_sync.push_back(b.input.to_vector<float>());
        targets_sync.push_back(b.target.to_vector<int64_t>());
      }
      CHECK(inputs_bg.size() == 17);
      CHECK(inputs_bg == inputs_sync);
      CHECK(targets_bg == targets_sync);
      // The dataset in memory, read into each batch on the caller: the same batches.
      DataLoader in_place(numbered, DataLoaderOptions(16).seed(11).prefetch(prefetch));
      in_place.set_epoch(epoch);
      size_t at = 0;
      for (Batch& b : in_place) {
        REQUIRE(at < inputs_bg.size());
        CHECK(b.input.to_vector<float>() == inputs_bg[at]);
        CHECK(b.target.to_vector<int64_t>() == targets_bg[at]);
        ++at;
      }
      CHECK(at == inputs_bg.size());
    }
  }
}

TEST_CASE("DataLoader: a dataset in memory is read into each batch by every thread", "[data]") {
  ByteImages images, images_on_disk;
  FromFiles files(images_on_disk);
  // 96 KiB batches, split over the threads; a last partial batch of 12.
  DataLoader in_place(images, DataLoaderOptions(96).seed(3)), worker(files, DataLoaderOptions(96).seed(3));
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<Batch> from_worker;
    for (Batch& b : worker) from_worker.push_back(b);
    size_t at = 0;
    for (Batch& b : in_place) {
      REQUIRE(at < from_worker.size());
      const Batch& w = from_worker[at++];
      CHECK(b.index == w.index);
      CHECK(b.indices == w.indices);
      REQUIRE(b.input.dtype() == DType::UInt8);
      REQUIRE(b.input.shape() == kiln::Shape{static_cast<int64_t>(b.indices.size()), 32, 32});
      const std::vector<uint8_t> bytes = b.input.to_vector<uint8_t>();
      CHECK(bytes == w.input.to_vector<uint8_t>());
      CHECK(b.target.to_vector<int64_t>() == w.target.to_vector<int64_t>());
      // Each row is its example's, whichever thread read it.
      bool rows_match = true;
      for (size_t k = 0; k < b.indices.size(); ++k)
        for (int64_t p = 0; p < 1024; ++p)
          rows_match = rows_match && bytes[k * 1024 + static_cast<size_t>(p)] == ByteImages::pixel(b.indices[k], p);
      CHECK(rows_match);
    }
    CHECK(at == from_worker.size());
    CHECK(at == 4);
  }
  // The loop's own thread reads the dataset in memory (with OpenMP's others); only the worker
  // reads the one "from files".
  CHECK(images.readers().count(std::this_thread::get_id()) == 1);
  CHECK(images_on_disk.readers().size() >= 1);
  CHECK(images_on_disk.readers().count(std::this_thread::get_id()) == 0);
  // A subclass may read otherwise (augment, draw numbers): it keeps the worker unless it says so.
  struct Augmented : TensorDataset {
    using TensorDataset::TensorDataset;
  };
  CHECK(numbered_dataset(3).reads_from_memory());
  CHECK_FALSE(Augmented(std::vector<float>{1, 2}, {1}, std::vector<int64_t>{0, 1}).reads_from_memory());
  // A read that throws on one of the threads: the batch's error, after the batches before it.
  ByteImages broken(150);
  DataLoader loader(broken, DataLoaderOptions(96).shuffle(false));
  int delivered = 0;
  auto run = [&] {
    for (Batch& b : loader) {
      (void)b;
      ++delivered;
    }
  };
  REQUIRE_THROWS_WITH(run(), Contains("gathering batch 1") && Contains("bad sector"));
  CHECK(delivered == 1);
}

TEST_CASE("DataLoader: breaking out of the loop early is clean", "[data]") {
  TensorDataset numbered = numbered_dataset(1000);
  FromFiles dataset(numbered);
  DataLoader loader(dataset, DataLoaderOptions(8).seed(5).prefetch(4));
  auto full = [&] {
    DataLoader fresh(dataset, DataLoaderOptions(8).seed(5));
    std::vector<std::vector<std::vector<int64_t>>> epochs;
    for (int e = 0; e < 3; ++e) epochs.push_back(one_epoch(fresh));
    return epochs;
  }();
  int taken = 0;
  for (Batch& b : loader) {
    CHECK(b.indices == full[0][taken]);
    if (++taken == 2) break;  // the worker is blocked on a full queue here
  }
  CHECK(loader.epoch() == 1);
  CHECK(one_epoch(loader) == full[1]);  // the next epoch starts cleanly where it should
  for (Batch& b : loader) {
    (void)b;
    break;  // and the loader is destroyed with an epoch in flight
  }
  // A loader that never iterates, or iterates an empty dataset, also shuts down cleanly.
  { DataLoader idle(dataset, DataLoaderOptions(8)); }
  TensorDataset empty(std::vector<float>{}, {2}, std::vector<int64_t>{});
  DataLoader none(empty, DataLoaderOptions(4));
  CHECK(none.size() == 0);
  CHECK(one_epoch(none).empty());
}

TEST_CASE("DataLoader: errors in the worker reach the loop as kiln::Error", "[data]") {
  for (int prefetch : {0, 2}) {
    for (bool kiln_error : {false, true}) {
      for (bool in_memory : {false, true}) {
        CAPTURE(prefetch, kiln_error, in_memory);
        FailingDataset dataset(kiln_error, in_memory);
        DataLoader loader(dataset, DataLoaderOptions(4).shuffle(false).prefetch(prefetch));
        int delivered = 0;
        auto run = [&] {
          for (Batch& b : loader) {
            (void)b;
            ++delivered;
          }
        };
        if (kiln_error) {
          REQUIRE_THROWS_WITH(run(), Contains("FailingDataset") && Contains("example 17 is unreadable"));
        } else {
          REQUIRE_THROWS_AS(run(), kiln::Error);
        }
        CHECK(delivered == 4);  // batches 0..3 arrive; batch 4 holds example 17
      }
    }
  }
  FailingDataset dataset(false);
  DataLoader loader(dataset, DataLoaderOptions(4).shuffle(false));
  REQUIRE_THROWS_WITH(one_epoch(loader), Contains("DataLoader") && Contains("gathering batch 4") &&
                                              Contains("disk on fire"));
  CHECK_THROWS_AS(DataLoader(dataset, DataLoaderOptions(0)), kiln::Error);
}

TEST_CASE("TensorDataset: from tensors, get() and shape checks", "[data]") {
  Tensor x = kiln::from_vector<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 2, 2});
  Tensor y = kiln::from_vector<int64_t>({2, 0, 1}, {3});
  TensorDataset dataset(x, y);
  CHECK(dataset.size() == 3);
  CHECK(dataset.input_shape() == kiln::Shape{2, 2});
  Example e = dataset.get(1);
  CHECK(e.input.to_vector<float>() == std::vector<float>{4, 5, 6, 7});
  CHECK(e.target.item() == 0);
  CHECK_THROWS_WITH(dataset.get(3), Contains("out of range"));
  CHECK_THROWS_AS(TensorDataset(x, kiln::from_vector<int64_t>({1, 2}, {2})), kiln::Error);
  CHECK_THROWS_AS(TensorDataset(std::vector<float>(5), {2}, std::vector<int64_t>(2)), kiln::Error);
}

// ---- IDX and Fashion-MNIST ----

TEST_CASE("read_idx reads gzip and plain IDX files", "[data]") {
  TempDir dir("idx");
  std::vector<uint8_t> data(2 * 3 * 4);
  std::iota(data.begin(), data.end(), uint8_t{200});  // wraps past 255: every byte value path
  std::vector<uint8_t> bytes = idx_bytes({2, 3, 4}, data);
  write_plain(dir.file("a.idx"), bytes);
  write_gzip(dir.file("a.idx.gz"), bytes);
  for (const std::string name : {"a.idx", "a.idx.gz"}) {
    CAPTURE(name);
    IdxArray array = read_idx(dir.file(name));
    CHECK(array.dims == std::vector<int64_t>{2, 3, 4});
    CHECK(array.data == data);
  }
}

TEST_CASE("read_idx rejects bad magic, truncation, trailing bytes and missing files", "[data]") {
  TempDir dir("idx-bad");
  std::vector<uint8_t> good = idx_bytes({10}, std::vector<uint8_t>(10, 1));

  std::vector<uint8_t> bad_magic = good;
  bad_magic[0] = 0x1f;
  write_plain(dir.file("magic"), bad_magic);
  CHECK_THROWS_WITH(read_idx(dir.file("magic")), Contains(dir.file("magic")) && Contains("bad magic number"));

  std::vector<uint8_t> float_type = good;
  float_type[2] = 0x0D;
  write_gzip(dir.file("type.gz"), float_type);
  CHECK_THROWS_WITH(read_idx(dir.file("type.gz")), Contains("type code 0x0d"));

  for (bool gzip : {false, true}) {
    CAPTURE(gzip);
    std::string suffix = gzip ? ".gz" : "";
    auto write = gzip ? write_gzip : write_plain;
    write(dir.file("short" + suffix), std::vector<uint8_t>(good.begin(), good.end() - 3));
    CHECK_THROWS_WITH(read_idx(dir.file("short" + suffix)),
                      Contains(dir.file("short" + suffix)) && Contains("truncated") && Contains("holds 7"));
    write(dir.file("header" + suffix), std::vector<uint8_t>(good.begin(), good.begin() + 6));
    CHECK_THROWS_WITH(read_idx(dir.file("header" + suffix)), Contains("truncated in the header"));
    write(dir.file("tiny" + suffix), {0, 0});
    CHECK_THROWS_WITH(read_idx(dir.file("tiny" + suffix)), Contains("truncated"));
    std::vector<uint8_t> longer = good;
    longer.push_back(9);
    write(dir.file("long" + suffix), longer);
    CHECK_THROWS_WITH(read_idx(dir.file("long" + suffix)), Contains("trailing bytes"));
  }

  // A .gz cut short in the middle of its compressed stream.
  std::vector<uint8_t> big = idx_bytes({4000}, std::vector<uint8_t>(4000, 7));
  for (size_t i = 0; i < big.size(); ++i) big[i] ^= static_cast<uint8_t>(i * 131);  // less compressible
  write_gzip(dir.file("cut.gz"), big);
  fs::resize_file(dir.file("cut.gz"), fs::file_size(dir.file("cut.gz")) / 2);
  CHECK_THROWS_AS(read_idx(dir.file("cut.gz")), kiln::Error);
  // Whole data but no trailer (CRC-32 and length, the last 8 bytes): zlib inflates every byte and
  // only says "unexpected end of file" on the side.
  write_gzip(dir.file("no-trailer.gz"), good);
  fs::resize_file(dir.file("no-trailer.gz"), fs::file_size(dir.file("no-trailer.gz")) - 8);
  CHECK_THROWS_WITH(read_idx(dir.file("no-trailer.gz")),
                    Contains(dir.file("no-trailer.gz")) && Contains("ends early") && Contains("trailer"));
  // A trailer whose checksum does not match the data.
  write_gzip(dir.file("bad-crc.gz"), good);
  {
    std::fstream f(dir.file("bad-crc.gz"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-8, std::ios::end);
    const char crc_byte = static_cast<char>(f.get());
    f.seekp(-8, std::ios::end);
    f.put(static_cast<char>(crc_byte ^ 0x5a));
  }
  CHECK_THROWS_WITH(read_idx(dir.file("bad-crc.gz")), Contains(dir.file("bad-crc.gz")) && Contains("corrupt"));

  CHECK_THROWS_WITH(read_idx(dir.file("nope")), Contains(dir.file("nope")) && Contains("no such file"));
}

TEST_CASE("FashionMnist reads a split from synthetic files, gzip or plain", "[data]") {
  TempDir dir("fmnist");
  write_fake_mnist(dir, "train", 6, /*gzip=*/true);
  write_fake_mnist(dir, "t10k", 3, /*gzip=*/false);

  FashionMnist train(dir.path.string(), Split::Train);
  REQUIRE(train.size() == 6);
  CHECK(train.input_shape() == kiln::Shape{784});
  CHECK(train.labels() == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
  CHECK(train.pixels()[5 * 784 + 100] == 50);  // kept as the file's bytes
  CHECK(train.value(50) == Approx(50.0f / 255.0f));
  CHECK(train.get(5).input.to_vector<float>()[100] == Approx(50.0f / 255.0f));
  Example e = train.get(2);
  CHECK(e.input.shape() == kiln::Shape{784});
  CHECK(e.input.to_vector<float>()[0] == Approx(20.0f / 255.0f));
  CHECK(e.target.item() == 2);

  FashionMnist test(dir.path.string(), Split::Test, FashionMnistOptions().image_shape().normalize());
  REQUIRE(test.size() == 3);
  CHECK(test.input_shape() == kiln::Shape{1, 28, 28});
  CHECK(test.get(1).input.to_vector<float>()[0] == Approx((10.0f / 255.0f - 0.2860f) / 0.3530f));
  DataLoader loader(test, DataLoaderOptions(2).shuffle(false));
  std::vector<kiln::Shape> shapes;
  for (Batch& b : loader) shapes.push_back(b.input.shape());
  CHECK(shapes == std::vector<kiln::Shape>{{2, 1, 28, 28}, {1, 1, 28, 28}});
  CHECK(std::string(FashionMnist::class_name(9)) == "Ankle boot");
}

TEST_CASE("FashionMnist: missing files name the paths and the Debian package", "[data]") {
  TempDir dir("fmnist-missing");
  try {
    FashionMnist train(dir.path.string(), Split::Train);
    FAIL("expected kiln::Error");
  } catch (const kiln::Error& e) {
    std::string message = e.what();
    CHECK_THAT(message, Contains(dir.file("train-images-idx3-ubyte")) &&
                            Contains(dir.file("train-labels-idx1-ubyte")) &&
                            Contains("apt-get install dataset-fashion-mnist") && Contains("--data DIR"));
  }
  // Only the labels missing: the message names just that file.
  write_fake_mnist(dir, "t10k", 2, true);
  fs::remove(dir.file("t10k-labels-idx1-ubyte.gz"));
  CHECK_THROWS_WITH(FashionMnist(dir.path.string(), Split::Test),
                    Contains("t10k-labels-idx1-ubyte") && !Contains("t10k-images-idx3-ubyte[") &&
                        Contains("apt-get install dataset-fashion-mnist"));
  // Mismatched counts and wrong image dims are rejected.
  write_fake_mnist(dir, "train", 3, false);
  write_plain(dir.file("train-labels-idx1-ubyte"), idx_bytes({2}, {0, 1}));
  CHECK_THROWS_WITH(FashionMnist(dir.path.string(), Split::Train), Contains("3 images") && Contains("2 labels"));
  write_plain(dir.file("train-images-idx3-ubyte"), idx_bytes({2, 27, 28}, std::vector<uint8_t>(2 * 27 * 28)));
  CHECK_THROWS_WITH(FashionMnist(dir.path.string(), Split::Train), Contains("expected (N, 28, 28)"));
}

TEST_CASE("default_fashion_mnist_dir honours KILN_DATA_DIR", "[data]") {
  kiln::FlagsGuard guard;
  TempDir dir("datadir");
  kiln::flags().set("data_dir", dir.path.string());  // what KILN_DATA_DIR sets at startup
  CHECK(default_fashion_mnist_dir() == dir.path.string());
  fs::create_directories(dir.path / "fashion-mnist");
  CHECK(default_fashion_mnist_dir() == (dir.path / "fashion-mnist").string());
  kiln::flags().data_dir.clear();
  CHECK(default_fashion_mnist_dir() == "/usr/share/datasets/fashion-mnist");
}

TEST_CASE("Fashion-MNIST from the Debian package, when installed", "[data]") {
  std::string dir = default_fashion_mnist_dir();
  bool present = true;
  for (Split split : {Split::Train, Split::Test})
    for (const std::string& stem : fashion_mnist_files(split))
      present = present && (fs::exists(fs::path(dir) / (stem + ".gz")) || fs::exists(fs::path(dir) / stem));
  if (!present) {
    WARN("SKIPPED: Fashion-MNIST files not found in " << dir
                                                      << " (apt-get install dataset-fashion-mnist to run this check)");
    return;
  }
  FashionMnist train(dir, Split::Train), test(dir, Split::Test);
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.input_shape() == kiln::Shape{784});
  CHECK(train.pixels().size() == size_t{60000} * 784);
  auto [lo, hi] = std::minmax_element(train.pixels().begin(), train.pixels().end());
  CHECK(train.value(*lo) == 0.0f);
  CHECK(train.value(*hi) == 1.0f);
  std::vector<int64_t> counts(10, 0);
  for (int64_t label : train.labels()) {
    REQUIRE((label >= 0 && label < 10));
    ++counts[label];
  }
  CHECK(counts == std::vector<int64_t>(10, 6000));  // Fashion-MNIST is balanced
  for (int64_t label : test.labels()) REQUIRE((label >= 0 && label < 10));
}

TEST_CASE("FashionMnist bytes: uint8 batches that to_float turns into the float batches, bit for bit", "[data]") {
  TempDir dir("fmnist-bytes");
  write_fake_mnist(dir, "train", 7, /*gzip=*/false);
  for (bool normalize : {false, true}) {
    INFO("normalize " << normalize);
    const auto options = FashionMnistOptions().normalize(normalize);
    FashionMnist floats(dir.path.string(), Split::Train, options);
    FashionMnist bytes(dir.path.string(), Split::Train, FashionMnistOptions(options).bytes());
    CHECK(floats.input_dtype() == DType::Float32);
    REQUIRE(bytes.input_dtype() == DType::UInt8);
    DataLoader a(floats, DataLoaderOptions(3).seed(4)), b(bytes, DataLoaderOptions(3).seed(4));
    auto ia = a.begin();
    auto ib = b.begin();
    int batches = 0;
    for (; ia != a.end() && ib != b.end(); ++ia, ++ib, ++batches) {
      REQUIRE(ib->input.dtype() == DType::UInt8);
      CHECK(ib->input.shape() == ia->input.shape());
      CHECK(ib->target.to_vector<int64_t>() == ia->target.to_vector<int64_t>());
      CHECK(bytes.to_float(ib->input).to_vector<float>() == ia->input.to_vector<float>());
    }
    CHECK(batches == 3);
  }
  // A float dataset has no bytes to hand out; to_float takes bytes only.
  TensorDataset plain(std::vector<float>(4, 1.0f), {2}, std::vector<int64_t>{0, 1});
  std::vector<uint8_t> out(2);
  int64_t target = 0;
  CHECK_THROWS_WITH(plain.read_bytes(0, out.data(), &target), Contains("input_dtype"));
  FashionMnist floats(dir.path.string(), Split::Train);
  CHECK_THROWS_WITH(floats.to_float(kiln::zeros({2, 784})), Contains("uint8"));
}
