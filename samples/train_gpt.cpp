// train_gpt: a character-level GPT (nn::GPT) trained on a text file, then asked for 200
// characters of its own.
//
//   ./build/samples/train_gpt                                   # the licenses in /usr/share/common-licenses
//   ./build/samples/train_gpt --text book.txt --steps 2000 --layers 6 --dim 256 --ctx 128
//   ./build/samples/train_gpt --save gpt.safetensors && ./build/samples/train_gpt --load gpt.safetensors --steps 0
//   ./build/samples/train_gpt --amp bf16 --checkpoint --compress-activations int8   # memory flags
//   ./build/samples/train_gpt --recompute elementwise   # the backward recomputes GELU outputs too
//
// The text is read as bytes: the vocabulary is the distinct bytes of the file (a UTF-8 letter
// outside ASCII is two or three tokens), so any file works. 90% trains, the last 10% validates.
// The recipe (nanoGPT's, scaled down): AdamW (betas 0.9, 0.95, weight decay 0.1), lr warmed up
// linearly over the first 10% of the steps then cosine-annealed to a tenth, gradients clipped to
// norm 1, dropout 0; batches of --batch random windows of --ctx + 1 bytes. Every --eval-every
// steps it prints the mean loss over 8 validation batches.
//
// --memory-report DIR writes the training step's memory: report.txt (memory::report()),
// trace.json of steps 3 to 5, arena.svg and timeline.svg (samples/step_recorder.h).
//
// --save PATH writes the weights and, next to them, the optimizer's state (gpt.safetensors ->
// gpt.optim.safetensors) with the vocabulary in the weights' metadata; --load PATH reads them
// back, with the model's shape it recorded. --device cuda trains on cuda:0.
//
// --data-parallel trains on every process mpirun starts (distributed::DataParallel): each draws
// its own windows (seed + rank), the optimizer averages the gradients and then clips them (the
// clipping sees the averaged gradients, so every rank takes the same step); rank 0 alone
// validates, prints, saves and samples.
//   mpirun -np 2 ./build/samples/train_gpt --data-parallel        # as root: --allow-run-as-root
//
// --pipeline P cuts the model into P stages, one per process (distributed::Pipeline over
// GPT::as_sequential(): the embeddings, the blocks, then the final LayerNorm with the head; the
// head gets a weight of its own, as the embedding is on the first stage), and trains each batch
// as --micro-batches micro-batches in a 1F1B order. Every stage draws the same windows; the
// clipping norm is summed over the stages, so the step is the one a single process would take
// with an untied head. At the end the stages' weights are gathered so that the last stage saves
// the whole model (loadable without --pipeline) and samples; each stage's optimizer state stays
// with it and is not saved.
//   mpirun -np 2 ./build/samples/train_gpt --pipeline 2 --micro-batches 4
#include <kiln/kiln.h>

#include "samples/command_line.h"
#include "samples/step_recorder.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>

namespace nn = kiln::nn;
namespace optim = kiln::optim;
using kiln::Tensor;

namespace {

// The files of `path` (a folder: its regular files in sorted order) as one string of bytes.
std::string read_text(const std::string& path) {
  namespace fs = std::filesystem;
  KILN_CHECK(fs::exists(path), "train_gpt", "no file or folder {}; pass --text FILE", path);
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& entry : fs::directory_iterator(path))
      if (entry.is_regular_file()) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string text;
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    KILN_CHECK(in.good(), "train_gpt", "cannot read {}", file.string());
    std::ostringstream bytes;
    bytes << in.rdbuf();
    text += bytes.str();
  }
  return text;
}

struct Corpus {
  std::string vocab;               // the distinct bytes, sorted: token i is vocab[i]
  std::vector<int64_t> train, val;  // token ids
};

Corpus tokenize(const std::string& text, const std::string& vocab_text) {
  Corpus c;
  c.vocab = vocab_text;
  if (c.vocab.empty()) {
    std::vector<bool> seen(256, false);
    for (unsigned char ch : text) seen[ch] = true;
    for (int b = 0; b < 256; ++b)
      if (seen[b]) c.vocab.push_back(static_cast<char>(b));
  }
  std::vector<int64_t> id(256, -1);
  for (size_t i = 0; i < c.vocab.size(); ++i) id[static_cast<unsigned char>(c.vocab[i])] = static_cast<int64_t>(i);
  std::vector<int64_t> tokens;
  tokens.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    int64_t t = id[static_cast<unsigned char>(text[i])];
    KILN_CHECK(t >= 0, "train_gpt", "byte {} at offset {} is not in the loaded model's vocabulary", int(text[i]), i);
    tokens.push_back(t);
  }
  const size_t split = tokens.size() * 9 / 10;
  c.train.assign(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(split));
  c.val.assign(tokens.begin() + static_cast<std::ptrdiff_t>(split), tokens.end());
  return c;
}

