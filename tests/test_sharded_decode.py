"""Decoding with every layer's cache sharded over ranks (Tree Attention, arXiv:2408.04093 §5.2):
greedy tokens and logits equal single-process decoding for every attention variant, with real
gloo process groups; then sample.py under torchrun prints the same text as one process.

Model checks: each world size is spawned once (torch.multiprocessing, file init) and runs every
variant; each rank computes the single-process reference itself (same seed, same weights), so a
failure names the variant and the rank. On CPU (gloo) models are fp64, so that no greedy tie can
flip a token; on GPUs (NCCL, when two are present) fp32, with the Triton kernels on both sides.
The static step (what a CUDA graph replays) over the sharded caches is checked the same way, run eagerly;
on GPUs also its graph.
"""
import datetime
import functools
import json
import os
import tempfile
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_train import TINY, run  # train.py / sample.py in a subprocess, tiny overrides

from model.gpt import GPT, GPTConfig

LLAMA = dict(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)
PRO = dict(qk_norm=True, kv_shift=True, output_gate=True, output_norm=True, mlp_ratio=3.5)
VARIANTS = {
    "baseline": dict(attention="baseline", **LLAMA),
    "gpt2_style": dict(attention="baseline", norm="layernorm", mlp="gelu", pos="learned", bias=True),
    "fox_llama": dict(attention="fox", **{**LLAMA, "pos": "none"}),
    "fox_pro": dict(attention="fox", **{**LLAMA, "pos": "none"}, **PRO),
    "transformer_pro": dict(attention="baseline", **LLAMA, **PRO),
    "castle": dict(attention="castle", **LLAMA),
    "castle_swl": dict(attention="castle_swl", castle_window=3, **LLAMA),
    # the ablations of CASTLE (arXiv:2509.07301 §5.2): no causal keys (no K^C cached), no SiLU gate
    "castle_no_causal_keys": dict(attention="castle", castle_causal_keys=False, **LLAMA),
    "castle_swl_no_silu": dict(attention="castle_swl", castle_window=3, castle_silu=False, **LLAMA),
}
# (prompt length, new tokens, prefill chunk): a prompt longer than one shard fed in chunks that
# do not divide by the world size; and a one-token prompt, which leaves every rank but 0 empty,
# then 32 greedy tokens, stored round robin on every rank
CASES = [(20, 10, 7), (1, 32, None)]


def tiny(**kw):
    # untied head: the greedy token then depends on the attention output, not just the input token
    base = dict(vocab_size=97, block_size=40, n_layer=2, n_head=4, n_embd=32, tie_embeddings=False)
    return GPTConfig(**{**base, **kw})


@torch.no_grad()
def greedy(model, prompt, n, group=None, chunk=None):
    """Greedy decoding through the cache: (tokens (B, n), last-position logits (B, n, V), cache)."""
    cache = model.new_cache(prompt.size(0), prompt.size(1) + n, group=group)
    x, tokens, logits = prompt, [], []
    for _ in range(n):
        for piece in x.split(chunk or x.size(1), dim=1):
            out = model(piece, cache=cache, last_only=True)[0][:, -1]
        tokens.append(out.argmax(-1))
        logits.append(out)
        x = tokens[-1][:, None]
    return torch.stack(tokens, 1), torch.stack(logits, 1), cache


@torch.no_grad()
def static_logits(model, prompt, tokens, group, chunk):
    """Logits of the prompt's last position, then of each of `tokens` (B, n) fed as static steps (the ones a CUDA
    graph replays, InferenceCache.to_static) over a cache sharded over `group`, run eagerly."""
    cache = model.new_cache(prompt.size(0), prompt.size(1) + tokens.size(1) + 1, group=group)
    for piece in prompt.split(chunk or prompt.size(1), dim=1):
        logits = [model(piece, cache=cache, last_only=True)[0][:, -1]]
    cache.to_static()
    logits += [model(tokens[:, t:t + 1], cache=cache)[0][:, -1] for t in range(tokens.size(1))]
    return torch.stack(logits, 1)


