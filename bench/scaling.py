# Scaling figures (issue 19 item 6): kiln's and PyTorch's MLP 784-W-W-10 training step time over
# batch sizes (width 512) and widths (batch 128), in one run, alternating, beside the time of each
# configuration's matrix products at the machine's float32 GEMM rate: the faster of torch.mm and
# kiln's matmul on 1024^3 in the same run.
# Writes the medians as CSV and both sweeps as one PNG.
#
#   python3 bench/scaling.py                           # 3 runs: docs/scaling.csv, docs/scaling.png
#   python3 bench/scaling.py --runs 1 --seconds 0.5    # quicker
#   python3 bench/scaling.py --plot-only               # the PNG again from the CSV
import argparse
import collections
import csv
import io
import os
import statistics
import subprocess
import sys

from harness import ROOT, ensure_module, machine_info, thread_env

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
WIDTHS = [256, 512, 1024, 2048, 4096]
SWEEP_WIDTH, SWEEP_BATCH = 512, 128


def gemm_flops(batch, width):
    """Matrix-product FLOPs of one step: the forward's three products, the backward's input
    gradients of layers 2 and 3 (layer 1's input needs none) and all three weight gradients."""
    forward = 2 * batch * (784 * width + width * width + width * 10)
    return 3 * forward - 2 * batch * 784 * width


def rows(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return [r for r in csv.DictReader(io.StringIO(out[out.index("framework,"):]))]


def main():
    p = argparse.ArgumentParser(description="kiln vs PyTorch MLP step time over batch and width")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="time measured per configuration and run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kiln", default=os.path.join(ROOT, "build", "bench", "bench_scaling"))
    p.add_argument("--csv", default=os.path.join(ROOT, "docs", "scaling.csv"))
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "scaling.png"))
    p.add_argument("--plot-only", action="store_true", help="plot the CSV of an earlier run")
    args = p.parse_args()
    if args.plot_only:
        with open(args.csv) as f:
            table = [(int(r["batch"]), int(r["width"]), float(r["kiln_ms"]), float(r["pytorch_ms"]),
                      float(r["gemm_ms"])) for r in csv.DictReader(f)]
            rate = gemm_flops(SWEEP_BATCH, SWEEP_WIDTH) / (1e6 * next(r[4] for r in table if r[:2] == (SWEEP_BATCH, SWEEP_WIDTH)))
        plot(table, rate, args.png)
        return
    if not os.access(args.kiln, os.X_OK):
        sys.exit(f"{args.kiln} not found: cmake -S . -B build && cmake --build build -j2 --target bench_scaling")
    ensure_module("torch")
    ensure_module("matplotlib")
    env = thread_env(args.threads)
    torch_cmd = [sys.executable, os.path.join(ROOT, "bench", "pytorch_scaling.py"), "--threads", str(args.threads)]
    sweeps = [["--batches", ",".join(map(str, BATCHES)), "--width", str(SWEEP_WIDTH)],
              ["--batch", str(SWEEP_BATCH), "--widths", ",".join(map(str, WIDTHS))]]
    print(machine_info(), flush=True)
    times = collections.defaultdict(list)  # (framework, batch, width) -> ms per run
    rates = []
    for run in range(args.runs):
        rates.append(max(float(subprocess.run(cmd + ["--gemm-rate"], env=env, check=True, capture_output=True,
                                              text=True).stdout.split(",")[1]) for cmd in ([args.kiln], torch_cmd)))
        for sweep in sweeps:
            for cmd in ([args.kiln], torch_cmd):
                for r in rows(cmd + sweep + ["--seconds", str(args.seconds)], env):
                    times[(r["framework"], int(r["batch"]), int(r["width"]))].append(float(r["step_ms"]))
        print(f"run {run + 1} of {args.runs} done (GEMM {rates[-1]:.0f} GFLOP/s)", flush=True)
    rate = statistics.median(rates)

    table = []
    for batch, width in [(b, SWEEP_WIDTH) for b in BATCHES] + [(SWEEP_BATCH, w) for w in WIDTHS if w != SWEEP_WIDTH]:
        k, t = statistics.median(times[("kiln", batch, width)]), statistics.median(times[("pytorch", batch, width)])
        bound = gemm_flops(batch, width) / (rate * 1e9) * 1e3
        table.append((batch, width, k, t, bound))
    with open(args.csv, "w") as f:
        f.write("batch,width,kiln_ms,pytorch_ms,gemm_ms\n")
        for row in table:
            f.write("{},{},{:.4f},{:.4f},{:.4f}\n".format(*row))
    print(f"\nfloat32 GEMM rate (the faster of torch.mm and kiln's matmul, 1024^3; median of {args.runs}): {rate:.0f} GFLOP/s")
    print("batch | width | kiln ms | PyTorch ms | PyTorch / kiln | products at the GEMM rate, ms | that / kiln")
    print("---|---|---|---|---|---|---")
    for b, w, k, t, bound in table:
        print(f"{b} | {w} | {k:.3f} | {t:.3f} | {t / k:.2f}x | {bound:.3f} | {bound / k:.2f}")
    plot(table, rate, args.png)
    print(f"\nwrote {args.csv} and {args.png}")


def plot(table, rate, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, xs, label, fixed in ((axes[0], 0, BATCHES, "batch", f"width {SWEEP_WIDTH}"),
                                      (axes[1], 1, WIDTHS, "hidden width", f"batch {SWEEP_BATCH}")):
        pick = [r for r in table if (r[1] == SWEEP_WIDTH if key == 0 else r[0] == SWEEP_BATCH)]
        pick.sort(key=lambda r: r[key])
        x = [r[key] for r in pick]
        ax.loglog(x, [r[2] for r in pick], "o-", label="kiln", color="#c0392b")
        ax.loglog(x, [r[3] for r in pick], "s-", label="PyTorch eager", color="#2c3e50")
        ax.loglog(x, [r[4] for r in pick], "--", label=f"its matrix products at {rate:.0f} GFLOP/s (GEMM 1024³)",
                  color="#7f8c8d")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("ms per training step")
        ax.set_title(f"MLP 784-W-W-10, SGD momentum, {fixed}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
