"""CUDA-graph decoding: the static step (InferenceCache.to_static) run eagerly equals today's dynamic cached
decoding on CPU; on a GPU its graph replays equal both (model/sampling.py GraphedDecodeStep); the benchmark runs.

The recurrent baselines' fla kernels run on CPU in the Triton interpreter only (tests/conftest.py sets it where
there is no GPU); a GPU machine tests them by the tests marked gpu."""
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._pytree import tree_leaves

import sample
from kernels.castle import CastleCache, castle_decode, castle_prefill
from kernels.triton_utils import interpreting
from model.cache import WindowCache
from model.gpt import ATTENTIONS, GPT
from model.recurrent import RecurrentCache
from model.sampling import GraphedDecodeStep
from scripts import bench_decode
from tests.test_entry_errors import compose_config, error_of
from tests.test_model import GPT2, LLAMA, PRO, tiny

NOPOS = {**LLAMA, "pos": "none"}
# the recurrent baselines (fla's layers) in tests/test_recurrent.py's tiny shapes; Mamba-2 blocks have no MLP
RECURRENT_VARIANTS = {
    "mamba2": dict(attention="mamba2", **{**NOPOS, "mlp": "none"}, n_head=4, head_dim=16, ssm_state_size=16),
    "hgrn2": dict(attention="hgrn2", **NOPOS, n_head=2, head_dim=16),
    "deltanet": dict(attention="deltanet", **NOPOS, n_head=2),
    "gated_deltanet": dict(attention="gated_deltanet", **NOPOS, n_head=2, head_dim=16),
}
# every variant, each of whose caches takes static steps: softmax attention, LLaMA / GPT-2 / Pro blocks, FoX,
# windows; CASTLE, CASTLE-SWL (a window shorter than the tokens decoded, so that it slides) and the ablations;
# the recurrent baselines
GRAPH_VARIANTS = {
    "llama": dict(attention="baseline", **LLAMA),
    "gpt2": dict(attention="baseline", **GPT2),
    "transformer_pro": dict(attention="baseline", **LLAMA, **PRO),
    "fox_llama": dict(attention="fox", **NOPOS),
    "fox_pro": dict(attention="fox", **NOPOS, **PRO),
    "transformer_swa": dict(attention="baseline", attention_window=5, **LLAMA),
    "fox_pro_swa": dict(attention="fox", attention_window=5, **NOPOS, **PRO),
    "castle": dict(attention="castle", **LLAMA),
    "castle_swl": dict(attention="castle_swl", castle_window=3, **LLAMA),
    "castle_swl_no_causal_keys": dict(attention="castle_swl", castle_window=4, castle_causal_keys=False, **LLAMA),
    "castle_no_silu_rope_qkv": dict(attention="castle", castle_silu=False, castle_rope="qkv", **LLAMA),
    **RECURRENT_VARIANTS,
}
SLOW_ON_CPU = ("deltanet", "gated_deltanet")    # seconds a test in the Triton interpreter: the full suite only


def cpu_marks(name):
    """fla's Triton kernels on CPU: in the interpreter only (Mamba-2's decode step is fla's torch code)."""
    if name not in RECURRENT_VARIANTS or name == "mamba2":
        return ()
    needs = pytest.mark.skipif(not interpreting(), reason="fla's kernels run on CPU in the Triton interpreter only")
    return (needs, pytest.mark.slow) if name in SLOW_ON_CPU else (needs,)


GRAPH_CONFIGS = [pytest.param(kw, id=name, marks=cpu_marks(name)) for name, kw in GRAPH_VARIANTS.items()]
# the delta rules' 48 greedy steps take tens of seconds in the interpreter;
# test_static_steps_equal_dynamic_and_keep_their_buffers checks their steps
GREEDY_CONFIGS = [param for param in GRAPH_CONFIGS if param.id not in SLOW_ON_CPU]
GPU_CONFIGS = [pytest.param(kw, id=name) for name, kw in GRAPH_VARIANTS.items()]
COMPILED_CONFIGS = [pytest.param(GRAPH_VARIANTS[name], id=name) for name in ("llama", "fox_pro", "castle")]
GPU_COMPILED_CONFIGS = COMPILED_CONFIGS + [pytest.param(RECURRENT_VARIANTS[name], id=name)
                                           for name in ("hgrn2", "deltanet")]
