"""Evaluate a checkpoint written by train.py; every result lands in one JSON file.

    python eval.py ckpt=runs/baseline-4x128                      # held-out loss and perplexity
    python eval.py ckpt=runs/baseline-4x128 data=text eval.val_tokens=1000000

The evaluations live in evaluation/ (one module each) and are chosen with `eval.tasks=[...]`.
"""
import json
import os
import time

import hydra

import evaluation.heldout  # noqa: F401  (registers "heldout")
from evaluation import EVALUATIONS, Context
from model.gpt import find_checkpoint, load_model


def run(cfg):
    unknown = set(cfg.eval.tasks) - set(EVALUATIONS)
    if unknown:
        raise ValueError(f"unknown eval.tasks {sorted(unknown)}; available: {sorted(EVALUATIONS)}")
    ckpt_path = find_checkpoint(cfg.ckpt)
    model, train_cfg, device = load_model(ckpt_path, cfg.device, cfg.dtype)
    out = cfg.out or os.path.join(os.path.dirname(ckpt_path), "results.json")
    ctx = Context(cfg, train_cfg, device, ckpt_path, os.path.dirname(os.path.abspath(out)))
    results = {"checkpoint": os.path.abspath(ckpt_path), "attention": train_cfg["model"]["attention"],
               "n_params": model.num_params()}
    for name in cfg.eval.tasks:
        t0 = time.perf_counter()
        results[name] = EVALUATIONS[name](model, ctx)
        print(f"{name}: {json.dumps(results[name])} ({time.perf_counter() - t0:.1f}s)")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {out}")
    return results


@hydra.main(version_base="1.3", config_path="configs", config_name="evaluate")
def main(cfg):
    run(cfg)


if __name__ == "__main__":
    main()
