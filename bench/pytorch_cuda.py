# PyTorch's side of bench/bench_cuda.cpp: the same four measurements, the same sizes and timing,
# on the same GPU, written as a PyTorch user would (eager mode, no torch.compile).
#
#   python3 bench/pytorch_cuda.py --json /tmp/pytorch_cuda.json    # on the GPU machine (< 60 s)
#   ./build-bench/bench/bench_cuda --pytorch-json /tmp/pytorch_cuda.json
#   python3 bench/pytorch_cuda.py --device cpu --scale 0.001       # exercises the code without a GPU
#
#   1  y = relu(x * a + b) * c over 256M float32 (eager: four kernels), GB/s counting x read once
#      and y written once, next to a device-to-device copy of the same bytes (dst.copy_(src))
#   2  softmax(x, -1) and layer_norm(x, (1024,), w, b) over 65536 x 1024 float32, GB/s as in 1
#   2b torch.sum(x) over 256M float32 into one value, GB/s counting x read once
#   3  torch.matmul of two 8192 x 8192 bfloat16 matrices, TFLOP/s = 2 M N K / time
#   4  training steps: MLP 784-512-512-10 and the CNN of samples/train_mnist.cpp (conv 32, pool,
#      conv 64, pool, fc 128, fc 10), one synthetic batch of 128 on the device, SGD momentum 0.9
#      lr 0.05, cross entropy, loss.item() every step; examples/s
#
# As in bench_cuda: each sample queues several runs back to back and then synchronizes; figures
# are medians over --reps samples after 3 warm-up runs; --scale multiplies the element count of 1
# and 2, the flop count of 3 (each dimension by scale^(1/3), a multiple of 16) and the batch of 4
# (8 to 128). TF32 is off for matmuls and convolutions, as in kiln by default (KILN_TF32=0), so
# both sides compute float32 in float32.
#
# Without torch or without CUDA it says why, writes {"available": false, "reason": ...} to --json
# and exits 0.
import argparse
import json
import math
import statistics
import sys
import time

WARMUP = 3
STEPS_PER_SAMPLE = 10


def parse_args():
    p = argparse.ArgumentParser(description="PyTorch's side of bench/bench_cuda.cpp")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu only checks that the code runs")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every size by this")
    p.add_argument("--reps", type=int, default=20, help="timed samples per figure (medians are reported)")
    p.add_argument("--json", help="write the figures to this JSON file")
    return p.parse_args()


