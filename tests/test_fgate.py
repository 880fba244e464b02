"""FoX forget-gate variants (arXiv:2503.02130 §4.5, App. D): model.fgate = data_dependent | bias_only | fixed
and the (T_min, T_max) bias init. The variants change only how the log forget gate (B, H, L) is computed, so
the kernels, the decode cache and sharded decoding take them unchanged; tests/test_model.py's VARIANTS run
the generic model tests (learning, causality, cached decoding) on bias_only and fixed models."""
import datetime
import json
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_model import experiment_model
from test_sharded_decode import greedy

from kernels.forgetting import forgetting_attn
from model.gpt import GPT, GPTConfig, split_heads

FOX = dict(attention="fox", pos="none")


def tiny(**kw):
    base = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32, **FOX)
    return GPTConfig(**{**base, **kw})


def random_decay_times():
    """Fresh (T_min, T_max) with 1 <= T_min < T_max."""
    t_min = 1 + 4 * torch.rand(()).item()
    return t_min, t_min * (2 + 100 * torch.rand(()).item())


def decay_times(t_min, t_max, H):
    """App. D: T^(h) = exp(log T_min + (log T_max - log T_min) (h - 1) / (H - 1)), h = 1..H; one head: T_min."""
    if H == 1:
        return torch.tensor([t_min], dtype=torch.float64)
    h = torch.arange(1, H + 1, dtype=torch.float64)
    return torch.exp(math.log(t_min) + (math.log(t_max) - math.log(t_min)) * (h - 1) / (H - 1))


def log_gate(attn, x):
    """The layer's log forget gate (B, H, T), as SoftmaxAttention.forward computes it."""
    return F.logsigmoid(attn.fgate(x).float()).transpose(1, 2)


