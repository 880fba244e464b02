"""train.sdpa_backend=fa4: FlashAttention-4's kernels behind `causal_attention` (kernels/fa4.py, kernels/sdpa.py).

On CPU the package's two kernel entry points are replaced by a float64 PyTorch reference with the same
signature and in-place outputs, which checks our side: the layout transposes, the custom ops' fake kernels
(strides included, through torch.library.opcheck), autograd and torch.compile. The GPU tests run the real
package against the same reference.
"""
import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import kernels.fa4 as fa4
import kernels.sdpa as sdpa
import train
from kernels.sdpa import causal_attention, prefer_sdpa_backend
from model.gpt import GPT, GPTConfig
from test_entry_errors import compose_config

HAVE_FA4 = importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None
needs_fa4 = pytest.mark.skipif(not HAVE_FA4, reason="needs flash-attn-4 (pip install flash-attn-4)")


def probabilities(q, k):
    """Causal softmax of (B, H, L, D) float64 queries and keys: (B, H, L, L) and each row's log-sum-exp."""
    L = q.size(2)
    s = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1), s.logsumexp(-1)


def heads_first(*tensors):
    return [t.double().transpose(1, 2) for t in tensors]


def reference_fwd(q, k, v, causal, return_lse, out, lse):
    """FA4's forward entry point on (B, L, H, D) inputs, in float64, writing `out` and `lse` (B, H, L)."""
    assert causal and return_lse
    q, k, v = heads_first(q, k, v)
    p, m = probabilities(q, k)
    out.copy_((p @ v).transpose(1, 2))
    lse.copy_(m)


def reference_bwd(q, k, v, out, dout, lse, causal, dq, dk, dv):
    """FA4's backward entry point, written out (a custom op's body runs without autograd)."""
    assert causal
    q, k, v, o, do = heads_first(q, k, v, out, dout)
    p, _ = probabilities(q, k)
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True)) * q.size(-1) ** -0.5
    for buf, g in zip((dq, dk, dv), (ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do)):
        buf.copy_(g.transpose(1, 2))


@pytest.fixture
def reference_kernels(monkeypatch):
    """The package's entry points replaced by the float64 reference (CPU tests of our wrapper); the list
    records the forward calls."""
    calls = []

    def counted_fwd(*args, **kwargs):
        calls.append(args[0].shape)
        reference_fwd(*args, **kwargs)

    stand_in = types.SimpleNamespace(_flash_attn_fwd=counted_fwd, _flash_attn_bwd=reference_bwd)
    for module in (fa4, sdpa):
        monkeypatch.setattr(module, "fa4_interface", lambda: stand_in)
    return calls


def bhld(B, H, L, D, dtype=torch.float32, device="cpu"):
    """(B, H, L, D) views of (B, L, H, D) storage, as the model's heads are."""
    return torch.randn(B, L, H, D, dtype=dtype, device=device).transpose(1, 2)


def check_against_sdpa(q, k, v, atol, rtol):
    """fa4_causal_attention's output and gradients against fp64 SDPA."""
    do = torch.randn_like(q)
    x = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = fa4.fa4_causal_attention(*x)
    expected = F.scaled_dot_product_attention(*ref, is_causal=True)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    for name, got, want in zip("qkv", torch.autograd.grad(out, x, do), torch.autograd.grad(expected, ref, do.double())):
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, msg=lambda m: f"d{name}: {m}")


def test_missing_package_is_named_before_any_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)   # makes the import fail, installed or not
    with pytest.raises(ImportError, match="train.sdpa_backend=fa4 needs FlashAttention-4.*pip install flash-attn-4"):
        prefer_sdpa_backend("fa4")


@pytest.mark.parametrize("B,H,L,D", [(2, 3, 37, 16), (1, 2, 1, 8)])
def test_wrapper_matches_sdpa(reference_kernels, B, H, L, D):
    check_against_sdpa(*(bhld(B, H, L, D) for _ in range(3)), atol=1e-5, rtol=1e-5)


def test_custom_ops_fake_kernels_and_autograd(reference_kernels):
    q, k, v = (bhld(2, 3, 19, 8).transpose(1, 2).requires_grad_() for _ in range(3))
    torch.library.opcheck(fa4.causal_fwd, (q, k, v))
    out, lse = fa4.causal_fwd(q, k, v)
    saved = [t.detach() for t in (q, k, v, out)]   # the backward's inputs never require grad
    torch.library.opcheck(fa4.causal_bwd, (*saved, torch.randn_like(out), lse.detach()))


def test_causal_attention_follows_the_choice_under_compile(reference_kernels):
    q, k, v = (bhld(1, 2, 33, 16) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with prefer_sdpa_backend("fa4"):
        got = torch.compile(causal_attention, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert reference_kernels == [(1, 33, 2, 16)], "the fa4 choice did not reach the FlashAttention-4 op"
    torch.testing.assert_close(causal_attention(q, k, v), expected)   # outside the context: SDPA again
    assert len(reference_kernels) == 1


def test_dropout_is_refused_under_fa4(reference_kernels):
    q = bhld(1, 1, 4, 8)
    with prefer_sdpa_backend("fa4"), pytest.raises(ValueError, match="model.dropout=0"):
        causal_attention(q, q, q, dropout_p=0.1)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,L,D", [(2, 3, 1000, 64), (1, 2, 77, 128), (1, 4, 2048, 64)])
def test_gpu_matches_sdpa(B, H, L, D, dtype):
    torch.manual_seed(L + D)
    check_against_sdpa(*(bhld(B, H, L, D, dtype, "cuda") for _ in range(3)), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_fa4
def test_gpu_model_trains_alike():
    """A compiled model's loss and gradients with fa4 against SDPA's defaults, bf16 autocast."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_embd=256, n_head=4, block_size=1024)
    model = GPT(cfg).cuda()
    x = torch.randint(0, 512, (2, 1024), device="cuda")

    def loss_and_grads(backend):
        model.zero_grad(set_to_none=True)
        with prefer_sdpa_backend(backend), torch.autocast("cuda", torch.bfloat16):
            loss = torch.compile(model)(x, x)[1]
        loss.backward()
        return loss.item(), [p.grad.float() for p in model.parameters()]

    (loss_sdpa, g_sdpa), (loss_fa4, g_fa4) = loss_and_grads("auto"), loss_and_grads("fa4")
    assert abs(loss_fa4 - loss_sdpa) < 2e-3
    for a, b in zip(g_fa4, g_sdpa):
        assert (a - b).norm() <= 2e-2 * b.norm() + 1e-6


def test_train_refuses_dropout_under_fa4_before_building_the_model(reference_kernels, tmp_path, monkeypatch):
    """train.py's check comes with the model's other checks, before the model is built or a step runs."""
    built = []
    monkeypatch.setattr(train, "GPT", lambda *a, **kw: built.append(1))
    cfg = compose_config("config", ["size=tiny", "model.dropout=0.1", "train.sdpa_backend=fa4", "train.device=cpu",
                                    f"train.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match="train.sdpa_backend=fa4 has no attention dropout, but model.dropout=0.1"):
        train.train(cfg, [], "llama")
    assert not built