# The static step is computed in the model's precision, FoX's gate logits included (kernels.tree.attn_partial's
# gate). A recurrent layer's static step is its dynamic step (the same kernels on the same state), so equal to
# the bit.
FP64_ATOL = {"baseline": 1e-12, "fox": 1e-12, "castle": 1e-12, "castle_swl": 1e-12,
             **dict.fromkeys(RECURRENT_VARIANTS, 0)}
# fla's delta-rule kernels take no fp64 in the Triton interpreter: those variants run the fp64 test in fp32
FP32_ONLY = ("deltanet", "gated_deltanet")


def model_of(kw, dtype=torch.float64, device="cpu", **size):
    return GPT(tiny(**{**kw, **size})).to(device=device, dtype=dtype).eval()


def unwritten_buffers(layer):
    """The buffers of a layer cache whose rows past its length hold no position yet (a window's ring marks
    its empty rows by position -1 instead; CASTLE's static Q^U ring holds position j at row j % its rows; a
    recurrent state has no rows)."""
    if isinstance(layer, (WindowCache, RecurrentCache)):
        return ()
    if isinstance(layer, CastleCache):
        return layer.u_buf, layer.qu_buf, layer.kc_buf, layer.vc_buf
    return layer.k, layer.v, getattr(layer, "log_fgate_cumsum", None)


def fill_unwritten_rows(cache, values, kind=object):
    """Every unwritten row of the layer caches of type `kind` <- values(rows)."""
    for layer in cache.layers:
        if isinstance(layer, kind):
            for buf in unwritten_buffers(layer):
                if buf is not None:
                    buf[:, :, layer.length:] = values(buf[:, :, layer.length:])


def turn_static(cache):
    """cache.to_static() from the worst start: CASTLE's buffers begin uninitialised (torch.empty, any bits, NaN
    at worst), so their unwritten rows are made NaN first, which to_static must clear."""
    fill_unwritten_rows(cache, lambda x: torch.full_like(x, float("nan")), CastleCache)
    cache.to_static()


@torch.no_grad()
def decode_logits(model, prompt, tokens, static, garbage=False):
    """Logits of the prompt's last position, then of each of `tokens` (B, n) fed one at a time: dynamic
    cached steps, or static ones after a dynamic prefill. garbage: once static, fill every cache row the
    prefill left unwritten with large random values, which the static step's mask must hide."""
    B, n = tokens.shape
    cache = model.new_cache(B, prompt.size(1) + n + 3)     # spare rows: the static step reads them all
    logits = [model(prompt, cache=cache, last_only=True)[0]]
    if static:
        turn_static(cache)
        if garbage:
            fill_unwritten_rows(cache, lambda x: 100 * torch.randn_like(x))
    logits += [model(tokens[:, t:t + 1], cache=cache)[0] for t in range(n)]
    return torch.cat(logits, dim=1), cache


# prompt lengths 1 (a window's ring still has empty rows), 6 and 9; the recurrent baselines take the longest only,
# a recurrent state having no rows whose filling the length could change (their static step is their dynamic step on
# the same state). Not the delta rules: their kernels run in fp32 only and on CPU tensors only in the interpreter,
# where, without rows for the garbage, this test would be test_static_steps_equal_dynamic_and_keep_their_buffers
# again at 30-45 s a case
LOGITS_CASES = [pytest.param(param.values[0], T0, id=f"{param.id}-{T0}", marks=param.marks)
                for param in GRAPH_CONFIGS if param.id not in SLOW_ON_CPU
                for T0 in ((9,) if param.id in RECURRENT_VARIANTS else (1, 6, 9))]


