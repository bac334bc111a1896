#!/usr/bin/env python3
# PyTorch's torch.distributed.pipelining (gloo, CPU) on the model and split bench_pipeline
# trains: 16 Linear(512) + ReLU layers cut into 2 stages of 8, batch 256 as 8 micro-batches, MSE
# loss, SGD momentum, GPipe then 1F1B. Spawns one process per stage (TCP on 127.0.0.1) and prints
# the last stage's median step time.
#
#   python3 bench/pytorch_pipeline.py [--stages 2 --micro-batches 8 --threads 1]
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def stage_module(args, stage):
    torch.manual_seed(1)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    per = len(layers) // args.stages
    return torch.nn.Sequential(*layers[stage * per:(stage + 1) * per])


def run(rank, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    torch.manual_seed(7)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    module = stage_module(args, rank)
    stage = PipelineStage(module, rank, args.stages, torch.device("cpu"))
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    for name, cls in (("GPipe", ScheduleGPipe), ("1F1B", Schedule1F1B)):
        schedule = cls(stage, args.micro_batches, loss_fn=torch.nn.functional.mse_loss)
        times = []
        for s in range(args.warmup + args.steps):
            if s == args.warmup:
                dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == args.stages - 1:
                losses = []
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            opt.step()
            if s >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        median = torch.tensor([statistics.median(times)])
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        if rank == args.stages - 1:
            print(f"pytorch {torch.__version__} pipelining {name} p {args.stages} m {args.micro_batches} layers "
                  f"{args.layers} width {args.width} batch {args.batch}: step {median.item():.2f} ms (median of "
                  f"{args.steps}, slowest stage); parameters per stage {params / 2**20:.1f} MiB", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    mp.spawn(run, args=(args,), nprocs=args.stages, join=True)


if __name__ == "__main__":
    main()
