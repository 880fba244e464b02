"""Evaluate a checkpoint written by train.py; every result lands in one JSON file.

    python eval.py ckpt=runs/llama-4x128-sample                  # held-out loss and perplexity
    python eval.py ckpt=runs/llama-4x128-sample data=text eval.val_tokens=1000000
    python eval.py ckpt=runs/castle-S eval.tasks=[lm_eval] lm_eval.preset=castle     # CASTLE Tables 2-3
    python eval.py ckpt=runs/fox eval.tasks=[lm_eval] lm_eval.tasks=[hellaswag] lm_eval.limit=200
    python eval.py ckpt=runs/fox eval.tasks=[long_context,niah]                      # FoX §4.1, §4.2

`ckpt` is a run directory (its newest readable checkpoint) or a checkpoint file. The evaluations
live in evaluation/ (one module each) and are chosen with `eval.tasks=[...]`. Results of earlier
runs on the same checkpoint stay in its results.json; new ones replace theirs.
"""
import json
import os
import time

from omegaconf import OmegaConf

import evaluation.heldout  # noqa: F401  (registers "heldout")
import evaluation.lm_eval_adapter  # noqa: F401  (registers "lm_eval")
import evaluation.long_context  # noqa: F401  (registers "long_context")
import evaluation.niah  # noqa: F401  (registers "niah")
import evaluation.results
import evaluation.tint  # noqa: F401  (registers "tint")
from evaluation import EVALUATIONS, Context
from evaluation import check_options as check_evaluation_options
from model.checkpoint import load_model
from model.runtime import DEVICE, check_options, entry_point, one_of, optional, text

OPTIONS = {"ckpt": text(), "device": DEVICE, "dtype": one_of("auto", "bf16", "fp32"), "out": optional(text())}


def check_eval_options(cfg):
    """eval.py's own options and the task list, before the model is loaded (each evaluation's
    options are checked once the model is known, before the first evaluation runs)."""
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise ValueError("ckpt is missing: pass ckpt=RUN_DIR (its newest readable checkpoint) or ckpt=FILE.pt")
    if isinstance(cfg.eval.tasks, str):     # eval.tasks=heldout means [heldout]
        cfg.eval.tasks = [cfg.eval.tasks]
    unknown = set(cfg.eval.tasks) - set(EVALUATIONS)
    if unknown or not cfg.eval.tasks:
        raise ValueError(f"eval.tasks={list(cfg.eval.tasks)} names unknown or no evaluations; "
                         f"choose from {sorted(EVALUATIONS)}")
    if (cfg.lm_eval.preset or cfg.lm_eval.tasks) and "lm_eval" not in cfg.eval.tasks:
        raise ValueError("lm_eval.preset / lm_eval.tasks are set but eval.tasks has no lm_eval; "
                         "add it, e.g. eval.tasks=[lm_eval]")
    check_options({key: OmegaConf.select(cfg, key) for key in OPTIONS}, OPTIONS)


def run(cfg):
    check_eval_options(cfg)
    model, train_cfg, device, ckpt_path = load_model(cfg.ckpt, cfg.device, cfg.dtype)
    out = cfg.out or os.path.join(os.path.dirname(ckpt_path), "results.json")
    ctx = Context(cfg, train_cfg, device, ckpt_path, os.path.dirname(os.path.abspath(out)))
    check_evaluation_options(model, ctx)
    results = evaluation.results.load(out, ckpt_path)
    results.update({"checkpoint": os.path.abspath(ckpt_path), "attention": train_cfg["model"]["attention"],
                    "n_params": model.num_params()})
    for name in cfg.eval.tasks:
        t0 = time.perf_counter()
        new = EVALUATIONS[name](model, ctx)
        results[name] = evaluation.results.merge(results.get(name, {}), new)
        summary = json.dumps(new)
        print(f"{name}: {summary[:400] + ' ...' if len(summary) > 400 else summary} ({time.perf_counter() - t0:.1f}s)")
    evaluation.results.save(out, results)
    print(f"wrote {out}")
    return results


@entry_point("evaluate")
def main(cfg):
    run(cfg)


if __name__ == "__main__":
    main()
