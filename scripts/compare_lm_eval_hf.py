"""Our lm-eval adapter against lm-eval's own `hf` backend, on one checkpoint and its export.

    python -m scripts.export_hf --ckpt runs/base --out hf/base
    python -m scripts.compare_lm_eval_hf --ckpt runs/base --hf hf/base \
        --tasks hellaswag arc_easy piqa lambada_openai --limit 500

Both go through lm-eval's simple_evaluate with the same task objects (the local copies when offline, as
eval.py runs them), the same few-shot seed and the same documents: ours is evaluation/lm_eval_adapter.py's
GPTLM over model/gpt.py, theirs is `lm_eval --model hf --model_args pretrained=DIR` with the settings that
make the two comparable: <|endoftext|> before every context (add_bos_token=True, as our add_bos), the
checkpoint's block_size as max_length, log-softmax in fp32 (softmax_dtype; ours always takes it in fp32)
and the same weight dtype. Prints, per task, every request's log-likelihood pair that differs by more than
--tol + --rtol x |log-likelihood| (largest first, up to --show), the largest and mean difference,
greedy-flag disagreements, and every metric of both side by side; exits 1 when a log-likelihood differs by
more than that or an accuracy by more than one item. --json keeps every request's pair.
"""
import argparse
import json
import sys
import tempfile

import lm_eval.tasks
import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM

from data.tokenizer import tokenizer_for
from evaluation.lm_eval_adapter import (GPTLM, check_task_names, data_root, load_tasks, select_tasks, use_local_copies,
                                        write_local_tasks)