@pytest.mark.parametrize("kw, T0", LOGITS_CASES)
def test_static_step_logits_equal_dynamic(kw, T0):
    """fp64, batch 3, odd prompt lengths (1: the window's ring still has empty rows), unwritten rows full of
    garbage: every static step's logits equal the dynamic step's."""
    model = model_of(kw, torch.float32 if kw["attention"] in FP32_ONLY else torch.float64)
    prompt, tokens = torch.randint(0, 97, (3, T0)), torch.randint(0, 97, (3, 8))
    dynamic, _ = decode_logits(model, prompt, tokens, static=False)
    static, _ = decode_logits(model, prompt, tokens, static=True, garbage=True)
    torch.testing.assert_close(static, dynamic, rtol=0, atol=FP64_ATOL[kw["attention"]])


@torch.no_grad()
def static_greedy(model, prompt, n):
    """Greedy decoding as GPT.generate_stream does it, with every step after the prefill a static one (the
    step GraphedDecodeStep captures), run eagerly."""
    cache = model.new_cache(prompt.size(0), prompt.size(1) + n)
    logits, _ = model(prompt, cache=cache, last_only=True)
    cache.to_static()
    tokens = []
    for _ in range(n):
        tokens.append(logits[:, -1].argmax(-1))
        logits, _ = model(tokens[-1][:, None], cache=cache)
    return torch.cat([prompt, torch.stack(tokens, dim=1)], dim=1)


@pytest.mark.parametrize("kw", GREEDY_CONFIGS)
def test_static_greedy_generation_equals_dynamic(kw):
    model = model_of(kw, torch.float32, block_size=64)
    prompt = torch.randint(0, 97, (2, 5))
    assert torch.equal(static_greedy(model, prompt, 24), model.generate(prompt, 24, temperature=0))


@torch.no_grad()
def test_step_that_chooses_continues_the_greedy_sequence():
    """GraphedDecodeStep with a `choose` writes the token it picks into its own input, so calling the step with
    no token continues the sequence (what generate_stream's graph replays): run eagerly on CPU, its 12 steps
    equal greedy generation."""
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32)
    prompt = torch.randint(0, 97, (2, 5))
    cache = model.new_cache(2, 5 + 13)
    first = model(prompt, cache=cache, last_only=True)[0][:, -1].argmax(-1)
    graphed = GraphedDecodeStep(model, cache, 2, choose=lambda logits: logits[:, -1].argmax(-1))
    graphed.token.copy_(first[:, None])
    tokens = [first]
    for _ in range(12):
        graphed.step()
        tokens.append(graphed.token[:, 0].clone())
    greedy = model.generate(prompt, 13, temperature=0)
    assert torch.equal(torch.cat([prompt, torch.stack(tokens, dim=1)], dim=1), greedy)


def python_state_of(layer):
    """A layer cache's attributes but its tensors; of a recurrent layer also fla's layer cache's (its counter)."""
    state = {name: x for name, x in vars(layer).items() if not isinstance(x, torch.Tensor)}
    if isinstance(layer, RecurrentCache):
        state["fla"] = {name: x for name, x in vars(layer.state.layers[0]).items() if name != "state"}
    return state


def tensors_of(cache):
    """Every tensor of the layer caches, and of a recurrent layer also those of the state its fla layer reads."""
    tensors = {}
    for i, layer in enumerate(cache.layers):
        tensors.update({(i, name): x for name, x in vars(layer).items() if isinstance(x, torch.Tensor)})
        if isinstance(layer, RecurrentCache):
            leaves = tree_leaves(layer.state[0])
            tensors.update({(i, "state", j): x for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)})
    return tensors


