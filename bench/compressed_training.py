#!/usr/bin/env python3
"""Training with compressed saved activations against float32, same run.

Runs `train_mnist --model M` for one epoch with and without `--compress-activations int8`,
alternating, and prints per model: the activation bytes the step keeps for its backward (from
the sample's "saved for the backward" line), training examples/s (median of --runs), and test
accuracy, each next to its float32 baseline. The issue's targets: saved bytes <= 0.3x,
step time <= 1.15x, accuracy within 1 point.

    python3 bench/compressed_training.py [--binary build/samples/train_mnist] [--models mlp,cnn] [--runs 3]
"""
import argparse
import re
import statistics
import subprocess
import sys


def run(binary, model, compress):
    command = [binary, "--model", model, "--compress-activations", "int8" if compress else "none"]
    text = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    rate = float(re.search(r"training: (\d+) examples/s", text).group(1))
    accuracy = float(re.search(r"test accuracy: ([\d.]+)%", text).group(1))
    saved = re.search(r"activations ([\d.]+ \S+) \(float32, uncompressed: ([\d.]+ \S+), ([\d.]+)x\)", text)
    return rate, accuracy, saved.groups() if saved else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default="build/samples/train_mnist")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for model in args.models.split(","):
        rates = {False: [], True: []}
        accuracy, saved = {}, None
        for _ in range(args.runs):
            for compress in (False, True):
                rate, acc, s = run(args.binary, model, compress)
                rates[compress].append(rate)
                accuracy[compress] = acc  # deterministic: the same seed gives the same run
                saved = saved or s
        wide, narrow = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"{model}: saved activations {saved[0]} vs {saved[1]} float32 ({saved[2]}x, target <= 0.3x)")
        print(f"{model}: examples/s {narrow:.0f} vs {wide:.0f} float32: step time {wide / narrow:.2f}x "
              f"(target <= 1.15x; medians of {args.runs}, alternating)")
        print(f"{model}: test accuracy {accuracy[True]:.2f}% vs {accuracy[False]:.2f}% float32 "
              f"({accuracy[True] - accuracy[False]:+.2f} points, target within 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
