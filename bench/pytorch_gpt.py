#!/usr/bin/env python3
"""PyTorch twin of samples/train_gpt: the same GPT, init and recipe, eager or torch.compile.

kiln's nn::GPT architecture and recipe: byte vocabulary of the same text, token + learned
positional embeddings, pre-LN blocks (causal attention, 4x GELU MLP), final LayerNorm, head tied
to the token embedding, GPT-2 initialization; AdamW (0.9, 0.95, weight decay 0.1 on every
parameter, as kiln's), linear warm-up over 10% of the steps then cosine to a tenth, gradients
clipped to norm 1; random windows of ctx + 1 bytes; validation loss as the mean over 8 fixed
batches of the last 10% of the text. --amp bf16 runs the forward and loss under
torch.autocast("cpu", torch.bfloat16) (train_gpt --amp bf16); --checkpoint recomputes each block
for the backward (torch.utils.checkpoint, non-reentrant; train_gpt --checkpoint).

    python3 bench/pytorch_gpt.py --steps 230                     # eager, steps 30..230 timed
    python3 bench/pytorch_gpt.py --steps 230 --compile --amp bf16 --log-csv loss.csv

Prints `steady: N tokens/s` (steps --timed-from .. --steps: compilation and warm-up behind),
`validation loss: V`, and what autograd saves for the backward of one step
(bench/pytorch_saved.py, on the eager module). bench/gpt_vs_pytorch.py and bench/compare.py
run it against train_gpt.
"""
import argparse
import math
import os
import statistics
import time


def add_model_args(parser):
    """The flags train_gpt and its twin share (bench/gpt_vs_pytorch.py passes them to both)."""
    parser.add_argument("--text", default="/usr/share/common-licenses")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)


def read_text(path):
    """The bytes of a file, or of a folder's regular files in sorted order (train_gpt's --text)."""
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


def make_gpt(V, args, checkpoint=False):
    """nn::GPT in PyTorch: V tokens, args.ctx / dim / heads / layers; logits (B, T, V)."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint as recompute

    C, D, H, L = args.ctx, args.dim, args.heads, args.layers

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(D), tnn.LayerNorm(D)
            self.qkv, self.out_proj = tnn.Linear(D, 3 * D), tnn.Linear(D, D)
            self.fc, self.proj = tnn.Linear(D, 4 * D), tnn.Linear(4 * D, D)

        def forward(self, x):  # (B, T, D)
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
            q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D / H)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)  # (B, H, T, T)
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

        def forward(self, idx):  # (B, T) token ids -> (B, T, V) logits
            h = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
            for b in self.blocks:
                h = recompute(b, h, use_reentrant=False) if checkpoint and torch.is_grad_enabled() else b(h)
            return self.ln_f(h) @ self.tokens.weight.t()

    return GPT()


def train(args, steps, compiled=False, amp=None, checkpoint=False, timed_from=30, csv_path=""):
    """Trains `steps` steps; returns seconds of steps timed_from..steps, the validation loss,
    torch's version and the saved bytes of one step (activations, weights)."""
    import torch
    import torch.nn.functional as F
    from pytorch_saved import saved_bytes

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    text = read_text(args.text)
    vocab = sorted(set(text))
    index = {b: i for i, b in enumerate(vocab)}
    tokens = torch.tensor([index[b] for b in text], dtype=torch.long)
    split = len(tokens) * 9 // 10
    train_set, val_set = tokens[:split], tokens[split:]
    V, C = len(vocab), args.ctx
    model = make_gpt(V, args, checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)
    amp_dtype = {None: None, "none": None, "bf16": torch.bfloat16}[amp]

    def lr_at(s):
        if s < warmup:
            return args.lr * (s + 1) / warmup
        t = min(s - warmup, max(1, steps - warmup))
        return args.lr / 10 + (args.lr - args.lr / 10) * (1 + math.cos(math.pi * t / max(1, steps - warmup))) / 2

    def loss_fn(x, y, autocast=True):  # validation runs in float32, as train_gpt's
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=autocast and amp_dtype is not None):
            return F.cross_entropy(model(x).view(-1, V).float(), y.view(-1))

    def batch(data, g):
        starts = torch.randint(0, len(data) - C - 1, (args.batch,), generator=g)
        x = torch.stack([data[s:s + C] for s in starts])
        y = torch.stack([data[s + 1:s + C + 1] for s in starts])
        return x, y

    x0, y0 = batch(train_set, torch.Generator().manual_seed(args.seed + 1))  # not the training stream
    saved = saved_bytes(lambda: loss_fn(x0, y0))  # autocast, if any, is inside loss_fn
    step_loss = torch.compile(loss_fn) if compiled else loss_fn
    gen = torch.Generator().manual_seed(args.seed)
    csv = open(csv_path, "w") if csv_path else None
    if csv:
        csv.write("step,loss\n")
    start = time.perf_counter()
    for s in range(steps):
        if s == timed_from:  # steady state from here: compilation and warm-up are behind
            start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(s)
        x, y = batch(train_set, gen)
        loss = step_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        if csv:
            csv.write(f"{s + 1},{value:.6f}\n")
    seconds = time.perf_counter() - start
    if csv:
        csv.close()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1234)
        v = statistics.mean(loss_fn(*batch(val_set, g), autocast=False).item() for _ in range(8))
    return seconds, v, torch.__version__, saved


def main():
    parser = argparse.ArgumentParser(description="PyTorch twin of samples/train_gpt")
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=230)
    parser.add_argument("--timed-from", type=int, default=30, help="first timed step (before it: compilation, warm-up)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the forward and loss")
    parser.add_argument("--amp", choices=["none", "bf16"], default="none")
    parser.add_argument("--checkpoint", action="store_true", help="recompute each block for the backward")
    parser.add_argument("--log-csv", default="", help="write step,loss per step to this CSV file")
    args = parser.parse_args()
    timed_from = min(args.timed_from, max(args.steps - 1, 0))
    seconds, val, version, (activations, weights) = train(args, args.steps, args.compile, args.amp, args.checkpoint,
                                                          timed_from, args.log_csv)
    tokens = (args.steps - timed_from) * args.batch * args.ctx
    print(f"pytorch {version}, {args.threads} threads{', torch.compile' if args.compile else ''}"
          f"{', bf16 autocast' if args.amp == 'bf16' else ''}{', checkpoint' if args.checkpoint else ''}")
    print(f"saved for the backward: activations {activations / 1024:.1f} KiB, weights {weights / 1024:.1f} KiB")
    print(f"steady: {tokens / seconds:.0f} tokens/s (steps {timed_from}..{args.steps}, {seconds:.2f} s)")
    print(f"validation loss: {val:.4f}")


if __name__ == "__main__":
    main()
