"""lm-evaluation-harness on this repo's checkpoints: the model adapter, the papers' presets, offline tasks.

    python eval.py ckpt=RUN eval.tasks=[lm_eval] lm_eval.preset=castle      # CASTLE Tables 2-3 (0 and 5 shots)
    python eval.py ckpt=RUN eval.tasks=[lm_eval] lm_eval.preset=fox         # FoX Table 1 (zero-shot)
    python eval.py ckpt=RUN eval.tasks=[lm_eval] lm_eval.preset=longbench   # FoX Table 2 (needs the Hub)
    python eval.py ckpt=RUN eval.tasks=[lm_eval] lm_eval.tasks=[hellaswag] lm_eval.limit=100
    python eval.py ckpt=RUN eval.tasks=[lm_eval] lm_eval.tasks=[my_task] lm_eval.include_path=my_tasks/

`GPTLM` scores with the model's own forward pass and generates with its own cache
(`GPT.generate_stream`), so every attention variant goes through it unchanged. Without the
Hugging Face Hub the tasks run from the local copies in ../shared/data/eval as `local_<task>`
(evaluation/tasks/; its README.md lists how they differ from the official tasks).
"""
import difflib
import functools
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import lm_eval.tasks
import torch
import torch.nn.functional as F
import yaml
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table
from tqdm import tqdm

from evaluation import check_positions, evaluation
from model.runtime import boolean, checked, integer, listed, one_of, optional, shown, text

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LM_EVAL_TASKS = Path(lm_eval.tasks.__file__).resolve().parent
DEFAULT_DATA_ROOT = REPO.parent / "shared" / "data" / "eval"
LOCAL_TASKS = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "lambada_openai", "mmlu", "openbookqa",
               "piqa", "wikitext", "winogrande")     # official names with a copy in evaluation/tasks