@pytest.mark.parametrize("kw", GRAPH_CONFIGS)
@torch.no_grad()                  # as in generation (Gated DeltaNet's layer takes its chunk kernel under autograd)
def test_static_steps_equal_dynamic_and_keep_their_buffers(kw):
    """fp32, batch 2: every static step's logits equal the dynamic step's. On the same steps (one run serves both
    checks: a delta rule's step takes about a second in the interpreter), what a captured graph relies on: a static
    step writes the cache in place (same tensors, same storage), changes no Python state (no attribute of a layer
    cache but its tensors' contents), reads RoPE tables that are not regrown, and advances the device position."""
    model = model_of(kw, torch.float32)
    prompt, tokens = torch.randint(0, 97, (2, 4)), torch.randint(0, 97, (2, 6))
    cache = model.new_cache(2, 12)                          # two spare rows: the static step reads them all
    static = [model(prompt, cache=cache, last_only=True)[0]]
    turn_static(cache)
    static.append(model(tokens[:, :1], cache=cache)[0])     # the first step may build the RoPE tables
    before = {key: (x, x.data_ptr()) for key, x in tensors_of(cache).items()}
    python_state = [python_state_of(layer) for layer in cache.layers], cache.pos
    rope = model._rope_cos
    static += [model(tokens[:, t:t + 1], cache=cache)[0] for t in range(1, 6)]
    after = tensors_of(cache)
    assert after.keys() == before.keys()
    for key, (x, ptr) in before.items():
        assert after[key] is x and x.data_ptr() == ptr, key
    assert ([python_state_of(layer) for layer in cache.layers], cache.pos) == python_state
    assert [(layer.length, layer.group) for layer in cache.layers] == [(4, None)] * 2 and cache.pos == 4
    assert model._rope_cos is rope
    assert cache.position.tolist() == [10] and all(layer.position is cache.position for layer in cache.layers)
    dynamic, _ = decode_logits(model, prompt, tokens, static=False)    # after the RoPE check: it may grow them
    torch.testing.assert_close(torch.cat(static, dim=1), dynamic, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 0, 2, 40])
@torch.no_grad()
def test_static_castle_cache_equals_dynamic(window):
    """castle_decode over a CastleCache turned static (the position a device tensor) equals dynamic decoding
    (fp64), also for the windows no model makes: W = 0 (no Q^U kept) and W above the capacity (the Q^U ring
    spans the cache); U, K^C, V^C end equal to the dynamic cache's. (The fused kernel's static steps:
    tests/test_castle_decode.py.)"""
    B, H, L, D, P = 2, 3, 12, 4, 5
    xs = [torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(6)]
    dynamic, static = (castle_prefill(*[x[..., :P, :] for x in xs], window=window, max_len=L)[1] for _ in range(2))
    position = torch.tensor([P])
    static.to_static(position)
    for t in range(P, L):
        one = [x[..., t:t + 1, :] for x in xs]
        torch.testing.assert_close(castle_decode(static, *one)[0], castle_decode(dynamic, *one)[0], rtol=0, atol=1e-13)
        position += 1
    assert static.length == P and dynamic.length == L == static.capacity
    for name in ("u", "kc", "vc"):
        torch.testing.assert_close(getattr(static, name), getattr(dynamic, name), rtol=0, atol=1e-13)


def test_static_step_takes_one_token():
    model = model_of(GRAPH_VARIANTS["llama"])
    cache = model.new_cache(1, 8)
    cache.to_static()
    with pytest.raises(ValueError, match="one token per step"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def test_static_learned_positions_check_the_whole_cache():
    model = model_of(GRAPH_VARIANTS["gpt2"])                 # block_size 32
    cache = model.new_cache(1, 40)
    cache.to_static()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_every_attention_takes_cuda_graph():
    """cuda_graph=True takes every attention: a recurrent model on the CPU is refused for the device only. A
    recurrent cache turns static only once it holds a state (after the prompt), and stays dynamic otherwise."""
    assert set(ATTENTIONS) == {kw["attention"] for kw in GRAPH_VARIANTS.values()}      # every one is tested here
    model = model_of(RECURRENT_VARIANTS["hgrn2"], torch.float32)
    with pytest.raises(ValueError, match="cuda_graph=True needs the model and prompt on a CUDA device, not cpu"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, cuda_graph=True)
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match=r"run the prompt \(at least one token\) through the cache before to_static"):
        cache.to_static()
    assert cache.position is None and all(layer.position is None for layer in cache.layers)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "CUDA device"),                      # the model is on the CPU
    ({"use_cache": False}, "use_cache=True"),
])   # with a process group: tests/test_sharded_decode.py
def test_cuda_graph_option_errors_are_named(kwargs, match):
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32)
    with pytest.raises(ValueError, match=match):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, cuda_graph=True, **kwargs)


