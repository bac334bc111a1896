#!/usr/bin/env python3
"""pytorch_memory: the PyTorch side of bench_memory -- memory of one SGD training step of the
same MLPs kiln's bench_memory runs, on the CPU.

Two figures per model, measured on the third step (the first two warm up PyTorch's lazy init):
  saved   bytes autograd saves for backward, from torch.autograd.graph.saved_tensors_hooks: the
          sum of nbytes over the unique storages packed during the forward. Reported in full and
          as activations only (without the parameters and the input batch, which every framework
          holds anyway); bench_memory compares kiln's arena with the activations-only figure.
  rss     peak RSS during the step minus RSS before it (VmHWM after resetting it through
          /proc/self/clear_refs, minus VmRSS), with MALLOC_MMAP_THRESHOLD_=131072 (the script
          restarts itself with it, as bench_memory sets M_MMAP_THRESHOLD for kiln) so freed large
          blocks go back to the OS and every step starts from the same RSS; without it glibc keeps
          them and the delta reads ~0.

Run:   python3 bench/pytorch_memory.py [--json] [--models a,b]
Needs: pip install torch --index-url https://download.pytorch.org/whl/cpu
"""
import argparse
import json
import os
import resource
import sys

import torch
import torch.nn.functional as F

# The models of bench_memory.cpp: layer widths and batch size.
MODELS = {
    "a": {"title": "MLP 784-512-512-10, batch 128", "widths": [784, 512, 512, 10], "batch": 128},
    "b": {"title": "MLP 16 layers 1024 wide, batch 256", "widths": [1024] * 16 + [10], "batch": 256},
}


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_peak_rss():
    """Sets VmHWM back to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_mlp(widths):
    # (in, out) weights as kiln's matmul(h, w) + b; scaled like bench_memory's
    params = []
    for i in range(len(widths) - 1):
        params.append((torch.randn(widths[i], widths[i + 1]) * 0.05).requires_grad_())
        params.append(torch.zeros(widths[i + 1]).requires_grad_())
    return params


def forward(params, x, y):
    h = x  # (B, widths[0])
    for i in range(0, len(params), 2):
        h = torch.addmm(params[i + 1], h, params[i])  # (B, widths[i/2 + 1])
        if i + 2 < len(params):
            h = F.relu(h)
    return F.cross_entropy(h, y)


def step(params, x, y, lr, saved=None):
    """One SGD step; with `saved` (a dict), records storages autograd saves for backward."""

    def pack(t):
        if saved is not None:
            storage = t.untyped_storage()
            # No reference kept: that would hold the tensor past its use in backward. While the
            # forward runs every saved storage is alive, so addresses cannot repeat.
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward(params, x, y)
    loss.backward()
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None
    return loss.item()


def measure(model):
    torch.manual_seed(1)
    params = make_mlp(model["widths"])
    x = torch.randn(model["batch"], model["widths"][0])
    y = torch.randint(0, model["widths"][-1], (model["batch"],))
    for _ in range(2):
        step(params, x, y, 0.01)

    saved = {}
    rss_before = status_kib("VmRSS")
    hwm_reset = reset_peak_rss()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(params, x, y, 0.01, saved)
    if hwm_reset:
        rss_delta = (status_kib("VmHWM") - rss_before) * 1024
    else:  # lifetime peak only: growth of it, 0 if the step stayed below an earlier peak
        rss_delta = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before) * 1024

    held = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr(),
                                                                y.untyped_storage().data_ptr()}
    saved_total = sum(saved.values())
    saved_activations = sum(nbytes for ptr, nbytes in saved.items() if ptr not in held)
    return {
        "title": model["title"],
        "saved_bytes": saved_total,
        "saved_activation_bytes": saved_activations,
        "saved_tensors": len(saved),
        "rss_delta_bytes": rss_delta,
        "rss_method": "VmHWM reset via clear_refs" if hwm_reset else "ru_maxrss growth",
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
    }


def mib(n):
    return f"{n / 2**20:.2f} MiB"


def main():
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # glibc reads it at start: run again with it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (for bench_memory)")
    parser.add_argument("--models", default="a,b", help="comma-separated: a, b")
    args = parser.parse_args()
    results = {name: measure(MODELS[name]) for name in args.models.split(",")}
    if args.json:
        print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "models": results}))
        return
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, r in results.items():
        print(f"model {name}: {r['title']}")
        print(f"  saved for backward: {mib(r['saved_bytes'])} in {r['saved_tensors']} storages, "
              f"activations only {mib(r['saved_activation_bytes'])}")
        print(f"  peak RSS delta of the step: {mib(r['rss_delta_bytes'])} ({r['rss_method']})")


if __name__ == "__main__":
    sys.exit(main())
