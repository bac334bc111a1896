#!/usr/bin/env python3
# PyTorch DistributedDataParallel (gloo) on the model bench_ddp trains: a deep MLP (48 Linear
# layers of 256 with ReLU), SGD momentum, random data per rank, MSE loss. Spawns `--ranks`
# processes on this machine (TCP on 127.0.0.1) and prints rank 0's median step time.
#
#   python3 bench/pytorch_ddp.py --ranks 2 [--bucket-mb 25] [--threads 1]
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(1)
    layers = []
    for i in range(args.layers):
        layers.append(torch.nn.Linear(args.width, args.width))
        if i + 1 < args.layers:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    times = []
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        if s >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        print(f"pytorch {torch.__version__} DDP gloo ranks {args.ranks} layers {args.layers} width {args.width} "
              f"batch {args.batch}/rank bucket_mb {args.bucket_mb}: step {statistics.median(times):.3f} ms "
              f"(median of {args.steps})", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    mp.spawn(run, args=(args,), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
