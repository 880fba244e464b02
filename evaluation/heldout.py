"""Held-out next-token loss and perplexity on the validation shards."""
import contextlib
import math

import torch

from evaluation import ValSplit, check_positions, evaluation
from model.runtime import checked, integer, optional


def settings(model, ctx):
    """(val split, batch size, sequence length, tokens asked for), checked: eval.batch_size, eval.seq_len
    (null: the training context), eval.val_tokens (null: the data config's val_tokens)."""
    B, T = checked(ctx.cfg.eval.batch_size, "eval.batch_size", integer(1)), ctx.seq_len
    tokens = checked(ctx.cfg.eval.val_tokens, "eval.val_tokens", optional(integer(1))) or ctx.data_cfg.val_tokens
    check_positions(model, T, "eval.seq_len")
    split = ValSplit(ctx.data_cfg)
    split.check(T, B, "eval.seq_len", "eval.batch_size")
    return split, B, T, tokens


@evaluation("heldout", check=settings)
@torch.no_grad()
def heldout_loss(model, ctx):
    """Mean next-token loss and perplexity over the first eval.val_tokens (default: the data
    config's val_tokens) validation tokens, in whole batches of eval.batch_size x seq_len."""
    split, B, T, tokens = settings(model, ctx)
    loader, steps, _ = split.batches(max(1, tokens // (B * T)) * B, T, B, f"eval.val_tokens ({tokens} tokens)")
    loss = mean_loss(model, loader, steps, ctx.device)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": steps * B * T, "tokens_requested": tokens,
            "seq_len": T}


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
