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
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_torch():
    # Checked in a child process: importing torch here would grow this process, and a forked
    # child's peak RSS starts from its parent's.
    if subprocess.call([sys.executable, "-c", "import torch"], stderr=subprocess.DEVNULL) == 0:
        return
    print("torch does not import; installing it with pip", flush=True)
    if subprocess.call([sys.executable, "-m", "pip", "install", "torch"]) == 0:
        return
    print("pip failed; trying Debian's python3-torch with OpenBLAS (OpenMP)", flush=True)
    if subprocess.call(["apt-get", "install", "-y", "python3-torch", "libopenblas0-openmp"]) != 0:
        sys.exit("cannot install torch: pip install torch, or apt-get install python3-torch libopenblas0-openmp")


def torch_config():
    """PyTorch's version and the BLAS / oneDNN / OpenMP lines of torch.__config__.show()."""
    code = (
        "import torch\n"
        "print(f'torch {torch.__version__}; mkldnn (oneDNN) available: {torch.backends.mkldnn.is_available()}; "
        "mkl available: {torch.backends.mkl.is_available()}')\n"
        "for line in torch.__config__.show().splitlines():\n"
        "    line = line.strip()\n"
        "    if line.startswith('- Build settings:'):\n"
        "        for item in line.split(', '):\n"
        "            if item.split('=')[0].strip('- ').split(': ')[-1] in ('BLAS_INFO', 'LAPACK_INFO', 'USE_MKL', 'USE_MKLDNN', 'USE_OPENMP', 'TORCH_VERSION'):\n"
        "                print('  ' + item.split(': ')[-1])\n"
        "    elif any(k in line for k in ('Math Kernel', 'MKL-DNN', 'oneDNN', 'OpenMP', 'BLAS', 'LAPACK', 'CPU capability')):\n"
        "        print('  ' + line.lstrip('- '))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.rstrip()


TIME = "/usr/bin/time"


def run(cmd, env):
    """Runs cmd; returns (its output, its peak RSS in MiB)."""
    if os.access(TIME, os.X_OK):  # GNU time: a small parent, so the figure is the program's own
        proc = subprocess.run([TIME, "-v"] + cmd, capture_output=True, env=env, text=True)
        out, rss = proc.stdout, re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        if proc.returncode != 0 or not rss:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(out + proc.stderr)[-3000:]}")
        return out.replace("\r", "\n"), int(rss.group(1)) / 1024.0
    # Otherwise wait4's rusage: the same figure, plus whatever of this interpreter the child
    # had before exec (small: torch is never imported here).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{out[-3000:]}")
    return out.replace("\r", "\n"), usage.ru_maxrss / 1024.0


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kiln", default=os.path.join(ROOT, "build", "samples", "train_mnist"),
                   help="the train_mnist binary (default: build/samples/train_mnist)")
    p.add_argument("--data", default="", help="folder with the Fashion-MNIST IDX files")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="also run both with mixed precision: kiln --amp, PyTorch torch.autocast (+ GradScaler for fp16)")
    args = p.parse_args()
    if not os.access(args.kiln, os.X_OK):
        sys.exit(f"{args.kiln} not found: cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2")
    ensure_torch()

    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, KILN_NUM_THREADS=threads)
    common = ["--model", args.model, "--epochs", str(args.epochs), "--batch", str(args.batch), "--seed", str(args.seed)]
    if args.data:
        common += ["--data", args.data]
    kiln_cmd = [args.kiln] + common
    torch_cmd = [sys.executable, os.path.join(ROOT, "bench", "pytorch_mnist.py"), "--threads", threads] + common

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
