// train_mnist: trains an MLP (784-512-512-10) or a small CNN on Fashion-MNIST, printing a progress
// bar per epoch and the test accuracy after each one.
//
//   ./build/samples/train_mnist --epochs 1
//   ./build/samples/train_mnist --epochs 1 --model cnn
//   ./build/samples/train_mnist --epochs 3 --lr 0.05 --batch 128 --save mlp.safetensors --log-csv loss.csv
//   ./build/samples/train_mnist --epochs 1 --load mlp.safetensors   # continue from a saved run
//   ./build/samples/train_mnist --epochs 1 --device cuda              # on cuda:0
//   KILN_CUDA_EMULATOR=1 ./build/samples/train_mnist --device cuda --max-steps 3   # no GPU: emulated
//
// The recipe, as a PyTorch user would write it: inputs normalized with the training set's mean
// and standard deviation (0.2860, 0.3530), SGD with momentum 0.9 and lr 0.05, the lr annealed to
// 0 over the whole run with a cosine (CosineAnnealingLR stepped once per batch), batch 128.
//
// --save PATH writes the weights to PATH and the optimizer's state (momentum buffers, step
// counts) next to it (mlp.safetensors -> mlp.optim.safetensors); --load PATH reads both, the
// optimizer's when its file exists. The lr schedule starts afresh from --lr in every run.
//
// Data: Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist), or
// --data DIR holding the four IDX .gz files. KILN_* flags apply (e.g. KILN_LOG=1, KILN_MEMORY_POOL).
//
// --data-parallel trains on every process mpirun starts (OpenMPI), each on its shard of every
// epoch; --batch is per process, so a step learns from batch x processes examples. Gradients are
// averaged over the processes (distributed::DataParallel); rank 0 alone prints, evaluates and saves.
//   mpirun -np 2 ./build/samples/train_mnist --data-parallel        # as root: --allow-run-as-root
// --accumulate K splits each batch into K micro-batches, one forward and backward each, and
// steps once (one all-reduce per K micro-batches under --data-parallel).
//
// --pipeline P cuts the MLP into P stages, one per process (mpirun -np P), and trains each batch
// as --micro-batches M micro-batches in the --schedule order (1f1b or gpipe); every process reads
// the same batches, the last stage prints, evaluates, and reports each stage's memory and the
// measured pipeline bubble next to the theory, (P - 1) / (M + P - 1). --save writes one file per
// stage (mlp.safetensors -> mlp.stage0.safetensors, ...), whose parameter names are the model's.
//   mpirun -np 2 ./build/samples/train_mnist --pipeline 2 --micro-batches 8 --schedule 1f1b
// With --data-parallel as well, a world of R x P processes trains R replicas of the P-stage
// pipeline, each on its shard (2-D: replica r holds ranks r*P ... r*P + P - 1):
//   mpirun -np 4 ./build/samples/train_mnist --pipeline 2 --data-parallel
//
// --tensor-parallel T splits the MLP's two large layers over T processes (mpirun -np T):
// fc1 by its outputs, fc2 by its inputs, one all-reduce per forward and one per backward; every
// process reads the same batches and holds 1/T of those weights and their momentum. --save
// writes one file per rank (mlp.safetensors -> mlp.tp0.safetensors, ...).
//   mpirun -np 2 ./build/samples/train_mnist --tensor-parallel 2
//
// --quantize 8 (or 4), after training (or with --load and --max-steps 0), evaluates the model in
// float32 and with every Linear int8 (or weight-only int4; nn::quantize_dynamic) and prints
// accuracy, bytes and inference speed:
//   ./build/samples/train_mnist --load mlp.safetensors --max-steps 0 --quantize 8
//
// --trace FILE writes steps 3 to 5 as a Chrome trace (ui.perfetto.dev): kernels by row (a
// pipeline stage's forward, backward, update; messages and the waits for them), memory counters.
// --memory-report DIR writes the training step's memory: report.txt (memory::report()),
// trace.json, arena.svg (where each buffer of the step's plan lives) and timeline.svg (bytes live
// during each kernel, the peak and the largest buffers there; samples/step_recorder.h).
//
// --replay records the training step once and then replays its plan on every batch
// (optim::TrainStep): the same values as recording each step, without its host work.
//   ./build/samples/train_mnist --epochs 1 --amp bf16 --replay
//
// --device cuda trains on cuda:0: the model moves there once, each batch is copied there before
// its forward (the data set stays in host memory), and the step runs as CUDA kernels and
// cuBLAS/cuDNN calls; only the loss and the count of correct predictions come back each step.
#include <kiln/kiln.h>