def check_static_steps(model, prompt, want_tok, want_logits, group, chunk, tol, device):
    """Failures of the sharded static step: every variant's caches take it (sample.py's cuda_graph=auto picks it)
    and equal single-process decoding; the compiled and fused steps are refused with a group."""
    import sample   # hydra and the entry point: only where this check runs
    fails = []
    if sample.graph_mode(SimpleNamespace(cuda_graph="auto"), torch.device("cuda"), model.config, group) is not True:
        fails.append("sample.py's cuda_graph=auto is not True sharded")
    try:
        model.generate(prompt, 2, temperature=0, group=group, cuda_graph="compiled")
        fails.append("generate(cuda_graph='compiled') took a sharded cache")
    except ValueError as e:
        if "cuda_graph='compiled' decodes on one device; a cache sharded over a process group takes" not in str(e):
            fails.append(f"unclear refusal: {e}")
    got = static_logits(model, prompt, want_tok[:, :-1], group, chunk)
    err = (got - want_logits).abs().max().item()
    if not err < tol:
        fails.append(f"static steps: logits differ by {err:.3g}")
    if device.type == "cuda":   # the graph of the sharded step: greedy tokens as the eager loop's
        gen = model.generate(prompt, want_tok.size(1), temperature=0, group=group, prefill_chunk=chunk, cuda_graph=True)
        if not torch.equal(gen[:, prompt.size(1):], want_tok):
            fails.append("generate(cuda_graph=True) differs")
    return fails


# backend -> (model dtype, logit tolerance): fp64 on CPU, where the FoX and CASTLE biases pass
# through fp32 (~1e-8); fp32 on GPUs, where the kernels may multiply in TF32
SETUPS = {"gloo": (torch.float64, 1e-7), "nccl": (torch.float32, 1e-2)}


