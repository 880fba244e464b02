"""The evaluation driver: the lm-eval adapter (through the real harness, offline), per-token loss,
needle in a haystack, TinT and eval.py end to end, on tiny random models (CPU); every bad option
of eval.py's evaluations fails before any evaluation runs, with a message naming it and the fix."""
import importlib.util
import json
import math
import os
import sys
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from hydra import compose, initialize_config_dir
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from omegaconf import OmegaConf

import eval as eval_script
from data.shards import write_shard
from data.tokenizer import get_tokenizer
import evaluation.results
import evaluation.tint
from evaluation import long_context, niah
from evaluation.lm_eval_adapter import (GPTLM, PRESETS, check_limit, data_root, hub_reachable, paper_row,
                                        select_tasks, write_local_tasks)
from model.checkpoint import CHECKPOINT_FORMAT, config_dict, load_model
from model.gpt import ATTENTIONS, GPT, RECURRENT_ATTENTIONS, GPTConfig
from tests.test_model import VARIANTS   # every attention variant and block style, in tiny form
from tests.test_recurrent import VARIANTS as RECURRENT_VARIANTS

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
TINY = {"vocab_size": 50304, "block_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 32}
NO_DATA = "needs the local benchmark copies (../shared/data/eval; .ci/run requires them)"
HAS_DATA = data_root().is_dir()
needs_data = pytest.mark.skipif(not HAS_DATA, reason=NO_DATA)


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**TINY)).eval()


def direct_loglikelihood(model, context, continuation):
    """Sum of log p(continuation | context) from one plain forward pass."""
    ids = torch.tensor([context + continuation])
    logits, _ = model(ids[:, :-1])
    logp = F.log_softmax(logits[0, len(context) - 1:].float(), dim=-1)
    return logp.gather(-1, torch.tensor(continuation)[:, None]).sum().item()


def instance(kind, *args):
    return Instance(kind, {}, args, 0)


# ----------------------------------------------------------------------------- adapter

def test_loglikelihood_boundary_and_batching_match_direct_computation(model, tok):
    lm = GPTLM(model, tok, batch_tokens=96)           # several padded batches
    pairs = [("The cat sat on the", " mat."), ("Question: what is two plus two?\nAnswer:", " four"),
             ("A", " much longer continuation than its context, spanning many tokens"), ("", "No context at all")]
    got = lm.loglikelihood([instance("loglikelihood", c, x) for c, x in pairs])
    for (context, continuation), (ll, _) in zip(pairs, got):
        ctx_ids = [tok.eot_token] + tok.encode_ordinary(context)        # add_bos: contexts start with EOT
        assert ll == pytest.approx(direct_loglikelihood(model, ctx_ids, tok.encode_ordinary(continuation)), abs=1e-4)
    # trailing spaces of the context move to the continuation (lm-eval's word-boundary rule)
    (ll, _), = lm.loglikelihood([instance("loglikelihood", "The cat sat on the ", "mat.")])
    assert ll == pytest.approx(got[0][0], abs=1e-4)


def test_greedy_flag_is_argmax(model, tok):
    lm = GPTLM(model, tok)
    context = [tok.eot_token] + tok.encode_ordinary("Hello")
    logits, _ = model(torch.tensor([context]))
    best = int(logits[0, -1].argmax())
    other = (best + 1) % 50257
    (_, greedy), (_, not_greedy) = lm._loglikelihood_tokens([(None, context, [best]), (None, context, [other])])
    assert greedy and not not_greedy


def test_left_truncation_keeps_the_last_max_length_tokens(model, tok):
    lm = GPTLM(model, tok, max_length=16)
    context, continuation = list(range(100, 140)), list(range(200, 205))
    (ll, _), = lm._loglikelihood_tokens([(None, context, continuation)])
    row = (context + continuation)[-17:]
    assert ll == pytest.approx(direct_loglikelihood(model, row[:-5], row[-5:]), abs=1e-4)
    with pytest.raises(ValueError, match="max_length"):
        lm._loglikelihood_tokens([(None, [1], list(range(20)))])
    assert lm._loglikelihood_tokens([(None, [1, 2], [])]) == [(0.0, True)]


def test_rolling_loglikelihood_is_the_sum_of_per_token_losses(model, tok):
    lm = GPTLM(model, tok)
    short = "A short text that fits in one window."
    ids = tok.encode_ordinary(short)
    _, loss = model(torch.tensor([[tok.eot_token] + ids[:-1]]), torch.tensor([ids]))
    got = lm.loglikelihood_rolling([instance("loglikelihood_rolling", short)])[0]
    assert got == pytest.approx(-loss.item() * len(ids), rel=1e-5)
    long = " ".join(f"word{i}" for i in range(80))    # several disjoint windows of 64 predictions
    ids = tok.encode_ordinary(long)
    padded = [tok.eot_token] + ids
    expected = 0.0
    for start in range(0, len(ids), 64):      # window k predicts ids[64k:64k+64], each from a full context
        end = min(start + 64, len(ids))
        x = torch.tensor([padded[max(0, end - 64):end]])
        logits, _ = model(x)
        losses = F.cross_entropy(logits[0], torch.tensor(ids[end - x.size(1):end]), reduction="none")
        expected -= losses[-(end - start):].sum().item()
    assert len(ids) > 128
    assert lm.loglikelihood_rolling([instance("loglikelihood_rolling", long)])[0] == pytest.approx(expected, rel=1e-5)