#include "samples/command_line.h"
#include "samples/mnist_models.h"
#include "samples/step_recorder.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <optional>
#include <set>
#include <fstream>
#include <iostream>

namespace nn = kiln::nn;
namespace data = kiln::nn::data;
using kiln::Tensor;

using kiln::samples::Cnn;
using kiln::samples::Mlp;

// Correct predictions in a batch of logits (B, 10) against labels (B): a lazy int64 scalar,
// detached so that it carries no gradient history into the optimizer's step.
static Tensor count_correct(const Tensor& logits, const Tensor& labels) {
  return kiln::eq(kiln::argmax(logits.detach(), 1), labels).sum();
}

// Where --save puts the optimizer's state: mlp.safetensors -> mlp.optim.safetensors.
static std::string optimizer_path(const std::string& model_path) {
  std::filesystem::path path(model_path);
  if (path.extension() == ".safetensors") return path.replace_extension(".optim.safetensors").string();
  return model_path + ".optim.safetensors";
}

// One file per process: mlp.safetensors -> mlp.stage0.safetensors (tag "stage0").
static std::string suffixed(const std::string& model_path, const std::string& tag) {
  std::filesystem::path path(model_path);
  return (path.parent_path() / path.stem()).string() + "." + tag +
         (path.has_extension() ? path.extension().string() : ".safetensors");
}

static int64_t parameter_bytes(nn::Module& model) {
  int64_t bytes = 0;
  for (const Tensor& p : model.parameters()) bytes += p.numel() * static_cast<int64_t>(kiln::dtype_size(p.dtype()));
  return bytes;
}

static double evaluate(nn::Module& model, const data::FashionMnist& test, kiln::Device device) {
  KILN_CHECK(test.size() > 0, "train_mnist", "the test set is empty: there is nothing to measure accuracy on");
  kiln::NoGradGuard no_grad;
  model.eval();
  data::DataLoader loader(test, data::DataLoaderOptions(1000));
  int64_t correct = 0;
  for (data::Batch& batch : loader)
    correct += static_cast<int64_t>(
        count_correct(model.forward(test.to_float(batch.input.to(device))), batch.target.to(device)).item());
  model.train();
  return 100.0 * static_cast<double>(correct) / static_cast<double>(test.size());
}

