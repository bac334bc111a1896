# PyTorch baseline for samples/train_mnist: the same models, recipe, batch, threads and data.
#
#   python3 bench/pytorch_mnist.py                 # MLP 784-512-512-10, 1 epoch, 2 threads
#   python3 bench/pytorch_mnist.py --model cnn     # conv 32, pool, conv 64, pool, fc 128, fc 10
#   python3 bench/mnist_vs_pytorch.py              # both frameworks side by side (peak RSS too)
#   python3 bench/pytorch_mnist.py --amp bf16      # torch.autocast("cpu", torch.bfloat16) forward
#   python3 bench/pytorch_mnist.py --compile --log-csv loss.csv   # torch.compile; step,loss per step
#
# Recipe (train_mnist's default): inputs normalized with the training set's mean and std
# (0.2860, 0.3530), SGD momentum 0.9, lr 0.05 annealed to 0 by CosineAnnealingLR stepped per
# batch, batch 128, shuffled with drop_last; the loss and the batch's correct predictions are read
# every step (train_mnist's progress bar does too). Test accuracy is computed in batches of 1000.
# Data: the IDX files of Debian's dataset-fashion-mnist package (--data DIR to override).
#
# Prints `test accuracy: NN.NN%` and `training: N examples/s (...)` in train_mnist's format:
# training time covers every step of every epoch, the first included, and no evaluation (with
# --compile the first step compiles, or loads Inductor's cache: warm it with a short run first,
# as bench/compare.py does), and `steady: N examples/s` over the first epoch's steps after its
# tenth (what train_mnist's progress bar gives between step 10 and the last). Also prints what autograd saves for the backward of the first batch
# (bench/pytorch_saved.py; measured on the eager module, also under --compile).
import argparse
import gzip
import os
import time

import numpy as np
import torch

from pytorch_saved import saved_bytes

MEAN, STD = 0.2860, 0.3530


def parse_args():
    p = argparse.ArgumentParser(description="PyTorch baseline for samples/train_mnist")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps in all (-1: no limit)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=os.environ.get("KILN_DATA_DIR", "/usr/share/datasets/fashion-mnist"))
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="torch.autocast on the CPU for the forward and the loss (fp16 adds a GradScaler)")
    p.add_argument("--compile", action="store_true", help="train and evaluate torch.compile(model)")
    p.add_argument("--log-csv", default="", help="write step,loss per step to this CSV file (train_mnist's format)")
    return p.parse_args()


def read_idx(path, offset):
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def load(data, split, model):
    """Images as normalized float32 (N, 784) or (N, 1, 28, 28), labels int64 (N)."""
    prefix = "train" if split == "train" else "t10k"
    def find(name):
        for suffix in (".gz", ""):
            if os.path.exists(os.path.join(data, name + suffix)):
                return os.path.join(data, name + suffix)
        raise SystemExit(f"missing {name}(.gz) in {data}: apt-get install dataset-fashion-mnist, or pass --data DIR")
    images = torch.from_numpy(read_idx(find(f"{prefix}-images-idx3-ubyte"), 16).copy()).to(torch.float32)
    images.div_(255).sub_(MEAN).div_(STD)  # in place: one float copy of the data set, as kiln holds
    images = images.view(-1, 1, 28, 28) if model == "cnn" else images.view(-1, 784)
    labels = torch.from_numpy(read_idx(find(f"{prefix}-labels-idx1-ubyte"), 8).astype(np.int64))
    return images, labels


def make_model(name):
    nn = torch.nn
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return nn.Sequential(  # (B, 1, 28, 28) -> (B, 10)
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # (B, 32, 14, 14)
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 64, 7, 7)
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    X, Y = load(args.data, "train", args.model)
    Xt, Yt = load(args.data, "test", args.model)
    model = make_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    steps_per_epoch = len(X) // args.batch  # drop_last
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps >= 0:
        total_steps = min(total_steps, args.max_steps)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(total_steps, 1))
    generator = torch.Generator().manual_seed(args.seed)
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
    x0, y0 = X[:args.batch].clone(), Y[:args.batch].clone()  # storages of their own: the hooks count storages
    def first_loss():
        return torch.nn.functional.cross_entropy(model(x0), y0)
    wide, wide_w = saved_bytes(first_loss)
    if amp_dtype is not None:
        low, low_w = saved_bytes(first_loss, amp_dtype)
        print(f"saved for the backward: activations {low / 1024:.1f} KiB (float32: {wide / 1024:.1f} KiB, "
              f"{low / wide:.2f}x), weights {low_w / 1024:.1f} KiB (float32: {wide_w / 1024:.1f} KiB)")
    else:
        print(f"saved for the backward: activations {wide / 1024:.1f} KiB, weights {wide_w / 1024:.1f} KiB")
    step_model = torch.compile(model) if args.compile else model
    csv = open(args.log_csv, "w") if args.log_csv else None
    if csv:
        csv.write("step,loss\n")

    train_seconds, examples, global_step, steady = 0.0, 0, 0, None
    for epoch in range(1, args.epochs + 1):
        if global_step == total_steps:
            break
        model.train()
        perm = torch.randperm(len(X), generator=generator)
        start = time.perf_counter()
        correct_total, seen = 0, 0
        steady_start = None  # (time, examples) after the epoch's first 10 steps
        for step in range(min(steps_per_epoch, total_steps - global_step)):
            idx = perm[step * args.batch:(step + 1) * args.batch]
            x, y = X[idx], Y[idx]
            with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = step_model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            schedule.step()
            loss_value = loss.item()
            if csv:
                csv.write(f"{global_step + 1},{loss_value:.9g}\n")
            correct_total += (logits.argmax(1) == y).sum().item()
            seen += len(y)
            global_step += 1
            if step == 9:
                steady_start = (time.perf_counter(), seen)
        end = time.perf_counter()
        train_seconds += end - start
        if epoch == 1 and steady_start and seen > steady_start[1]:
            steady = (seen - steady_start[1]) / (end - steady_start[0])
        examples += seen
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(Xt), 1000):
                correct += (step_model(Xt[i:i + 1000]).argmax(1) == Yt[i:i + 1000]).sum().item()
        accuracy = 100.0 * correct / len(Xt)
        print(f"epoch {epoch}: test accuracy {accuracy:.2f}% (train accuracy {100.0 * correct_total / seen:.1f}%)")
    if csv:
        csv.close()
    print(f"pytorch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}"
          f"{', torch.compile' if args.compile else ''}")
    print(f"test accuracy: {accuracy:.2f}%")
    print(f"training: {examples / train_seconds:.0f} examples/s ({examples} examples in {train_seconds:.2f} s, "
          "first step included, evaluation excluded)")
    if steady:
        print(f"steady: {steady:.0f} examples/s (epoch 1 after its first 10 steps)")


if __name__ == "__main__":
    main()
