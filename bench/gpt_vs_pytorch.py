#!/usr/bin/env python3
"""train_gpt against the same GPT in PyTorch (eager and torch.compile), same run.

The PyTorch twin (bench/pytorch_gpt.py, run in this process) has kiln's nn::GPT architecture and
recipe. Steady-state speed is
measured without the first --short steps (compilation, warm-up): kiln runs --short and --long
steps and its rate is (long - short) steps' tokens over the difference of the two wall times;
PyTorch times steps short..long inside one run. Medians of --runs alternating runs. Also prints each one's validation loss after --long steps.

    python3 bench/gpt_vs_pytorch.py [--binary build/samples/train_gpt] [--short 30] [--long 230] [--runs 2]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt import add_model_args, train  # noqa: E402


def pytorch_run(args, steps, compiled):
    seconds, val, version, _ = train(args, steps, compiled, timed_from=args.short)  # steps short..steps timed
    return seconds, val, version


def kiln_run(args, steps):
    command = [args.binary, "--text", args.text, "--steps", str(steps), "--batch", str(args.batch), "--ctx",
               str(args.ctx), "--layers", str(args.layers), "--heads", str(args.heads), "--dim", str(args.dim),
               "--lr", str(args.lr), "--seed", str(args.seed), "--eval-every", str(max(1, steps))]
    env = dict(os.environ, KILN_NUM_THREADS=str(args.threads))
    start = time.perf_counter()
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    seconds = time.perf_counter() - start
    val = float(re.findall(r"val ([\d.]+)", out)[-1])
    return seconds, val


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default="build/samples/train_gpt")
    parser.add_argument("--short", type=int, default=30)
    parser.add_argument("--long", type=int, default=230)
    parser.add_argument("--runs", type=int, default=2)
    add_model_args(parser)
    args = parser.parse_args()
    tokens = (args.long - args.short) * args.batch * args.ctx
    rates = {"kiln": [], "PyTorch eager": [], "torch.compile": []}
    vals = {}
    version = "?"
    for _ in range(args.runs):
        t_short, _ = kiln_run(args, args.short)
        t_long, vals["kiln"] = kiln_run(args, args.long)
        rates["kiln"].append(tokens / (t_long - t_short))
        for name, compiled in (("PyTorch eager", False), ("torch.compile", True)):
            seconds, vals[name], version = pytorch_run(args, args.long, compiled)  # steps short..long timed
            rates[name].append(tokens / seconds)
    print(f"GPT {args.layers} layers, dim {args.dim}, {args.heads} heads, ctx {args.ctx}, batch {args.batch}; "
          f"{args.threads} threads; PyTorch {version}; medians of {args.runs} runs")
    kiln_rate = statistics.median(rates["kiln"])
    for name, r in rates.items():
        rate = statistics.median(r)
        print(f"  {name:>14}: {rate / 1e3:6.1f}k tokens/s (kiln / this {kiln_rate / rate:.2f}x), "
              f"validation loss after {args.long} steps {vals[name]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