// --quantize 8: the trained model's test accuracy, bytes and inference speed in float32, then
// with every Linear int8 (nn::quantize_dynamic), both measured here on the whole test set.
static void compare_quantized(nn::Module& model, const data::FashionMnist& test, kiln::Device device, int bits) {
  auto timed = [&] {
    evaluate(model, test, device);  // warm-up: compiles the plans
    auto start = std::chrono::steady_clock::now();
    const double accuracy = evaluate(model, test, device);
    return std::make_pair(accuracy, static_cast<double>(test.size()) /
                                        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };
  const auto [float_accuracy, float_rate] = timed();
  const int64_t layers = nn::quantize_dynamic(model, nn::QuantizeOptions().bits(bits));
  // The quantized model's bytes: each quantized weight counts as its int8 values and scales; the
  // rest (biases, convolutions) stays float32.
  auto bytes_of = [](const Tensor& t) { return t.numel() * static_cast<int64_t>(kiln::dtype_size(t.dtype())); };
  std::set<std::string> quantized;
  int64_t float_bytes = 0, quantized_bytes = 0;
  for (const auto& [name, b] : model.named_buffers())
    if (name.ends_with(".weight_int8") || name.ends_with(".weight_int4") || name.ends_with(".weight_scale")) {
      quantized.insert(name.substr(0, name.rfind('.')) + ".weight");
      quantized_bytes += bytes_of(b);
    }
  for (const auto& [name, p] : model.named_parameters()) {
    float_bytes += bytes_of(p);
    if (!quantized.count(name)) quantized_bytes += bytes_of(p);
  }
  const auto [int8_accuracy, int8_rate] = timed();
  fmt::print("float32: test accuracy {:.2f}%, {} of weights and biases, {:.0f} examples/s (inference)\n", float_accuracy,
             kiln::memory::format_bytes(float_bytes), float_rate);
  fmt::print("int{} ({} Linear layers{}): test accuracy {:.2f}% ({:+.2f} points), {} ({:.1f}x smaller), {:.0f} examples/s "
             "({:.2f}x)\n",
             bits, layers, bits == 4 ? ", weight-only" : "", int8_accuracy, int8_accuracy - float_accuracy, kiln::memory::format_bytes(quantized_bytes),
             static_cast<double>(float_bytes) / static_cast<double>(std::max<int64_t>(quantized_bytes, 1)), int8_rate,
             int8_rate / float_rate);
}

// One line, rewritten in place: [#####.....] step 120/468  loss 0.4312  acc 84.1%  9870 ex/s  mem 12.0 MiB
static void progress(int epoch, int64_t step, int64_t steps, double loss, double accuracy, double rate) {
  constexpr int kWidth = 24;
  int filled = static_cast<int>(kWidth * step / std::max<int64_t>(steps, 1));
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  auto pool = kiln::memory::pool_stats();
  // A negative accuracy: not measured while training (--pipeline).
  std::string acc = accuracy < 0 ? "" : fmt::format("  acc {:5.1f}%", accuracy);
  fmt::print("\repoch {} [{}] step {}/{}  loss {:.4f}{}  {:6.0f} ex/s  mem {}  ", epoch, bar, step, steps, loss, acc,
             rate, kiln::memory::format_bytes(pool.reserved.current));
  std::fflush(stdout);
}

struct Settings {
  int epochs = 1;
  int64_t max_steps = -1, batch_size = 128;
  double lr = 0.05;
  std::string model_name = "mlp", device = "cpu", save_path, load_path, csv_path, data_dir, amp = "none";
  uint64_t seed = 0;
  bool data_parallel = false;
  int64_t accumulate = 1;
  int64_t pipeline = 0, micro_batches = 8;
  std::string schedule = "1f1b";
  int64_t tensor_parallel = 0;
  std::string trace_path, memory_report;
  int quantize = 0;
  std::string compress_activations = "none";
  bool replay = false;
};

// --amp: the type autocast runs matmuls and convolutions in (float32 when "none").
static kiln::DType amp_dtype(const std::string& amp) {
  return amp == "bf16" ? kiln::DType::BFloat16 : amp == "fp16" ? kiln::DType::Float16 : kiln::DType::Float32;
}

// What the first step keeps for its backward under autocast or compression, next to the same
// step in float32 without compression (planned, not run: that graph is built and dropped).
static void print_saved(nn::Module& model, const Tensor& x, const Tensor& labels, const Tensor& loss, bool compressed) {
  std::vector<Tensor> params = model.parameters();
  kiln::jit::SavedForBackward low = kiln::jit::saved_for_backward(loss, params), wide;
  {
    kiln::AutocastGuard off(false);
    kiln::CompressActivationsGuard uncompressed(false);
    wide = kiln::jit::saved_for_backward(nn::cross_entropy(model.forward(x), labels), params);
  }
  using kiln::memory::format_bytes;
  fmt::print("saved for the backward: activations {} (float32{}: {}, {:.2f}x), the batch {}, weights {} (float32: {})\n",
             format_bytes(low.activations), compressed ? ", uncompressed" : "", format_bytes(wide.activations),
             static_cast<double>(low.activations) / static_cast<double>(std::max<int64_t>(wide.activations, 1)),
             format_bytes(low.inputs), format_bytes(low.weights), format_bytes(wide.weights));
}

static void fit(const Settings& settings, const data::FashionMnist& train_set, const data::FashionMnist& test) {
  const auto& [epochs, max_steps, batch_size, lr, model_name, device, save_path, load_path, csv_path, data_dir,
               amp, seed, data_parallel, accumulate, pipeline, micro_batches, pipeline_schedule, tensor_parallel,
               trace_path, memory_report, quantize, compress_activations, replay] = settings;
  const kiln::Device run_on = device == "cuda" ? kiln::Device::cuda(0) : kiln::Device::cpu();
  namespace dist = kiln::distributed;
  const bool lead = dist::rank() == 0;  // the rank that prints and saves
  // Under --tensor-parallel every rank computes every step and evaluation together.
  const bool all_ranks_evaluate = tensor_parallel > 0;
  // Any model, held by value as "any module": forward dispatches to Mlp's, Cnn's or the split Mlp's.
  nn::AnyModule model = model_name == "cnn"    ? nn::AnyModule(Cnn())
                        : tensor_parallel > 0 ? nn::AnyModule(kiln::samples::TensorParallelMlp())
                                               : nn::AnyModule(Mlp());
  model.to(run_on);  // before the optimizer: its momentum buffers are made on the parameters' device
  if (lead) std::cout << model << "\n";
  // Under --data-parallel the optimizer's steps average the gradients over the processes; the
  // wrapper shares the model's parameters, so `model` trains too.
  std::optional<dist::DataParallel> replicated;
  if (data_parallel) {
    replicated.emplace(model);
    if (lead)
      fmt::print("data parallel: {} processes, {} examples per step ({} each)\n", dist::world_size(),
                 batch_size * dist::world_size(), batch_size);
  }
  if (tensor_parallel > 0 && lead)
    fmt::print("tensor parallel: {} processes; rank 0 holds {} of parameters\n", dist::world_size(),
               kiln::memory::format_bytes(parameter_bytes(model)));
  kiln::optim::SGD optimizer(model.parameters(), kiln::optim::SGDOptions(lr).momentum(0.9));
  // float16 gradients underflow without loss scaling; bfloat16 has float32's range and needs none.
  kiln::optim::GradScaler scaler(kiln::optim::GradScalerOptions().enabled(amp == "fp16"));
  optimizer.sync_with_step(model.buffers());  // running statistics, if a model has BatchNorm
  if (!load_path.empty()) {
    nn::load(model, load_path);
    std::string state_path = optimizer_path(load_path);
    if (std::filesystem::exists(state_path)) {
      kiln::optim::load(optimizer, state_path);
      optimizer.set_lr(lr);  // the schedule below starts from --lr
    }
    if (lead) fmt::print("loaded {}{}\n", load_path, std::filesystem::exists(state_path) ? " and " + state_path : "");
  }
  data::DataLoader loader(train_set, data::DataLoaderOptions(batch_size).shuffle(true).seed(seed).drop_last(true).sampler(
                                         {data_parallel ? dist::rank() : 0, data_parallel ? dist::world_size() : 1}));
  int64_t total_steps = static_cast<int64_t>(loader.size()) * epochs;
  if (max_steps >= 0) total_steps = std::min(total_steps, max_steps);
  kiln::optim::CosineAnnealingLR schedule(optimizer, std::max<int64_t>(total_steps, 1));
  std::ofstream csv;
  if (!csv_path.empty() && lead) {
    csv.open(csv_path);
    KILN_CHECK(csv.good(), "train_mnist", "cannot write {}", csv_path);
    csv << "step,loss\n";
  }

  kiln::samples::StepRecorder tracer(trace_path, memory_report);
  int64_t global_step = 0, trained_examples = 0;
  double accuracy = 0, train_seconds = 0;  // training steps only: evaluation excluded
  // --replay: forward, loss, accuracy, backward and update recorded once and replayed per batch.
  auto record_step = [&](const Tensor& input, const Tensor& labels, bool first) -> std::vector<Tensor> {
    Tensor x = train_set.to_float(input);  // no copy for the CPU
    std::optional<kiln::AutocastGuard> autocast;  // none: KILN_AMP still applies
    if (amp != "none") autocast.emplace(amp_dtype(amp));  // matmuls and convolutions in bf16/fp16
    std::optional<kiln::CompressActivationsGuard> compress;  // none: KILN_COMPRESS_ACTIVATIONS still applies
    if (compress_activations == "int8") compress.emplace(true);
    Tensor logits = model.forward(x);
    Tensor loss = nn::cross_entropy(logits, labels);
    const bool compressed = compress_activations == "int8" || kiln::flags().compress_activations == "int8";
    if (first && (amp != "none" || compressed) && lead) print_saved(model, x, labels, loss, compressed);
    return {loss, count_correct(logits, labels)};
  };
  std::optional<kiln::optim::TrainStep> replayed;
  if (replay)
    replayed.emplace(optimizer, [&](const std::vector<Tensor>& b) { return record_step(b[0], b[1], global_step == 0); });

  for (int epoch = 1; epoch <= epochs && global_step != max_steps; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    int64_t step = 0, seen = 0, correct_total = 0;
    for (data::Batch& batch : loader) {
      Tensor loss, correct;
      const int64_t rows = batch.target.numel(), micro = (rows + accumulate - 1) / accumulate;
      tracer.before(global_step);
      if (accumulate > 1) optimizer.zero_grad();
      if (replayed) {
        std::vector<Tensor> out = (*replayed)({batch.input.to(run_on), batch.target.to(run_on)});
        loss = out[0], correct = out[1];
      }
      for (int64_t at = 0; at < rows && !replayed; at += micro) {
        // No handle to the logits outlives the step: it would keep the update from running in place.
        Tensor x = batch.input.to(run_on), labels = batch.target.to(run_on);  // no copy for the CPU
        if (accumulate > 1) x = x.slice(0, at, std::min(rows, at + micro)), labels = labels.slice(0, at, std::min(rows, at + micro));
        std::vector<Tensor> out = record_step(x, labels, global_step == 0 && at == 0);
        Tensor part = out[0], hits = out[1];
        if (accumulate == 1) {
          loss = part, correct = hits;
          break;
        }
        // Each micro-batch's mean, weighted by its share of the batch: the gradients add up to
        // the whole batch's mean.
        const double share = static_cast<double>(labels.numel()) / static_cast<double>(rows);
        scaler.scale(part * share).backward();
        loss = loss.defined() ? loss + (part * share).detach() : (part * share).detach();
        correct = correct.defined() ? correct + hits : hits;
      }
      // Forward, backward, update, loss and accuracy as one cached plan. step(loss) computes
      // the gradients itself, so they live only inside the plan; PyTorch's style,
      // zero_grad(); loss.backward(); step({loss, correct}), works too but writes them to p.grad()
      // (as --accumulate does).
      if (replayed) {}  // stepped
      else if (accumulate == 1) scaler.step(optimizer, loss, {correct});  // optimizer.step(loss, {correct}) when scaling is off
      else scaler.step(optimizer, {loss, correct});
      scaler.update();
      schedule.step();
      double loss_value = loss.item();
      correct_total += static_cast<int64_t>(correct.item());
      seen += batch.target.numel();
      ++step;
      ++global_step;
      tracer.after(global_step);
      if (csv.is_open()) csv << fmt::format("{},{:.9g}\n", global_step, loss_value);
      double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (lead && (step % 10 == 0 || step == static_cast<int64_t>(loader.size())))
        progress(epoch, step, static_cast<int64_t>(loader.size()), loss_value, 100.0 * correct_total / seen,
                 seen / seconds);
      if (global_step == max_steps) break;
    }
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (replayed && epoch == 1 && lead)
      fmt::print("\n--replay: {}\n", replayed->replaying() ? fmt::format("{} steps replayed, {} recorded",
                                                                          replayed->replays(), replayed->recordings())
                                                            : "every step recorded: " + replayed->why_not_replayed());
    tracer.finish();
    trained_examples += seen;
    if (!lead && !all_ranks_evaluate) continue;  // the other ranks go on with the next epoch's steps
    accuracy = evaluate(model, test, run_on);
    if (lead) fmt::print("\nepoch {}: test accuracy {:.2f}%\n", epoch, accuracy);
  }
  if (tensor_parallel > 0 && !save_path.empty()) {  // one file per rank, its blocks of the weights
    const std::string path = suffixed(save_path, fmt::format("tp{}", dist::rank()));
    nn::save(model, path);
    kiln::optim::save(optimizer, optimizer_path(path));
    fmt::print("rank {}: saved {} and {}\n", dist::rank(), path, optimizer_path(path));
  }
  if (!lead) return;
  if (global_step == 0) accuracy = evaluate(model, test, run_on);  // --max-steps 0: the model as loaded
  fmt::print("test accuracy: {:.2f}%\n", accuracy);
  // Every process trains as fast as rank 0 (each step waits for all of them).
  const int64_t processes = data_parallel ? dist::world_size() : 1;
  fmt::print("training: {:.0f} examples/s ({} examples in {:.2f} s{}, first step included, evaluation excluded)\n",
             processes * trained_examples / std::max(train_seconds, 1e-9), processes * trained_examples,
             train_seconds, processes > 1 ? fmt::format(" on {} processes", processes) : "");
  if (!save_path.empty() && tensor_parallel == 0) {
    nn::save(model, save_path);
    kiln::optim::save(optimizer, optimizer_path(save_path));
    fmt::print("saved {} and {}\n", save_path, optimizer_path(save_path));
  }
  if (quantize > 0) compare_quantized(model, test, run_on, quantize);  // after saving: the file stays float32
}

// --pipeline: every rank reads the same batches; stage s holds only its layers and their
// optimizer state; the last stage reports.
static void fit_pipeline(const Settings& settings, const data::FashionMnist& train_set, const data::FashionMnist& test) {
  namespace dist = kiln::distributed;
  // With --data-parallel: replica r runs its stages on ranks [r * P, (r + 1) * P), and the ranks
  // holding the same stage average their gradients (a 2-D layout of replicas x stages).
  const int stages = static_cast<int>(settings.pipeline), replicas = dist::world_size() / stages;
  const int replica = dist::rank() / stages;
  std::vector<dist::Group> pipelines, same_stage;
  for (int r = 0; r < replicas; ++r) {  // every rank makes every group, in the same order
    std::vector<int> ranks(static_cast<size_t>(stages));
    std::iota(ranks.begin(), ranks.end(), r * stages);
    pipelines.push_back(dist::new_group(ranks));
  }
  for (int s = 0; s < stages; ++s) {
    std::vector<int> ranks;
    for (int r = 0; r < replicas; ++r) ranks.push_back(r * stages + s);
    same_stage.push_back(dist::new_group(ranks));
  }
  dist::Pipeline pipe(kiln::samples::mlp_layers(),
                      dist::PipelineOptions()
                          .micro_batches(settings.micro_batches)
                          .schedule(settings.schedule == "gpipe" ? dist::PipelineSchedule::GPipe
                                                                 : dist::PipelineSchedule::OneFOneB)
                          .group(pipelines[static_cast<size_t>(replica)]));
  std::optional<dist::DataParallel> averaged;
  if (replicas > 1) averaged.emplace(pipe, same_stage[static_cast<size_t>(pipe.stage())]);
  const bool lead = pipe.is_last() && replica == 0;
  if (lead)
    fmt::print("pipeline: {} stages (layers {}), {} micro-batches of {}, {}{}\n", pipe.stages(),
               fmt::join(pipe.stage_bounds(), "|"), settings.micro_batches, settings.batch_size / settings.micro_batches,
               settings.schedule,
               replicas > 1 ? fmt::format("; {} data-parallel replicas of {} examples per step", replicas, settings.batch_size)
                            : "");
  kiln::optim::SGD optimizer(pipe.parameters(), kiln::optim::SGDOptions(settings.lr).momentum(0.9));
  data::DataLoader loader(train_set, data::DataLoaderOptions(settings.batch_size)
                                         .shuffle(true)
                                         .seed(settings.seed)
                                         .drop_last(true)
                                         .sampler({replica, replicas}));
  int64_t total_steps = static_cast<int64_t>(loader.size()) * settings.epochs;
  if (settings.max_steps >= 0) total_steps = std::min(total_steps, settings.max_steps);
  kiln::optim::CosineAnnealingLR schedule(optimizer, std::max<int64_t>(total_steps, 1));
  auto loss_fn = [](const Tensor& logits, const Tensor& labels) { return nn::cross_entropy(logits, labels); };
  kiln::samples::StepRecorder tracer(settings.trace_path, settings.memory_report);
  int64_t global_step = 0, peak_live = 0, arena = 0;
  double step_seconds = 0, waited = 0;  // after the first step (which compiles)
  for (int epoch = 1; epoch <= settings.epochs && global_step != settings.max_steps; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    int64_t step = 0, seen = 0;
    for (data::Batch& batch : loader) {
      tracer.before(global_step);
      Tensor loss = pipe.train_step(optimizer, train_set.to_float(batch.input), batch.target, loss_fn);
      schedule.step();
      if (global_step > 0) step_seconds += pipe.last_step().step_seconds, waited += pipe.last_step().recv_wait_seconds;
      peak_live = std::max(peak_live, pipe.last_step().peak_live_micro_batches);
      arena = std::max(arena, pipe.last_step().arena_bytes);
      seen += batch.target.numel();
      ++step;
      ++global_step;
      tracer.after(global_step);
      double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (lead && (step % 10 == 0 || step == static_cast<int64_t>(loader.size())))
        progress(epoch, step, static_cast<int64_t>(loader.size()), loss.item(), -1, seen / seconds);
      if (global_step == settings.max_steps) break;
    }
    tracer.finish();
    // Every stage takes part in the evaluation; the last one counts.
    kiln::NoGradGuard no_grad;
    pipe.eval();
    data::DataLoader eval_loader(test, data::DataLoaderOptions(1000));
    int64_t correct = 0;
    for (data::Batch& batch : eval_loader) {
      Tensor logits = pipe.forward(test.to_float(batch.input));
      if (pipe.is_last()) correct += static_cast<int64_t>(count_correct(logits, batch.target).item());
    }
    pipe.train();
    if (lead)
      fmt::print("\nepoch {}: test accuracy {:.2f}%\n", epoch,
                 100.0 * static_cast<double>(correct) / static_cast<double>(test.size()));
  }
  // Per stage: parameter bytes, the step plan's arena (activations and gradients), live micro-batches, and the fraction of
  // the step spent waiting for another stage (the bubble), gathered on the last stage.
  const int64_t param_bytes = parameter_bytes(pipe);
  Tensor mine = kiln::from_vector<double>({static_cast<double>(param_bytes), static_cast<double>(arena),
                                           static_cast<double>(peak_live), waited / std::max(step_seconds, 1e-9)},
                                          {1, 4});
  std::vector<double> all = dist::all_gather(mine, pipelines[static_cast<size_t>(replica)]).to_doubles();
  if (!settings.save_path.empty() && replica == 0) {  // the replicas hold the same weights
    const std::string stage_path = suffixed(settings.save_path, fmt::format("stage{}", pipe.stage()));
    nn::save(pipe, stage_path);
    fmt::print("stage {}: saved {}\n", pipe.stage(), stage_path);
  }
  if (!lead) return;
  double bubble = 0;
  for (int64_t s = 0; s < pipe.stages(); ++s) {
    const double* r = &all[static_cast<size_t>(4 * s)];
    fmt::print("stage {}: parameters {}, step arena {}, live micro-batches {}, waiting {:.1f}% of the step\n", s,
               kiln::memory::format_bytes(static_cast<int64_t>(r[0])), kiln::memory::format_bytes(static_cast<int64_t>(r[1])),
               static_cast<int64_t>(r[2]), 100 * r[3]);
    bubble += r[3] / static_cast<double>(pipe.stages());
  }
  fmt::print("pipeline bubble: measured {:.1f}% (mean over stages), theory (p - 1) / (m + p - 1) = {:.1f}%\n",
             100 * bubble, 100 * pipe.theoretical_bubble());
}

int main(int argc, char** argv) {
  CLI::App app{"Train an MLP or a CNN on Fashion-MNIST with kiln"};
  Settings s;
  auto& [epochs, max_steps, batch_size, lr, model_name, device, save_path, load_path, csv_path, data_dir, amp, seed,
         data_parallel, accumulate, pipeline, micro_batches, pipeline_schedule, tensor_parallel, trace_path,
         memory_report, quantize, compress_activations, replay] = s;
  kiln::samples::CommandLine cli(app);
  cli.at_least("--epochs", epochs, 1, "passes over the training set");
  cli.at_least("--max-steps", max_steps, -1, "stop after this many steps in all (-1: no limit)");
  cli.at_least("--batch", batch_size, 1, "examples per step");
  cli.positive("--lr", lr, "peak learning rate of SGD (momentum 0.9), cosine-annealed to 0");
  app.add_option("--model", model_name, "mlp (784-512-512-10) or cnn (conv 32, pool, conv 64, pool, fc 128, fc 10)")
      ->check(CLI::IsMember({"mlp", "cnn"}));
  app.add_option("--device", device, "cpu, or cuda (cuda:0; KILN_CUDA_EMULATOR=1 emulates one on the host)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--seed", seed, "seed of initialization and shuffling");
  app.add_option("--amp", amp, "mixed precision: none, bf16 or fp16 (autocast; parameters stay float32)")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}));
  app.add_option("--save", save_path, "write the trained weights (safetensors) and the optimizer state next to them");
  app.add_option("--load", load_path, "start from these weights (and their optimizer state, if saved)");
  app.add_option("--log-csv", csv_path, "write step,loss per step to this CSV file");
  app.add_option("--data", data_dir, "folder with the Fashion-MNIST IDX files");
  app.add_flag("--data-parallel", data_parallel,
               "train on every process mpirun starts, each on its shard; --batch is per process");
  cli.at_least("--accumulate", accumulate, 1, "micro-batches per step (gradient accumulation)");
  app.add_flag("--replay", replay,
               "record the training step once and replay it on every batch (optim::TrainStep): nothing is "
               "recorded per step");
  cli.at_least("--pipeline", pipeline, 1, "cut the MLP into this many pipeline stages, one per process (mpirun -np N)");
  cli.at_least("--micro-batches", micro_batches, 1, "micro-batches per batch under --pipeline");
  app.add_option("--schedule", pipeline_schedule, "pipeline order: 1f1b or gpipe")->check(CLI::IsMember({"1f1b", "gpipe"}));
  cli.at_least("--tensor-parallel", tensor_parallel, 1,
               "split the MLP's two large layers over this many processes (mpirun -np N)");
  app.add_option("--quantize", quantize,
                 "after training, compare the model in float32 and with every Linear quantized: 8 (int8) or 4 "
                 "(weight-only int4, groups of 32): accuracy, bytes, speed")
      ->check(CLI::IsMember({8, 4}));
  app.add_option("--compress-activations", compress_activations,
                 "keep what the backward reads of the forward as int8 (1-bit relu masks where that is all it reads): "
                 "int8 or none")
      ->check(CLI::IsMember({"int8", "none"}));
  app.add_option("--trace", trace_path,
                 "write steps 3 to 5 as a Chrome trace (one file per process under mpirun: FILE.rankN.json)");
  app.add_option("--memory-report", memory_report,
                 "write the training step's memory into this folder: report.txt, trace.json, arena.svg, timeline.svg");
  if (std::optional<int> exit_code = cli.parse(argc, argv)) return *exit_code;

  if (device == "cuda" && !kiln::cuda::available()) {
    fmt::print(stderr, "error: --device cuda, but no CUDA device is usable: {}\n(KILN_CUDA_EMULATOR=1 runs the "
               "CUDA code paths on the host emulator, slowly)\n", kiln::cuda::unavailable_reason());
    return 1;
  }
  try {
    // Before any data is read or step run: a --save that cannot be written fails now, not at the
    // end. (Under --pipeline and --tensor-parallel each rank writes files tagged with its rank
    // beside it; the first rank's names stand for them.)
    if (!save_path.empty()) {
      const std::string model_path = pipeline > 0          ? suffixed(save_path, "stage0")
                                     : tensor_parallel > 0 ? suffixed(save_path, "tp0")
                                                           : save_path;
      kiln::samples::check_writable("--save", {model_path, pipeline > 0 ? "" : optimizer_path(model_path)});
    }
    if (data_parallel || pipeline > 0 || tensor_parallel > 0) kiln::distributed::init();
    if (tensor_parallel > 0) {
      KILN_CHECK(tensor_parallel == kiln::distributed::world_size(), "train_mnist",
                 "--tensor-parallel {} needs {} processes (mpirun -np {}); this world has {}", tensor_parallel,
                 tensor_parallel, tensor_parallel, kiln::distributed::world_size());
      KILN_CHECK(512 % tensor_parallel == 0, "train_mnist",
                 "--tensor-parallel {} does not divide the MLP's 512 hidden units; use a divisor of 512", tensor_parallel);
      KILN_CHECK(!data_parallel && pipeline == 0 && model_name == "mlp" && device == "cpu" && load_path.empty(),
                 "train_mnist", "--tensor-parallel runs the MLP on the CPU, without --data-parallel, --pipeline or --load");
    }
    if (pipeline > 0) {
      const int world = kiln::distributed::world_size();
      if (data_parallel)
        KILN_CHECK(world % pipeline == 0, "train_mnist",
                   "--pipeline {} --data-parallel needs a multiple of {} processes (replicas x stages); this world has {}",
                   pipeline, pipeline, world);
      else
        KILN_CHECK(pipeline == world, "train_mnist",
                   "--pipeline {} needs {} processes (mpirun -np {}), one per stage (or --data-parallel with a "
                   "multiple of {}); this world has {}",
                   pipeline, pipeline, pipeline, pipeline, world);
      KILN_CHECK(accumulate == 1 && model_name == "mlp" && device == "cpu" && amp == "none" && load_path.empty(),
                 "train_mnist", "--pipeline runs the MLP on the CPU in float32, without --accumulate "
                 "(micro-batches do that), --amp or --load");
      KILN_CHECK(batch_size % micro_batches == 0, "train_mnist",
                 "--batch {} does not split into --micro-batches {} equal micro-batches", batch_size, micro_batches);
    }
    KILN_CHECK(!replay || (accumulate == 1 && amp != "fp16" && pipeline == 0 && tensor_parallel == 0), "train_mnist",
               "--replay replays one whole step: it takes neither --accumulate, --amp fp16 (loss scaling reads on the "
               "host), --pipeline nor --tensor-parallel");
    KILN_CHECK(accumulate <= batch_size, "train_mnist", "--accumulate {} needs at least as many examples per batch (--batch {})",
               accumulate, batch_size);
    kiln::manual_seed(seed);
    if (data_dir.empty()) data_dir = data::default_fashion_mnist_dir();
    // (x - 0.2860) / 0.3530; batches of pixel bytes, turned into floats inside the step
    auto normalized = data::FashionMnistOptions().normalize().bytes();
    data::FashionMnist train(data_dir, data::Split::Train, normalized);
    data::FashionMnist test(data_dir, data::Split::Test, normalized);

    if (pipeline > 0) {
      fit_pipeline(s, train, test);
      return 0;
    }
    fit(s, train, test);
    if (kiln::distributed::rank() != 0) return 0;
    const auto& jit = kiln::jit::stats();
    fmt::print("jit: {} kernels compiled, {} plan cache hits, {:.2f} s compiling\n", jit.kernels_compiled,
               jit.plan_cache_hits, jit.compile_seconds);
  } catch (const kiln::Error& e) {
    fmt::print(stderr, "\nerror: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // from the standard library (e.g. std::bad_alloc): never terminate
    fmt::print(stderr, "\nerror: {}\n", e.what());
    return 1;
  }
  return 0;
}
