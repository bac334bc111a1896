# compare_report: the table and plots of bench/compare.py, from its measurements.
#
#   import compare_report
#   compare_report.write("docs/compare", results, info, settings)
#
# results: one dict per (workload, row, program, run) with any of speed, rss (MiB), saved and
# saved_float32 (bytes), accuracy, val_loss, loss, curve (a step,loss CSV). Writes results.md
# (three tables: speed, memory, quality; medians over runs), results.json (every run), and
# loss_<workload>.png, memory.png, speed.png.
import csv
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PROGRAMS = ("kiln", "eager", "compile")
LABELS = {"kiln": "kiln", "eager": "PyTorch eager", "compile": "torch.compile"}
COLORS = {"kiln": "tab:blue", "eager": "tab:orange", "compile": "tab:green"}
SPEED_UNIT = {"fusion": "GB/s", "mlp": "examples/s", "cnn": "examples/s", "gpt": "tokens/s"}


def medians(results):
    """{(workload, row): {program: {metric: median over runs}}}, rows in first-seen order;
    curve: the first run's CSV."""
    table = {}
    for r in results:
        cell = table.setdefault((r["workload"], r["row"]), {}).setdefault(r["program"], {})
        for k, v in r.items():
            if isinstance(v, float):
                cell.setdefault(k, []).append(v)
            elif k == "curve":
                cell.setdefault("curve", v)
    for programs in table.values():
        for cell in programs.values():
            for k, v in cell.items():
                if isinstance(v, list):
                    cell[k] = statistics.median(v)
    # train_mnist prints saved bytes under --amp only, with the float32 figure next to them.
    for (workload, row), programs in table.items():
        kiln = programs.get("kiln", {})
        low = table.get((workload, "bf16"), {}).get("kiln", {})
        if row == "float32" and "saved" not in kiln and "saved_float32" in low:
            kiln["saved"], kiln["saved_from_bf16_run"] = low["saved_float32"], True
    return table


def fmt(value, unit=""):
    if value is None:
        return "—"
    if unit == "bytes":
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value >= size:
                return f"{value / size:.1f} {name}"
        return f"{value:.0f} B"
    if value >= 1000:
        return f"{value:,.0f}".replace(",", " ")
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def ratio(a, b):
    return f"{a / b:.2f}×" if a is not None and b else "—"


def get(programs, program, metric):
    return programs.get(program, {}).get(metric)


def speed_table(table):
    lines = ["| workload | configuration | unit | kiln | PyTorch eager | torch.compile | kiln / eager | kiln / compile |",
             "|---|---|---|---|---|---|---|---|"]
    for (w, row), p in table.items():
        k, e, c = (get(p, prog, "speed") for prog in PROGRAMS)
        lines.append(f"| {w} | {row} | {SPEED_UNIT[w]} | {fmt(k)} | {fmt(e)} | {fmt(c)} | **{ratio(k, e)}** | **{ratio(k, c)}** |")
    return lines


def memory_table(table):
    lines = ["| workload | configuration | peak RSS kiln | eager | compile | kiln / eager | kiln / compile "
             "| saved activations kiln | eager | kiln / eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (w, row), p in table.items():
        k, e, c = (get(p, prog, "rss") for prog in PROGRAMS)
        mib = [None if v is None else v * 2**20 for v in (k, e, c)]
        sk, se = get(p, "kiln", "saved"), get(p, "eager", "saved")
        mark = " †" if get(p, "kiln", "saved_from_bf16_run") else ""
        lines.append(f"| {w} | {row} | {fmt(mib[0], 'bytes')} | {fmt(mib[1], 'bytes')} | {fmt(mib[2], 'bytes')} | "
                     f"**{ratio(k, e)}** | **{ratio(k, c)}** | {fmt(sk, 'bytes')}{mark} | {fmt(se, 'bytes')} | {ratio(sk, se)} |")
    return lines


def quality_table(table):
    lines = ["| workload | configuration | metric | kiln | PyTorch eager | torch.compile | kiln − eager |",
             "|---|---|---|---|---|---|---|"]
    for (w, row), p in table.items():
        for metric, name, unit in (("accuracy", "test accuracy", "%"), ("val_loss", "validation loss", ""),
                                   ("loss", "training loss, last 20 steps", "")):
            k, e, c = (get(p, prog, metric) for prog in PROGRAMS)
            if k is None and e is None:
                continue
            diff = f"{k - e:+.2f} points" if unit == "%" and k is not None and e is not None else \
                f"{(k - e) / e:+.1%}" if k is not None and e else "—"
            show = (lambda v: "—" if v is None else f"{v:.2f}%") if unit == "%" else (lambda v: "—" if v is None else f"{v:.4f}")
            lines.append(f"| {w} | {row} | {name} | {show(k)} | {show(e)} | {show(c)} | {diff} |")
    return lines


def read_curve(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]


def smooth(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def save(fig, out, name):
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_losses(out, workload, title, rows):
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), squeeze=False)
    for ax, ((_, row), programs) in zip(axes[0], rows):
        for program in PROGRAMS:
            path = get(programs, program, "curve")
            if not path or not os.path.exists(path):
                continue
            steps, losses = read_curve(path)
            window = max(1, len(losses) // 25)
            ax.plot(steps, losses, color=COLORS[program], alpha=0.2, linewidth=0.6)
            ax.plot(steps, smooth(losses, window), color=COLORS[program], linestyle="--" if program == "compile" else "-",
                    label=f"{LABELS[program]} (mean of {window})")
        ax.set_title(row)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, out, f"loss_{workload}.png")