def test_cuda_graph_mode_is_checked():
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32)
    with pytest.raises(ValueError, match=r"cuda_graph takes one of \(False, True, 'compiled', 'autotuned', 'fused'\), not 'fast'"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, cuda_graph="fast")


@pytest.mark.parametrize("mode,options", [("compiled", {}),
                                          ("autotuned", {"max_autotune": True, "coordinate_descent_tuning": True})])
def test_graphed_step_compiles_with_its_modes_inductor_options(monkeypatch, mode, options):
    """cuda_graph="compiled" and "autotuned" hand the step to torch.compile with their Inductor options
    (without Inductor's own CUDA graphs: ours captures the step); cuda_graph=True compiles nothing."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32)
    for compile in (mode, None):
        cache = model.new_cache(1, 8)
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        GraphedDecodeStep(model, cache, 1, compile=compile)
    assert seen == [{"dynamic": False, "options": options}]


@pytest.mark.slow
@pytest.mark.parametrize("kw", COMPILED_CONFIGS)
@torch.no_grad()
def test_compiled_static_step_equals_eager(kw):
    """What cuda_graph="compiled" captures: the static step through torch.compile (Inductor, CPU here) gives the
    eager static step's logits and writes the same cache (fp32), at every position with one compilation."""
    model = model_of(kw, torch.float32)
    prompt, tokens = torch.randint(0, 97, (2, 5)), torch.randint(0, 97, (2, 4))
    caches = [model.new_cache(2, 12) for _ in range(2)]
    for cache in caches:
        model(prompt, cache=cache)
        cache.to_static()
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=False)
    for t in range(tokens.size(1)):
        torch.testing.assert_close(compiled(tokens[:, t:t + 1], cache=caches[0])[0],
                                   model(tokens[:, t:t + 1], cache=caches[1])[0], rtol=1e-5, atol=1e-5)
    for (key, x), y in zip(tensors_of(caches[0]).items(), tensors_of(caches[1]).values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, equal_nan=True, msg=str(key))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def test_cuda_graph_refuses_training_mode():
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32).train()
    with pytest.raises(ValueError, match="eval"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, cuda_graph=True)


@pytest.mark.parametrize("overrides, expected", [
    (["cuda_graph=compiled", "sharded=true"], "cuda_graph=compiled decodes on one GPU: with sharded=true pass"),
    (["cuda_graph=true", "device=cpu"], "cuda_graph=true needs a CUDA device"),
    (["cuda_graph=yes"], "cuda_graph"),
    (["cuda_graph=compiled", "device=cpu"], "cuda_graph=compiled needs a CUDA device"),
    (["cuda_graph=fused", "sharded=true"], "cuda_graph=fused decodes on one GPU"),
])
def test_sample_cuda_graph_option_errors(overrides, expected):
    assert expected in error_of(sample.check_sample_options, compose_config("sample", ["ckpt=x", *overrides]))


@pytest.mark.parametrize("overrides, device, capability, blocks, mode", [
    ([], "cuda", (9, 0), LLAMA, "fused"), ([], "cuda", (10, 0), LLAMA, "fused"), ([], "cuda", (8, 0), LLAMA, True),
    ([], "cuda", (9, 0), dict(attention="fox", **LLAMA, **PRO), True), ([], "cuda", (9, 0), GPT2, True),
    ([], "cpu", None, LLAMA, False),
    (["cuda_graph=true"], "cuda", (9, 0), LLAMA, True), (["cuda_graph=fused"], "cuda", (8, 0), LLAMA, "fused"),
    (["cuda_graph=false"], "cuda", (9, 0), LLAMA, False)])
