#!/usr/bin/env python3
"""kiln against PyTorch (eager and torch.compile), side by side, in one command.

Runs each kiln program and its PyTorch twin (same model, init, recipe, batch, data and threads)
as child processes, alternating kiln / eager / compile run after run, and writes a markdown table
of ratios and PNG plots (bench/compare_report.py) to --out:

  fusion  bench_fusion against bench/pytorch_fusion.py: y = gelu(x * a + b) * c over 16M float32
  mlp     train_mnist --model mlp against bench/pytorch_mnist.py, Fashion-MNIST, float32 and bf16
  cnn     the same with the CNN
  gpt     train_gpt against bench/pytorch_gpt.py: float32, bf16 autocast, per-block checkpointing

    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2
    python3 bench/compare.py                        # everything, 2 runs (~15 min on 2 cores)
    python3 bench/compare.py --quick                # a smoke test of every path (~5 min, cold caches)
    python3 bench/compare.py --only mlp,gpt --runs 3 --out /tmp/compare
    python3 bench/compare.py --mnist-steps 150 --gpt-steps 100    # shorter runs (docs/compare's)

What each figure is (medians over --runs; every run is a fresh process):
- speed: fusion GB/s (bytes read and written over the median iteration), MNIST training
  examples/s over the first epoch after its tenth step, GPT training tokens/s after step 30 (the
  first steps compile or load kernels, and warm up). kiln's are read from its progress lines
  (cumulative rates at step 10 or 30 and at the last line before the end), PyTorch's timed
  inside the loop. Before the measured runs one short run of each program and configuration
  fills kiln's kernel cache and Inductor's cache, as a user's second run would find them.
- peak RSS: /usr/bin/time -v's maximum resident set size of the process (interpreter and
  `import torch` included for PyTorch; the largest of a process and the children it waited for).
- saved activations: what the step keeps for its backward, as each program prints it: kiln's
  jit::saved_for_backward (train_mnist prints it under --amp, with the float32 figure next to
  it), PyTorch's saved_tensors_hooks (eager module; torch.compile's graphs save other tensors).
- quality: MNIST test accuracy after the run, GPT validation loss (8 fixed batches), and the
  mean training loss of the last 20 steps; loss curves from each program's --log-csv.
Threads: OMP_NUM_THREADS, MKL_NUM_THREADS, KILN_NUM_THREADS and torch.set_num_threads all --threads.
"""
import argparse
import csv
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, ensure_module, machine_info, run_measured, thread_env, torch_config  # noqa: E402
from mnist_vs_pytorch import parse as parse_mnist  # noqa: E402

PROGRAMS = ("kiln", "eager", "compile")
PYTHON = sys.executable


def script(name):
    return [PYTHON, os.path.join(ROOT, "bench", name)]


def number(pattern, out, what):
    m = re.search(pattern, out, re.M)
    if not m:
        sys.exit(f"cannot find /{pattern}/ in {what}'s output:\n{out[-3000:]}")
    return float(m.group(1))


def to_bytes(amount, unit):
    return float(amount) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def steady_rate(points, first):
    """Rate between two cumulative-rate readings: points are (step, amount per s since the
    start), the amount being proportional to the step; from step `first` to the last point."""
    (s1, r1), (s2, r2) = next(p for p in points if p[0] == first), points[-1]
    return (s2 - s1) / (s2 / r2 - s1 / r1)


def tail_loss(path, n=20):
    """Mean training loss of the last n steps of a step,loss[,...] CSV."""
    with open(path) as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    return statistics.mean(losses[-n:]) if losses else float("nan")


class Fusion:
    name, title = "fusion", "fused elementwise chain gelu(x·a + b)·c, 16M float32"
    configs = ("float32",)

    def __init__(self, s):
        self.s = s

    def command(self, config, program, csv_path, warm):
        iterations = str(1 if warm else self.s.fusion_iterations)
        if program == "kiln":
            return [self.s.binary("bench", "bench_fusion"), iterations]
        return script("pytorch_fusion.py") + ["--iterations", iterations, "--threads", str(self.s.threads)] + \
            (["--compile"] if program == "compile" else [])

    def parse(self, config, program, out, csv_path):
        rows = {}
        for variant, moved in (("scalars", 2), ("tensors", 5)):
            ms = number(rf"^fused, a/b/c {variant} \(\d+ MiB\)\s+([\d.]+)ms", out, program)
            rows[f"a, b, c {variant}"] = {"speed": moved * 64 * 2**20 / (ms / 1e3) / 1e9}
        return rows


