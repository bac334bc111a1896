#!/usr/bin/env python3
# kiln's train_mnist against PyTorch (bench/pytorch_mnist.py) in one run: the same model, recipe,
# batch, data and threads, one epoch each, a few times, alternating. Prints PyTorch's version
# and BLAS / oneDNN configuration, every run, and a table of medians with kiln/PyTorch ratios.
#
#   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2
#   python3 bench/mnist_vs_pytorch.py                     # MLP, 3 runs each, ~1 minute
#   python3 bench/mnist_vs_pytorch.py --model cnn --runs 1
#   python3 bench/mnist_vs_pytorch.py --kiln build-bench/samples/train_mnist --seed 1
#   python3 bench/mnist_vs_pytorch.py --amp bf16          # + both with mixed precision (4 programs)
#
# What is measured:
# - test accuracy after the epoch(s), as each program prints it;
# - training examples/s (median and best run: on a shared machine the best run is the one least
#   disturbed by other jobs): every step of the epoch, the first included, evaluation and data
#   loading excluded (each program times its own training loop the same way). Before the
#   measured runs, kiln's kernel cache is warmed by a 2-step run, so JIT compilation (a one-time
#   cost that the disk cache keeps across processes) is not in the figure; the compile time of
#   that warm-up run is printed separately;
# - peak RSS of the whole process: "Maximum resident set size" from /usr/bin/time -v (or, without
#   it, ru_maxrss from wait4), the Python interpreter and `import torch` included for PyTorch.
# Threads: OMP_NUM_THREADS=2 and MKL_NUM_THREADS=2 for both, KILN_NUM_THREADS=2 for kiln,
# torch.set_num_threads(2) for PyTorch (--threads to change).
#
# torch is installed only if it does not import: `pip install torch`, or where PyPI is not
# reachable Debian's python3-torch with libopenblas0-openmp (the default reference BLAS is ~30x
# slower and not a fair baseline).
import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, ensure_module, run_measured as run, thread_env, torch_config  # noqa: E402


def parse(out, what):
    accuracy = re.search(r"^test accuracy: ([\d.]+)%", out, re.M)
    rate = re.search(r"^training: ([\d.]+) examples/s", out, re.M)
    if not accuracy or not rate:
        sys.exit(f"cannot read accuracy and examples/s from {what}'s output:\n{out[-3000:]}")
    return float(accuracy.group(1)), float(rate.group(1))


