"""Per-token loss L(i) and perplexity P(l) on held-out sequences (FoX, arXiv:2503.02130 §4.2), past the
training context too.

    python eval.py ckpt=RUN eval.tasks=[long_context] long_context.seq_len=65536 long_context.num_seqs=512
    python -m scripts.plot_long_context runs/fox runs/baseline --out long_context.png    # overlay runs

L(i) is the mean over M held-out sequences of -log p(token i), summed in float64; P(l) =
exp(mean of L(1..l)) from the unsmoothed L. Plots smooth L with a centred moving average (101
tokens, averaging over the part of the window inside the sequence at the edges). Every sequence is
read in one forward pass of seq_len tokens: no sliding window, and no sequence twice: when the
val split holds fewer than long_context.num_seqs distinct sequences of seq_len tokens, all of
them are used, with a warning, and the results' num_seqs says how many (num_seqs_requested the
setting). Writes long_context.csv (position,
loss, smoothed loss) and long_context.png next to results.json.
"""
import csv
import io
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from evaluation import ValSplit, check_positions, evaluation
from model.checkpoint import atomic_write
from model.runtime import checked, integer, optional


@torch.no_grad()
def per_token_loss(model, batches, device):
    """Mean loss at every position over the (x, y) batches: (T,) float64 array, and the sequence count."""
    total, count = None, 0
    for x, y in batches:
        logits, _ = model(x.to(device))
        summed = token_losses(logits, y.to(device)).double().sum(0)
        total = summed if total is None else total + summed
        count += x.size(0)
    return (total / count).cpu().numpy(), count


def first_sequences(loader, count, batch_size):
    """The loader's first `count` sequences as (x, y) batches, the last one cut to fit."""
    for start in range(0, count, batch_size):
        x, y = loader.next_batch()
        yield x[:count - start], y[:count - start]


def token_losses(logits, targets, chunk=4096):
    """(B, T, V) logits, (B, T) targets -> (B, T) float32 losses; float32 copies of `chunk` positions at a time."""
    return torch.cat([F.cross_entropy(logits[:, s:s + chunk].float().transpose(1, 2), targets[:, s:s + chunk],
                                      reduction="none") for s in range(0, targets.size(1), chunk)], dim=1)


def smooth(values, window):
    """Centred moving average; at the edges the mean over the part of the window that exists."""
    half = window // 2
    sums = np.concatenate([[0.0], np.cumsum(values)])
    i = np.arange(len(values))
    lo, hi = np.maximum(i - half, 0), np.minimum(i + half + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def perplexity_by_length(losses, min_len):
    """{l: P(l)} for l = T, T/2, T/4, ... >= min_len (just T when T < min_len)."""
    lengths, l = [], len(losses)
    while l >= min_len or not lengths:
        lengths.append(l)
        l //= 2
    return {l: math.exp(float(np.mean(losses[:l]))) for l in lengths}


def write_csv(path, losses, smoothed):
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["position", "loss", "loss_smoothed"])
    writer.writerows((i + 1, f"{a:.6f}", f"{b:.6f}") for i, (a, b) in enumerate(zip(losses, smoothed)))
    atomic_write(str(path), lambda f: f.write(text.getvalue().encode()))


def read_csv(path):
    """long_context.csv (or the run directory holding it) -> (positions, losses) arrays."""
    path = Path(path)
    data = np.loadtxt(path / "long_context.csv" if path.is_dir() else path, delimiter=",", skiprows=1)
    return data[:, 0], data[:, 1]


def plot_curves(curves, png, window, train_len=None):
    """curves: {label: (positions, raw losses)}; overlays the smoothed L(i); a dashed line at train_len."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (positions, losses) in curves.items():
        ax.plot(positions, smooth(losses, window), label=label, lw=1)
    if train_len:
        ax.axvline(train_len, ls="--", c="gray", lw=0.8, label=f"training context ({train_len})")
    ax.set(xlabel="token position i", ylabel=f"per-token loss L(i), {window}-token moving average")
    ax.grid(alpha=0.3)
    ax.legend()
    atomic_write(str(png), lambda f: fig.savefig(f, format="png", dpi=150, bbox_inches="tight"))
    plt.close(fig)


def settings(model, ctx):
    """(val split, seq_len, batch size) from the long_context options: every one checked, seq_len
    resolved (long_context.seq_len, else the data's val_seq_len, else 4x the training context; the
    default stops at the block_size of a model with learned positions, an explicit value must fit it)."""
    c = ctx.cfg.long_context
    for option in ("num_seqs", "batch_size", "smooth", "min_len"):
        checked(c[option], f"long_context.{option}", integer(1))
    T = checked(c.seq_len, "long_context.seq_len", optional(integer(1)))
    if T is None:
        T = ctx.data_cfg.get("val_seq_len") or 4 * ctx.train_cfg["train"]["seq_len"]
        if model.config.pos == "learned" and T > model.config.block_size:
            T = model.config.block_size
            print(f"long_context: the model's learned positions end at {T}; seq_len set to {T}")
    check_positions(model, T, "long_context.seq_len")
    split = ValSplit(ctx.data_cfg)
    split.check(T, c.batch_size, "long_context.seq_len", "long_context.batch_size")
    return split, T, c.batch_size


@evaluation("long_context", check=settings)
def long_context(model, ctx):
    c = ctx.cfg.long_context
    split, T, B = settings(model, ctx)
    loader, _, count = split.batches(c.num_seqs, T, B, f"long_context.num_seqs={c.num_seqs}")
    losses, count = per_token_loss(model, first_sequences(loader, count, B), ctx.device)
    train_len = ctx.train_cfg["train"]["seq_len"]
    out = Path(ctx.out_dir)
    write_csv(out / "long_context.csv", losses, smooth(losses, c.smooth))
    label = f"{ctx.train_cfg['model']['attention']} ({Path(ctx.ckpt_path).parent.name})"
    plot_curves({label: (np.arange(1, T + 1), losses)}, out / "long_context.png", c.smooth, train_len)
    return {"seq_len": T, "num_seqs": count, "num_seqs_requested": c.num_seqs, "train_seq_len": train_len,
            "loss": float(losses.mean()),
            "perplexity": {str(l): p for l, p in perplexity_by_length(losses, c.min_len).items()},
            "csv": str(out / "long_context.csv"), "png": str(out / "long_context.png")}
