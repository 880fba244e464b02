"""TinT dynamic evaluation of a checkpoint: the in-repo analogue of Tables 2-3 of TinT (arXiv:2307.01189 §3).

    python eval.py ckpt=RUN eval.tasks=[tint]                                   # configs/tint/default.yaml
    python eval.py ckpt=RUN eval.tasks=[tint] tint.lr=3e-5 tint.train_fracs=[0.3,0.5,0.7,0.9]

Each sequence is split into a training segment (its first n_train tokens) and a test segment; the
test tokens are scored side by side by
  * vanilla   the checkpoint, no update;
  * dyneval   exact-gradient dynamic evaluation with TinT's loss, lr and parameter set, so that its gap to
              tint_ref is what TinT's approximations (§2.4, §2.5) cost (the paper does not say how its own
              dynamic-evaluation baseline is set up);
  * dyneval_full (optional) exact gradients on every weight of the top blocks and the final norm;
  * tint_ref  TinT's approximate one-step update computed directly (model/tint/reference.py);
  * tint_sim  the TinT simulator (GPT-2- and LLaMA-style checkpoints; expensive, so on the first
              `sim_batches` batches / `sim_examples` questions, with vanilla and tint_ref re-reported
              on exactly that subset and the largest |sim - ref| logit difference).
Two workloads:
  * text: held-out sequences of the data config's val split (data.loader.build_loader); for every
    fraction in train_fracs, the perplexity of the tail tokens (the paper's Table 2 protocol);
  * task: a local multiple-choice set (llm-foundry {query, choices, gold} jsonl: arc_easy by default,
    arc_challenge, openbookqa; or piqa's valid.jsonl + labels), the zero-shot "learn from the context"
    protocol (the paper's k = 0 setting, §3.1): the context (optional `task_shots` solved
    demonstrations, then the question) is the training segment, the answer option the test segment;
    acc (sum of log-probs) and acc_norm (per byte of the option), like lm-eval.
The learning rate multiplies the loss *summed* over the training tokens (TinT's convention), so it
scales like 1 / (number of training tokens): with ~500 training tokens start around 1e-4.

Options (`tint:` in the eval config; every key optional, defaults in DEFAULTS = configs/tint/default.yaml):
  lr, task_lr (null: lr), n_layers (null: all), n_steps, fd_eps, dtype (fp32 | fp64),
  methods (subset of [vanilla, dyneval, dyneval_full, tint_ref, tint_sim]),
  train_fracs (each in (0, 1)), seq_len (null: the eval context, capped at block_size; at most block_size), batch_size,
  batches (capped, with a warning, at the distinct sequences the val split holds), sim_batches,
  task (arc_easy | arc_challenge | openbookqa | piqa | null), task_path (null: <data_root>/<task>/...),
  data_root (null: $EVAL_DATA_ROOT, else ../shared/data/eval next to the repo), task_examples,
  sim_examples, task_shots, sim_K (null: default K = D / S), check_param_formula.
"""
import copy
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from evaluation import ValSplit, evaluation
from model.runtime import boolean, checked, integer, listed, number, one_of, optional, shown
from model.tint import (
    SimConfig,
    TinT,
    dyn_eval_reference,
    paper_param_formula,
    tint_param_formula,
    tint_reference,
)
from model.tint.auxiliary import check_aux_model

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_ROOT = REPO.parent / "shared" / "data" / "eval"
TASK_FILES = {"arc_easy": "arc_easy/arc_easy.llmfoundry.jsonl",
              "arc_challenge": "arc_challenge/arc_challenge.llmfoundry.jsonl",
              "openbookqa": "openbookqa/openbook_qa.llmfoundry.jsonl",
              "piqa": "piqa/valid.jsonl"}
METHODS = ("vanilla", "dyneval", "dyneval_full", "tint_ref", "tint_sim")
DEFAULTS = {"lr": 1e-4, "task_lr": None, "n_layers": None, "n_steps": 1, "fd_eps": 1e-3, "dtype": "fp32",
            "methods": ["vanilla", "dyneval", "tint_ref", "tint_sim"], "train_fracs": [0.5], "seq_len": None,
            "batch_size": 4, "batches": 8, "sim_batches": 1, "task": "arc_easy", "task_path": None,
            "data_root": None, "task_examples": 200, "sim_examples": 10, "task_shots": 0, "sim_K": None,
            "check_param_formula": True}