from model.checkpoint import load_model
from model.runtime import user_errors

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file or run directory (model/gpt.py side)")
    p.add_argument("--hf", required=True, help="its export by scripts/export_hf.py (lm-eval's hf side)")
    p.add_argument("--tasks", nargs="+", default=["hellaswag", "arc_easy", "piqa", "lambada_openai"])
    p.add_argument("--limit", type=int, default=500, help="documents per task")
    p.add_argument("--num-fewshot", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weights of both models")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=32, help="hf backend's batch size")
    p.add_argument("--batch-tokens", type=int, default=16384, help="our adapter's padded tokens per batch")
    p.add_argument("--tol", type=float, default=None, help="largest allowed |log-likelihood difference| "
                   "(default: 1e-3 for bf16, 1e-4 for fp32)")
    p.add_argument("--rtol", type=float, default=1e-6, help="allowed difference per unit of |log-likelihood| on "
                   "top of --tol: a long request sums hundreds of token log-probabilities, each rounded")
    p.add_argument("--show", type=int, default=10, help="differing requests printed per task")
    p.add_argument("--offline", default="auto", choices=["auto", "true", "false"],
                   help="local task copies (as lm_eval.offline): auto = when the Hub does not answer")
    p.add_argument("--data-root", default=None, help="local benchmark copies (default: as eval.py)")
    p.add_argument("--json", default=None, help="write every request's (ours, hf) pair here")
    return p.parse_args(argv)


def harnesses(args):
    """(our GPTLM, lm-eval's HFLM) over the same weights in the same dtype on the same device."""
    model, train_cfg, device, _ = load_model(args.ckpt, args.device, args.dtype)
    ours = GPTLM(model, tokenizer_for(train_cfg["data"]), batch_tokens=args.batch_tokens, add_bos=True)
    theirs = HFLM(pretrained=args.hf, device=str(device), dtype=DTYPES[args.dtype], softmax_dtype="float32",
                  batch_size=args.batch_size, add_bos_token=True, max_length=model.config.block_size,
                  trust_remote_code=True)
    return ours, theirs


def evaluate(lm, names, args, task_manager):
    objects, skipped = load_tasks(task_manager, names)       # fresh task objects for every run
    if skipped:
        raise ValueError(f"tasks that could not be loaded: {skipped}")
    return simple_evaluate(model=lm, tasks=objects, num_fewshot=args.num_fewshot, limit=args.limit,
                           task_manager=task_manager, bootstrap_iters=0, log_samples=True)


def request_pairs(ours, theirs):
    """{task: [(doc_id, request index, our response, hf response)]}, matched by document and request."""
    pairs = {}
    for task, samples in ours["samples"].items():
        by_doc = {(s["doc_id"], s["filter"]): s["resps"] for s in theirs["samples"][task]}
        pairs[task] = [(s["doc_id"], i, a[0], b[0]) for s in samples
                       for i, (a, b) in enumerate(zip(s["resps"], by_doc[s["doc_id"], s["filter"]]))]
    return pairs


def loglikelihood(resp):
    """(ll, is_greedy) of a loglikelihood request's answer, (ll, None) of a rolling one's; (None, None)
    for generated text."""
    if isinstance(resp, (tuple, list)):
        return float(resp[0]), bool(resp[1])
    return (float(resp), None) if isinstance(resp, (int, float)) else (None, None)


def report(task, pairs, ours, theirs, tol, rtol, show):
    """Print one task's comparison; return the number of failed checks."""
    scored, texts = [], 0
    for doc, i, a, b in pairs:
        (la, ga), (lb, gb) = loglikelihood(a), loglikelihood(b)
        if la is None:
            texts += a != b
        else:
            scored.append((abs(la - lb), doc, i, la, lb, ga != gb))
    scored.sort(key=lambda row: -row[0])
    over = [row for row in scored if row[0] > tol + rtol * max(abs(row[3]), abs(row[4]))]
    line = f"\n== {task}: {len(pairs)} requests"
    if scored:
        line += (f", max |d ll| {scored[0][0]:.3g}, mean {sum(r[0] for r in scored) / len(scored):.3g}, "
                 f"over {tol:g} + {rtol:g} |ll|: {len(over)}, greedy flags differ: {sum(r[5] for r in scored)}")
    print(line + (f", generations differ: {texts}" if texts else ""))
    for diff, doc, i, la, lb, _ in over[:show]:
        print(f"   doc {doc} request {i}: ours {la:.6f}  hf {lb:.6f}  diff {la - lb:+.3g}")
    failed = len(over) + texts
    n_docs = len({doc for doc, *_ in pairs})
    print(f"   {'metric':24s} {'ours':>10s} {'hf':>10s}")
    for key, value in sorted(ours["results"][task].items()):
        other = theirs["results"][task].get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or "stderr" in key or other is None:
            continue
        print(f"   {key:24s} {value:10.6g} {other:10.6g}")
        if key.startswith("acc") and abs(value - other) * n_docs > 1 + 1e-9:
            print(f"   !! {key} differs by {abs(value - other) * n_docs:.0f} items (more than one)")
            failed += 1
    return failed


def main(argv=None):
    args = parse(argv)
    with user_errors():
        return compare(args)


def compare(args):
    tol = args.tol if args.tol is not None else 1e-3 if args.dtype == "bf16" else 1e-4
    root = data_root(args.data_root)
    local = use_local_copies({"auto": "auto", "true": True, "false": False}[args.offline], root)
    names, skipped = select_tasks(None, args.tasks, local)
    if skipped:
        raise ValueError(f"no local copy of {sorted(skipped)}; run with the Hub reachable (--offline false)")
    check_task_names(names, None)
    ours_lm, theirs_lm = harnesses(args)
    with tempfile.TemporaryDirectory() as tmp:
        manager = lm_eval.tasks.TaskManager(include_path=[str(write_local_tasks(tmp, root))],
                                            include_defaults=any(not n.startswith("local_") for n in names))
        ours, theirs = evaluate(ours_lm, names, args, manager), evaluate(theirs_lm, names, args, manager)
    pairs = request_pairs(ours, theirs)
    print(f"ours: {args.ckpt} (model/gpt.py) | hf: {args.hf} (lm-eval hf backend) | {args.dtype} on "
          f"{args.device} | limit {args.limit}, {args.num_fewshot}-shot | tolerance {tol:g} + {args.rtol:g} |ll|")
    failed = sum(report(task, pairs[task], ours, theirs, tol, args.rtol, args.show) for task in pairs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({task: [{"doc_id": d, "request": i, "ours": a, "hf": b} for d, i, a, b in rows]
                       for task, rows in pairs.items()}, f, default=str)
    print(f"\n{'FAIL' if failed else 'OK'}: {failed} check(s) over the tolerance")
    return failed


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