def test_paper_example_decay_times():
    """App. D's example: H = 4 and (T_min, T_max) = (2, 128) give T = (2, 8, 32, 128), T(b) = -1 / log sigmoid(b)."""
    attn = GPT(tiny(fgate="fixed", fgate_tmin=2, fgate_tmax=128)).blocks[0].attn
    T = -1 / F.logsigmoid(attn.fgate.bias.double())
    torch.testing.assert_close(T, torch.tensor([2.0, 8.0, 32.0, 128.0], dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fgate", ["data_dependent", "bias_only", "fixed"])
@pytest.mark.parametrize("n_head", [1, 4, 5])
def test_tmin_tmax_init_equals_the_formula(fgate, n_head):
    """b^(h) = -log(expm1(1 / T^(h))) in every layer, whichever variant it initialises."""
    t_min, t_max = random_decay_times()
    model = GPT(tiny(fgate=fgate, fgate_tmin=t_min, fgate_tmax=t_max, n_head=n_head, n_embd=8 * n_head))
    expected = -torch.expm1(1 / decay_times(t_min, t_max, n_head)).log()
    for block in model.blocks:
        torch.testing.assert_close(block.attn.fgate.bias.double(), expected, rtol=1e-6, atol=1e-6)


def test_without_tmin_tmax_every_head_starts_at_fgate_bias_init():
    for fgate in ["data_dependent", "bias_only", "fixed"]:
        model = GPT(tiny(fgate=fgate, fgate_bias_init=1.5))
        assert torch.equal(model.blocks[1].attn.fgate.bias, torch.full((4,), 1.5))


def test_fixed_gate_is_alibi_with_no_trainable_parameters():
    """log f_t^(h) = -1 / T^(h) at every position of every sequence: ALiBi with slope 1 / T^(h) (§3); nothing of
    the gate is a parameter (the optimizer never sees it), yet it is saved with the weights."""
    t_min, t_max = random_decay_times()
    model = GPT(tiny(fgate="fixed", fgate_tmin=t_min, fgate_tmax=t_max)).double()
    assert not any("fgate" in name for name, _ in model.named_parameters())
    assert "blocks.0.attn.fgate.bias" in model.state_dict()
    optimized = {id(p) for group in model.param_groups(0.1) for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    attn = model.blocks[0].attn
    x = torch.randn(3, 11, 32, dtype=torch.float64)
    expected = (-1 / decay_times(t_min, t_max, 4))[None, :, None].expand(3, 4, 11)
    torch.testing.assert_close(log_gate(attn, x).double(), expected, rtol=1e-6, atol=0)


def test_bias_only_gate_ignores_the_input_and_is_learned():
    """f_t^(h) = sigmoid(b^(h)): a new input leaves the gate as it is; b (one scalar per head, no weight
    decay) gets a gradient and moves in training."""
    model = GPT(tiny(fgate="bias_only", fgate_tmin=2, fgate_tmax=64))
    attn = model.blocks[0].attn
    assert [(n, p.shape) for n, p in attn.fgate.named_parameters()] == [("bias", (4,))]
    x = torch.randn(2, 9, 32)
    gate = log_gate(attn, x)
    assert torch.equal(log_gate(attn, torch.randn(2, 9, 32)), gate)
    assert torch.equal(gate, gate[:1, :, :1].expand_as(gate))
    _, no_decay = model.param_groups(0.1)
    assert any(p is attn.fgate.bias for p in no_decay["params"])
    idx = torch.randint(0, 97, (2, 12))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert attn.fgate.bias.grad.abs().min() > 0


def test_data_dependent_gate_depends_on_the_input():
    attn = GPT(tiny(fgate_tmin=2, fgate_tmax=64)).blocks[0].attn
    x = torch.randn(2, 9, 32)
    assert not torch.allclose(log_gate(attn, x), log_gate(attn, torch.randn(2, 9, 32)))


@pytest.mark.parametrize("fgate", ["data_dependent", "bias_only", "fixed"])
def test_gate_gradients_through_the_triton_kernels_equal_the_reference(fgate):
    """Training through the Triton kernels (interpreted on CPU): the output and the gradients of the gate's
    parameters, q, k, v and the layer input equal the torch reference's, odd length."""
    attn = GPT(tiny(fgate=fgate, fgate_tmin=2, fgate_tmax=64, n_embd=64, n_head=4)).blocks[0].attn
    x = torch.randn(2, 19, 64)
    w = torch.randn(2, 4, 19, 16)
    results = []
    for impl in ["torch", "triton"]:
        attn.zero_grad()
        xi = x.clone().requires_grad_()
        q, k, v = (split_heads(t, 4) for t in attn.qkv(xi).chunk(3, dim=-1))
        out = forgetting_attn(q, k, v, log_gate(attn, xi), impl=impl)
        (out * w).sum().backward()
        grads = [p.grad.clone() for p in attn.fgate.parameters()] + [xi.grad]
        results.append((out.detach(), grads))
    (o_ref, g_ref), (o_tri, g_tri) = results
    torch.testing.assert_close(o_tri, o_ref, rtol=1e-4, atol=1e-5)
    assert len(g_ref) == {"data_dependent": 3, "bias_only": 2, "fixed": 1}[fgate]
    for got, want in zip(g_tri, g_ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 20])
def test_pruning_option_reaches_the_op_and_keeps_the_loss(monkeypatch, window):
    """model.fgate_prune_log_eps: every FoX layer's forgetting_attn runs with it (windowed too), and with strongly
    decaying gates the loss and the gradients stay those of the exact model (ACP drops weight < eps per row)."""
    import model.gpt as gpt
    seen = []
    op = gpt.forgetting_attn
    monkeypatch.setattr(gpt, "forgetting_attn", lambda *a, **kw: seen.append(kw["prune_log_eps"]) or op(*a, **kw))
    idx = torch.randint(0, 97, (2, 61))
    results = []
    for prune in (None, -10.0):
        model = GPT(tiny(fgate_bias_init=-2.0, block_size=64, attention_window=window, fgate_prune_log_eps=prune))
        model.load_state_dict(results[0][2] if results else model.state_dict())
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append((loss.item(), [p.grad for p in model.parameters()], model.state_dict()))
    assert seen == [None, None, -10.0, -10.0]
    (loss, grads, _), (pruned_loss, pruned_grads, _) = results
    assert abs(pruned_loss - loss) < 1e-5
    for got, want in zip(pruned_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_pruning_compiles_in_one_graph():
    """The pruning plan (acp_block_bounds, acp_plan: what the Triton path computes too) traces without a graph
    break; the compiled model's loss is the eager one's."""
    model = GPT(tiny(fgate_bias_init=-2.0, block_size=64, qk_norm=True, fgate_prune_log_eps=-10.0))
    idx = torch.randint(0, 97, (2, 61))
    _, loss = torch.compile(model, fullgraph=True, backend="aot_eager")(idx[:, :-1], idx[:, 1:])
    _, eager_loss = model(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(loss, eager_loss)


@pytest.mark.parametrize("fgate", ["data_dependent", "bias_only", "fixed"])
def test_each_variant_learns(fgate):
    """A few AdamW steps on one batch lower the loss (the fixed gate only through the other weights)."""
    model = GPT(tiny(fgate=fgate, fgate_tmin=2, fgate_tmax=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 97, (4, 17))
    fixed_bias = model.blocks[0].attn.fgate.bias.clone()
    losses = []
    for _ in range(10):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    moved = not torch.equal(model.blocks[0].attn.fgate.bias, fixed_bias)
    assert moved == (fgate != "fixed")


@pytest.mark.parametrize("fgate", ["data_dependent", "bias_only", "fixed"])
def test_cached_decoding_equals_parallel_forward(fgate):
    """Prefill, then one token at a time through the cache of cumulative gates: the logits of the full forward."""
    model = GPT(tiny(fgate=fgate, fgate_tmin=2, fgate_tmax=64, kv_shift=True)).double().eval()
    idx = torch.randint(0, 97, (2, 13))
    full, _ = model(idx)
    cache = model.new_cache(2, 13)
    pieces = [model(idx[:, :6], cache=cache)[0]] + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- sharded decoding

def _sharded_worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    errors = {}
    for fgate in ["bias_only", "fixed"]:
        torch.manual_seed(0)
        config = tiny(fgate=fgate, fgate_tmin=2, fgate_tmax=64, tie_embeddings=False, block_size=40)
        model = GPT(config).double().eval()
        prompt = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(1))
        want_tok, want_logits, _ = greedy(model, prompt, 12)
        got_tok, got_logits, _ = greedy(model, prompt, 12, dist.group.WORLD, chunk=4)
        errors[fgate] = (not torch.equal(got_tok, want_tok), (got_logits - want_logits).abs().max().item())
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(errors, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_decoding_equals_single_process():
    """Tree-attention decoding with the cache split over 2 gloo ranks gives the single process's greedy
    tokens and logits for the data-independent gates."""
    tmp = tempfile.mkdtemp(prefix="fgate_sharded_")
    mp.spawn(_sharded_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2)
    for rank in range(2):
        with open(os.path.join(tmp, f"{rank}.json")) as f:
            for fgate, (tokens_differ, logit_err) in json.load(f).items():
                assert not tokens_differ and logit_err < 1e-7, (rank, fgate, logit_err)


# ----------------------------------------------------------------------------- configs and bad input

# FoX 360M (24 layers, 16 heads, d = 1024): bias_only drops w_f (d x H per layer), fixed also its bias
DROPPED = {"bias_only": 24 * 16 * 1024, "fixed": 24 * (16 * 1024 + 16)}


@pytest.mark.parametrize("arch", ["llama", "pro"])
@pytest.mark.parametrize("fgate", DROPPED)
def test_gate_experiment_configs_drop_only_the_gate_parameters(arch, fgate):
    base, variant = experiment_model(f"fox_{arch}_360M"), experiment_model(f"fox_{arch}_360M_{fgate}")
    assert (variant.config.fgate, variant.config.fgate_tmin, variant.config.fgate_tmax) == (fgate, 2, 16384)
    assert base.num_params() - variant.num_params() == DROPPED[fgate]


@pytest.mark.parametrize("bad, match", [
    (dict(attention="baseline", pos="rope", fgate="fixed"), r"model\.fgate=fixed only applies to attention=fox"),
    (dict(attention="castle", pos="rope", fgate_tmin=2, fgate_tmax=8),
     r"model\.fgate_tmin=2, model\.fgate_tmax=8 only applies"),
    (dict(attention="baseline", pos="rope", fgate_bias_init=1.0), r"model\.fgate_bias_init=1\.0 only applies"),
    (dict(fgate="alibi"), r"model\.fgate='alibi' is unknown; choose one of \['bias_only', 'data_dependent', 'fixed'\]"),
    (dict(fgate_tmin=2), "fgate_tmin and model.fgate_tmax go together"),
    (dict(fgate_tmax=8), "fgate_tmin and model.fgate_tmax go together"),
    (dict(fgate_tmin=8, fgate_tmax=8), r"fgate_tmin=8, model\.fgate_tmax=8: .* 0 < fgate_tmin < fgate_tmax"),
    (dict(fgate_tmin=16, fgate_tmax=2), r"fgate_tmin=16, model\.fgate_tmax=2: .* 0 < fgate_tmin < fgate_tmax"),
    (dict(fgate_tmin=0, fgate_tmax=2), r"fgate_tmin=0, model\.fgate_tmax=2: .* 0 < fgate_tmin"),
    (dict(fgate_tmin=-1, fgate_tmax=2), r"fgate_tmin=-1"),
    (dict(fgate="bias_only", fgate_tmin=2, fgate_tmax=8, fgate_bias_init=0.5), "both set the forget-gate bias"),
    (dict(fgate_prune_log_eps=0.0), r"model\.fgate_prune_log_eps=0\.0 must be null/None \(no pruning\) or log\(eps\) < 0"),
    (dict(fgate_prune_log_eps=True), r"model\.fgate_prune_log_eps=True"),
    (dict(attention="baseline", pos="rope", fgate_prune_log_eps=-10), r"fgate_prune_log_eps=-10 only applies"),
])
def test_bad_gate_options_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


def test_gate_option_on_a_model_without_forget_gate_is_refused_from_the_config():
    """`+model.fgate=fixed` on model=llama reaches GPTConfig (plain `model.fgate=` is refused by Hydra itself,
    since llama's config has no such key)."""
    with initialize_config_dir(config_dir=os.path.abspath("configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=llama", "+model.fgate=fixed"])
    with pytest.raises(ValueError, match=r"model\.fgate=fixed only applies to attention=fox"):
        GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