def grouped_bars(ax, labels, series, ylabel, log=False):
    """series: [(name, color, values)] with None for a missing value."""
    width = 0.8 / len(series)
    for i, (name, color, values) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        ax.bar([x for x, v in zip(xs, values) if v], [v for v in values if v], width, label=name, color=color)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def plot_memory(out, table):
    rows = [(key, p) for key, p in table.items() if key[0] != "fusion" or key[1].endswith("tensors")]
    labels = [f"{w} {row}" for (w, row), _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    grouped_bars(left, labels, [(LABELS[p], COLORS[p], [get(q, p, "rss") for _, q in rows]) for p in PROGRAMS],
                 "peak RSS (MiB)")
    left.set_title("peak RSS of the process")
    saved_rows = [(key, p) for key, p in rows if get(p, "kiln", "saved") or get(p, "eager", "saved")]
    grouped_bars(right, [f"{w} {row}" for (w, row), _ in saved_rows],
                 [(LABELS[p], COLORS[p], [(get(q, p, "saved") or 0) / 2**20 or None for _, q in saved_rows])
                  for p in ("kiln", "eager")], "MiB (log scale)", log=True)
    right.set_title("activations saved for the backward, one step")
    return save(fig, out, "memory.png")


def plot_speed(out, table):
    labels = [f"{w} {row}" for w, row in table]
    fig, ax = plt.subplots(figsize=(10, 4))
    series = []
    for p in ("eager", "compile"):
        values = []
        for programs in table.values():
            k, o = get(programs, "kiln", "speed"), get(programs, p, "speed")
            values.append(k / o if k and o else None)
        series.append((f"kiln / {LABELS[p]}", COLORS[p], values))
    grouped_bars(ax, labels, series, "speed ratio (> 1: kiln faster; log scale)", log=True)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_title("kiln's speed over PyTorch's, same run (medians)")
    return save(fig, out, "speed.png")


def write(out, results, info, settings):
    os.makedirs(out, exist_ok=True)
    table = medians(results)
    plots = [plot_speed(out, table), plot_memory(out, table)]
    for workload in dict.fromkeys(w for w, _ in table):
        rows = [(key, p) for key, p in table.items() if key[0] == workload and get(p, "kiln", "curve")]
        if rows:
            plots.append(plot_losses(out, workload, settings["titles"][workload], rows))
    torch_lines = info["torch"].splitlines()
    load = info["loadavg"], info["loadavg_end"]
    header = [
        "# kiln against PyTorch, side by side (`bench/compare.py`)",
        "",
        f"Generated {info['date']} by `python3 bench/compare.py {settings['argv']}` in {info['minutes']:.1f} minutes.",
        f"kiln {info['kiln']}; {torch_lines[0]}; Python {info['python']}.",
        f"CPU: {info['cpu']} ({info['isa']}), {info['cpus']} CPUs visible, {settings['threads']} threads for "
        f"every program; load average {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end.",
        f"Medians of {settings['runs']} run(s) per program, alternating kiln, PyTorch eager, torch.compile; "
        "ratios are kiln over PyTorch (speed: > 1 is kiln faster; memory: < 1 is kiln smaller).",
    ]
    if info.get("torch_import_rss"):
        header.append(f"`python3 -c 'import torch'` alone peaks at {info['torch_import_rss']:.0f} MiB of RSS here: "
                      "PyTorch's peak RSS below includes it.")
    if settings.get("note"):
        header.append(settings["note"])
    if settings.get("quick"):
        header.append("**--quick: tiny runs for a smoke test, not a measurement.**")
    header += ["", "Workloads:"] + [f"- {w}: {t}" for w, t in settings["titles"].items()]
    body = ["", "## Speed", ""] + speed_table(table) + \
        ["", "## Memory", ""] + memory_table(table) + \
        ["", "† kiln's float32 figure as train_mnist prints it in its bf16 run (float32 next to bf16); its float32 "
         "run prints none. — : the program prints no such figure (fusion: no backward).",
         "", "## Quality", ""] + quality_table(table) + \
        ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots] + \
        ["", "PyTorch's configuration:", "", "```"] + torch_lines + ["```", ""]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(header + body))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"info": info, "settings": settings, "runs": results}, f, indent=1, default=str)
    print("\n".join(body[:-len(torch_lines) - 4]))
    print(f"\nwrote {os.path.join(out, 'results.md')}, results.json and {', '.join(os.path.basename(p) for p in plots)}")
