#!/usr/bin/env python3
"""train_gpt against the same GPT in PyTorch (eager and torch.compile), same run.

The PyTorch twin has kiln's nn::GPT architecture and recipe: byte vocabulary of the same text,
token + learned positional embeddings, pre-LN blocks (causal attention, 4x GELU MLP), final
LayerNorm, head tied to the token embedding, GPT-2 initialization; AdamW (0.9, 0.95, weight
decay 0.1 on every parameter, as kiln's), linear warm-up over 10% of the steps then cosine to a
tenth, gradients clipped to norm 1; random windows of ctx + 1 bytes. Steady-state speed is
measured without the first --short steps (compilation, warm-up): kiln runs --short and --long
steps and its rate is (long - short) steps' tokens over the difference of the two wall times;
PyTorch times steps short..long inside one run. Medians of --runs alternating runs. Also prints each one's validation loss after --long steps.

    python3 bench/gpt_vs_pytorch.py [--binary build/samples/train_gpt] [--short 30] [--long 230] [--runs 2]
"""
import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time


def read_text(path):
    if os.path.isdir(path):
        data = b""
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    data += f.read()
        return data
    with open(path, "rb") as f:
        return f.read()


def pytorch_run(args, steps, compiled):
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    text = read_text(args.text)
    vocab = sorted(set(text))
    index = {b: i for i, b in enumerate(vocab)}
    tokens = torch.tensor([index[b] for b in text], dtype=torch.long)
    split = len(tokens) * 9 // 10
    train, val = tokens[:split], tokens[split:]
    V, C, D, H, L = len(vocab), args.ctx, args.dim, args.heads, args.layers

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(D), tnn.LayerNorm(D)
            self.qkv, self.out_proj = tnn.Linear(D, 3 * D), tnn.Linear(D, D)
            self.fc, self.proj = tnn.Linear(D, 4 * D), tnn.Linear(4 * D, D)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
            q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, D)
            x = x + self.out_proj(y)
            return x + self.proj(F.gelu(self.fc(self.ln2(x))))

    class GPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = tnn.Embedding(V, D), tnn.Embedding(C, D)
            self.blocks = tnn.ModuleList(Block() for _ in range(L))
            self.ln_f = tnn.LayerNorm(D)
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                if name.endswith("bias"):
                    tnn.init.zeros_(p)
                else:
                    std = 0.02 / math.sqrt(2 * L) if name.endswith("out_proj.weight") or name.endswith(".proj.weight") else 0.02
                    tnn.init.normal_(p, 0.0, std)

        def forward(self, idx):
            h = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
            for b in self.blocks:
                h = b(h)
            return self.ln_f(h) @ self.tokens.weight.t()

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)

    def lr_at(s):
        if s < warmup:
            return args.lr * (s + 1) / warmup
        t = min(s - warmup, max(1, steps - warmup))
        return args.lr / 10 + (args.lr - args.lr / 10) * (1 + math.cos(math.pi * t / max(1, steps - warmup))) / 2

    def loss_fn(x, y):
        return F.cross_entropy(model(x).view(-1, V), y.view(-1))

    step_loss = torch.compile(loss_fn) if compiled else loss_fn
    gen = torch.Generator().manual_seed(args.seed)

    def batch(data, g):
        starts = torch.randint(0, len(data) - C - 1, (args.batch,), generator=g)
        x = torch.stack([data[s:s + C] for s in starts])
        y = torch.stack([data[s + 1:s + C + 1] for s in starts])
        return x, y

    start = time.perf_counter()
    for s in range(steps):
        if s == args.short:  # steady state from here: compilation and warm-up are behind
            start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(s)
        x, y = batch(train, gen)
        loss = step_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        g = torch.Generator().manual_seed(1234)
        v = statistics.mean(loss_fn(*batch(val, g)).item() for _ in range(8))
    return seconds, v, torch.__version__


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
    parser.add_argument("--text", default="/usr/share/common-licenses")
    parser.add_argument("--short", type=int, default=30)
    parser.add_argument("--long", type=int, default=230)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
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