def main():
    p = argparse.ArgumentParser(description="kiln train_mnist vs PyTorch, side by side")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--runs", type=int, default=3, help="runs of each framework (medians are reported)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=-1,
                   help="stop both after this many steps (-1: whole epochs); e.g. --batch 1 --max-steps 3000 for latency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate (smaller for small batches)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kiln", default=os.path.join(ROOT, "build", "samples", "train_mnist"),
                   help="the train_mnist binary (default: build/samples/train_mnist)")
    p.add_argument("--data", default="", help="folder with the Fashion-MNIST IDX files")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="also run both with mixed precision: kiln --amp, PyTorch torch.autocast (+ GradScaler for fp16)")
    args = p.parse_args()
    if not os.access(args.kiln, os.X_OK):
        sys.exit(f"{args.kiln} not found: cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2")
    ensure_module("torch")

    threads = str(args.threads)
    env = thread_env(args.threads)
    common = ["--model", args.model, "--epochs", str(args.epochs), "--batch", str(args.batch), "--seed", str(args.seed),
              "--lr", str(args.lr)]
    if args.data:
        common += ["--data", args.data]
    steps = ["--max-steps", str(args.max_steps)] if args.max_steps >= 0 else []
    kiln_cmd = [args.kiln] + common + steps
    torch_cmd = [sys.executable, os.path.join(ROOT, "bench", "pytorch_mnist.py"), "--threads", threads] + common + steps

    print(torch_config())
    print(f"model {args.model}, batch {args.batch}, {args.epochs} epoch(s), seed {args.seed}, {threads} threads, "
          f"{os.cpu_count()} CPUs visible")
    warm, _ = run([args.kiln, "--max-steps", "2"] + common[:2] + common[4:], env)
    compile_line = re.search(r"^jit: .*$", warm, re.M)
    print(f"kiln warm-up (2 steps, fills the kernel cache): {compile_line.group(0) if compile_line else '?'}")

    programs = [("kiln", kiln_cmd), ("pytorch", torch_cmd)]
    if args.amp != "none":
        amp = ["--amp", args.amp]
        programs += [(f"kiln {args.amp}", kiln_cmd + amp), (f"pytorch {args.amp}", torch_cmd + amp)]
        warm, _ = run([args.kiln, "--max-steps", "2"] + amp + common[:2] + common[4:], env)
    results = {name: [] for name, _ in programs}
    saved = {}
    for i in range(args.runs):
        for name, cmd in programs:
            out, rss = run(cmd, env)
            accuracy, rate = parse(out, name)
            results[name].append((accuracy, rate, rss))
            line = re.search(r"^saved for the backward: .*$", out, re.M)
            if line:
                saved[name] = line.group(0)
            print(f"run {i + 1} {name:12s} test accuracy {accuracy:6.2f}%  {rate:8.0f} examples/s  peak RSS {rss:7.1f} MiB",
                  flush=True)

    med = {name: [statistics.median(r[k] for r in runs) for k in range(3)] for name, runs in results.items()}
    if args.amp != "none":
        amp_table(args, med, results, saved)
        return
    (ka, kr, km), (pa, pr, pm) = med["kiln"], med["pytorch"]
    print(f"\nmedians of {args.runs} run(s) | kiln | PyTorch | kiln / PyTorch")
    print("---|---|---|---")
    print(f"test accuracy | {ka:.2f}% | {pa:.2f}% | {ka - pa:+.2f} points")
    print(f"training examples/s | {kr:.0f} | {pr:.0f} | {kr / pr:.2f}x")
    kb, pb = (max(r[1] for r in results[name]) for name in ("kiln", "pytorch"))
    print(f"training examples/s, best run | {kb:.0f} | {pb:.0f} | {kb / pb:.2f}x")
    print(f"peak RSS | {km:.1f} MiB | {pm:.1f} MiB | {km / pm:.2f}x")



def amp_table(args, med, results, saved):
    a = args.amp
    k, p, ka, pa = "kiln", "pytorch", f"kiln {a}", f"pytorch {a}"
    print(f"\nmedians of {args.runs} run(s) | kiln float32 | kiln {a} | PyTorch float32 | PyTorch {a} | "
          f"kiln {a} / kiln float32 | kiln {a} / PyTorch {a}")
    print("---|---|---|---|---|---|---")
    acc = {n: med[n][0] for n in med}
    rate = {n: med[n][1] for n in med}
    best = {n: max(r[1] for r in results[n]) for n in results}
    rss = {n: med[n][2] for n in med}
    print(f"test accuracy | {acc[k]:.2f}% | {acc[ka]:.2f}% | {acc[p]:.2f}% | {acc[pa]:.2f}% | "
          f"{acc[ka] - acc[k]:+.2f} points | {acc[ka] - acc[pa]:+.2f} points")
    print(f"training examples/s | {rate[k]:.0f} | {rate[ka]:.0f} | {rate[p]:.0f} | {rate[pa]:.0f} | "
          f"{rate[ka] / rate[k]:.2f}x | {rate[ka] / rate[pa]:.2f}x")
    print(f"training examples/s, best run | {best[k]:.0f} | {best[ka]:.0f} | {best[p]:.0f} | {best[pa]:.0f} | "
          f"{best[ka] / best[k]:.2f}x | {best[ka] / best[pa]:.2f}x")
    print(f"peak RSS MiB | {rss[k]:.1f} | {rss[ka]:.1f} | {rss[p]:.1f} | {rss[pa]:.1f} | "
          f"{rss[ka] / rss[k]:.2f}x | {rss[ka] / rss[pa]:.2f}x")
    for name in (ka, pa):
        if name in saved:
            print(f"{name}: {saved[name]}")


if __name__ == "__main__":
    main()
