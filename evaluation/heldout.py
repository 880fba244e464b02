"""Held-out next-token loss and perplexity on the validation shards."""
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
    val_tokens = ctx.cfg.eval.val_tokens or ctx.data_cfg.val_tokens
    steps = max(1, val_tokens // (B * T))
    total = 0.0
    for _ in range(steps):
        x, y = loader.next_batch()
        _, loss = model(x.to(ctx.device), y.to(ctx.device))
        total += loss.item()
    loss = total / steps
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": steps * B * T, "seq_len": T}
