"""Held-out next-token loss and perplexity on the validation shards."""
import contextlib
import math

import torch

from data.loader import build_loader
from evaluation import evaluation


@evaluation("heldout")
@torch.no_grad()
def heldout_loss(model, ctx):
    """Mean next-token loss and perplexity over the first eval.val_tokens (default: the data
    config's val_tokens) validation tokens."""
    B, T = ctx.cfg.eval.batch_size, ctx.seq_len
    loader = build_loader(ctx.data_cfg, "val", B, T)
    steps = max(1, (ctx.cfg.eval.val_tokens or ctx.data_cfg.val_tokens) // (B * T))
    loss = mean_loss(model, loader, steps, ctx.device)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": steps * B * T, "seq_len": T}


@torch.no_grad()
def mean_loss(model, loader, steps, device, autocast=contextlib.nullcontext()):
    """Mean next-token loss over `steps` batches of `loader` (train.py's validation uses it too)."""
    total = 0.0
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        total += loss.item()
    return total / steps