def options(ctx):
    """DEFAULTS overridden by ctx.cfg.tint, every value checked (those that need no model); unknown
    keys are an error (typos must not pass silently)."""
    user = ctx.cfg.get("tint", None) or {}
    user = dict(user.items()) if hasattr(user, "items") else dict(user)
    unknown = set(user) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tint options {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    o = {**DEFAULTS, **user}
    o["methods"] = checked(o["methods"], "tint.methods", listed(one_of(*METHODS)))
    o["train_fracs"] = checked(o["train_fracs"], "tint.train_fracs",
                               optional(listed(number(above=0, below=1), empty=True))) or []
    checked(o["dtype"], "tint.dtype", one_of("fp32", "fp64"))
    checked(o["lr"], "tint.lr", number(0))
    checked(o["task_lr"], "tint.task_lr", optional(number(0)))
    checked(o["fd_eps"], "tint.fd_eps", number(above=0))
    checked(o["seq_len"], "tint.seq_len", optional(integer(2)))
    for name in ("n_steps", "batch_size", "batches", "task_examples"):
        checked(o[name], f"tint.{name}", integer(1))
    for name in ("sim_batches", "sim_examples", "task_shots"):
        checked(o[name], f"tint.{name}", integer(0))
    checked(o["n_layers"], "tint.n_layers", optional(integer(1)))
    checked(o["sim_K"], "tint.sim_K", optional(integer(1)))
    checked(o["check_param_formula"], "tint.check_param_formula", boolean())
    if o["task"] is not None and o["task"] not in TASK_FILES:
        raise ValueError(f"tint.task={shown(o['task'])} is unknown; choose one of {sorted(TASK_FILES)} "
                         "or null (no task)")
    if not o["train_fracs"] and o["task"] is None:
        raise ValueError("tint has nothing to evaluate: tint.train_fracs is empty and tint.task is null; set either")
    if "tint_sim" in o["methods"]:
        for name, workload in (("sim_batches", o["train_fracs"]), ("sim_examples", o["task"])):
            if workload and o[name] == 0:
                raise ValueError(f"tint.{name}=0 leaves the simulator (tint_sim in tint.methods) nothing to score; "
                                 f"set tint.{name} >= 1 or drop tint_sim from tint.methods")
    if o["task"]:
        check_task_file(o)
    return o


def task_file(o):
    """The multiple-choice file of tint.task: tint.task_path, else <data root>/<TASK_FILES entry>."""
    if o["task_path"]:
        return Path(o["task_path"]).expanduser()
    root = Path(o["data_root"] or os.environ.get("EVAL_DATA_ROOT") or DEFAULT_DATA_ROOT).expanduser()
    return root / TASK_FILES[o["task"]]


def check_task_file(o):
    """The task file (and piqa's labels) exist and hold more questions than tint.task_shots."""
    path = task_file(o)
    needed = [path] + ([path.with_name("valid-labels.lst")] if o["task"] == "piqa" else [])
    for file in needed:
        if not file.is_file():
            raise FileNotFoundError(f"tint.task={o['task']} needs {file}, which does not exist; set "
                                    "tint.task_path=FILE, tint.data_root=DIR (or $EVAL_DATA_ROOT), or tint.task=null "
                                    "to skip the task")
    questions = sum(1 for line in path.read_text().splitlines() if line.strip())
    if o["task_shots"] >= questions:
        raise ValueError(f"tint.task_shots={o['task_shots']} leaves no question to score: {path} holds {questions}; "
                         "lower tint.task_shots")


def settings(model, ctx):
    """(options, val split, text sequence length): options() plus the checks that need the model:
    TinT's auxiliary model must be a plain softmax-attention GPT, tint.n_layers must name layers it
    has, tint.seq_len (null: the eval context, capped at block_size) fit its positions and the val
    split, and the simulator be buildable with tint.sim_K. Split and length are None without text."""
    try:
        check_aux_model(model)
    except ValueError as e:
        raise ValueError(f"eval.tasks has tint, but this checkpoint cannot be TinT's auxiliary model ({e}); evaluate "
                         "a checkpoint with attention=baseline (e.g. model=gpt2 or model=llama) or drop tint from "
                         "eval.tasks") from None
    o = options(ctx)
    config = model.config
    if o["n_layers"] is not None and o["n_layers"] > config.n_layer:
        raise ValueError(f"tint.n_layers={o['n_layers']} is out of range: the model has {config.n_layer} layer(s); "
                         f"choose tint.n_layers in [1, {config.n_layer}] or null (all)")
    if o["seq_len"] is not None and o["seq_len"] > config.block_size:
        raise ValueError(f"tint.seq_len={o['seq_len']} is out of range: TinT reads at most the model's block_size="
                         f"{config.block_size} tokens; choose tint.seq_len in [2, {config.block_size}] or null")
    if "tint_sim" in o["methods"] and sim_supported(config):
        try:
            simulator_size(config, o)
        except ValueError as e:
            raise ValueError(f"the TinT simulator cannot be built for this model with tint.sim_K={shown(o['sim_K'])} "
                             f"({e}); set tint.sim_K=null (automatic) or drop tint_sim from tint.methods") from None
    if not o["train_fracs"]:
        return o, None, None
    L = min(o["seq_len"] or ctx.seq_len, config.block_size)
    split = ValSplit(ctx.data_cfg)
    split.check(L, o["batch_size"], "tint.seq_len", "tint.batch_size")
    return o, split, L


def sim_supported(config):
    """The simulator needs square D x D maps: n_head * head_dim == n_embd."""
    return config.n_head * config.head_dim == config.n_embd


class Scorer:
    """The test-segment logits of every method, with one TinT simulator per learning rate (built lazily)."""

    def __init__(self, aux, o):
        self.aux, self.o = aux, o
        self.kw = {"n_layers": o["n_layers"], "n_steps": o["n_steps"], "fd_eps": o["fd_eps"]}
        self._sims = {}

    def simulator(self, lr):
        if lr not in self._sims:
            self._sims.clear()                      # one simulator at a time (they are large)
            self._sims[lr] = TinT.from_model(self.aux, lr=lr, K=self.o["sim_K"] or 0, **self.kw)
        return self._sims[lr]

    @torch.no_grad()
    def logits(self, method, idx, n_train, lr):
        if method == "vanilla":
            return self.aux(idx)[0][:, n_train - 1: idx.size(1) - 1]
        if method in ("dyneval", "dyneval_full"):
            return dyn_eval_reference(self.aux, idx, n_train, lr=lr, full=method == "dyneval_full", **self.kw)
        if method == "tint_ref":
            return tint_reference(self.aux, idx, n_train, lr=lr, **self.kw)
        return self.simulator(lr)(idx, n_train)


def _nll(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").item()


def text_eval(scorer, split, L, o, methods, device):
    """Perplexity of the test segment (the tail of each held-out sequence) for every train fraction."""
    loader, steps, sequences = split.batches(o["batches"] * o["batch_size"], L, o["batch_size"],
                                             "tint.batches x tint.batch_size")
    batches = [loader.next_batch()[0] for _ in range(steps)]
    out = {}
    for frac in o["train_fracs"]:
        n_train = min(max(2, round(frac * L)), L - 1)
        tot = {m: 0.0 for m in methods}
        sub = {m: 0.0 for m in methods}           # the simulator's subset
        n_tok = n_sub = 0
        max_diff = 0.0
        for b, x in enumerate(batches):
            x = x.to(device)
            tgt = x[:, n_train:]
            on_subset = b < o["sim_batches"]
            got = {}
            for m in methods:
                if m == "tint_sim" and not on_subset:
                    continue
                got[m] = scorer.logits(m, x, n_train, o["lr"])
                nll = _nll(got[m], tgt)
                if m != "tint_sim":
                    tot[m] += nll
                if on_subset:
                    sub[m] += nll
            n_tok += tgt.numel()
            if on_subset:
                n_sub += tgt.numel()
                if "tint_sim" in got and "tint_ref" in got:
                    max_diff = max(max_diff, (got["tint_sim"] - got["tint_ref"]).abs().max().item())
        res = {"n_train": n_train, "seq_len": L, "sequences": sequences, "test_tokens": n_tok,
               "perplexity": {m: math.exp(tot[m] / n_tok) for m in methods if m != "tint_sim"}}
        if "tint_sim" in methods:
            res["sim_subset"] = {"test_tokens": n_sub,
                                 "perplexity": {m: math.exp(sub[m] / n_sub) for m in methods},
                                 "max_abs_logit_diff_sim_vs_ref": max_diff}
        out[f"frac_{frac:g}"] = res
    return out


# ---------------------------------------------------------------------------- multiple choice

def load_task(o):
    """[(context, [choices], gold)] from the local copy (see TASK_FILES)."""
    task, path = o["task"], task_file(o)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if task == "piqa" or "goal" in rows[0]:
        labels_path = path.with_name("valid-labels.lst")
        labels = [int(s) for s in labels_path.read_text().split()]
        return [(f"Question: {r['goal']}\nAnswer:", [" " + r["sol1"], " " + r["sol2"]], y)
                for r, y in zip(rows, labels)]
    # lm-eval's prompts: ARC "Question: ...\nAnswer:" (the query already starts with "Question: "); OpenBookQA the stem
    fmt = (lambda q: q) if task == "openbookqa" else (lambda q: f"{q}\nAnswer:")
    return [(fmt(r["query"]), [" " + c for c in r["choices"]], int(r["gold"])) for r in rows]


def task_eval(scorer, ctx, o, methods, device, tokenizer):
    """Zero-shot / few-shot multiple choice where TinT learns from the context (TinT §3.1, k = 0)."""
    items = load_task(o)
    shots, items = items[: o["task_shots"]], items[o["task_shots"]:]
    demo = "".join(f"{c}{ch[g]}\n\n" for c, ch, g in shots)
    items = items[: o["task_examples"]]
    lr = o["task_lr"] if o["task_lr"] is not None else o["lr"]
    T_max = scorer.aux.config.block_size
    eot = getattr(tokenizer, "eot_token", 50256)
    correct = {m: [0, 0] for m in methods}        # acc, acc_norm
    counted = {m: 0 for m in methods}
    sub_correct = {m: [0, 0] for m in methods}
    n_sub = 0
    for q, (context, choices, gold) in enumerate(items):
        ctx_ids = [eot] + tokenizer.encode_ordinary(demo + context)
        opts = [tokenizer.encode_ordinary(c) for c in choices]
        longest = max(len(c) for c in opts)
        if longest >= T_max - 1:
            continue
        ctx_ids = ctx_ids[-(T_max - longest):]    # keep the end of the context
        n_train = len(ctx_ids)
        idx = torch.full((len(opts), n_train + longest), eot, dtype=torch.long)
        for i, c in enumerate(opts):
            idx[i, :n_train] = torch.tensor(ctx_ids)
            idx[i, n_train:n_train + len(c)] = torch.tensor(c)
        idx = idx.to(device)
        on_subset = q < o["sim_examples"]
        n_sub += on_subset
        for m in methods:
            if m == "tint_sim" and not on_subset:
                continue
            logp = torch.log_softmax(scorer.logits(m, idx, n_train, lr).float(), -1)
            tok_lp = logp.gather(-1, idx[:, n_train:, None])[..., 0]
            scores = torch.stack([tok_lp[i, :len(c)].sum() for i, c in enumerate(opts)])
            norm = scores / torch.tensor([max(1, len(ch.encode())) for ch in choices], device=scores.device)
            hits = [int(scores.argmax().item() == gold), int(norm.argmax().item() == gold)]
            if m != "tint_sim":
                correct[m][0] += hits[0]
                correct[m][1] += hits[1]
                counted[m] += 1
            if on_subset:
                sub_correct[m][0] += hits[0]
                sub_correct[m][1] += hits[1]
    n = max(counted.values()) if counted else 0
    res = {"task": o["task"], "shots": o["task_shots"], "examples": n, "lr": lr,
           "acc": {m: correct[m][0] / max(1, counted[m]) for m in methods if m != "tint_sim"},
           "acc_norm": {m: correct[m][1] / max(1, counted[m]) for m in methods if m != "tint_sim"}}
    if "tint_sim" in methods:
        res["sim_subset"] = {"examples": n_sub,
                             "acc": {m: sub_correct[m][0] / max(1, n_sub) for m in methods},
                             "acc_norm": {m: sub_correct[m][1] / max(1, n_sub) for m in methods}}
    return res


# ---------------------------------------------------------------------------- entry point

def simulator_size(aux_cfg, o):
    """Our construction's exact parameter count (formula; checked against the built simulator in
    tests and, with check_param_formula, here) and the paper's Table-1 estimate for the same sizes."""
    from model.gpt import mlp_hidden_size
    n_layers = o["n_layers"] or aux_cfg.n_layer
    cfg = SimConfig(n_embd=aux_cfg.n_embd, n_head=aux_cfg.n_head, head_dim=aux_cfg.head_dim,
                    n_layer=aux_cfg.n_layer, vocab_size=aux_cfg.vocab_size, block_size=aux_cfg.block_size,
                    mlp_hidden=mlp_hidden_size(aux_cfg), bias=aux_cfg.bias, norm_eps=aux_cfg.norm_eps,
                    pos=aux_cfg.pos, norm=aux_cfg.norm, mlp=aux_cfg.mlp, rope_theta=aux_cfg.rope_theta, lr=o["lr"],
                    n_layers=n_layers, n_steps=o["n_steps"], fd_eps=o["fd_eps"], K=o["sim_K"] or 0)
    ours = tint_param_formula(cfg)
    paper = paper_param_formula(aux_cfg.n_embd, n_layers, aux_cfg.block_size, H_sim=cfg.H_L, K=cfg.K,
                                D_sim=cfg.D_s)
    return {"K": cfg.K, "D_sim": cfg.D_s, "H_linear": cfg.H_L, "H_softmax": cfg.H_soft,
            "params_formula": ours["total"], "params_paper_table1": int(paper["total"])}


@evaluation("tint", check=settings)
def tint_eval(model, ctx):
    """Dynamic evaluation three ways (no update / reference update / simulator) plus exact dyn-eval."""
    o, split, L = settings(model, ctx)
    dtype = torch.float64 if o["dtype"] == "fp64" else torch.float32
    aux = copy.deepcopy(model).to(dtype).eval()
    for p in aux.parameters():
        p.requires_grad_(False)
    methods = list(o["methods"])
    result = {"options": {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in o.items()}}
    if "tint_sim" in methods and not sim_supported(aux.config):
        methods.remove("tint_sim")
        result["simulator"] = "not built: the simulator needs n_head * head_dim == n_embd"
    scorer = Scorer(aux, o)
    if "tint_sim" in methods:
        size = simulator_size(aux.config, o)
        t0 = time.perf_counter()
        sim = scorer.simulator(o["lr"])
        size["build_seconds"] = round(time.perf_counter() - t0, 2)
        size["params_built"] = sim.num_params()
        if o["check_param_formula"] and size["params_built"] != size["params_formula"]:
            raise AssertionError(f"simulator has {size['params_built']} parameters, formula says "
                                 f"{size['params_formula']}")
        size["aux_params"] = aux.num_params()
        result["simulator"] = size
        print(f"tint: simulator {size['params_built']:,} parameters (formula {size['params_formula']:,}; "
              f"paper Table-1 formula {size['params_paper_table1']:,}) for a {size['aux_params']:,}-parameter "
              f"auxiliary model")
    device = next(aux.parameters()).device
    if o["train_fracs"]:
        result["text"] = text_eval(scorer, split, L, o, methods, device)
    if o["task"]:
        result["task"] = task_eval(scorer, ctx, o, methods, device, ctx.tokenizer)
    print(format_table(result))
    return result


def format_table(result):
    """Side-by-side text table: perplexity per train fraction, then task accuracy; a "(sim subset)" row
    repeats every method, simulator included, on the batches / questions the simulator scored."""
    methods = [m for m in METHODS if m in result["options"]["methods"]]
    lines = [f"{'tint':<24}" + "".join(f"{m:>13}" for m in methods)]

    def row(name, vals, fmt):
        return f"{name:<24}" + "".join(f"{vals[m]:>13{fmt}}" if m in vals else f"{'-':>13}" for m in methods)

    for name, res in result.get("text", {}).items():
        lines.append(row(f"{name} ppl", res["perplexity"], ".3f"))
        if "sim_subset" in res:
            lines.append(row("  (sim subset)", res["sim_subset"]["perplexity"], ".3f"))
    task = result.get("task")
    if task:
        for metric in ("acc", "acc_norm"):
            lines.append(row(f"{task['task']} {metric}", task[metric], ".4f"))
            if "sim_subset" in task:
                lines.append(row("  (sim subset)", task["sim_subset"][metric], ".4f"))
    return "\n".join(lines)
