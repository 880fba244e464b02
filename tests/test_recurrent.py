"""model/recurrent.py: the FoX paper's recurrent baselines (Mamba-2, HGRN2, DeltaNet; Gated DeltaNet) through
fla's layers: training, cached decoding, Mamba-2's scan against fla's own Mamba2 forward, parameter counts of
the experiment configs, refusals.

On CPU fla's Triton kernels run under the interpreter (tests/conftest.py), with their first autotune config.
Gated DeltaNet's chunk kernel and Mamba-2's chunked scan (chunk_simple_gla) do not run there (the interpreter
hands a Python int where their loops call .to()): they are tested by the tests marked gpu.
"""
import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model.checkpoint import load_model
from model.gpt import GPT, GPTConfig
from model.hf.convert import checkpoint_dict, export_hf
from model.recurrent import GATED_BACKWARD, check_trainable, mamba2_scan, refuse_gated_backward

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
CUDA = torch.cuda.is_available()
# fp32 on a GPU: fla's Triton matmuls take TF32 (fla.utils.hardware), its chunked and step kernels round apart
TOL = dict(atol=2e-3, rtol=2e-3) if CUDA else dict(atol=2e-5, rtol=1e-4)

TINY = dict(vocab_size=97, block_size=64, n_layer=2, n_embd=32, pos="none", tie_embeddings=False)
VARIANTS = {
    "mamba2": dict(attention="mamba2", mlp="none", n_head=4, head_dim=16, ssm_state_size=16),
    "hgrn2": dict(attention="hgrn2", n_head=2, head_dim=16),
    "deltanet": dict(attention="deltanet", n_head=2),
    "gated_deltanet": dict(attention="gated_deltanet", n_head=2, head_dim=16),
}


def variants(fast=("mamba2", "hgrn2")):
    """The variants as test parameters: gated_deltanet on a GPU only (its chunk kernel fails in the
    interpreter), those not in `fast` in the full suite only (seconds each in the interpreter)."""
    def marks(name):
        return pytest.mark.gpu if name == "gated_deltanet" else () if name in fast else pytest.mark.slow
    return [pytest.param(name, marks=marks(name)) for name in VARIANTS]


def tiny(name, **kw):
    return GPTConfig(**{**TINY, **VARIANTS[name], **kw})


def device():
    return "cuda" if CUDA else "cpu"


def backward_unless_refused(name, loss):
    """loss.backward(), True; or, where check_trainable refuses the layer on loss's device, False after checking
    that fla's own backward refuses it too (the check mirrors fla's)."""
    try:
        check_trainable(name, loss.device)
    except ValueError:
        assert name in GATED_BACKWARD
        with pytest.raises(RuntimeError, match="Triton >= 3.7.1"):
            loss.backward()
        return False
    loss.backward()
    return True


@pytest.mark.parametrize("name", variants())
def test_training_step_is_finite_and_every_weight_gets_a_gradient(name):
    model = GPT(tiny(name)).to(device())
    idx = torch.randint(0, 97, (2, 23), device=device())
    _, loss = model(idx[:, :-1], targets=idx[:, 1:])
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 1.0
    if not backward_unless_refused(name, loss):
        return
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"no gradient reached {no_grad}"


@pytest.mark.parametrize("name", variants())
def test_cached_decoding_equals_the_uncached_forward(name):
    """A prompt, a 3-token chunk, then single tokens through the recurrent state == one uncached pass."""
    model = GPT(tiny(name)).to(device()).eval()
    idx = torch.randint(0, 97, (2, 13), device=device())
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(2, idx.size(1))
        pieces = [model(piece, cache=cache)[0] for piece in idx.split([7, 3, 1, 1, 1], dim=1)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)
    assert cache.pos == 13 and all(layer.length == 13 for layer in cache.layers)


@pytest.mark.parametrize("name", variants(fast=("mamba2",)))
def test_generation_with_the_cache_equals_generation_without(name):
    """GPT.generate's cached path (a prefill, then one-token steps through the layers' state) against rerunning
    the whole sequence for every token (seconds a token for DeltaNet in the interpreter)."""
    model = GPT(tiny(name)).to(device()).eval()
    prompt = torch.randint(0, 97, (2, 5), device=device())
    cached = model.generate(prompt, 4, temperature=0, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, 4, temperature=0, use_cache=False))


@pytest.mark.parametrize("name", variants())
def test_the_model_is_llama_blocks_around_direct_calls_of_the_fla_layer(name):
    """Logits == embedding, then per block x + layer(norm(x)) with the fla layer called directly (no MLP sub-layer
    for Mamba-2), final norm, head."""
    model = GPT(tiny(name)).to(device()).eval()
    idx = torch.randint(0, 97, (2, 11), device=device())
    with torch.no_grad():
        x = model.wte(idx)
        for block in model.blocks:
            x = x + block.attn.layer(block.norm_attn(x))[0]
            if name != "mamba2":
                x = x + block.mlp(block.norm_mlp(x))
        torch.testing.assert_close(model(idx)[0], model.lm_head(model.norm_f(x)), **TOL)
    assert (model.blocks[0].mlp is None) == (name == "mamba2")