// `batch` random windows of ctx + 1 tokens: inputs (B, ctx) and next-token targets (B, ctx).
std::pair<Tensor, Tensor> sample_batch(const std::vector<int64_t>& data, int64_t batch, int64_t ctx, std::mt19937_64& rng,
                                       kiln::Device device) {
  std::uniform_int_distribution<size_t> start(0, data.size() - static_cast<size_t>(ctx) - 1);
  std::vector<int64_t> x, y;
  for (int64_t b = 0; b < batch; ++b) {
    size_t s = start(rng);
    x.insert(x.end(), data.begin() + static_cast<std::ptrdiff_t>(s), data.begin() + static_cast<std::ptrdiff_t>(s + ctx));
    y.insert(y.end(), data.begin() + static_cast<std::ptrdiff_t>(s + 1), data.begin() + static_cast<std::ptrdiff_t>(s + ctx + 1));
  }
  return {kiln::from_vector<int64_t>(x, {batch, ctx}).to(device), kiln::from_vector<int64_t>(y, {batch, ctx}).to(device)};
}

// Mean next-token cross entropy of logits (B, T, vocab) against targets (B, T).
Tensor lm_loss_of(const Tensor& logits, const Tensor& y) {
  return nn::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

Tensor lm_loss(nn::GPT& gpt, const Tensor& x, const Tensor& y) { return lm_loss_of(gpt.forward(x), y); }

// After a pipeline's training every process holds the whole model again: each parameter from the
// stage that trained it (the others contribute zeros to a sum).
void gather_stages(nn::GPT& gpt, const kiln::distributed::Pipeline& pipe) {
  const std::vector<Tensor> mine = pipe.parameters();
  kiln::NoGradGuard no_grad;
  for (Tensor& p : gpt.parameters()) {
    const bool owned = std::any_of(mine.begin(), mine.end(), [&](const Tensor& q) { return q.node() == p.node(); });
    // One parameter per plan: the same collective on every process, whichever holds the value.
    p.assign(kiln::distributed::all_reduce(owned ? p : kiln::zeros_like(p)));
    p.realize();
  }
}

// The vocabulary in the checkpoint's metadata, as hex: safetensors metadata is JSON text, and
// the bytes need not be UTF-8.
std::string to_hex(const std::string& bytes) {
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

std::string from_hex(const std::string& hex) {
  KILN_CHECK(hex.size() % 2 == 0 && hex.find_first_not_of("0123456789abcdef") == std::string::npos, "train_gpt",
             "the checkpoint's vocabulary is not hex bytes");
  std::string bytes;
  for (size_t i = 0; i < hex.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return bytes;
}

std::string optimizer_path(const std::string& path) {
  std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".optim" + p.extension().string())).string();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a character-level GPT on a text file with kiln"};
  std::string text_path = "/usr/share/common-licenses", device = "cpu", save_path, load_path, csv_path, amp = "none",
              budget, compress = "none", recompute, offload, memory_report;
  int64_t steps = 600, batch = 32, ctx = 64, layers = 4, heads = 4, dim = 128, eval_every = 100;
  double lr = 3e-3;
  uint64_t seed = 0;
  int64_t pipeline = 0, micro_batches = 4;
  bool checkpoint = false, data_parallel = false;
  app.add_option("--text", text_path, "a text file, or a folder whose files are read in sorted order");
  kiln::samples::CommandLine cli(app);
  cli.at_least("--steps", steps, 0, "training steps (0: only evaluate and sample)");
  cli.at_least("--batch", batch, 1, "windows per step");
  cli.at_least("--ctx", ctx, 1, "context length (tokens per window)");
  cli.at_least("--layers", layers, 1, "transformer blocks");
  cli.at_least("--heads", heads, 1, "attention heads (must divide --dim)");
  cli.at_least("--dim", dim, 1, "model width");
  cli.positive("--lr", lr, "peak learning rate of AdamW");
  app.add_option("--seed", seed, "seed of initialization, batches and sampling");
  cli.at_least("--eval-every", eval_every, 1, "steps between validation losses");
  app.add_option("--save", save_path, "write the weights (safetensors) and the optimizer state next to them");
  app.add_option("--load", load_path, "start from these weights (and their optimizer state, if saved)");
  app.add_option("--log-csv", csv_path, "write step,loss,val_loss per step to this CSV file");
  app.add_option("--memory-report", memory_report,
                 "write the training step's memory into this folder: report.txt, trace.json, arena.svg, timeline.svg");
  app.add_option("--device", device, "cpu, or cuda (cuda:0; KILN_CUDA_EMULATOR=1 emulates one)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--amp", amp, "mixed precision: none, bf16 or fp16 (autocast)")->check(CLI::IsMember({"none", "bf16", "fp16"}));
  app.add_flag("--checkpoint", checkpoint, "recompute each block for the backward (nn::checkpoint)");
  app.add_option("--budget", budget, "KILN_MEMORY_BUDGET for the step: a size (64MiB) or a fraction (0.5)");
  app.add_option("--offload", offload,
                 "KILN_OFFLOAD on a GPU: auto (what --budget needs, the default), all (every saved activation) or off")
      ->check(CLI::IsMember({"auto", "all", "off"}));
  app.add_option("--compress-activations", compress, "int8: keep what the backward reads as int8; or none")
      ->check(CLI::IsMember({"int8", "none"}));
  app.add_option("--recompute", recompute,
                 "KILN_RECOMPUTE: cheap (the default), elementwise (also GELU outputs) or off")
      ->check(CLI::IsMember({"cheap", "elementwise", "off"}));
  app.add_flag("--data-parallel", data_parallel, "train on every process mpirun starts, gradients averaged");
  cli.at_least("--pipeline", pipeline, 1, "cut the model into this many pipeline stages, one per process (mpirun -np N)");
  cli.at_least("--micro-batches", micro_batches, 1, "micro-batches per step under --pipeline (must divide --batch)");
  if (std::optional<int> exit_code = cli.parse(argc, argv)) return *exit_code;

  try {
    // Before the text is read or a step run: a --save that cannot be written fails now, not at the end.
    if (!save_path.empty()) kiln::samples::check_writable("--save", {save_path, optimizer_path(save_path)});
    namespace dist = kiln::distributed;
    KILN_CHECK(!(data_parallel && pipeline > 0), "train_gpt", "--data-parallel and --pipeline cannot be combined here; "
               "choose one");
    KILN_CHECK(pipeline == 0 || !checkpoint, "train_gpt", "--checkpoint does not apply under --pipeline (a stage's "
               "blocks are not checkpointed); leave one out");
    KILN_CHECK(pipeline == 0 || batch % micro_batches == 0, "train_gpt",
               "--micro-batches {} must divide --batch {}", micro_batches, batch);
    if (data_parallel || pipeline > 0) dist::init();
    KILN_CHECK(pipeline == 0 || dist::world_size() == pipeline, "train_gpt",
               "--pipeline {} needs {} processes (mpirun -np {}), this run has {}", pipeline, pipeline, pipeline,
               dist::world_size());
    // The rank that validates, prints, saves and samples: the last stage, which has the loss.
    const bool lead = pipeline > 0 ? dist::rank() == pipeline - 1 : dist::rank() == 0;
    kiln::manual_seed(seed);
    if (!budget.empty()) kiln::flags().set("memory_budget", budget);
    if (!recompute.empty()) kiln::flags().set("recompute", recompute);
    if (!offload.empty()) kiln::flags().set("offload", offload);
    const kiln::Device run_on = device == "cuda" ? kiln::Device::cuda(0) : kiln::Device::cpu();
    const std::string text = read_text(text_path);
    KILN_CHECK(static_cast<int64_t>(text.size()) * 9 / 10 > ctx + 1 && static_cast<int64_t>(text.size()) / 10 > ctx + 1,
               "train_gpt", "{} has {} bytes; --ctx {} needs at least {} (90% to train and 10% to validate, each longer "
               "than ctx + 1)", text_path, text.size(), ctx, 10 * (ctx + 2));
    std::string vocab;
    nn::Metadata meta;
    if (!load_path.empty()) {
      nn::load_tensors(load_path, &meta);
      vocab = meta.count("vocab") ? from_hex(meta["vocab"]) : "";
      // The model's shape comes from the checkpoint; a flag that says otherwise is a mistake.
      for (auto [flag, value] : {std::pair{"ctx", &ctx}, {"layers", &layers}, {"heads", &heads}, {"dim", &dim}}) {
        if (!meta.count(flag)) continue;
        const int64_t saved = std::stoll(meta[flag]);
        KILN_CHECK(app.count(fmt::format("--{}", flag)) == 0 || *value == saved, "train_gpt",
                   "--{} {} does not match {}, whose model has {} {}{}; leave --{} out to use the checkpoint's", flag,
                   *value, load_path, flag, saved,
                   std::string(flag) == "ctx" ? " positions in its positional table" : "", flag);
        *value = saved;
      }
    }
    const Corpus corpus = tokenize(text, vocab);
    const int64_t vocab_size = static_cast<int64_t>(corpus.vocab.size());
    // A pipeline holds the embedding and the head on different stages: the head is its own weight.
    const bool tied = pipeline == 0 && (!meta.count("tied") || meta["tied"] == "1");
    KILN_CHECK(pipeline == 0 || !meta.count("tied") || meta["tied"] == "0", "train_gpt",
               "{} has a head tied to the token embedding, and --pipeline puts them on different stages; train a "
               "model for the pipeline from scratch (without --load)", load_path);
    nn::GPT gpt(nn::GPTConfig().vocab(vocab_size).ctx(ctx).layers(layers).heads(heads).dim(dim).checkpoint(checkpoint)
                    .tie_weights(tied));
    gpt.to(run_on);
    if (!load_path.empty()) nn::load(gpt, load_path);
    std::optional<dist::Pipeline> pipe;
    if (pipeline > 0)
      pipe.emplace(gpt.as_sequential(), dist::PipelineOptions().micro_batches(micro_batches));
    // Under a pipeline each stage updates its own parameters; the clipping norm is the model's.
    optim::AdamW opt(pipe ? pipe->parameters() : gpt.parameters(),
                     optim::AdamWOptions(lr).betas(0.9, 0.95).weight_decay(0.1));
    if (pipe) opt.clip_grad_norm(1.0, [](const Tensor& sum_of_squares) { return dist::all_reduce(sum_of_squares); });
    else opt.clip_grad_norm(1.0);  // after data parallel's averaging, so every rank clips alike
    if (!load_path.empty()) {
      if (!pipe && std::filesystem::exists(optimizer_path(load_path))) optim::load(opt, optimizer_path(load_path));
      opt.set_lr(lr);
      if (lead) fmt::print("loaded {}\n", load_path);
    }
    // Rank 0's weights on every rank (a --load'ed optimizer state is the same file everywhere).
    std::optional<dist::DataParallel> replicated;
    if (data_parallel) replicated.emplace(nn::AnyModule(gpt));
    const int64_t world = data_parallel ? dist::world_size() : 1;
    int64_t parameters = 0;
    for (const Tensor& p : gpt.parameters()) parameters += p.numel();
    if (lead) {
      fmt::print("{}: {} bytes ({} train, {} validation), vocabulary {} bytes\n", text_path, text.size(),
                 corpus.train.size(), corpus.val.size(), vocab_size);
      fmt::print("GPT: {} layers, {} heads, dim {}, ctx {}: {:.2f}M parameters\n", layers, heads, dim, ctx,
                 static_cast<double>(parameters) / 1e6);
      if (data_parallel)
        fmt::print("data parallel: {} processes, {} windows per step ({} each)\n", world, batch * world, batch);
      if (pipe)
        fmt::print("pipeline: {} stages (layers {} of embeddings, {} blocks, head), {} micro-batches of {}\n",
                   pipe->stages(), fmt::join(pipe->stage_bounds(), "|"), layers, micro_batches, batch / micro_batches);
    }

    const int64_t warmup = std::max<int64_t>(1, steps / 10);
    auto cosine = std::make_shared<optim::CosineAnnealingLR>(opt, std::max<int64_t>(1, steps - warmup), lr / 10);
    optim::LinearWarmup schedule(opt, warmup, cosine);
    // Data parallel: each rank its own windows; a pipeline's stages all read the same batch.
    std::mt19937_64 rng(seed + static_cast<uint64_t>(pipe ? 0 : dist::rank()));
    auto validate = [&] {
      kiln::NoGradGuard no_grad;
      gpt.eval();
      std::mt19937_64 fixed(1234);  // the same validation windows every time
      double total = 0;
      for (int i = 0; i < 8; ++i) {
        auto [x, y] = sample_batch(corpus.val, batch, ctx, fixed, run_on);
        if (!pipe) {
          total += lm_loss(gpt, x, y).item();
        } else {  // every stage runs its part; the last has the logits
          pipe->eval();
          const Tensor logits = pipe->forward(x);
          if (pipe->is_last()) total += lm_loss_of(logits, y).item();
          pipe->train();
        }
      }
      gpt.train();
      return total / 8;
    };
    std::ofstream csv;
    if (!csv_path.empty() && lead) {
      csv.open(csv_path);
      KILN_CHECK(csv.good(), "train_gpt", "cannot write {}", csv_path);
      csv << "step,loss,val_loss\n";
    }
    kiln::samples::StepRecorder recorder("", memory_report);
    auto start = std::chrono::steady_clock::now();
    double loss_value = 0, val = 0;
    for (int64_t step = 1; step <= steps; ++step) {
      recorder.before(step - 1);
      auto [x, y] = sample_batch(corpus.train, batch, ctx, rng, run_on);
      Tensor loss;
      {
        std::optional<kiln::AutocastGuard> autocast;
        if (amp != "none") autocast.emplace(amp == "bf16" ? kiln::DType::BFloat16 : kiln::DType::Float16);
        std::optional<kiln::CompressActivationsGuard> int8;
        if (compress == "int8") int8.emplace(true);
        if (pipe) loss = pipe->train_step(opt, x, y, lm_loss_of);  // forward, backward and update
        else loss = lm_loss(gpt, x, y);
      }
      if (step == 1 && lead && !pipe) {  // what the step keeps for its backward (planned, not run)
        const kiln::jit::SavedForBackward saved = kiln::jit::saved_for_backward(loss, gpt.parameters());
        using kiln::memory::format_bytes;
        fmt::print("saved for the backward: activations {}, the batch {}, weights {}\n", format_bytes(saved.activations),
                   format_bytes(saved.inputs), format_bytes(saved.weights));
      }
      if (!pipe) {
        opt.zero_grad();
        loss.backward();
        opt.step({loss});
      }
      if (step == 1 && lead)  // the plan of the whole step: forward, backward and update
        if (auto plan = kiln::memory::last_plan())
          fmt::print("step plan: {} kernels, arena {}\n", plan->kernels.size(),
                     kiln::memory::format_bytes(plan->arena_bytes));
      schedule.step();
      recorder.after(step);
      if (step == steps) recorder.finish();  // before validation: the report is the training step's
      if (lead) loss_value = loss.item();  // this rank's
      const bool evaluate = (step % eval_every == 0 || step == steps) && lead;
      if ((step % eval_every == 0 || step == steps) && (lead || pipe)) val = validate();  // all stages of a pipeline
      if (csv.is_open()) csv << fmt::format("{},{:.6f},{}\n", step, loss_value, evaluate ? fmt::format("{:.6f}", val) : "");
      if (lead && (step % 10 == 0 || evaluate)) {
        double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        fmt::print("step {:>5}/{} | loss {:.4f}{} | {:.1f}k tokens/s | memory {}\n", step, steps, loss_value,
                   evaluate ? fmt::format(" | val {:.4f}", val) : "",
                   static_cast<double>(step * batch * ctx * world) / seconds / 1e3,
                   kiln::memory::format_bytes(kiln::memory::allocated_bytes()));
      }
    }
    recorder.finish();
    if (steps == 0) {
      const double loss0 = validate();  // every stage of a pipeline takes part
      if (lead) fmt::print("validation loss {:.4f}\n", loss0);
    }
    if (pipe) gather_stages(gpt, *pipe);
    if (!lead) return 0;
    if (!save_path.empty()) {
      // The vocabulary, so that --load decodes the same bytes, and the shape it rebuilds.
      nn::save(gpt, save_path, {{"vocab", to_hex(corpus.vocab)}, {"ctx", std::to_string(ctx)},
                                {"layers", std::to_string(layers)}, {"heads", std::to_string(heads)},
                                {"dim", std::to_string(dim)}, {"tied", tied ? "1" : "0"}});
      if (pipe) {
        fmt::print("saved {} (the optimizer's state stays with each stage under --pipeline)\n", save_path);
      } else {
        optim::save(opt, optimizer_path(save_path));
        fmt::print("saved {} and {}\n", save_path, optimizer_path(save_path));
      }
    }
    // 200 bytes from the model, after a newline.
    const int64_t newline = static_cast<int64_t>(corpus.vocab.find('\n'));
    Tensor prompt = kiln::from_vector<int64_t>({newline >= 0 ? newline : 0}, {1, 1}).to(run_on);
    std::vector<int64_t> out = gpt.generate(prompt, 200, nn::GenerateOptions().temperature(0.8)).to_vector<int64_t>();
    std::string sample;
    for (size_t i = 1; i < out.size(); ++i) sample.push_back(corpus.vocab[static_cast<size_t>(out[i])]);
    fmt::print("--- sample (temperature 0.8) ---\n{}\n---\n", sample);
  } catch (const std::exception& e) {  // kiln::Error, and the standard library's (std::bad_alloc): never terminate
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
