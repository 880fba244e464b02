"""Sliding-window attention (model.attention_window = W; Transformer-SWA, FoX arXiv:2503.02130 §F.4) in the
model: softmax and forgetting attention see only the last W positions in training, in cached decoding
(a cache of at most W rows, equal to the uncached forward) and in sharded decoding (equal to one
process, real gloo groups); bad input; the experiment configs. The kernels' window is tested against
the reference in test_forgetting_kernels.py."""
import datetime
import json
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_model import experiment_model
from test_sharded_decode import SETUPS, VARIANTS, greedy, tiny

from model.cache import WindowCache
from model.gpt import GPT, GPTConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
WINDOWED = ["baseline", "gpt2_style", "transformer_pro", "fox_llama", "fox_pro"]


def windowed_model(variant, window, seed=0):
    torch.manual_seed(seed)
    return GPT(tiny(**VARIANTS[variant], attention_window=window)).double().eval()


# ----------------------------------------------------------------------------- the uncached forward

@pytest.mark.parametrize("variant", ["baseline", "fox_pro"])
def test_window_past_the_sequence_is_full_attention(variant):
    """W >= T changes nothing; W < T changes the logits of positions >= W only."""
    full = windowed_model(variant, None)
    idx = torch.randint(0, 97, (2, 19))
    logits = full(idx)[0]
    wide = windowed_model(variant, 19)
    torch.testing.assert_close(wide(idx)[0], logits, rtol=1e-12, atol=1e-12)
    narrow = windowed_model(variant, 6)(idx)[0]
    torch.testing.assert_close(narrow[:, :6], logits[:, :6], rtol=1e-12, atol=1e-12)
    assert (narrow[:, 6:] - logits[:, 6:]).abs().amax(-1).min() > 1e-6


def test_window_limits_what_a_position_sees():
    """With W = 4 (2 layers: receptive field 2 * 3 + 1 = 7 positions), the logits at t do not change
    when tokens before t - 6 do."""
    model = windowed_model("fox_llama", 4)
    idx = torch.randint(0, 97, (1, 24))
    other = idx.clone()
    other[:, :10] = (other[:, :10] + 1) % 97
    a, b = model(idx)[0], model(other)[0]
    assert torch.equal(a[:, 17:], b[:, 17:])
    assert not torch.allclose(a[:, 10:17], b[:, 10:17])


def test_flops_count_the_window():
    full, swa = GPT(tiny(attention_window=None)), GPT(tiny(attention_window=8))
    assert swa.flops_per_token(8) == full.flops_per_token(8)
    assert swa.flops_per_token(40) < full.flops_per_token(40)


# ----------------------------------------------------------------------------- cached decoding

def cached_logits(model, idx, prefill, chunk, max_len):
    """Logits of every position: a prefill of `prefill` tokens, then `chunk` tokens at a time; the cache's
    largest tensors are checked after every call."""
    cache = model.new_cache(idx.size(0), max_len)
    out = []
    for piece in [idx[:, :prefill]] + list(idx[:, prefill:].split(chunk, dim=1)):
        out.append(model(piece, cache=cache)[0])
        for layer in cache.layers:
            assert isinstance(layer, WindowCache)
            assert max(t.size(2) for t in (layer.k, layer.v, layer.c) if t is not None) <= model.config.attention_window
            assert layer.pos.numel() <= model.config.attention_window
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("prefill,chunk", [(9, 1), (3, 4), (1, 5)])
@pytest.mark.parametrize("variant", WINDOWED)
def test_window_cache_equals_uncached(variant, prefill, chunk):
    """Cached decoding with the window (a prompt longer or shorter than W, then one token or chunks at a
    time) gives the uncached forward's logits at every position."""
    window, L = 5, 23
    model = windowed_model(variant, window)
    idx = torch.randint(0, 97, (2, L))
    got, cache = cached_logits(model, idx, prefill, chunk, max_len=40)
    torch.testing.assert_close(got, model(idx)[0], rtol=0, atol=1e-7)  # FoX's bias passes through fp32
    assert cache.layers[0].length == L and cache.layers[0].capacity == window


def test_window_cache_memory_does_not_grow():
    """A stream 12x the window through a cache made for it: W rows per layer, no more, from the first
    step to the last (a full-attention cache holds every position)."""
    window = 4
    model = windowed_model("fox_pro", window)
    idx = torch.randint(0, 97, (1, 48))
    got, cache = cached_logits(model, idx, prefill=2, chunk=1, max_len=48)
    torch.testing.assert_close(got, model(idx)[0], rtol=0, atol=1e-7)  # FoX's bias passes through fp32
    layer = cache.layers[0]
    assert layer.k.shape[2] == layer.v.shape[2] == layer.c.shape[2] == window
    assert sorted(layer.pos.tolist()) == list(range(44, 48))
    assert windowed_model("fox_pro", None).new_cache(1, 48).layers[0].k.shape[2] == 48


def test_short_stream_allocates_only_its_length():
    cache = windowed_model("baseline", 64).new_cache(1, 10)
    assert cache.layers[0].capacity == 10


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["baseline", "fox_pro"])
def test_gpu_window_cache_equals_uncached(variant):
    """On a GPU (Triton training kernels uncached, the Triton split-KV decode kernel cached), fp32, a
    window cutting tiles: every position's logits agree."""
    torch.manual_seed(0)
    model = GPT(tiny(**VARIANTS[variant], attention_window=37, n_embd=128)).cuda().eval()
    idx = torch.randint(0, 97, (2, 300), device="cuda")
    with torch.no_grad():
        got, _ = cached_logits(model, idx, prefill=150, chunk=1, max_len=300)
        torch.testing.assert_close(got, model(idx)[0], rtol=0, atol=1e-3)