def check_variant(name, rank, world, device, backend):
    """Failures (a list of strings) of one variant on this rank; every rank issues the same
    collectives whatever fails."""
    fails = []
    group = dist.group.WORLD
    dtype, tol = SETUPS[backend]
    torch.manual_seed(0)
    model = GPT(tiny(**VARIANTS[name])).to(device, dtype).eval()
    for T0, n, chunk in CASES:
        prompt = torch.randint(0, 97, (2, T0), generator=torch.Generator().manual_seed(T0)).to(device)
        want_tok, want_logits, _ = greedy(model, prompt, n)
        got_tok, got_logits, cache = greedy(model, prompt, n, group, chunk)
        case = f"prompt {T0}, chunk {chunk}"
        if not torch.equal(got_tok, want_tok):
            fails.append(f"{case}: tokens {got_tok.tolist()} != {want_tok.tolist()}")
        err = (got_logits - want_logits).abs().max().item()
        if not err < tol:
            fails.append(f"{case}: logits differ by {err:.3g}")
        # the cache is split: this rank allocated ceil(max_len / p) rows, and the ranks' rows
        # partition the positions fed so far (the last token is never fed)
        layer = cache.layers[0]
        total = T0 + n - 1
        if layer.capacity != -(-(T0 + n) // world) or layer.length != total:
            fails.append(f"{case}: {layer.capacity} rows, length {layer.length}")
        held = [None] * world
        dist.all_gather_object(held, layer.key_positions().tolist(), group=group)
        if sorted(p for rows in held for p in rows) != list(range(total)):
            fails.append(f"{case}: positions held {held}")
        # through GPT.generate too; every rank holds the same logits bits
        gen = model.generate(prompt, n, temperature=0, group=group, prefill_chunk=chunk)
        if not torch.equal(gen[:, T0:], want_tok):
            fails.append(f"{case}: generate() differs")
        every = [None] * world
        dist.all_gather_object(every, got_logits.cpu(), group=group)
        if not all(torch.equal(x, got_logits.cpu()) for x in every):
            fails.append(f"{case}: ranks hold different logits")
        fails += [f"{case}: {f}" for f in check_static_steps(model, prompt, want_tok, want_logits, group,
                                                              chunk, tol, device)]
    # sampling: each rank's RNG differs, the broadcast token keeps one stream
    torch.manual_seed(100 + rank)
    sampled = model.generate(prompt, 6, temperature=1.0, group=group).tolist()
    every = [None] * world
    dist.all_gather_object(every, sampled, group=group)
    if any(x != sampled for x in every):
        fails.append(f"sampled streams differ across ranks: {every}")
    return fails


def _worker(rank, world, backend, init_file, out_dir):
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in VARIANTS:
        try:
            results[name] = "; ".join(check_variant(name, rank, world, device, backend)) or "ok"
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@functools.cache
def run_world(world, backend="gloo"):
    """Spawn `world` processes once; {variant: [outcome per rank]}."""
    tmp = tempfile.mkdtemp(prefix="sharded_decode_")
    mp.spawn(_worker, args=(world, backend, os.path.join(tmp, "init"), tmp), nprocs=world)
    per_rank = []
    for r in range(world):
        with open(os.path.join(tmp, f"{r}.json")) as f:
            per_rank.append(json.load(f))
    return {name: [res[name] for res in per_rank] for name in VARIANTS}


# an even and an odd world (round robin leaves ranks of unequal shares and, at prompt 1, empty ones); a world
# of 4 added nothing these two miss and took the longest test of the CPU suite (4 processes on 2 cores)
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_greedy_equals_single_process(variant, world):
    outcomes = run_world(world)[variant]
    bad = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_greedy_equals_single_process_nccl(variant):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    outcomes = run_world(2, "nccl")[variant]
    bad = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not bad, "\n".join(bad)


def _decode_alone(rank, init_file, out_dir):
    """Rank 0 decodes window, FoX and CASTLE models on its own (unsharded caches) while rank 1 waits outside any
    collective: a collective there would block rank 0 until the group's timeout."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    done = os.path.join(out_dir, "done")
    if rank == 0:
        outcome = "ok"
        try:
            for kw in (dict(attention_window=3, **LLAMA), VARIANTS["fox_pro"], VARIANTS["castle_swl"]):
                GPT(tiny(**kw)).eval().generate(torch.randint(0, 97, (1, 7)), 5, temperature=0)
        except Exception as e:
            outcome = repr(e)
        with open(done, "w") as f:
            f.write(outcome)
    else:
        for _ in range(600):
            if os.path.exists(done):
                break
            time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_an_unsharded_cache_decodes_without_collectives_inside_a_process_group():
    """train.py's end-of-run sample runs on rank 0 alone after multi-GPU training: its decoding must not
    enter a collective (tree_decode's group=None is the default group)."""
    tmp = tempfile.mkdtemp(prefix="decode_alone_")
    mp.spawn(_decode_alone, args=(os.path.join(tmp, "init"), tmp), nprocs=2)
    with open(os.path.join(tmp, "done")) as f:
        assert f.read() == "ok"


def test_unsharded_cache_without_group():
    """A group of one rank (or none) keeps the plain single-device caches."""
    model = GPT(tiny(**VARIANTS["fox_pro"])).eval()
    cache = model.new_cache(1, 9)
    assert cache.layers[0].group is None and cache.layers[0].k.size(2) == 9


# ----------------------------------------------------------------------------- sample.py

PROMPT = "prompt=The river flows into the sea near the old town where fishermen mend their nets"
SAMPLE = [PROMPT, "max_new_tokens=12", "temperature=0"]   # 16 prompt tokens: longer than a shard


@pytest.fixture(scope="module", params=[["model=fox_pro"], ["model=castle_swl", "model.castle_window=4"]],
                ids=["fox_pro", "castle_swl"])
def checkpoint(request, tmp_path_factory):
    """A tiny checkpoint written by train.py: FoX (Pro) (the Softmax cache with every option) and
    CASTLE-SWL (the UQ-KV cache), with untied heads so that greedy text is not a repeated token."""
    out = str(tmp_path_factory.mktemp("run"))
    run("train.py", TINY + request.param + ["model.tie_embeddings=false", f"train.out_dir={out}",
                                            "train.max_steps=2", "train.global_batch_tokens=128",
                                            "train.ckpt_interval=2"])
    single = run("sample.py", [f"ckpt={out}"] + SAMPLE).stdout
    assert len(set(single.split("nets")[-1].split())) >= 5, single   # a varied continuation
    return out, single


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_torchrun_sharded_sample_prints_the_single_process_text(checkpoint, world):
    ckpt, single = checkpoint
    sharded = run("sample.py", [f"ckpt={ckpt}", "sharded=true", "prefill_chunk=5"] + SAMPLE,
                  torchrun=world).stdout
    assert sharded == single, (sharded, single)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_without_sharded_is_a_clear_error(tmp_path):
    proc = run("sample.py", [f"ckpt={tmp_path}", "max_new_tokens=2"], torchrun=2, check=False)
    assert proc.returncode != 0 and "sharded=true" in proc.stderr