class GPTLM(TemplateLM):
    """lm-eval's model interface over a `model.gpt.GPT`.

    Every context starts with <|endoftext|> when add_bos is on, as every training document does.
    Sequences longer than max_length keep their last max_length tokens. Loglikelihood requests
    are sorted longest first and packed into right-padded batches of at most batch_tokens tokens
    (right padding never changes a causal model's logits at the real positions). Generation runs
    one request at a time through the model's own cache; truncation="middle" keeps the two ends
    of a long prompt (LongBench), first_line=True keeps the first non-empty line (FoX's scorer).
    """

    def __init__(self, model, tokenizer, max_length=None, batch_tokens=16384, add_bos=True,
                 max_gen_toks=256, truncation="left", first_line=False):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.max_length = max_length or model.config.block_size
        self.batch_tokens, self.add_bos, self.max_gen_toks = batch_tokens, add_bos, max_gen_toks
        self.truncation, self.first_line = truncation, first_line
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self):
        return self.tokenizer.eot_token

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        ids = self.tokenizer.encode_ordinary(string)
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        return [self.eot_token_id] + ids if bos else ids

    # ------------------------------------------------------------------------- scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """[(key, context ids, continuation ids)] -> [(sum of continuation log-probs, is greedy)]."""
        rows, n_cont = [], []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens does not fit "
                                 f"max_length={self.max_length}")
            rows.append((context + continuation)[-(self.max_length + 1):])   # inputs are rows[:-1]
            n_cont.append(len(continuation))
        results = [(0.0, True)] * len(rows)          # an empty continuation has probability 1
        order = sorted((i for i in range(len(rows)) if n_cont[i]), key=lambda i: -len(rows[i]))
        with tqdm(total=len(order), desc="loglikelihood", disable=disable_tqdm) as bar:
            for batch in self._batches(order, rows):
                for i, result in zip(batch, self._score([rows[i] for i in batch], [n_cont[i] for i in batch])):
                    results[i] = result
                bar.update(len(batch))
        return results

    def _batches(self, order, rows):
        """Consecutive slices of `order` (longest first) with at most batch_tokens padded tokens."""
        batch = []
        for i in order:
            if batch and (len(batch) + 1) * (len(rows[batch[0]]) - 1) > self.batch_tokens:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    @torch.no_grad()
    def _score(self, rows, n_cont):
        """One forward pass over right-padded rows; every continuation token scored in one gather."""
        width = max(map(len, rows)) - 1
        idx = torch.tensor([row[:-1] + [0] * (width + 1 - len(row)) for row in rows], device=self.device)
        # every continuation token: its row, the input position whose logits predict it, the token itself
        owner = [b for b, n in enumerate(n_cont) for _ in range(n)]
        pos = [len(row) - 1 - n + j for row, n in zip(rows, n_cont) for j in range(n)]
        target = [t for row, n in zip(rows, n_cont) for t in row[len(row) - n:]]
        owner, pos, target = (torch.tensor(v, device=self.device) for v in (owner, pos, target))
        logits, _ = self.model(idx)
        logp = F.log_softmax(logits[owner, pos].float(), dim=-1)
        ll = torch.zeros(len(rows), dtype=torch.float64, device=self.device)
        ll.index_add_(0, owner, logp.gather(-1, target[:, None]).squeeze(1).double())
        misses = torch.zeros(len(rows), device=self.device).index_add_(0, owner, (logp.argmax(-1) != target).float())
        return [(value, miss == 0) for value, miss in zip(ll.tolist(), misses.tolist())]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Log-likelihood of whole texts in disjoint windows of max_length tokens; the first
        window is conditioned on <|endoftext|>, later ones on the window before them."""
        windows, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0], add_special_tokens=False)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += ll
        return totals

    # ------------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm=False):
        return [self._generate(*request.args) for request in tqdm(requests, desc="generate", disable=disable_tqdm)]

    def _generate(self, context, gen_kwargs):
        kwargs = dict(gen_kwargs)
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = kwargs.get("max_gen_toks", self.max_gen_toks)
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks={max_new} (the task's, else lm_eval.max_gen_toks) leaves no room for a "
                             f"prompt in max_length={self.max_length} (lm_eval.max_length, null: the model's "
                             "block_size); lower lm_eval.max_gen_toks or raise lm_eval.max_length")
        temperature = kwargs.get("temperature", 1.0) if kwargs.get("do_sample") else 0.0
        prompt = self._truncate(self.tok_encode(context), self.max_length - max_new)
        new = []
        for token in self.model.generate_stream(torch.tensor([prompt], device=self.device), max_new,
                                                temperature=temperature, top_k=kwargs.get("top_k"),
                                                top_p=kwargs.get("top_p"), eot_token=self.eot_token_id):
            if token.item() == self.eot_token_id:
                break
            new.append(token.item())
            if self._stop(self.tokenizer.decode(new), until):
                break
        return self._cut(self.tokenizer.decode(new), until)

    def _truncate(self, ids, budget):
        if len(ids) <= budget:
            return ids
        if self.truncation == "middle":
            head = budget // 2
            return ids[:head] + ids[len(ids) - (budget - head):]
        return ids[len(ids) - budget:]

    def _stop(self, text, until):
        return any(s in text for s in until) or (self.first_line and "\n" in text.lstrip("\n"))

    def _cut(self, text, until):
        for s in until:
            text = text.split(s)[0]
        return text.lstrip("\n").split("\n")[0] if self.first_line else text


# ----------------------------------------------------------------------------- presets

@dataclass(frozen=True)
class Preset:
    """A paper's table: columns (title, official lm-eval task, metric), shots, generation settings."""
    columns: tuple
    shots: tuple = (0,)
    average: bool = True          # Avg = plain mean of the non-perplexity columns, in %
    truncation: str = "left"
    first_line: bool = False


LONGBENCH = (("NarrativeQA", "narrativeqa"), ("Qasper", "qasper"), ("MFQA", "multifieldqa_en"),
             ("HotpotQA", "hotpotqa"), ("2WikiMQA", "2wikimqa"), ("Musique", "musique"),
             ("GovReport", "gov_report"), ("QMSum", "qmsum"), ("MultiNews", "multi_news"), ("TREC", "trec"),
             ("TriviaQA", "triviaqa"), ("SamSum", "samsum"), ("LCC", "lcc"), ("RepoBench-P", "repobench-p"))