# ----------------------------------------------------------------------------- sharded decoding

def check_sharded(variant, world, group):
    """Greedy tokens and logits of a window cache split over the group equal one process's (window 3 on
    global positions, prompts longer than the window fed in chunks); each rank holds ceil(W / p) rows."""
    fails = []
    dtype, tol = SETUPS["gloo"]
    window = 3
    torch.manual_seed(0)
    model = GPT(tiny(**VARIANTS[variant], attention_window=window)).to(dtype).eval()
    for T0, n, chunk in [(11, 8, 4), (1, 12, None)]:
        prompt = torch.randint(0, 97, (2, T0), generator=torch.Generator().manual_seed(T0))
        want_tok, want_logits, _ = greedy(model, prompt, n)
        got_tok, got_logits, cache = greedy(model, prompt, n, group, chunk)
        if not torch.equal(got_tok, want_tok):
            fails.append(f"prompt {T0}: tokens {got_tok.tolist()} != {want_tok.tolist()}")
        err = (got_logits - want_logits).abs().max().item()
        if not err < tol:
            fails.append(f"prompt {T0}: logits differ by {err:.3g}")
        if cache.layers[0].capacity != -(-window // world):
            fails.append(f"prompt {T0}: {cache.layers[0].capacity} rows on a rank")
    return fails


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in WINDOWED:
        try:
            results[name] = "; ".join(check_sharded(name, world, dist.group.WORLD)) or "ok"
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_window_decoding_equals_single_process(world):
    tmp = tempfile.mkdtemp(prefix="swa_sharded_")
    mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world)
    bad = []
    for r in range(world):
        with open(os.path.join(tmp, f"{r}.json")) as f:
            bad += [f"rank {r} {name}: {outcome}" for name, outcome in json.load(f).items() if outcome != "ok"]
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- bad input, configs

@pytest.mark.parametrize("kw,message", [
    (dict(attention_window=0), "model.attention_window=0 must be an integer >= 1"),
    (dict(attention_window=-2), "model.attention_window=-2 must be an integer >= 1"),
    (dict(attention="castle", attention_window=8), "not attention=castle (CASTLE-SWL's window is model.castle_window)"),
    (dict(attention="castle_swl", castle_window=4, attention_window=8), "model=llama, gpt2, transformer_llama"),
    (dict(attention_window=8, dropout=0.1), "set model.dropout=0"),
])
def test_bad_window(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny(**kw)


def model_config(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg.model, resolve=True)


@pytest.mark.parametrize("model", ["llama", "gpt2", "transformer_llama", "transformer_pro", "fox_llama", "fox_pro"])
def test_every_softmax_model_takes_the_window(model):
    assert GPTConfig.from_dict(model_config([f"model={model}", "model.attention_window=16"])).attention_window == 16


def test_castle_model_refuses_the_window():
    with pytest.raises(ValueError, match="model.attention_window=16 only applies to softmax and forgetting"):
        GPTConfig.from_dict(model_config(["model=castle", "model.attention_window=16"]))


@pytest.mark.parametrize("size", ["125M", "360M", "760M"])
def test_swa_experiments_are_transformer_llama_with_the_papers_window(size):
    """FoX §F.4: Transformer-SWA (LLaMA) is Transformer (LLaMA) with W = 2048: same parameters."""
    swa, full = experiment_model(f"transformer_swa_{size}"), experiment_model(f"transformer_llama_{size}")
    assert swa.config.attention_window == 2048 and full.config.attention_window is None
    assert swa.num_params() == full.num_params()


def test_swa_xs_is_the_compare_xs_llama_with_a_window():
    swa, full = experiment_model("transformer_swa_XS"), experiment_model("compare_XS")
    assert swa.config.attention_window == 256 and swa.config.attention == full.config.attention == "baseline"
    assert swa.num_params() == full.num_params()


@pytest.mark.parametrize("variant", ["baseline", "fox_pro"])
def test_hf_custom_model_keeps_the_window(variant):
    """The exported model (modeling_attn_lm.py, plain materialized attention) applies the window on real
    tokens, left padding included; no stock transformers class is offered for a windowed model."""
    from model.hf.convert import choose_architecture, hf_config
    from model.hf.modeling_attn_lm import AttnLMForCausalLM
    model = windowed_model(variant, 5)
    hf = AttnLMForCausalLM(hf_config(model.config, "custom", 97, torch.float64)).double().eval()
    hf.load_state_dict(model.state_dict(), strict=False)   # our names; the RoPE tables are not weights
    idx = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], rtol=0, atol=1e-8)
        padded = hf(torch.cat([idx.new_zeros(2, 3), idx], 1), attention_mask=torch.cat(
            [idx.new_zeros(2, 3), torch.ones_like(idx)], 1)).logits[:, 3:]
        torch.testing.assert_close(padded, model(idx)[0], rtol=0, atol=1e-8)
    assert choose_architecture(GPTConfig(attention_window=5), "auto") == "custom"
    assert choose_architecture(GPTConfig(), "auto") == "llama"
