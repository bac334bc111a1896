// Writes the seed corpora of the fuzz targets into the folder given (the checked-in copies are in
// tests/fuzz/corpus): valid files of every kind each target reads, made by kiln itself, so that
// mutations start from inputs that pass the parsers' first checks.
//   build-fuzz/tests/fuzz/make_corpus tests/fuzz/corpus
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_models.h"

namespace {

using namespace kiln;
namespace fs = std::filesystem;

void write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  KILN_CHECK(out.good(), "make_corpus", "cannot write {}", path.string());
}

void write_gzip(const fs::path& path, const std::string& bytes) {
  gzFile file = gzopen(path.c_str(), "wb9");
  KILN_CHECK(file != nullptr, "make_corpus", "cannot write {}", path.string());
  gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(file);
}

// An IDX array of unsigned bytes: magic 0x00000800 | ndim, big-endian dims, the data.
std::string idx(const std::vector<uint32_t>& dims) {
  std::string out = {0, 0, 8, static_cast<char>(dims.size())};
  size_t count = 1;
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) out += static_cast<char>((d >> shift) & 0xff);
    count *= d;
  }
  for (size_t i = 0; i < count; ++i) out += static_cast<char>((i * 37) % 256);
  return out;
}

void step(optim::Optimizer& opt, nn::Linear& fc) {
  Tensor x = from_doubles({1, -2, 0.5, 0.25, 1, -1}, {2, 3}, DType::Float32);
  opt.zero_grad();
  Tensor y = fc.forward(x);
  opt.step(sum(mul(y, y)));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    KILN_CHECK(argc == 2, "make_corpus", "usage: make_corpus <corpus folder>");
    const fs::path root = argv[1];
    for (const char* target : {"safetensors", "optim_state", "idx", "flags", "graph"}) fs::create_directories(root / target);

    fuzz::CheckpointNet net;
    nn::save(net, (root / "safetensors" / "checkpoint.safetensors").string());
    // Every dtype, a scalar, an empty tensor and metadata, at odd offsets (float16 after a bool).
    nn::save_tensors({{"a_bool", from_doubles({1, 0, 1}, {3}, DType::Bool)},
                      {"b_half", from_doubles({0.5, -2, 65504}, {3}, DType::Float16)},
                      {"c_bf16", from_doubles({1, -0.25}, {2, 1}, DType::BFloat16)},
                      {"d_i8", from_doubles({-128, 127}, {2}, DType::Int8)},
                      {"e_u8", from_doubles({255}, {}, DType::UInt8)},
                      {"f_i32", from_doubles({7, -7}, {1, 2}, DType::Int32)},
                      {"g_i64", from_doubles({1}, {1}, DType::Int64)},
                      {"h_f64", from_doubles({3.5}, {1, 1}, DType::Float64)},
                      {"i_empty", zeros({0, 3})}},
                     (root / "safetensors" / "dtypes.safetensors").string(), {{"epoch", "3"}});

    fuzz::Optimizers o;
    step(o.sgd, o.fc);
    optim::save(o.sgd, (root / "optim_state" / "sgd.safetensors").string());
    step(o.adam, o.fc);
    optim::save(o.adam, (root / "optim_state" / "adam.safetensors").string());
    o.adam.zero_grad();
    Tensor y = o.fc.forward(ones({1, 3}));
    o.scaler.step(o.adam, sum(y));
    o.scaler.update();
    optim::save(o.adam, o.scaler, (root / "optim_state" / "adam_scaler.safetensors").string());

    write(root / "idx" / "images-idx3-ubyte", idx({2, 3, 3}));
    write_gzip(root / "idx" / "labels-idx1-ubyte.gz", idx({4}));
    write_gzip(root / "idx" / "images-idx3-ubyte.gz", idx({1, 2, 2}));

    const std::vector<std::string> flag_seeds = {"memory_budget=0.5", "memory_budget=512MiB", "memory_limit=2GiB",
                                                 "lazy=0",            "log=2",                "amp=bf16",
                                                 "bucket_mb=0.0001",  "seed=-3",              "memory_pool=none",
                                                 "recompute=elementwise", "quantize_bits=4",  "1.5TB"};
    for (size_t i = 0; i < flag_seeds.size(); ++i) write(root / "flags" / ("seed" + std::to_string(i)), flag_seeds[i]);

    // Programs for fuzz_graph: bytes from a fixed generator (the decoder reads any bytes).
    uint32_t state = 12345;
    for (int i = 0; i < 8; ++i) {
      std::string bytes;
      for (int j = 0; j < 48; ++j) {
        state = state * 1664525u + 1013904223u;
        bytes += static_cast<char>(state >> 24);
      }
      write(root / "graph" / ("seed" + std::to_string(i)), bytes);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_corpus: %s\n", e.what());
    return 1;
  }
  return 0;
}
