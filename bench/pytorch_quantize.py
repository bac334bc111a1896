#!/usr/bin/env python3
# PyTorch's dynamic int8 Linear (torch.ao.quantization.quantize_dynamic) against its float32
# Linear, on the shapes bench_quantize times: 768 -> 3072 and 3072 -> 768 at batch 1, 8, 32, 128,
# under torch.inference_mode, medians of --runs forwards.
#
#   python3 bench/pytorch_quantize.py [--runs 200 --threads 2]
import argparse
import statistics
import time

import torch


def median_us(fn, runs):
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"pytorch {torch.__version__}, quantized engine {torch.backends.quantized.engine}")
    print(f"{'layer':>14} {'batch':>6} {'float32 us':>12} {'int8 us':>12} {'speed-up':>8}")
    for inp, out in ((768, 3072), (3072, 768)):
        torch.manual_seed(1)
        fc = torch.nn.Sequential(torch.nn.Linear(inp, out))
        q = torch.ao.quantization.quantize_dynamic(fc, {torch.nn.Linear}, dtype=torch.qint8)
        for batch in (1, 8, 32, 128):
            x = torch.randn(batch, inp)
            with torch.inference_mode():
                f32 = median_us(lambda: fc(x), args.runs)
                i8 = median_us(lambda: q(x), args.runs)
            print(f"{inp:>6}->{out:<7} {batch:>6} {f32:>12.1f} {i8:>12.1f} {f32 / i8:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