def test_sample_cuda_graph_defaults_to_the_fastest_step_on_one_gpu(overrides, device, capability, blocks, mode,
                                                                  monkeypatch):
    """cuda_graph=auto, the default: the single-launch step for LLaMA blocks on a Hopper or newer GPU, a CUDA graph
    of the step for other blocks or GPUs (every variant's graph is tested on a GPU), none on the CPU; auto is never
    refused, any other value is passed on as given. The GPU's generation is the one query faked. (Sharded:
    tests/test_sharded_decode.py, with a real process group.)"""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    model = GPT(tiny(**{"n_head": 2, **blocks}))
    cfg = compose_config("sample", ["ckpt=x", *overrides])
    sample.check_sample_options(cfg)
    got = sample.graph_mode(cfg, torch.device(device), model.config, None)
    assert got == mode and type(got) is type(mode)


# ----------------------------------------------------------------------------- the benchmark

def run_bench_decode(*args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "scripts.bench_decode", "--model", "tiny", "--batch", "1", *args],
                          cwd=root, capture_output=True, text=True, timeout=600)


def test_bench_decode_smoke():
    out = run_bench_decode("--device", "cpu", "--ctx", "64", "--n", "6", "--capacity", "96")
    assert out.returncode == 0, out.stderr
    assert "a cache of 96 positions" in out.stdout
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| batch"))
    rows = [line for line in lines[header + 2:] if line.startswith("|")]
    assert len(rows) == 1 and rows[0].split("|")[4].strip() == "eager", out.stdout
    assert "3350 GB/s" in out.stdout and "no CUDA graph on cpu" in out.stdout
    ms, waited, startup = (float(rows[0].split("|")[i]) for i in (5, 6, 11))
    assert ms > 0 and waited > 0 and startup > 0


def test_bench_decode_times_transformers_on_the_exported_weights(tmp_path):
    """--export-hf writes the random model, --hf times transformers' generate on it next to ours, with both caches."""
    hf = str(tmp_path / "hf")
    assert run_bench_decode("--device", "cpu", "--ctx", "64", "--n", "6", "--export-hf", hf).returncode == 0
    out = run_bench_decode("--device", "cpu", "--ctx", "64", "--n", "6", "--hf", hf)
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[4].strip(): line.split("|") for line in out.stdout.splitlines() if "| hf |" in line}
    assert set(rows) == {"eager", "transformers dynamic cache", "transformers static cache"}, out.stdout
    assert all(float(row[5]) > 0 and float(row[6]) > 0 and float(row[11]) >= 0 for row in rows.values())


@pytest.mark.parametrize("args, says", [
    (["--n", "8", "--profile"], "--n must exceed 12"),
    (["--n", "4"], "--n must be >= 5: the first 4 tokens are not timed"),
    (["--capacity", "63"], "--capacity 63 must be at least every --ctx (largest 64)"),
    (["--prefill-chunk", "-1"], "--prefill-chunk -1: give a chunk of tokens, or 0 for the whole prompt at once"),
    (["--inductor", "max_autotun=True"], "'max_autotun=True' is not KEY=VALUE"),
    (["--inductor", "max_autotune"], "'max_autotune' is not KEY=VALUE"),
    (["--inductor", "max_autotune=yes"], "'max_autotune=yes': the value must be a Python literal")])