PRESETS = {
    # CASTLE (arXiv:2509.07301) §3.3, Tables 2-3: acc_norm for ARC-C, HellaSwag, OBQA, PIQA; acc for the rest;
    # 0- and 5-shot
    "castle": Preset(shots=(0, 5), columns=(
        ("ARC-C", "arc_challenge", "acc_norm"), ("ARC-E", "arc_easy", "acc"), ("BoolQ", "boolq", "acc"),
        ("Hella.", "hellaswag", "acc_norm"), ("MMLU", "mmlu", "acc"), ("OBQA", "openbookqa", "acc_norm"),
        ("PIQA", "piqa", "acc_norm"), ("Wino.", "winogrande", "acc"))),
    # FoX (arXiv:2503.02130) §4.4, Table 1 (zero-shot). The paper does not define Avg; the mean of the 10 accuracy
    # columns (both perplexities left out) reproduces its numbers
    "fox": Preset(columns=(
        ("Wiki. ppl", "wikitext", "word_perplexity"), ("LMB. ppl", "lambada_openai", "perplexity"),
        ("LMB. acc", "lambada_openai", "acc"), ("PIQA", "piqa", "acc"), ("Hella.", "hellaswag", "acc_norm"),
        ("Wino.", "winogrande", "acc"), ("ARC-e", "arc_easy", "acc"), ("ARC-c", "arc_challenge", "acc_norm"),
        ("COPA", "copa", "acc"), ("OBQA", "openbookqa", "acc_norm"), ("SciQA", "sciq", "acc"),
        ("BoolQ", "boolq", "acc"))),
    # FoX §4.4, Table 2. The paper gives no protocol beyond LongBench's metrics; its numbers come from its code,
    # which cuts prompts in the middle and every prediction at its first line
    "longbench": Preset(columns=tuple((title, f"longbench_{name}", "score") for title, name in LONGBENCH),
                        average=False, truncation="middle", first_line=True),
}


def paper_row(preset, results):
    """{column title: value} in the papers' units (accuracy in %, perplexity as is) plus Avg.

    `results` is the harness's results dict; a column reads the official task or its local_ copy.
    """
    row = {}
    for title, task, metric in preset.columns:
        key = f"{metric},none"
        found = [results[t][key] for t in (task, f"local_{task}") if key in results.get(t, {})]
        row[title] = None if not found else found[0] if "perplexity" in metric else 100 * found[0]
    if preset.average:
        accuracies = [row[title] for title, _, metric in preset.columns if "perplexity" not in metric]
        row["Avg"] = None if None in accuracies else sum(accuracies) / len(accuracies)
    return row


# ----------------------------------------------------------------------------- local tasks

def data_root(setting=None):
    """Where the local benchmark copies live: the setting, else $EVAL_DATA_ROOT, else ../shared/data/eval."""
    return Path(setting or os.environ.get("EVAL_DATA_ROOT") or DEFAULT_DATA_ROOT).expanduser().resolve()


