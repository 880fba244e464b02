"""Evaluate a checkpoint written by train.py; every result lands in one JSON file.

    python eval.py ckpt=runs/baseline-4x128                      # held-out loss and perplexity
    python eval.py ckpt=runs/baseline-4x128 data=text eval.val_tokens=1000000
    python eval.py ckpt=runs/castle-S eval.tasks=[lm_eval] lm_eval.preset=castle     # CASTLE Tables 2-3
    python eval.py ckpt=runs/fox eval.tasks=[lm_eval] lm_eval.tasks=[hellaswag] lm_eval.limit=200
    python eval.py ckpt=runs/fox eval.tasks=[long_context,niah]                      # FoX §4.1, §4.2

The evaluations live in evaluation/ (one module each) and are chosen with `eval.tasks=[...]`.
Results of earlier runs on the same checkpoint stay in its results.json; new ones replace theirs.
"""
import json
import os
import time

import hydra

import evaluation.heldout  # noqa: F401  (registers "heldout")
import evaluation.lm_eval_adapter  # noqa: F401  (registers "lm_eval")
import evaluation.long_context  # noqa: F401  (registers "long_context")
import evaluation.niah  # noqa: F401  (registers "niah")
import evaluation.tint  # noqa: F401  (registers "tint")
import evaluation.results
from evaluation import EVALUATIONS, Context, check_options
from model.gpt import find_checkpoint, load_model


def run(cfg):
    if isinstance(cfg.eval.tasks, str):     # eval.tasks=heldout means [heldout]
        cfg.eval.tasks = [cfg.eval.tasks]
    unknown = set(cfg.eval.tasks) - set(EVALUATIONS)
    if unknown:
        raise ValueError(f"unknown eval.tasks {sorted(unknown)}; available: {sorted(EVALUATIONS)}")
    if (cfg.lm_eval.preset or cfg.lm_eval.tasks) and "lm_eval" not in cfg.eval.tasks:
        raise ValueError("lm_eval.preset / lm_eval.tasks are set but eval.tasks has no lm_eval; "
                         "add it, e.g. eval.tasks=[lm_eval]")
    ckpt_path = find_checkpoint(cfg.ckpt)
    model, train_cfg, device = load_model(ckpt_path, cfg.device, cfg.dtype)
    out = cfg.out or os.path.join(os.path.dirname(ckpt_path), "results.json")
    ctx = Context(cfg, train_cfg, device, ckpt_path, os.path.dirname(os.path.abspath(out)))
    check_options(model, ctx)
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


@hydra.main(version_base="1.3", config_path="configs", config_name="evaluate")
def main(cfg):
    run(cfg)


if __name__ == "__main__":
    main()