def test_generate_until_decodes_greedily_with_the_cache_and_stops(model, tok):
    lm = GPTLM(model, tok)
    prompt = "Once upon a time"
    ids = torch.tensor([[tok.eot_token] + tok.encode_ordinary(prompt)])
    reference = tok.decode(model.generate(ids, 12, temperature=0, use_cache=False)[0, ids.size(1):].tolist())
    assert lm.generate_until([instance("generate_until", prompt, {"until": [], "max_gen_toks": 12})]) == [reference]
    stop = reference[len(reference) // 2:][:3]
    got = lm.generate_until([instance("generate_until", prompt, {"until": [stop], "max_gen_toks": 12})])
    assert got == [reference.split(stop)[0]]


def test_truncation_modes_and_first_line(model, tok):
    ids = list(range(10))
    assert GPTLM(model, tok)._truncate(ids, 4) == [6, 7, 8, 9]
    assert GPTLM(model, tok, truncation="middle")._truncate(ids, 5) == [0, 1, 7, 8, 9]
    first = GPTLM(model, tok, first_line=True)
    assert first._cut("\n\nanswer one\nmore", ["zzz"]) == "answer one"
    assert first._stop("\n\nanswer", []) is False and first._stop("\nanswer\n", []) is True


# the recurrent layers (fla's) share one path through the adapter: their state as the cache; hgrn2 stands for them
ADAPTER_VARIANTS = {**VARIANTS, "hgrn2": {**RECURRENT_VARIANTS["hgrn2"], "pos": "none"}}


def test_variants_cover_every_attention():
    assert set(ATTENTIONS) - set(RECURRENT_ATTENTIONS) <= {kw["attention"] for kw in VARIANTS.values()}


@pytest.mark.parametrize("name", ADAPTER_VARIANTS)
def test_every_attention_variant_goes_through_the_adapter(name, tok):
    torch.manual_seed(0)
    variant = GPT(GPTConfig(**{**TINY, **ADAPTER_VARIANTS[name]})).eval()
    lm = GPTLM(variant, tok, batch_tokens=64)
    pairs = [("Paris is the capital of", " France"), ("One two three", " four five six seven")]
    got = lm.loglikelihood([instance("loglikelihood", c, x) for c, x in pairs])
    for (context, continuation), (ll, _) in zip(pairs, got):
        ctx_ids = [tok.eot_token] + tok.encode_ordinary(context)
        assert ll == pytest.approx(direct_loglikelihood(variant, ctx_ids, tok.encode_ordinary(continuation)), abs=1e-3)
    ids = torch.tensor([[tok.eot_token] + tok.encode_ordinary("Paris")])
    reference = tok.decode(variant.generate(ids, 5, temperature=0, use_cache=False)[0, ids.size(1):].tolist())
    assert lm.generate_until([instance("generate_until", "Paris", {"until": [], "max_gen_toks": 5})]) == [reference]


# ----------------------------------------------------------------------------- real harness

@needs_data
def test_user_task_through_the_harness_matches_hand_computed_accuracy(model, tok, tmp_path):
    """A task in a user's include_path, built from 6 ARC-Easy items of the shared copy."""
    with open(data_root() / "arc_easy" / "arc_easy.llmfoundry.jsonl") as f:
        items = [json.loads(next(f)) for _ in range(6)]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (tmp_path / "tiny_arc.yaml").write_text(yaml.safe_dump({
        "task": "tiny_arc", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "items.jsonl")}},
        "output_type": "multiple_choice", "doc_to_text": "{{query}}\nAnswer:", "doc_to_choice": "{{choices}}",
        "doc_to_target": "gold", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    res = simple_evaluate(model=GPTLM(model, tok), tasks=["tiny_arc"], task_manager=manager,
                          bootstrap_iters=0, log_samples=False)["results"]["tiny_arc"]
    acc, acc_norm = [], []
    for item in items:
        context = [tok.eot_token] + tok.encode_ordinary(item["query"] + "\nAnswer:")
        lls = [direct_loglikelihood(model, context, tok.encode_ordinary(" " + choice)) for choice in item["choices"]]
        acc.append(np.argmax(lls) == item["gold"])
        acc_norm.append(np.argmax([ll / len(choice) for ll, choice in zip(lls, item["choices"])]) == item["gold"])
    assert res["acc,none"] == pytest.approx(np.mean(acc))
    assert res["acc_norm,none"] == pytest.approx(np.mean(acc_norm))


@pytest.mark.slow
@needs_data
def test_local_tasks_match_the_official_prompts(tmp_path):
    """The local copies, loaded offline, produce lm-eval's official prompts and targets."""
    manager = TaskManager(include_path=str(write_local_tasks(tmp_path, data_root())), include_defaults=False)
    names = ["local_arc_challenge", "local_boolq", "local_hellaswag", "local_openbookqa", "local_mmlu"]
    tasks = manager.load(names)["tasks"]
    arc, boolq, hellaswag = tasks["local_arc_challenge"], tasks["local_boolq"], tasks["local_hellaswag"]
    assert len(arc.eval_docs) == 1172 and len(boolq.eval_docs) == 3270 and len(hellaswag.eval_docs) == 10042
    doc = arc.eval_docs[0]
    assert arc.doc_to_text(doc).startswith("Question: ") and arc.doc_to_text(doc).endswith("?\nAnswer:")
    assert hellaswag.doc_to_text(hellaswag.eval_docs[0]) == "Roof shingle removal: A man is sitting on a roof. He"
    assert hellaswag.doc_to_target(hellaswag.eval_docs[0]) == 3
    assert boolq.doc_to_choice(boolq.eval_docs[0]) == ["no", "yes"] and boolq.doc_to_target(boolq.eval_docs[0]) == 0
    assert sum(name.startswith("local_mmlu_") for name in tasks) == 57
    assert sum(len(t.eval_docs) for name, t in tasks.items() if name.startswith("local_mmlu_")) == 14042


def test_paper_average_reproduces_fox_table1():
    """FoX (arXiv:2503.02130) Table 1: the Avg of FoX (Pro), 50.88, is the mean of its 10 accuracy columns."""
    row = [23.04, 14.91, 42.75, 64.09, 38.39, 52.33, 52.23, 26.54, 71.00, 29.80, 85.10, 46.57]
    results = {}
    for (_, task, metric), value in zip(PRESETS["fox"].columns, row):
        results.setdefault(task, {})[f"{metric},none"] = value if "perplexity" in metric else value / 100
    table = paper_row(PRESETS["fox"], results)
    assert table["Avg"] == pytest.approx(50.88, abs=0.005) and table["Wiki. ppl"] == 23.04


def test_offline_selection_maps_to_local_copies_and_skips_the_rest():
    names, skipped = select_tasks(PRESETS["fox"], ["sciq", "my_task"], local=True)
    assert "local_hellaswag" in names and "local_wikitext" in names and "my_task" in names
    assert set(skipped) == {"copa", "sciq"}
    names, skipped = select_tasks(PRESETS["castle"], [], local=False)
    assert names[:2] == ["arc_challenge", "arc_easy"] and not skipped
    names, skipped = select_tasks(PRESETS["longbench"], [], local=True)
    assert not names and len(skipped) == 14


# ----------------------------------------------------------------------------- long context

def test_per_token_loss_matches_the_training_loss(model):
    batches = [(torch.randint(0, 50257, (2, 48)), torch.randint(0, 50257, (2, 48))) for _ in range(3)]
    losses, count = long_context.per_token_loss(model, batches, "cpu")
    assert losses.shape == (48,) and losses.dtype == np.float64 and count == 6
    reference = np.mean([model(x, y)[1].item() for x, y in batches])
    assert losses.mean() == pytest.approx(reference, rel=1e-5)
    first = [F.cross_entropy(model(x)[0][:, 0], y[:, 0]).item() for x, y in batches]
    assert losses[0] == pytest.approx(np.mean(first), rel=1e-5)


def test_smoothing_and_perplexity_by_length():
    assert long_context.smooth(np.array([1.0, 2, 3, 4]), 3) == pytest.approx([1.5, 2, 3, 3.5])
    assert long_context.smooth(np.full(500, 2.0), 101) == pytest.approx(np.full(500, 2.0))
    losses = np.concatenate([np.full(512, 1.0), np.full(512, 3.0)])
    p = long_context.perplexity_by_length(losses, 512)
    assert list(p) == [1024, 512] and p[512] == pytest.approx(math.e) and p[1024] == pytest.approx(math.exp(2))


# ----------------------------------------------------------------------------- needle in a haystack

def test_needle_prompt_layout(tok):
    hay = tok.encode_ordinary("One sentence here. Another one follows it. And a third one ends.")
    needle, end = tok.encode_ordinary(niah.NEEDLES["standard"]), tok.encode_ordinary(niah.PROMPT_END)
    period = set(tok.encode_ordinary("."))
    prompts = {d: niah.build_prompt(hay, needle, end, tok.eot_token, d, period) for d in (0, 50, 100)}
    assert len({len(p) for p in prompts.values()}) == 1
    assert prompts[0][:1 + len(needle)] == [tok.eot_token] + needle
    assert prompts[100][-len(end) - len(needle):-len(end)] == needle
    at = prompts[50].index(needle[0])
    assert prompts[50][at - 1] in period
    assert tok.decode(prompts[100]).endswith("Answer: The best thing to do in San Francisco is")


def test_needle_scoring_finds_the_answer(tok):
    """A stand-in model that always answers correctly passes every prompt."""
    answer = torch.tensor(tok.encode_ordinary(" eat a sandwich and sit in Dolores Park on a sunny day."))
    oracle = types.SimpleNamespace(generate=lambda idx, n, **kw: torch.cat([idx, answer.expand(idx.size(0), -1)], 1))
    hay = tok.encode_ordinary("Some text. " * 200)
    c = OmegaConf.create({"question_reserve": 200, "max_new_tokens": 16, "batch_size": 2})
    records = niah.run_mode(oracle, tok, hay, "easy", [300, 400], [0.0, 50.0, 100.0], c, "cpu")
    assert len(records) == 6 and all(r["match"] for r in records)
    assert len({r["prompt_tokens"] for r in records if r["length"] == 300}) == 1


# ----------------------------------------------------------------------------- eval.py end to end

def write_checkpoint(run_dir, overrides=()):
    """A randomly initialised checkpoint in train.py's format (a 1-layer model, 64-token context)."""
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                                                       "model.head_dim=16", "train.seq_len=64",
                                                       f"train.out_dir={run_dir}", *overrides])
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True)))
    torch.save({"format": CHECKPOINT_FORMAT, "step": 0, "model": gpt.state_dict(),
                "model_config": config_dict(gpt.config), "config": OmegaConf.to_container(cfg, resolve=True)},
               run_dir / "ckpt_0.pt")
    return run_dir


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """LLaMA-style (RoPE), trained on nothing."""
    return write_checkpoint(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def learned_checkpoint(tmp_path_factory):
    """GPT-2 style: learned positions, so nothing reads past block_size=64."""
    return write_checkpoint(tmp_path_factory.mktemp("gpt2"), ["model=gpt2"])


def eval_run(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return eval_script.run(compose(config_name="evaluate", overrides=overrides))


@pytest.fixture(scope="module")
def evaluated_checkpoint(tiny_checkpoint):
    """The tiny run after eval.py's long-context, needle and (offline) lm_eval tasks; -> (run dir, results)."""
    if not HAS_DATA:                         # a fixture cannot take the needs_data mark
        pytest.skip(NO_DATA)
    ckpt = f"ckpt={tiny_checkpoint}"
    eval_run([ckpt, "eval.tasks=[long_context,niah]", "long_context.num_seqs=3", "long_context.min_len=64",
              "niah.lengths=[300,400]", "niah.depths=[0,50,100]", "niah.max_new_tokens=6"])
    results = eval_run([ckpt, "eval.tasks=[lm_eval]", "lm_eval.preset=fox", "lm_eval.offline=true", "lm_eval.limit=2",
                        "lm_eval.bootstrap_iters=0"])
    return tiny_checkpoint, results


def test_eval_py_end_to_end(evaluated_checkpoint):
    tiny_checkpoint, results = evaluated_checkpoint
    ckpt = f"ckpt={tiny_checkpoint}"
    saved = json.loads((tiny_checkpoint / "results.json").read_text())
    assert saved == json.loads(json.dumps(results)) and {"long_context", "niah", "lm_eval"} <= set(saved)

    lc = saved["long_context"]
    assert lc["seq_len"] == 256 and lc["num_seqs"] == 3 and list(lc["perplexity"]) == ["256", "128", "64"]
    assert abs(lc["loss"] - math.log(50304)) < 1.0              # a random model is near uniform
    csv = np.loadtxt(tiny_checkpoint / "long_context.csv", delimiter=",", skiprows=1)
    assert csv.shape == (256, 3) and np.isfinite(csv).all() and csv[:, 1].mean() == pytest.approx(lc["loss"], rel=1e-4)
    assert (tiny_checkpoint / "long_context.png").stat().st_size > 0

    for mode in ("easy", "standard"):
        assert np.array(saved["niah"][mode]["match"]).shape == (3, 2)
        assert (tiny_checkpoint / f"niah_{mode}.png").stat().st_size > 0
        assert len(json.loads((tiny_checkpoint / f"niah_{mode}.json").read_text())) == 6

    fox = saved["lm_eval"]["fox"]
    assert set(fox["skipped"]) == {"copa", "sciq"}
    run = fox["0-shot"]
    assert 0 <= run["results"]["local_hellaswag"]["acc_norm,none"] <= 1
    assert run["results"]["local_wikitext"]["word_perplexity,none"] > 1
    assert run["table"]["COPA"] is None and run["table"]["Avg"] is None and run["table"]["PIQA"] is not None

    with pytest.raises(ValueError, match="eval.tasks has no lm_eval"):
        eval_run([ckpt, "lm_eval.preset=castle"])


def run_script(name, args, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(CONFIGS), "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [name] + args)
    module.main()


def test_plot_and_table_scripts(evaluated_checkpoint, tmp_path, monkeypatch, capsys):
    """The plot and table scripts on the tiny run's results.json and long_context.csv."""
    tiny_checkpoint, _ = evaluated_checkpoint
    png = tmp_path / "overlay.png"
    run_script("plot_long_context", [str(tiny_checkpoint), str(tiny_checkpoint / "long_context.csv"),
                                     "--labels", "a", "b", "--out", str(png), "--min-len", "64"], monkeypatch)
    assert png.stat().st_size > 0 and "| a | " in capsys.readouterr().out
    run_script("plot_paper_tables", [str(tiny_checkpoint)], monkeypatch)
    out = capsys.readouterr().out
    assert "### fox, 0-shot" in out and "| COPA |" in out and "### perplexity P(l)" in out and "needle" in out


# ----------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def castle_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("castle"), ["model=castle"])


@pytest.fixture(scope="module")
def small_val(tmp_path_factory, tok):
    """A data config whose val split is 200 tokens of the bundled novel (train: the next 200)."""
    folder = tmp_path_factory.mktemp("small_data")
    text = open(os.path.join(os.path.dirname(CONFIGS), "data", "sample", "night_and_day.txt")).read(20000)
    tokens = np.array(tok.encode_ordinary(text)[:400])
    write_shard(folder / "val_000000.bin", tokens[:200])
    write_shard(folder / "train_000000.bin", tokens[200:])
    return ["data=sample", f"data.dir={folder}", "data.auto_prepare=null"], tokens[:200]


def error_of(overrides):
    """The user error eval.py raises for `overrides`: one line, ValueError or FileNotFoundError."""
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        eval_run(overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


BAD_OPTIONS = [   # (checkpoint, overrides, what the message must say: the option, its value and the fix)
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.limit=0"],
     ["lm_eval.limit=0", "integer >= 1", "fraction in (0, 1)"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.limit=2.5"], ["lm_eval.limit=2.5"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.limit=-0.5"], ["lm_eval.limit=-0.5"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.num_fewshot=-1"],
     ["lm_eval.num_fewshot=-1", "integer >= 0"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.batch_tokens=0"],
     ["lm_eval.batch_tokens=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.bootstrap_iters=-1"],
     ["lm_eval.bootstrap_iters=-1", "integer >= 0"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.max_gen_toks=0"],
     ["lm_eval.max_gen_toks=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.max_length=1"],
     ["lm_eval.max_length=1", "integer >= 2"]),
    ("learned", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.max_length=128"],
     ["lm_eval.max_length=128", "block_size=64", "[1, 64]"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.offline=sometimes"],
     ["lm_eval.offline=sometimes", "one of true, false, auto"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.preset=castel"], ["lm_eval.preset='castel'", "castle"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.offline=true",
              "lm_eval.data_root=/nonexistent/eval"], ["/nonexistent/eval", "lm_eval.data_root"]),
    ("tiny", ["eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswag]", "lm_eval.include_path=/nonexistent/tasks"],
     ["lm_eval.include_path=/nonexistent/tasks", "folder of task YAMLs"]),
    ("tiny", ["data=longcrawl64"], ["data=longcrawl64", "gpt2_json", "trained on gpt2 tokens", "leave data= out"]),
    ("tiny", ["eval.batch_size=0"], ["eval.batch_size=0", "integer >= 1"]),
    ("tiny", ["eval.val_tokens=0"], ["eval.val_tokens=0", "integer >= 1, or null"]),
    ("tiny", ["eval.seq_len=-4"], ["eval.seq_len=-4", "integer >= 1"]),
    ("learned", ["eval.seq_len=128"], ["eval.seq_len=128", "block_size=64", "[1, 64]"]),
    ("tiny", ["eval.tasks=[long_context]", "long_context.seq_len=0"], ["long_context.seq_len=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[long_context]", "long_context.seq_len=1000000"],
     ["long_context.seq_len=1000000 is out of range", "val split", "choose long_context.seq_len in [1, "]),
    ("learned", ["eval.tasks=[long_context]", "long_context.seq_len=128"],
     ["long_context.seq_len=128", "learned positions", "[1, 64]"]),
    ("tiny", ["eval.tasks=[long_context]", "long_context.num_seqs=0"], ["long_context.num_seqs=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[long_context]", "long_context.batch_size=0"], ["long_context.batch_size=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[long_context]", "long_context.batch_size=100000"],
     ["long_context.batch_size=100000 is too large", "lower long_context.batch_size"]),
    ("tiny", ["eval.tasks=[long_context]", "long_context.smooth=0"], ["long_context.smooth=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[niah]", "niah.modes=[hard]"], ["niah.modes=[hard]", "one of standard, easy"]),
    ("tiny", ["eval.tasks=[niah]", "niah.depths=[50,150]"], ["niah.depths=[50,150]", "number >= 0 and <= 100"]),
    ("tiny", ["eval.tasks=[niah]", "niah.lengths=[100,300]"],
     ["niah.lengths=[100,300]", "no haystack", "niah.question_reserve"]),
    ("tiny", ["eval.tasks=[niah]", "niah.lengths=[300.5]"], ["niah.lengths=[300.5]", "integer >= 1"]),
    ("tiny", ["eval.tasks=[niah]", "niah.max_new_tokens=0"], ["niah.max_new_tokens=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[niah]", "niah.batch_size=0"], ["niah.batch_size=0", "integer >= 1"]),
    ("tiny", ["eval.tasks=[niah]", "niah.question_reserve=-1"], ["niah.question_reserve=-1", "integer >= 0"]),
    ("tiny", ["eval.tasks=[niah]", "niah.lengths=[300]", "niah.books_dir=/nonexistent/books"],
     ["niah.books_dir=/nonexistent/books", "$BOOKS_DIR"]),
    ("learned", ["eval.tasks=[niah]", "niah.lengths=[300]", "niah.question_reserve=0", "niah.max_new_tokens=4"],
     ["niah.lengths=[300]", "block_size=64", "niah.max_new_tokens=4", "lengths in [39, 60]"]),
    ("learned", ["eval.tasks=[niah]"], ["block_size=64", "niah.question_reserve=200", "niah.max_new_tokens=64",
                                        "drop niah from eval.tasks"]),
    ("tiny", ["eval.tasks=[niah]", "niah.question_reserve=2000"], ["default niah lengths", "niah.lengths=[...]"]),
    ("castle", ["eval.tasks=[tint]", "tint.task_path=/nonexistent/x.jsonl"], ["eval.tasks has tint", "attention='baseline'", "drop tint from eval.tasks"]),
    ("learned", ["eval.tasks=[tint]", "tint.lr=-1"], ["tint.lr=-1", "number >= 0"]),
    ("learned", ["eval.tasks=[tint]", "tint.lr=fast"], ["tint.lr=fast", "number >= 0"]),
    ("learned", ["eval.tasks=[tint]", "tint.fd_eps=0"], ["tint.fd_eps=0", "number > 0"]),
    ("learned", ["eval.tasks=[tint]", "tint.train_fracs=[0.5,1.0]"],
     ["tint.train_fracs=[0.5,1.0]", "number > 0 and < 1"]),
    ("learned", ["eval.tasks=[tint]", "tint.methods=[vanilla,magic]"],
     ["tint.methods=[vanilla,magic]", "each one of vanilla, ", "tint_ref"]),
    ("learned", ["eval.tasks=[tint]", "tint.dtype=fp16"], ["tint.dtype=fp16", "one of fp32, fp64"]),
    ("learned", ["eval.tasks=[tint]", "tint.n_steps=0"], ["tint.n_steps=0", "integer >= 1"]),
    ("learned", ["eval.tasks=[tint]", "tint.batches=0"], ["tint.batches=0", "integer >= 1"]),
    ("learned", ["eval.tasks=[tint]", "tint.task=mmlu"], ["tint.task=mmlu", "arc_easy", "null"]),
    ("learned", ["eval.tasks=[tint]", "tint.task_path=/nonexistent/arc.jsonl"],
     ["/nonexistent/arc.jsonl", "tint.task_path", "tint.task=null"]),
    ("learned", ["eval.tasks=[tint]", "tint.train_fracs=[]", "tint.task=null"],
     ["tint.train_fracs", "tint.task", "nothing to evaluate"]),
    ("learned", ["eval.tasks=[tint]", "tint.task=null", "tint.sim_batches=0"],
     ["tint.sim_batches=0", "drop tint_sim from tint.methods"]),
    ("learned", ["eval.tasks=[tint]", "tint.task=null", "tint.n_layers=2"],
     ["tint.n_layers=2", "has 1 layer", "[1, 1]"]),
    ("learned", ["eval.tasks=[tint]", "tint.task=null", "tint.seq_len=128"],
     ["tint.seq_len=128", "block_size=64", "[2, 64]"]),
    ("learned", ["eval.tasks=[tint]", "tint.task=null", "tint.sim_K=7"], ["tint.sim_K=7", "tint.sim_K=null"]),
]


@pytest.mark.parametrize("which, overrides, parts", BAD_OPTIONS, ids=[" ".join(o[-1:]) for _, o, _ in BAD_OPTIONS])
def test_bad_options_fail_naming_the_option_and_the_fix(which, overrides, parts, request):
    ckpt = request.getfixturevalue(f"{which}_checkpoint")
    message = error_of([f"ckpt={ckpt}", *overrides])
    for part in parts:
        assert part in message


def test_lm_eval_limit_accepts_what_lm_eval_reads():
    for limit in (None, 1, 100, 0.5, 1e-3):
        check_limit(limit)
    for limit in (0, -1, 0.0, 1.0, 2.5, True, "10"):
        with pytest.raises(ValueError, match="lm_eval.limit"):
            check_limit(limit)


def test_no_hub_and_no_local_copies_is_an_error_not_a_run_of_skips(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_reachable.cache_clear()
    message = error_of([f"ckpt={tiny_checkpoint}", "eval.tasks=[lm_eval]", "lm_eval.preset=fox",
                        "lm_eval.offline=auto", "lm_eval.data_root=/nonexistent/eval"])
    hub_reachable.cache_clear()
    assert "/nonexistent/eval" in message and "Hub does not answer" in message and "lm_eval.data_root" in message


def test_unknown_tint_option_is_named():
    """Hydra refuses tint.lrr=1 on the command line; a config built another way meets options()."""
    ctx = types.SimpleNamespace(cfg=OmegaConf.create({"tint": {"lrr": 1}}))
    with pytest.raises(ValueError, match=r"unknown tint options \['lrr'\]; valid: .*'lr'"):
        evaluation.tint.options(ctx)


@pytest.mark.slow        # indexes every task of the installed lm-eval (several seconds)
def test_unknown_lm_eval_task_names_it_and_says_how_to_list_tasks(tiny_checkpoint):
    message = error_of([f"ckpt={tiny_checkpoint}", "eval.tasks=[lm_eval]", "lm_eval.tasks=[hellaswg]",
                        "lm_eval.offline=false"])
    assert "hellaswg" in message and "did you mean hellaswag" in message and "lm-eval ls tasks" in message


def test_a_bad_option_stops_eval_before_any_evaluation(tmp_path):
    run_dir = write_checkpoint(tmp_path)
    message = error_of([f"ckpt={run_dir}", "eval.tasks=[long_context,niah]", "long_context.num_seqs=1",
                        "niah.depths=[-5]"])
    assert "niah.depths=[-5]" in message
    assert not (run_dir / "long_context.csv").exists() and not (run_dir / "results.json").exists()


# ----------------------------------------------------------------------------- no sequence twice

def test_long_context_never_repeats_a_sequence(tiny_checkpoint, small_val, tmp_path):
    """200 val tokens hold 3 sequences of 64 (+1 target): asking for 5 evaluates those 3, warns, says so."""
    data, tokens = small_val
    with pytest.warns(UserWarning, match=r"long_context.num_seqs=5 asks for 5 .* holds 3 distinct"):
        got = eval_run([f"ckpt={tiny_checkpoint}", *data, "eval.tasks=[long_context]", "long_context.seq_len=64",
                        "long_context.num_seqs=5", "long_context.min_len=16", f"out={tmp_path / 'r.json'}"])
    lc = got["long_context"]
    assert lc["num_seqs"] == 3 and lc["num_seqs_requested"] == 5
    model = load_model(str(tiny_checkpoint), "cpu", "fp32")[0]
    x = torch.tensor(tokens[:193]).long()
    batches = [(x[i * 64:(i + 1) * 64][None], x[i * 64 + 1:(i + 1) * 64 + 1][None]) for i in range(3)]
    expected, count = long_context.per_token_loss(model, batches, "cpu")
    assert count == 3 and lc["loss"] == pytest.approx(expected.mean(), rel=1e-5)


def test_long_context_evaluates_exactly_num_seqs(tiny_checkpoint, small_val, tmp_path):
    data, _ = small_val
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # 3 of the 3 distinct sequences: no warning
        got = eval_run([f"ckpt={tiny_checkpoint}", *data, "eval.tasks=[long_context]", "long_context.seq_len=32",
                        "long_context.num_seqs=3", "long_context.batch_size=2", "long_context.min_len=16",
                        f"out={tmp_path / 'r.json'}"])
    assert got["long_context"]["num_seqs"] == 3


def test_heldout_reads_each_val_token_once(tiny_checkpoint, small_val, tmp_path):
    data, tokens = small_val
    with pytest.warns(UserWarning, match="eval.val_tokens"):
        got = eval_run([f"ckpt={tiny_checkpoint}", *data, "eval.val_tokens=100000", "eval.batch_size=1",
                        f"out={tmp_path / 'r.json'}"])["heldout"]
    assert got["tokens"] == 3 * 64 and got["tokens_requested"] == 100000
    model = load_model(str(tiny_checkpoint), "cpu", "fp32")[0]
    x = torch.tensor(tokens[:193]).long()
    _, loss = model(x[:192].view(3, 64), x[1:193].view(3, 64))
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_tint_driver_end_to_end(learned_checkpoint, small_val, tmp_path, tok):
    """TinT through eval.py on a GPT-2 style checkpoint: held-out text capped at the distinct sequences
    the split holds, and a multiple-choice file; tint_ref with lr=0 is the model itself."""
    data, _ = small_val
    task = tmp_path / "mc.jsonl"
    task.write_text("".join(json.dumps({"query": f"Question: is {i} even?", "choices": [" yes", " no"],
                                        "gold": i % 2}) + "\n" for i in range(4)))
    with pytest.warns(UserWarning, match="tint.batches x tint.batch_size asks for 40"):
        got = eval_run([f"ckpt={learned_checkpoint}", *data, "eval.tasks=[tint]", "tint.methods=[vanilla,tint_ref]",
                        "tint.lr=0", "tint.seq_len=32", "tint.batch_size=2", "tint.batches=20",
                        f"tint.task_path={task}", "tint.task_shots=1", f"out={tmp_path / 'r.json'}"])["tint"]
    text = got["text"]["frac_0.5"]
    assert text["sequences"] == 6 and text["n_train"] == 16 and text["test_tokens"] == 6 * 16
    assert text["perplexity"]["tint_ref"] == pytest.approx(text["perplexity"]["vanilla"], rel=1e-5)
    assert got["task"]["examples"] == 3 and got["task"]["acc"]["tint_ref"] == got["task"]["acc"]["vanilla"]
    message = error_of([f"ckpt={learned_checkpoint}", *data, "eval.tasks=[tint]", f"tint.task_path={task}",
                        "tint.task_shots=4", f"out={tmp_path / 'r.json'}"])
    assert "tint.task_shots=4" in message and "holds 4" in message


# ----------------------------------------------------------------------------- results.json

def test_results_of_another_checkpoint_are_moved_aside_not_lost(tmp_path):
    path = tmp_path / "results.json"
    first = {"checkpoint": str(tmp_path / "ckpt_100.pt"), "heldout": {"loss": 3.0}}
    evaluation.results.save(str(path), first)
    assert evaluation.results.load(str(path), str(tmp_path / "ckpt_200.pt")) == {}
    second = {"checkpoint": str(tmp_path / "ckpt_200.pt"), "heldout": {"loss": 2.5}}
    moved = evaluation.results.save(str(path), second)
    assert moved == tmp_path / "results_ckpt_100.json"
    assert json.loads(moved.read_text()) == first and json.loads(path.read_text()) == second
    assert evaluation.results.save(str(path), second) is None          # same checkpoint: replaced in place
    path.write_text('{"checkpoint": "x", "heldout": ')                   # a truncated file
    with pytest.raises(ValueError, match="results.json is not a results file .* out=PATH"):
        evaluation.results.load(str(path), str(tmp_path / "ckpt_200.pt"))


# ----------------------------------------------------------------------------- padded vocabulary

def test_generate_until_never_decodes_a_padded_vocabulary_id(tok):
    """The model has 50304 outputs, the tokenizer 50257 ids; make ids 50257..50303 win every step by
    far. generate_until (greedy and sampled) must still return text: GPT.generate never proposes an
    id the tokenizer cannot decode (needs GPTConfig.tokenizer_vocab_size, the model's fix)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, norm="layernorm", bias=True, tokenizer_vocab_size=tok.n_vocab)).eval()
    with torch.no_grad():                 # final hidden state = all ones; padded rows score n_embd = 32
        model.norm_f.weight.zero_()
        model.norm_f.bias.fill_(1.0)
        model.lm_head.weight[tok.n_vocab:] = 1.0
    ids = torch.tensor([[tok.eot_token] + tok.encode_ordinary("Once upon a time")])
    assert model(ids)[0][0, -1].argmax() >= tok.n_vocab              # the padded ids do dominate
    assert model.generate(ids, 8, temperature=1.0)[0, ids.size(1):].max() < tok.n_vocab
    lm = GPTLM(model, tok)
    requests = [instance("generate_until", "Once upon a time", {"until": [], "max_gen_toks": 8}),
                instance("generate_until", "Once upon a time", {"until": [], "max_gen_toks": 8, "do_sample": True,
                                                                "temperature": 1.0})]
    greedy, sampled = lm.generate_until(requests)
    assert greedy == tok.decode(model.generate(ids, 8, temperature=0)[0, ids.size(1):].tolist())
    assert isinstance(sampled, str)


@pytest.mark.slow        # builds and runs the TinT simulator (several seconds)
def test_tint_driver_simulator_agrees_with_the_reference(learned_checkpoint, small_val, tmp_path):
    """tint_sim through eval.py: its parameter count is the formula's and its logits are the reference
    update's, on held-out text and on a multiple-choice question."""
    data, _ = small_val
    task = tmp_path / "mc.jsonl"
    task.write_text(json.dumps({"query": "Question: which is larger?", "choices": [" two", " one"], "gold": 0}) + "\n")
    got = eval_run([f"ckpt={learned_checkpoint}", *data, "eval.tasks=[tint]",
                    "tint.methods=[vanilla,tint_ref,tint_sim]", "tint.dtype=fp64", "tint.lr=1e-2", "tint.seq_len=16", "tint.batch_size=1", "tint.batches=1",
                    f"tint.task_path={task}", "tint.sim_examples=1", f"out={tmp_path / 'r.json'}"])["tint"]
    assert got["simulator"]["params_built"] == got["simulator"]["params_formula"]
    sim = got["text"]["frac_0.5"]["sim_subset"]
    assert sim["max_abs_logit_diff_sim_vs_ref"] <= 1e-8
    assert sim["perplexity"]["tint_sim"] == pytest.approx(sim["perplexity"]["tint_ref"], rel=1e-9)
    assert sim["perplexity"]["tint_ref"] != pytest.approx(sim["perplexity"]["vanilla"], rel=1e-9)   # lr moved it
    assert got["task"]["sim_subset"]["acc"]["tint_sim"] == got["task"]["sim_subset"]["acc"]["tint_ref"]
