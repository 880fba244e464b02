"""Every variant on a GPU at a real sequence length: bf16 autocast training step (Triton kernels,
torch.compile, one graph: fullgraph=True fails on any graph break) against the fp64 CPU model with the same
weights. Skipped without CUDA."""
import pytest
import torch

from model.gpt import GPT, GPTConfig

PRO = dict(qk_norm=True, kv_shift=True, output_gate=True, output_norm=True, mlp_ratio=3.5)
VARIANTS = {
    "baseline": dict(attention="baseline"),
    "castle": dict(attention="castle"),
    "castle_swl": dict(attention="castle_swl", castle_window=128),
    "fox_llama": dict(attention="fox", pos="none"),
    "fox_pro": dict(attention="fox", pos="none", **PRO),
    "transformer_pro": dict(attention="baseline", **PRO),
}
# training only: Adaptive Computation Pruning (at init, f ~ 0.5, it skips most of the 128 x 128 blocks at L 999;
# the fp64 CPU model masks the same blocks)
TRAINED = {**VARIANTS, "fox_pro_acp": dict(VARIANTS["fox_pro"], fgate_prune_log_eps=-10.0)}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("variant", TRAINED)
def test_bf16_training_step_matches_fp64(variant, compile_model):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, block_size=1000, n_layer=2, n_head=4, n_embd=256, head_dim=64,
                       **TRAINED[variant])
    reference = GPT(config).double()
    model = GPT(config).cuda()
    model.load_state_dict(reference.state_dict())
    idx, targets = torch.randint(0, 1024, (2, 2, 999))      # odd length: kernel tails
    run = torch.compile(model, fullgraph=True) if compile_model else model
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = run(idx.cuda(), targets.cuda())
    loss.backward()
    _, ref_loss = reference(idx, targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert rel(p.grad.cpu(), q.grad) < 8e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_greedy_generation_on_gpu(variant):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=128, head_dim=32,
                       **VARIANTS[variant])
    model = GPT(config).cuda().eval()
    prompt = torch.randint(0, 512, (2, 37), device="cuda")
    cached = model.generate(prompt, 24, temperature=0)
    uncached = model.generate(prompt, 24, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