def test_bench_decode_options_are_checked_before_any_work(args, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_decode.parse(["--device", "cpu", "--model", "tiny", "--ctx", "64", "--n", "6", *args])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_bench_decode_profile_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_decode.main(["--device", "cpu", "--model", "tiny", "--ctx", "64", "--n", "20", "--batch", "1",
                           "--profile"])


def test_bench_decode_applies_inductor_settings(monkeypatch, capsys):
    """KEY=VALUE literals, dotted keys for Inductor's sub-configs; set for the run and named in its header."""
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config, "coordinate_descent_tuning", False)   # restored after the test
    monkeypatch.setattr(inductor_config.triton, "enable_pdl", False)
    assert bench_decode.inductor_settings(["coordinate_descent_tuning=True", "triton.enable_pdl=True"]) == {
        "coordinate_descent_tuning": True, "triton.enable_pdl": True}
    bench_decode.main(["--device", "cpu", "--model", "tiny", "--ctx", "32", "--n", "5", "--batch", "1",
                       "--inductor", "coordinate_descent_tuning=True", "triton.enable_pdl=True"])
    assert inductor_config.coordinate_descent_tuning is True and inductor_config.triton.enable_pdl is True
    assert "inductor triton.enable_pdl=True" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_decode_profile_traces_each_mode():
    """--profile prints one trace per mode of ours, each with its kernels and kernel time per step (a graph's
    kernels included: the profiler sees the kernels a replay launches)."""
    out = run_bench_decode("--device", "cuda", "--ctx", "256", "--n", "20", "--compiled", "--profile")
    assert out.returncode == 0, out.stderr
    traces = [line.split() for line in out.stdout.splitlines() if "kernels per step" in line]
    assert len(traces) == 3, out.stdout                         # eager, cuda_graph=True, compiled
    for words in traces:
        assert float(words[0]) > 0 and float(words[4]) > 0, words


# ----------------------------------------------------------------------------- on a GPU

GPU_SIZE = dict(n_embd=64, n_head=4, block_size=512)         # head_dim 16: the split-KV kernel's smallest tile


def graphed_logits(model, prompt, tokens):
    """Logits of each of `tokens` (B, n) through GraphedDecodeStep after a dynamic prefill (the first calls
    warm up eagerly, then it captures and replays)."""
    cache = model.new_cache(prompt.size(0), prompt.size(1) + tokens.size(1) + 200)   # a few key tiles
    model(prompt, cache=cache)
    step = GraphedDecodeStep(model, cache, prompt.size(0))
    out = [step(tokens[:, t:t + 1]).clone() for t in range(tokens.size(1))]
    assert step.graph is not None and step.calls == tokens.size(1)
    return torch.cat(out, dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", GPU_CONFIGS)
@torch.no_grad()
def test_graph_replay_equals_eager_static_and_dynamic_step(kw):
    model = model_of(kw, torch.bfloat16, "cuda", **GPU_SIZE)
    prompt = torch.randint(0, 97, (3, 37), device="cuda")
    tokens = torch.randint(0, 97, (3, 12), device="cuda")
    graphed = graphed_logits(model, prompt, tokens)
    cache = model.new_cache(3, 37 + 12 + 200)
    model(prompt, cache=cache)
    cache.to_static()
    eager_static = torch.cat([model(tokens[:, t:t + 1], cache=cache)[0] for t in range(12)], dim=1)
    dynamic = decode_logits(model, prompt, tokens, static=False)[0][:, 1:]
    torch.testing.assert_close(graphed.float(), eager_static.float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(graphed.float(), dynamic.float(), rtol=1.6e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", GPU_CONFIGS)
def test_graph_greedy_tokens_equal(kw):
    """32 greedy tokens: in fp32 cuda_graph=True equals the dynamic path; in bf16 the graph equals the same
    static step run eagerly (the same kernels, so near-ties cannot break differently)."""
    prompt = torch.randint(0, 97, (2, 11), device="cuda")
    model = model_of(kw, torch.float32, "cuda", **GPU_SIZE)
    assert torch.equal(model.generate(prompt, 32, temperature=0, cuda_graph=True),
                       model.generate(prompt, 32, temperature=0))
    model = model_of(kw, torch.bfloat16, "cuda", **GPU_SIZE)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, 32, temperature=0, cuda_graph=True), static_greedy(model, prompt, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [pytest.param(kw, id=name) for name, kw in RECURRENT_VARIANTS.items()])
def test_graph_continues_a_chunked_recurrent_prompt(kw):
    """A prompt over 64 tokens: the fla layers take their chunk kernels, whose final states the static buffers
    then hold (the one-token steps' shapes and dtypes). A recurrent static step is its dynamic step on the same
    state, so the graph's 24 greedy tokens equal the dynamic path's, also in bf16."""
    prompt = torch.randint(0, 97, (2, 100), device="cuda")
    model = model_of(kw, torch.bfloat16, "cuda", **GPU_SIZE)
    assert torch.equal(model.generate(prompt, 24, temperature=0, cuda_graph=True),
                       model.generate(prompt, 24, temperature=0))


@pytest.mark.gpu
@pytest.mark.parametrize("kw", GPU_COMPILED_CONFIGS)
def test_compiled_graph_greedy_tokens_equal(kw):
    """cuda_graph="compiled": 32 greedy tokens in fp32 equal the dynamic path's."""
    prompt = torch.randint(0, 97, (2, 11), device="cuda")
    model = model_of(kw, torch.float32, "cuda", **GPU_SIZE)
    torch._dynamo.reset()
    assert torch.equal(model.generate(prompt, 32, temperature=0, cuda_graph="compiled"),
                       model.generate(prompt, 32, temperature=0))


@pytest.mark.gpu
@pytest.mark.slow
def test_autotuned_graph_greedy_tokens_equal():
    """cuda_graph="autotuned" (max-autotune's matmul templates): 32 greedy fp32 tokens equal the dynamic path's."""
    prompt = torch.randint(0, 97, (2, 11), device="cuda")
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32, "cuda", **GPU_SIZE)
    torch._dynamo.reset()
    assert torch.equal(model.generate(prompt, 32, temperature=0, cuda_graph="autotuned"),
                       model.generate(prompt, 32, temperature=0))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [True, "fused"])
