"""Evaluate a checkpoint written by train.py; every result lands in one JSON file.

    python eval.py ckpt=runs/baseline-4x128                      # held-out loss and perplexity
    python eval.py ckpt=runs/baseline-4x128 data=text eval.val_tokens=1000000

Evaluations are registered in EVALUATIONS (name -> function(model, context) -> dict) and chosen
with `eval.tasks=[...]`; later capabilities add their own entries.
"""
import json
import math
import os
import time

import hydra
import torch
from omegaconf import OmegaConf

from data.loader import build_loader
from model.gpt import find_checkpoint, load_model

EVALUATIONS = {}


def evaluation(name):
    def register(fn):
        EVALUATIONS[name] = fn
        return fn
    return register


class Context:
    """What an evaluation needs besides the model: configs, device, the checkpoint's path."""

    def __init__(self, cfg, train_cfg, device, ckpt_path):
        self.cfg, self.train_cfg, self.device, self.ckpt_path = cfg, train_cfg, device, ckpt_path
        self.data_cfg = cfg.data if cfg.get("data") else OmegaConf.create(train_cfg["data"])
        self.seq_len = cfg.eval.seq_len or train_cfg["train"]["seq_len"]


@evaluation("heldout")
@torch.no_grad()
def heldout_loss(model, ctx):
    """Mean next-token loss and perplexity over the first eval.val_tokens validation tokens."""
    B, T = ctx.cfg.eval.batch_size, ctx.seq_len
    loader = build_loader(ctx.data_cfg, "val", B, T)
    steps = max(1, ctx.cfg.eval.val_tokens // (B * T))
    total = 0.0
    for _ in range(steps):
        x, y = loader.next_batch()
        _, loss = model(x.to(ctx.device), y.to(ctx.device))
        total += loss.item()
    loss = total / steps
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": steps * B * T, "seq_len": T}


def run(cfg):
    unknown = set(cfg.eval.tasks) - set(EVALUATIONS)
    if unknown:
        raise ValueError(f"unknown eval.tasks {sorted(unknown)}; available: {sorted(EVALUATIONS)}")
    ckpt_path = find_checkpoint(cfg.ckpt)
    model, train_cfg, device = load_model(ckpt_path, cfg.device, cfg.dtype)
    ctx = Context(cfg, train_cfg, device, ckpt_path)
    results = {"checkpoint": os.path.abspath(ckpt_path), "attention": train_cfg["model"]["attention"],
               "n_params": model.num_params()}
    for name in cfg.eval.tasks:
        t0 = time.perf_counter()
        results[name] = EVALUATIONS[name](model, ctx)
        print(f"{name}: {json.dumps(results[name])} ({time.perf_counter() - t0:.1f}s)")
    out = cfg.out or os.path.join(os.path.dirname(ckpt_path), "results.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {out}")
    return results


@hydra.main(version_base="1.3", config_path="configs", config_name="evaluate")
def main(cfg):
    run(cfg)


if __name__ == "__main__":
    main()