@pytest.mark.parametrize("name", variants())
def test_fused_norms_give_the_unfused_logits(name):
    """model.fused_norm: each residual add done by the next norm; Mamba-2's block defers its layer's branch."""
    plain = GPT(tiny(name, fused_norm=False)).to(device()).eval()
    fused = GPT(tiny(name, fused_norm=True)).to(device()).eval()
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 97, (2, 11), device=device())
    with torch.no_grad():
        torch.testing.assert_close(fused(idx)[0], plain(idx)[0], **TOL)


def mamba2_layer(seed_model):
    return seed_model.blocks[0].attn.layer


def test_mamba2_scan_equals_fla_mamba2_forward_outputs_states_and_gradients():
    """mamba2_scan (fla's simple-GLA scan on the Mamba-2 layer's parameters) against the fla Mamba2 layer's
    own forward: output, the cached conv and SSM states, and the input and weight gradients."""
    layer = mamba2_layer(GPT(tiny("mamba2")))
    with torch.no_grad():
        layer.A_log.uniform_(-1, 2)            # fresh decay rates and skip weights, not the init's
        layer.D.normal_()
    x = torch.randn(2, 21, 32, requires_grad=True)
    ref, ref_conv, ref_ssm = layer.torch_forward(x, use_cache=True)
    y, conv, ssm = mamba2_scan(layer, x, keep_state=True)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(conv, ref_conv)
    torch.testing.assert_close(ssm, ref_ssm, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(y)
    ours = torch.autograd.grad(y, [x, layer.in_proj.weight, layer.A_log, layer.dt_bias, layer.D], g)
    theirs = torch.autograd.grad(ref, [x, layer.in_proj.weight, layer.A_log, layer.dt_bias, layer.D], g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_recurrent_layers_need_a_gpu_or_the_interpreter_except_mamba2(monkeypatch):
    """Without TRITON_INTERPRET on CPU, fla's Triton layers refuse clearly; Mamba-2 takes fla's own torch
    forward, which gives the same logits."""
    idx = torch.randint(0, 97, (1, 9))
    mamba = GPT(tiny("mamba2")).eval()
    hgrn = GPT(tiny("hgrn2")).eval()
    with torch.no_grad():
        interpreted = mamba(idx)[0]
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        torch.testing.assert_close(mamba(idx)[0], interpreted, atol=2e-5, rtol=1e-4)
        with pytest.raises(ValueError, match="attention=hgrn2 runs the Triton kernels of fla: it needs a CUDA GPU"):
            hgrn(idx)


def test_a_saved_checkpoint_loads_back_to_the_same_logits_and_hf_export_refuses(tmp_path):
    model = GPT(tiny("mamba2", tokenizer_vocab_size=97)).eval()
    with torch.no_grad():
        model.blocks[1].attn.layer.A_log.normal_()          # not the values a fresh model draws
    torch.save(checkpoint_dict(model.config, model.state_dict(), {}), tmp_path / "ckpt_1.pt")
    loaded, _, _, _ = load_model(tmp_path, device="cpu", dtype="fp32")
    idx = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="attention=mamba2 .* has no Hugging Face export"):
        export_hf(tmp_path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", VARIANTS)
def test_sharded_decoding_refuses_recurrent_models(name):
    attn = GPT(tiny(name)).blocks[0].attn
    with pytest.raises(ValueError, match=f"attention={name} is recurrent.*tree \\(sharded\\) decoding does not apply"):
        attn.new_cache(1, 8, "cpu", torch.float32, group=object())


@pytest.mark.parametrize("name, bad, match", [
    ("mamba2", dict(fgate="fixed"), "model.fgate=fixed only applies to attention=fox"),
    ("hgrn2", dict(qk_norm=True), "model.qk_norm=True only apply to softmax/forgetting attention or CASTLE"),
    ("deltanet", dict(output_gate=True, kv_shift=True), "model.kv_shift=True, model.output_gate=True only apply"),
    ("mamba2", dict(castle_window=128), "model.castle_window=128 only apply"),
    ("deltanet", dict(pos="rope"), "model.pos='rope' with the recurrent attention=deltanet"),
    ("hgrn2", dict(ssm_state_size=64), "model.ssm_state_size=64 only applies to attention=mamba2"),
    ("mamba2", dict(gdn_expand_v=1.0), "model.gdn_expand_v=1.0 only applies to attention=gated_deltanet"),
    ("mamba2", dict(n_head=3), "attention=mamba2: model.n_head x model.head_dim = 48 .* multiple of model.n_embd=32"),
    ("hgrn2", dict(head_dim=8), "attention=hgrn2: model.n_head x model.head_dim = 2 x 8 must equal model.n_embd=32"),
    ("gated_deltanet", dict(gdn_expand_v=0.3), "head_dim x model.gdn_expand_v = 16 x 0.3 must be a whole number"),
])
def test_options_that_do_not_apply_refuse(name, bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(name, **bad)


@pytest.mark.parametrize("name", VARIANTS)
def test_fla_init_and_weight_decay(name):
    """As FLA's models: convolutions N(0, 0.02) with zero bias, no weight decay on A_log, D, dt_bias and norm scales,
    output projections scaled for the residual stream; every parameter in exactly one AdamW group."""
    model = GPT(tiny(name, n_embd=64, n_head=VARIANTS[name]["n_head"] * 2))
    layer = model.blocks[0].attn.layer
    for conv in (m for m in layer.modules() if isinstance(m, torch.nn.Conv1d)):
        assert abs(conv.weight.std().item() - 0.02) < 0.005 and (conv.bias is None or not conv.bias.any())
    decay, no_decay = model.param_groups(0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    skipped = {names[id(p)].split("attn.layer.")[-1] for p in no_decay["params"] if "attn.layer." in names[id(p)]}
    expected = {"mamba2": {"A_log", "D", "dt_bias", "conv1d.bias", "norm.weight"}, "hgrn2": {"g_norm.weight"},
                "deltanet": {"o_norm.weight"}, "gated_deltanet": {"A_log", "dt_bias", "o_norm.weight"}}[name]
    assert skipped == expected
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    out = layer.out_proj if name == "mamba2" else layer.o_proj
    assert abs(out.weight.std().item() - 0.02 / (2 * model.config.n_layer) ** 0.5) < 0.003


@pytest.mark.parametrize("name, per_layer", [("mamba2", 20 * 32 * 16), ("hgrn2", 5 * 32 * 16),
                                             ("deltanet", 6 * 32 * 16), ("gated_deltanet", 6 * 2 * 16 * 32)])
def test_flops_count_the_recurrence_of_fox_table_6(name, per_layer):
    """6N + each layer's recurrent-form FLOPs (forward; x3 with the backward), independent of the context."""
    with torch.device("meta"):
        model = GPT(tiny(name))
    n = model.num_params() - model.wte.weight.numel()       # the untied input embedding is a lookup
    assert model.flops_per_token(4096) == model.flops_per_token(16) == 6 * n + 2 * 3 * per_layer


def test_ssm_state_size_reaches_the_mamba2_layer():
    layer = mamba2_layer(GPT(tiny("mamba2", ssm_state_size=8)))
    assert layer.ssm_state_size == 8 and layer.num_heads == 4 and layer.intermediate_size == 64


def experiment_params(name, *overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={name}", *overrides])
    config = GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    with torch.device("meta"):
        return config, GPT(config).num_params()


@pytest.mark.parametrize("name, reference", [
    (f"{m}_{s}", (f"transformer_llama_{s}",) if s != "XS" else ("compare_XS", "model=llama"))
    for m in VARIANTS for s in ("125M", "360M", "XS")])
def test_experiment_parameter_counts_match_the_transformer_within_2_percent(name, reference):
    config, n = experiment_params(name)
    _, n_ref = experiment_params(*reference)
    assert config.attention == name.rsplit("_", 1)[0]
    assert abs(n - n_ref) / n_ref < 0.02, f"{name}: {n} parameters vs {reference[0]}'s {n_ref}"


def test_the_gated_backward_is_refused_on_hopper_with_triton_before_3_7_1():
    for capability, version in [((9, 0), "3.4.0"), ((9, 0), "3.6.0"), ((9, 0), "3.7.0+git1a2b")]:
        with pytest.raises(ValueError, match=r"attention=mamba2 cannot train on a Hopper GPU .*Triton >= 3\.7\.1.*hgrn2"):
            refuse_gated_backward("mamba2", capability, version)
    for capability, version in [((9, 0), "3.3.1"), ((9, 0), "3.7.1"), ((8, 0), "3.6.0"), ((10, 0), "3.6.0")]:
        refuse_gated_backward("gated_deltanet", capability, version)
    for name in VARIANTS:
        check_trainable(name, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
def test_bf16_training_step_on_gpu(name):
    """The path a real run takes: fla's chunked kernels (Mamba-2: chunk_simple_gla) under bf16 autocast."""
    model = GPT(tiny(name, n_embd=128, n_head=VARIANTS[name]["n_head"] * 4)).cuda()
    idx = torch.randint(0, 97, (2, 300), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        _, loss = model(idx[:, :-1], targets=idx[:, 1:])
    if not backward_unless_refused(name, loss):
        return
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all()
                                        for p in model.parameters())


@pytest.mark.gpu
def test_mamba2_chunked_scan_equals_fla_mamba2_forward_on_gpu():
    layer = mamba2_layer(GPT(tiny("mamba2")).cuda())
    x = torch.randn(2, 300, 32, device="cuda")
    ref, _, ref_ssm = layer.torch_forward(x, use_cache=True)
    y, _, ssm = mamba2_scan(layer, x, keep_state=True)
    torch.testing.assert_close(y, ref, atol=2e-3, rtol=2e-3)      # tf32 in the chunked kernel
    torch.testing.assert_close(ssm, ref_ssm, atol=2e-3, rtol=2e-3)