class Mnist:
    configs = ("float32", "bf16")

    def __init__(self, s, model):
        self.s, self.name = s, model
        self.title = {"mlp": "MLP 784-512-512-10", "cnn": "CNN conv32-pool-conv64-pool-fc128-fc10"}[model] + \
            f", Fashion-MNIST, batch 128, {'1 epoch' if s.mnist_steps < 0 else f'{s.mnist_steps} steps'}"

    def command(self, config, program, csv_path, warm):
        args = ["--model", self.name, "--seed", str(self.s.seed), "--max-steps", str(2 if warm else self.s.mnist_steps),
                "--log-csv", csv_path] + (["--amp", "bf16"] if config == "bf16" else [])
        if program == "kiln":
            return [self.s.binary("samples", "train_mnist")] + args
        return script("pytorch_mnist.py") + ["--threads", str(self.s.threads)] + args + \
            (["--compile"] if program == "compile" else [])

    def parse(self, config, program, out, csv_path):
        accuracy, _ = parse_mnist(out, program)
        row = {"accuracy": accuracy, "loss": tail_loss(csv_path), "curve": csv_path}
        saved = re.search(r"^saved for the backward: activations ([\d.]+) (\w+)(?: \(float32[^:]*: ([\d.]+) (\w+))?", out, re.M)
        if saved:
            row["saved"] = to_bytes(saved.group(1), saved.group(2))
            if saved.group(3):
                row["saved_float32"] = to_bytes(saved.group(3), saved.group(4))
        if program == "kiln":  # progress lines of epoch 1: cumulative examples/s every 10 steps
            points = [(int(a), float(b)) for a, b in re.findall(r"^epoch 1 \[[#.]*\] step (\d+)/\d+ .*?(\d+) ex/s", out, re.M)]
            row["speed"] = steady_rate(points, 10)
        else:
            row["speed"] = number(r"^steady: ([\d.]+) examples/s", out, program)
        return {config: row}


class Gpt:
    name = "gpt"
    configs = ("float32", "bf16", "checkpoint")
    first_timed = 30  # a multiple of 10: train_gpt prints its rate every 10 steps

    def __init__(self, s):
        self.s = s
        self.title = f"GPT 4 layers, dim 128, 4 heads, ctx 64, batch 32, {s.gpt_steps} steps (bytes of the licenses)"

    def command(self, config, program, csv_path, warm):
        steps = str(2 if warm else self.s.gpt_steps)
        flags = {"float32": [], "bf16": ["--amp", "bf16"], "checkpoint": ["--checkpoint"]}[config]
        args = ["--steps", steps, "--seed", str(self.s.seed), "--log-csv", csv_path] + flags
        if program == "kiln":
            return [self.s.binary("samples", "train_gpt"), "--eval-every", steps] + args
        return script("pytorch_gpt.py") + ["--threads", str(self.s.threads), "--timed-from", str(self.first_timed)] + \
            args + (["--compile"] if program == "compile" else [])

    def parse(self, config, program, out, csv_path):
        row = {"loss": tail_loss(csv_path), "curve": csv_path}
        if program == "kiln":
            # step lines every 10 steps: cumulative k tokens/s (the last one, which also validates,
            # does not match)
            points = [(int(a), float(b)) for a, b in re.findall(r"^step\s+(\d+)/\d+ \| loss [\d.]+ \| ([\d.]+)k tokens/s", out, re.M)]
            row["speed"] = 1e3 * steady_rate(points, self.first_timed)
            row["val_loss"] = float(re.findall(r"\| val ([\d.]+)", out)[-1])
        else:
            row["speed"] = number(r"^steady: ([\d.]+) tokens/s", out, program)
            row["val_loss"] = number(r"^validation loss: ([\d.]+)", out, program)
        saved = re.search(r"^saved for the backward: activations ([\d.]+) (\w+)", out, re.M)
        if saved:
            row["saved"] = to_bytes(saved.group(1), saved.group(2))
        return {config: row}


