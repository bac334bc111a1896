#!/usr/bin/env python3
"""PyTorch twin of bench/bench_fusion.cpp: y = gelu(x * a + b) * c over 16M float32.

The same two variants, data and timing as bench_fusion: a, b, c as scalars (a changes every
iteration) or as float32 tensors shaped like x; three input sets used in turn, so no result can
be reused; three untimed iterations first (torch.compile compiles there, and specializes on the
changing scalar once), then the median and best of --iterations. gelu is the exact (erf) one,
as kiln's default. Eager runs four ATen kernels with three temporaries; --compile lets Inductor
fuse the chain into one loop, as kiln does.

    python3 bench/pytorch_fusion.py [--iterations 15] [--threads 2] [--compile]

Prints a line per variant in bench_fusion's layout: name, median ms, best ms, GB/s.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

ELEMENTS = 16 * 1024 * 1024  # 16M float32 = 64 MiB per tensor
BYTES = ELEMENTS * 4
VARIANTS = (("fused, a/b/c scalars (128 MiB)", False), ("fused, a/b/c tensors (320 MiB)", True))


def chain(x, a, b, c):
    return F.gelu(x * a + b) * c


def samples(tensor_operands, iterations, compiled):
    """Seconds per iteration of the variant, after three untimed ones."""
    sets = []
    for _ in range(3):
        s = [torch.randn(ELEMENTS)]
        if tensor_operands:
            s += [torch.rand(ELEMENTS) + 0.5 for _ in range(3)]
        sets.append(s)
    fn = torch.compile(chain) if compiled else chain

    def run(i):
        s = sets[i % 3]
        return fn(*s) if tensor_operands else fn(s[0], 1.5 + 0.01 * i, 0.25, 0.75)

    for i in range(3):
        run(i)
    times = []
    for i in range(iterations):
        start = time.perf_counter()
        y = run(i)
        times.append(time.perf_counter() - start)
        del y
    return times


def main():
    p = argparse.ArgumentParser(description="PyTorch twin of bench_fusion")
    p.add_argument("--iterations", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile the chain (Inductor fuses it)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"pytorch_fusion: y = gelu(x * a + b) * c, {ELEMENTS} float32, {args.iterations} iterations, "
          f"{torch.get_num_threads()} threads, {'torch.compile' if args.compile else 'eager'}, torch {torch.__version__}")
    for name, tensor_operands in VARIANTS:
        t = samples(tensor_operands, args.iterations, args.compile)
        moved = (5.0 if tensor_operands else 2.0) * BYTES
        print(f"{name:<36} {statistics.median(t) * 1e3:>7.2f}ms {min(t) * 1e3:>7.2f}ms "
              f"{moved / statistics.median(t) / 1e9:>9.2f}")


if __name__ == "__main__":
    main()