def write_local_tasks(dest, root):
    """Copy evaluation/tasks to dest with ${EVAL_DATA} and ${LM_EVAL_TASKS} filled in, and write one
    local_mmlu_<subject> task per subject of the installed lm-eval's MMLU. Returns dest."""
    dest = Path(dest)
    shutil.copytree(TASKS_DIR, dest, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    for path in dest.rglob("*.yaml"):
        text = path.read_text().replace("${EVAL_DATA}", str(root))
        path.write_text(text.replace("${LM_EVAL_TASKS}", str(LM_EVAL_TASKS)))
    for subject, official in mmlu_subjects():
        files = {split: str(root / "mmlu" / "hf_arrow" / subject / split / "data-00000-of-00001.arrow")
                 for split in ("dev", "test")}
        task = {"include": str(official), "task": f"local_mmlu_{subject}", "tag": "local_mmlu_tasks",
                "dataset_path": "arrow", "dataset_name": None, "dataset_kwargs": {"data_files": files}}
        (dest / "mmlu" / f"local_mmlu_{subject}.yaml").write_text(yaml.safe_dump(task))
    return dest


def mmlu_subjects():
    """(subject, official task YAML) for every subject of the installed lm-eval's MMLU."""
    return [(path.stem.removeprefix("mmlu_"), path)
            for path in sorted((LM_EVAL_TASKS / "mmlu" / "default").glob("mmlu_*.yaml"))]


@functools.lru_cache(maxsize=None)
def hub_reachable(timeout=3.0):
    """Whether the Hugging Face Hub answers; asked once per process, so every check and run agrees."""
    if os.environ.get("HF_HUB_OFFLINE", "0") != "0" or os.environ.get("HF_DATASETS_OFFLINE", "0") != "0":
        return False
    try:
        urllib.request.urlopen("https://huggingface.co", timeout=timeout)
        return True
    except OSError:
        return False


def use_local_copies(offline, root):
    """offline: true | false | "auto" (local copies when the data root exists and the Hub does not answer)."""
    if offline == "auto":
        return root.is_dir() and not hub_reachable()
    return bool(offline)


def select_tasks(preset, tasks, local):
    """Task names to run, and {name: reason} for preset tasks that have no local copy when offline."""
    names = list(dict.fromkeys([task for _, task, _ in preset.columns] if preset else []))
    names += [t for t in ([tasks] if isinstance(tasks, str) else tasks or []) if t not in names]
    if not local:
        return names, {}
    preset_tasks = {task for _, task, _ in preset.columns} if preset else set()
    skipped = {n: "no local copy; run with the Hugging Face Hub reachable (lm_eval.offline=false)"
               for n in names if n in preset_tasks and n not in LOCAL_TASKS}
    return [f"local_{n}" if n in LOCAL_TASKS else n for n in names if n not in skipped], skipped


def local_task_names():
    """The names write_local_tasks defines: local_<task>, the local_mmlu group, its subjects and tags."""
    subjects = {f"local_mmlu_{subject}" for subject, _ in mmlu_subjects()}
    return {f"local_{t}" for t in LOCAL_TASKS} | subjects | {"local_tasks", "local_mmlu_tasks"}


@functools.lru_cache(maxsize=None)
def indexed_task_names(include_path):
    """Every task, group and tag name of the installed lm-eval and of `include_path` (indexing takes seconds)."""
    return frozenset(lm_eval.tasks.TaskManager(include_path=include_path).all_tasks)


def check_task_names(names, include_path):
    """Unknown names are an error that says where names come from and how to list them."""
    known = local_task_names()
    unknown = [n for n in names if n not in known and not os.path.isfile(n)]
    if unknown:
        known |= indexed_task_names(include_path)
        unknown = [n for n in unknown if n not in known]
    if unknown:
        hints = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
        hint = "; ".join(f"{n}: did you mean {', '.join(m)}?" for n, m in hints.items() if m)
        raise ValueError(f"lm_eval.tasks holds unknown lm-eval task(s) {unknown}: not in lm-eval, evaluation/tasks or "
                         f"lm_eval.include_path{' (' + hint + ')' if hint else ''}. List the valid names with "
                         "`lm-eval ls tasks` (add `--include_path DIR` for your own task YAMLs)")


def load_tasks(task_manager, names):
    """Task/Group objects for `names` (checked by check_task_names); a task whose data cannot be
    fetched is reported, not fatal (local_ tasks must always load: their failure is a bug)."""
    objects, skipped = [], {}
    for name in names:
        try:
            loaded = task_manager.load([name])
        except Exception as e:          # dataset download failed: no network, moved or gated data
            if name.startswith("local_"):
                raise
            skipped[name] = f"could not load its data ({type(e).__name__}: {e})"
            continue
        objects += [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())
    return objects, skipped


# ----------------------------------------------------------------------------- evaluation

def check_limit(limit):
    """lm-eval reads a float below 1 as a fraction of each task's documents and anything else as a count."""
    fraction = isinstance(limit, float) and 0 < limit < 1
    count = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1
    if not (limit is None or fraction or count):
        raise ValueError(f"lm_eval.limit={shown(limit)} is invalid: it must be null (every document), an integer "
                         ">= 1 (documents per task) or a fraction in (0, 1) of each task's documents, e.g. "
                         "lm_eval.limit=100 or lm_eval.limit=0.1")


@dataclass(frozen=True)
class Plan:
    """What run_lm_eval runs: the preset, task names, {skipped task: why}, whether the local copies
    stand in for the Hub, where they are, and the user's include_path."""
    preset: Preset | None
    names: list
    skipped: dict
    local: bool
    root: Path
    include_path: str | None


def settings(model, ctx):
    """The lm_eval options, every one checked -> Plan."""
    c = ctx.cfg.lm_eval
    if not c.preset and not c.tasks:
        raise ValueError("eval.tasks has lm_eval but nothing to run: set lm_eval.preset=castle|fox|longbench "
                         "or lm_eval.tasks=[...]")
    if c.preset and c.preset not in PRESETS:
        raise ValueError(f"lm_eval.preset={c.preset!r} is unknown; choose one of {sorted(PRESETS)}")
    tasks = checked(c.tasks, "lm_eval.tasks", listed(text())) if c.tasks else []
    check_limit(c.limit)
    checked(c.num_fewshot, "lm_eval.num_fewshot", optional(integer(0)))
    checked(c.batch_tokens, "lm_eval.batch_tokens", integer(1))
    checked(c.bootstrap_iters, "lm_eval.bootstrap_iters", integer(0))
    max_length = checked(c.max_length, "lm_eval.max_length", optional(integer(2))) or model.config.block_size
    check_positions(model, max_length, "lm_eval.max_length")
    checked(c.max_gen_toks, "lm_eval.max_gen_toks", integer(1))   # against max_length: by generating tasks only
    checked(c.add_bos, "lm_eval.add_bos", boolean())
    checked(c.offline, "lm_eval.offline", one_of(True, False, "auto"))
    include_path = str(Path(c.include_path).expanduser().resolve()) if c.include_path else None
    if include_path and not os.path.isdir(include_path):
        raise FileNotFoundError(f"lm_eval.include_path={c.include_path} is not a directory; point it at a folder "
                                "of task YAMLs")
    preset = PRESETS[c.preset] if c.preset else None
    root = data_root(c.data_root)
    local = use_local_copies(c.offline, root)
    names, skipped = select_tasks(preset, tasks, local)
    needs_copies = local or set(names) & local_task_names() or (c.offline == "auto" and not hub_reachable())
    if needs_copies and not root.is_dir():
        raise FileNotFoundError(f"the local benchmark copies are not at {root} (lm_eval.data_root, else "
                                f"$EVAL_DATA_ROOT, else {DEFAULT_DATA_ROOT})" + ("" if local else " and the Hugging "
                                "Face Hub does not answer") + "; point lm_eval.data_root at them, or run with the "
                                "Hub reachable and lm_eval.offline=false")
    check_task_names(names, include_path)
    return Plan(preset, names, skipped, local, root, include_path)


@evaluation("lm_eval", check=settings)
def run_lm_eval(model, ctx):
    """Run a preset and/or lm_eval.tasks; returns {preset or "tasks": {"<k>-shot": harness results}}."""
    c = ctx.cfg.lm_eval
    plan = settings(model, ctx)
    preset, names, skipped = plan.preset, plan.names, plan.skipped
    lm = GPTLM(model, ctx.tokenizer, max_length=c.max_length, batch_tokens=c.batch_tokens,
               add_bos=c.add_bos, max_gen_toks=c.max_gen_toks,
               truncation=preset.truncation if preset else "left", first_line=bool(preset and preset.first_line))
    shots = [c.num_fewshot] if c.num_fewshot is not None else list(preset.shots) if preset else [None]
    out = {"settings": {"local_copies": plan.local, "data_root": str(plan.root) if plan.local else None,
                        "max_length": lm.max_length, "add_bos": lm.add_bos, "limit": c.limit, "tasks": names}}
    with tempfile.TemporaryDirectory() as tmp:
        include = [str(write_local_tasks(tmp, plan.root))] + ([plan.include_path] if plan.include_path else [])
        official = any(not name.startswith("local_") for name in names)    # indexing lm-eval's own tasks takes seconds
        task_manager = lm_eval.tasks.TaskManager(include_path=include, include_defaults=official)
        for k in shots:
            objects, not_loaded = load_tasks(task_manager, names)   # fresh tasks: num_fewshot sticks to a task
            skipped.update(not_loaded)
            if objects:
                key = f"{k}-shot" if k is not None else "task-default-shots"
                out[key] = harness_run(lm, objects, k, c, task_manager, preset)
    for name, reason in skipped.items():
        print(f"lm_eval: skipped {name}: {reason}")
    out["skipped"] = skipped
    return {c.preset or "tasks": out}


def harness_run(lm, objects, num_fewshot, c, task_manager, preset):
    res = simple_evaluate(model=lm, tasks=objects, num_fewshot=num_fewshot, limit=c.limit, task_manager=task_manager,
                          bootstrap_iters=c.bootstrap_iters, log_samples=False)
    print(make_table(res))
    run = {key: res[key] for key in ("results", "groups", "n-shot", "n-samples", "versions") if key in res}
    if preset:
        run["table"] = paper_row(preset, res["results"])
    return run