def unavailable(args, reason):
    print(f"pytorch_cuda: skipped, {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"available": False, "reason": reason}, f)
    sys.exit(0)


def llround(v):
    """C's llround for v >= 0 (Python's round() rounds halves to even)."""
    return math.floor(v + 0.5)


class Sizes:
    """bench_cuda's Sizes: the same rounding, so both programs measure the same shapes."""
    def __init__(self, scale):
        self.elements = max(1024, llround(256 * 2**20 * scale))
        self.rows, self.cols = max(1, llround(65536 * scale)), 1024
        self.matmul = max(16, 16 * llround(8192 * scale ** (1 / 3) / 16))
        self.batch = min(max(llround(128 * scale), 8), 128)


def main():
    args = parse_args()
    try:
        import torch
    except ImportError as e:
        unavailable(args, f"torch does not import ({e})")
    if args.device == "cuda" and not torch.cuda.is_available():
        unavailable(args, f"torch {torch.__version__} sees no CUDA device")
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    s = Sizes(args.scale)
    gpu = torch.cuda.get_device_name(0) if dev.type == "cuda" else "host CPU"

    def samples(run, inner):
        """Seconds per run: --reps samples of `inner` runs, each sample closed by a synchronize."""
        i = 0
        for _ in range(WARMUP):
            run(i)
            i += 1
        sync()
        out = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for _ in range(inner):
                run(i)
                i += 1
            sync()
            out.append((time.perf_counter() - start) / inner)
        return out

    def copy_gbps(nbytes):
        src = torch.ones(nbytes // 4, device=dev)
        dst = torch.empty_like(src)
        return 2 * nbytes / statistics.median(samples(lambda i: dst.copy_(src), 10)) / 1e9

    def bandwidth(name, nbytes, run, note, moved=None):
        before = copy_gbps(nbytes)
        value = (2 * nbytes if moved is None else moved) / statistics.median(samples(run, 10)) / 1e9
        copy = (before + copy_gbps(nbytes)) / 2
        return {"name": name, "unit": "GB/s", "value": value, "baseline_name": "D2D copy", "baseline": copy,
                "ratio": value / copy, "note": note}

    def fused_chain():
        # a changes every run, as in bench_cuda.
        x = torch.randn(s.elements, device=dev)  # (N)
        return bandwidth(f"relu(x*a+b)*c, {s.elements} f32", 4 * s.elements,
                         lambda i: torch.relu(x * (1.5 + 1e-3 * (i % 64)) + 0.25) * 0.75, "eager: 4 kernels")

    def row_op(softmax):
        x = torch.randn(s.rows, s.cols, device=dev)  # (R, C)
        w, b = torch.rand(s.cols, device=dev) + 0.5, torch.randn(s.cols, device=dev)  # (C)
        name = "softmax" if softmax else "layer_norm"
        op = (lambda i: torch.softmax(x, -1)) if softmax else \
            (lambda i: torch.nn.functional.layer_norm(x, (s.cols,), w, b))
        return bandwidth(f"{name} {s.rows}x{s.cols} f32", 4 * s.rows * s.cols, op, "")

    def full_sum():
        x = torch.rand(s.elements, device=dev)  # (N)
        return bandwidth(f"sum of {s.elements} f32", 4 * s.elements, lambda i: torch.sum(x), "", moved=4 * s.elements)

    def matmul_bf16():
        n = s.matmul
        a = torch.randn(n, n, device=dev).to(torch.bfloat16)  # (M, K)
        b = torch.randn(n, n, device=dev).to(torch.bfloat16)  # (K, N)
        tflops = 2 * n**3 / statistics.median(samples(lambda i: torch.matmul(a, b), 5)) / 1e12
        return {"name": f"matmul {n}^3 bf16", "unit": "TFLOP/s", "value": tflops, "note": "fp32 accumulation"}

    # The models of samples/train_mnist.cpp, taking (B, 784) inputs as there.
    nn = torch.nn

    def mlp():
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def cnn():
        return nn.Sequential(nn.Unflatten(1, (1, 28, 28)),
                             nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def training(title, make, amp=None):
        torch.manual_seed(0)
        model = make().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        xb = torch.randn(s.batch, 784, device=dev)  # (B, 784): one synthetic batch
        yb = torch.randint(0, 10, (s.batch,), device=dev)  # (B)
        losses = []

        def step(i):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())  # the host waits for every step, as kiln's side does

        per_step = statistics.median(samples(step, STEPS_PER_SAMPLE))
        name = f"{title} train step{' (bf16 autocast)' if amp is not None else ''}, batch {s.batch}"
        return {"name": name, "unit": "ex/s", "value": s.batch / per_step,
                "note": f"loss {losses[0]:.4g} -> {losses[-1]:.4g}"}

    print(f"PyTorch {torch.__version__} on {dev.type} ({gpu}); scale {args.scale}, {args.reps} samples per figure;"
          f" TF32 off; training reads loss.item() every step", flush=True)
    plan = [("fused_chain", fused_chain), ("softmax", lambda: row_op(True)), ("layer_norm", lambda: row_op(False)),
            ("sum", full_sum), ("matmul_bf16", matmul_bf16), ("train_mlp", lambda: training("MLP", mlp)),
            ("train_cnn", lambda: training("CNN", cnn)),
            ("train_mlp_bf16", lambda: training("MLP", mlp, torch.bfloat16)),
            ("train_cnn_bf16", lambda: training("CNN", cnn, torch.bfloat16))]
    figures = {}
    start = time.perf_counter()
    for key, measure in plan:
        # One failing figure (out of memory, a missing library) leaves its error and not the others'.
        try:
            figures[key] = measure()
        except Exception as e:  # noqa: BLE001 - any failure is reported in the figure's place
            figures[key] = {"name": key, "value": None, "error": f"{type(e).__name__}: {e}"[:500], "note": ""}
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # give the last figure's blocks back: the next one gets the whole GPU
        print(f"[pytorch_cuda] {time.perf_counter() - start:.1f} s: {key} done", file=sys.stderr, flush=True)
        if args.json:  # rewritten after every figure: a run stopped by a timeout leaves what it measured
            with open(args.json, "w") as out:
                json.dump({"available": True, "complete": len(figures) == len(plan), "device": dev.type, "gpu": gpu,
                           "torch": torch.__version__, "scale": args.scale, "reps": args.reps, "batch": s.batch,
                           "tf32": False, "train_policy": "loss.item() every step", "figures": figures}, out, indent=2)

    print(f"{'figure':<36} {'value':>10} {'unit':<8} {'copy':>10} {'ratio':>6}  note")
    for f in figures.values():
        if f.get("error"):
            print(f"{f['name']:<36} error: {f['error']}")
            continue
        copy = f"{f['baseline']:.4g}" if "baseline" in f else "-"
        ratio = f"{f['ratio']:.2f}" if "ratio" in f else "-"
        print(f"{f['name']:<36} {f['value']:>10.4g} {f['unit']:<8} {copy:>10} {ratio:>6}  {f['note']}")


if __name__ == "__main__":
    main()