def parse_args():
    p = argparse.ArgumentParser(description="kiln against PyTorch eager and torch.compile, side by side")
    p.add_argument("--runs", type=int, default=None, help="measured runs of every program (default 2; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="tiny runs: a smoke test of every path, not a measurement")
    p.add_argument("--only", default="fusion,mlp,cnn,gpt", help="comma-separated workloads: fusion, mlp, cnn, gpt")
    p.add_argument("--kiln-build", default=os.path.join(ROOT, "build"), help="kiln's build folder (default: build)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "compare"), help="where the table and plots go")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mnist-steps", type=int, default=None, help="MNIST training steps (default: one epoch, 468)")
    p.add_argument("--gpt-steps", type=int, default=None, help="GPT training steps (default 230; timed from step 30)")
    p.add_argument("--note", default="", help="a line for the table's header (e.g. what else ran on the machine)")
    s = p.parse_args()
    s.runs = s.runs or (1 if s.quick else 2)
    if s.mnist_steps is None:
        s.mnist_steps = 30 if s.quick else -1  # -1: one epoch (468 steps)
    if s.gpt_steps is None:
        s.gpt_steps = 60 if s.quick else 230
    if s.gpt_steps < Gpt.first_timed + 20 or (s.mnist_steps >= 0 and s.mnist_steps < 20):
        sys.exit(f"--gpt-steps must be >= {Gpt.first_timed + 20} and --mnist-steps >= 20: speed is timed after the first steps")
    s.fusion_iterations = 3 if s.quick else 15
    s.logs = os.path.join(s.kiln_build, "compare")  # the programs' outputs and loss CSVs (ignored by git)
    s.binary = lambda *path: os.path.join(s.kiln_build, *path)
    return s


def workloads(s):
    known = {"fusion": lambda: Fusion(s), "mlp": lambda: Mnist(s, "mlp"), "cnn": lambda: Mnist(s, "cnn"), "gpt": lambda: Gpt(s)}
    chosen = [w.strip() for w in s.only.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in known]
    if unknown:
        sys.exit(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    found = []
    for name in chosen:
        w = known[name]()
        needs = s.binary("bench", "bench_fusion") if name == "fusion" else \
            s.binary("samples", "train_gpt" if name == "gpt" else "train_mnist")
        if not os.access(needs, os.X_OK):
            print(f"skipping {name}: {needs} is not built (bench_fusion needs libbenchmark-dev)", flush=True)
            continue
        found.append(w)
    return found


def main():
    s = parse_args()
    ensure_module("torch")
    ensure_module("matplotlib")
    ensure_module("numpy")
    os.makedirs(s.logs, exist_ok=True)
    env = thread_env(s.threads)
    info = machine_info()
    info["torch"] = torch_config()
    info["torch_import_rss"] = run_measured([PYTHON, "-c", "import torch"], env)[1]  # PyTorch's floor
    print(f"kiln {info['kiln']}; {info['cpu']} ({info['isa']}), {info['cpus']} CPUs, load average "
          f"{info['loadavg'][0]:.2f}; {info['torch'].splitlines()[0]}", flush=True)
    chosen = workloads(s)
    started = time.time()

    def run(w, config, program, tag, warm=False):
        csv_path = os.path.join(s.logs, f"{w.name}_{config}_{program}_{tag}.csv")
        cmd = w.command(config, program, csv_path, warm)
        t = time.time()
        out, rss = run_measured(cmd, env)
        with open(os.path.join(s.logs, f"{w.name}_{config}_{program}_{tag}.log"), "w") as f:
            f.write(" ".join(cmd) + "\n" + out)
        return out, rss, time.time() - t, csv_path

    for w in chosen:  # warm-up: kernel caches of kiln and Inductor; nothing measured
        for config in w.configs:
            for program in ("kiln", "compile"):
                _, _, seconds, _ = run(w, config, program, "warm", warm=True)
                print(f"warm-up {w.name} {config} {program}: {seconds:.1f} s", flush=True)

    results = []  # one dict per (workload, row, program, run)
    for i in range(1, s.runs + 1):
        for w in chosen:
            for config in w.configs:
                for program in PROGRAMS:  # alternating: kiln, eager, compile, kiln, eager, ...
                    out, rss, seconds, csv_path = run(w, config, program, f"run{i}")
                    for row, metrics in w.parse(config, program, out, csv_path).items():
                        results.append(dict(metrics, workload=w.name, row=row, program=program, run=i, rss=rss))
                        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
                        print(f"run {i} {w.name:6s} {row:16s} {program:8s} {seconds:6.1f} s  peak RSS {rss:7.1f} MiB  {shown}",
                              flush=True)
    info["loadavg_end"] = os.getloadavg()
    info["minutes"] = (time.time() - started) / 60
    settings = {k: v for k, v in vars(s).items() if k not in ("binary",)}
    settings["titles"] = {w.name: w.title for w in chosen}
    settings["argv"] = " ".join(sys.argv[1:])
    import compare_report  # matplotlib is there now
    compare_report.write(s.out, results, info, settings)


if __name__ == "__main__":
    main()
