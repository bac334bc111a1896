# PyTorch side of bench/bench_scaling.cpp: the same MLP 784-W-W-10 training step (ReLU,
# cross-entropy, SGD momentum 0.9, loss read every step) over batch sizes or widths, eager, and
# the machine's float32 GEMM rate measured with torch.mm in the same process.
#
#   python3 bench/pytorch_scaling.py --batches 1,8,64,512 --width 512
#   python3 bench/pytorch_scaling.py --batch 128 --widths 256,1024,4096
#   python3 bench/pytorch_scaling.py --gemm-rate          # prints gemm,GFLOP/s only
import argparse
import statistics
import time

import torch


def ints(text):
    return [int(v) for v in text.split(",")]


def step_ms(batch, width, seconds):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.rand(batch, 784)
    y = torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()

    for _ in range(3):
        step()
    times, start = [], time.perf_counter()
    while len(times) < 5 or (len(times) < 500 and time.perf_counter() - start < seconds):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_gflops(n=1024, reps=20):
    a, b = torch.rand(n, n), torch.rand(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", "--batch", type=ints, default=[128])
    p.add_argument("--widths", "--width", type=ints, default=[512])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gemm-rate", action="store_true", help="print the float32 GEMM rate (GFLOP/s) and stop")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.gemm_rate:
        print(f"gemm,{gemm_gflops():.1f}")
        return
    print("framework,batch,width,step_ms")
    for width in args.widths:
        for batch in args.batches:
            print(f"pytorch,{batch},{width},{step_ms(batch, width, args.seconds):.4f}", flush=True)


if __name__ == "__main__":
    main()