@pytest.mark.parametrize("filters", [dict(top_k=20), dict(top_p=0.9), dict(top_k=50, top_p=0.8, temperature=0.7)])
def test_graph_sampling_follows_the_seed(filters, mode):
    """The graph samples inside it from PyTorch's CUDA generator: the same seed draws the same tokens with and
    without it (fp32), with top-k, nucleus and both filters. "fused" (sample.py's default on Hopper) at batch 1
    (its Gluon kernel there) and 2 (Triton)."""
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32, "cuda", **GPU_SIZE)
    prompt = torch.randint(0, 97, (2, 5), device="cuda")
    kw = dict(temperature=1.0) | filters
    for rows in (prompt[:1], prompt):
        torch.manual_seed(3)
        graphed = model.generate(rows, 16, cuda_graph=mode, **kw)
        torch.manual_seed(3)
        assert torch.equal(graphed, model.generate(rows, 16, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [True, "fused"])
def test_graph_stops_at_the_end_token_as_the_eager_loop(mode):
    """eot_token: the graph marks finished rows inside it and the host reads that one step late; the output equals
    the eager loop's, which stops once every row has produced the token (a batch of one, stopping after its 7th
    token) and pads finished rows with it (a batch of two whose second row may never produce it)."""
    model = model_of(GRAPH_VARIANTS["llama"], torch.float32, "cuda", **GPU_SIZE)
    prompt = torch.randint(0, 97, (2, 5), device="cuda")
    free = model.generate(prompt[:1], 24, temperature=0)
    eot = int(free[0, 5 + 6])
    for rows in (prompt[:1], prompt):
        eager = model.generate(rows, 24, temperature=0, eot_token=eot)
        assert torch.equal(model.generate(rows, 24, temperature=0, eot_token=eot, cuda_graph=mode), eager)
        if len(rows) == 1:
            assert eager.size(1) <= 5 + 7 and eager[0, -1] == eot
