// Checkpoints in the safetensors format, so weights open in the Python ecosystem:
//   8 bytes   little-endian uint64 N, the header length
//   N bytes   JSON: {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//             "__metadata__": {"format": "kiln"}}, padded with spaces to a multiple of 8
//   the rest  raw little-endian tensor bytes; offsets are relative to the start of this part
//
//   nn::save(net, "net.safetensors");         // parameters and buffers, dotted names
//   nn::load(net, "net.safetensors");         // all-or-nothing: validates, then assigns
//   nn::save_tensors({{"step", t}}, "extra.safetensors", {{"epoch", "3"}});
//   nn::Metadata meta;
//   auto tensors = nn::load_tensors("extra.safetensors", &meta);   // meta["epoch"] == "3"
//   (optimizer state: optim::save / optim::load in optim/serialize.h)
//
// Files are written to a temporary name and renamed, so a crash never leaves half a checkpoint.
#pragma once
#include <map>
#include <string>

#include "core/tensor.h"
#include "nn/module.h"

namespace kiln::nn {

using TensorMap = std::map<std::string, Tensor>;
// The header's "__metadata__": strings only, as the format requires. save_tensors adds
// "format": "kiln".
using Metadata = std::map<std::string, std::string>;

void save_tensors(const TensorMap& tensors, const std::string& path, const Metadata& metadata = {});
// Throws kiln::Error naming the problem for a missing, truncated or malformed file. Fills
// `metadata` (when given) with the file's metadata.
TensorMap load_tensors(const std::string& path, Metadata* metadata = nullptr);

// `metadata`: extra header entries (strings), e.g. what a program needs to read the weights back.
void save(const Module& module, const std::string& path, const Metadata& metadata = {});
// Every parameter and buffer of `module` must be in the file with the same shape and dtype;
// otherwise throws kiln::Error naming the key, and the module is left unchanged. Keys in the file
// that the module lacks are errors too unless `strict` is false.
void load(Module& module, const std::string& path, bool strict = true);

// The safetensors dtype tag ("F32", "BF16", "I64", "BOOL", ...) and back.
std::string safetensors_dtype(DType dtype);
DType dtype_from_safetensors(const std::string& tag);

}  // namespace kiln::nn
