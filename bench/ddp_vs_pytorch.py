#!/usr/bin/env python3
# kiln's DataParallel against PyTorch's DistributedDataParallel (gloo) on one machine, same model
# (bench_ddp's deep MLP: 48 Linear layers of 256, ~100 parameter tensors), batch per rank, SGD
# momentum and threads (1 per process), in one run: bucketed (25 MiB) and one all-reduce per
# tensor, then kiln's scaling over 1, 2 and 4 processes. Prints every figure and a summary table.
#
#   cmake --build build -j2 --target bench_ddp && python3 bench/ddp_vs_pytorch.py [--runs 3] [--tcp]
#
# --tcp makes OpenMPI use TCP over loopback instead of shared memory (closer to two hosts).
# As root it sets OMPI_ALLOW_RUN_AS_ROOT; more processes than cores run with --oversubscribe.
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_ms(output):
    m = re.search(r"step ([\d.]+) ms", output)
    if not m:
        sys.exit("no step time in:\n" + output)
    return float(m.group(1))


def run(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    line = [l for l in out.stdout.splitlines() if "step" in l][-1]
    print("  " + line, flush=True)
    return line


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tcp", action="store_true")
    p.add_argument("--bench", default=os.path.join(ROOT, "build", "bench", "bench_ddp"))
    args = p.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", KILN_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    transport = ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"] if args.tcp else []

    def kiln(ranks, bucket_mb):
        e = dict(env, KILN_BUCKET_MB=str(bucket_mb))
        return run(["mpirun", "--oversubscribe", *transport, "-np", str(ranks), args.bench], e)

    def torch(bucket_mb):
        return run([sys.executable, os.path.join(ROOT, "bench", "pytorch_ddp.py"), "--ranks", "2",
                    "--bucket-mb", str(bucket_mb)], env)

    results = {k: [] for k in ["kiln 25", "kiln tensor", "torch 25", "torch tensor", "kiln np1", "kiln np4"]}
    hidden = []
    for r in range(args.runs):
        print(f"run {r + 1}", flush=True)
        line = kiln(2, 25)
        results["kiln 25"].append(step_ms(line))
        hidden.append(float(re.search(r"hidden (\d+)%", line).group(1)))
        results["kiln tensor"].append(step_ms(kiln(2, 0.0001)))
        results["torch 25"].append(step_ms(torch(25)))
        results["torch tensor"].append(step_ms(torch(0.0001)))
        results["kiln np1"].append(step_ms(kiln(1, 25)))
        results["kiln np4"].append(step_ms(kiln(4, 25)))
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmedians of {args.runs} run(s), 2 ranks, {'TCP loopback' if args.tcp else 'shared memory'}")
    print("| step time (ms) | kiln | PyTorch DDP (gloo) | kiln / PyTorch |")
    print("|---|---|---|---|")
    print(f"| buckets of 25 MiB | {med['kiln 25']:.2f} | {med['torch 25']:.2f} | {med['torch 25'] / med['kiln 25']:.2f}x faster |")
    print(f"| one all-reduce per tensor | {med['kiln tensor']:.2f} | {med['torch tensor']:.2f} | "
          f"{med['torch tensor'] / med['kiln tensor']:.2f}x faster |")
    print(f"| bucketed / per tensor | {med['kiln tensor'] / med['kiln 25']:.2f}x | "
          f"{med['torch tensor'] / med['torch 25']:.2f}x | |")
    print(f"kiln all-reduce time hidden under the backward (25 MiB buckets): {statistics.median(hidden):.0f}%")
    print("kiln scaling (examples/s = processes x 64 / step):")
    for n, key in [(1, "kiln np1"), (2, "kiln 25"), (4, "kiln np4")]:
        print(f"  {n} process(es): {n * 64 / med[key] * 1e3:.0f} examples/s (step {med[key]:.2f} ms)")


if __name__ == "__main__":
    main()
