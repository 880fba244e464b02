"""kernels/forgetting/: Forgetting Attention reference, Triton kernels, decode helpers.

Each test checks a property of Forgetting Attention (FoX, arXiv:2503.02130 §3, eq (11)) that the op
must keep. On CPU the Triton kernels run in the interpreter on tiny shapes (tile 16, so L = 17, 45
cover several tiles and padded tails); the gpu-marked tests run the compiled kernels at real shapes.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import kernels.forgetting.reference as reference
import kernels.forgetting.triton as fox_triton
from kernels.forgetting import fgate_cumsum, forgetting_attn, forgetting_decode
from kernels.forgetting.triton import MAX_BLOCK, gate_grad, split_c
from kernels.triton_utils import interpreting, triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# every output and gradient buffer starts as NaN (conftest.nan_filled_empty): unwritten entries fail
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


# gate logit ranges: log f = logsigmoid(logit)
DECAY = {"strong": (-5.0, 0.0), "weak": (5.0, 10.0), "mixed": (-5.0, 10.0)}


def rel_err(a, b):
    """||a - b|| / ||b|| in fp64; the floor of 1 (typical norms here are 10-100) only matters
    for references that are exactly zero, like dq and dk at L = 1. A NaN (an unwritten output)
    gives inf, since max() over a list of errors would skip a NaN."""
    a, b = a.double(), b.double()
    err = ((a - b).norm() / b.norm().clamp_min(1.0)).item()
    return err if math.isfinite(err) else math.inf


def make_inputs(B, H, L, D, dtype=torch.float32, decay="mixed", device=DEV):
    q, k, v = (torch.randn(B, H, L, D, device=device).to(dtype) for _ in range(3))
    lo, hi = DECAY[decay]
    log_fgate = F.logsigmoid(torch.empty(B, H, L, device=device).uniform_(lo, hi))
    return q, k, v, log_fgate


def run(q, k, v, log_fgate, do=None, **kw):
    """Output and gradients (q, k, v[, log_fgate]) for upstream gradient `do` (random by default);
    log_fgate None: no gate."""
    inputs = [x.detach().requires_grad_() for x in (q, k, v, log_fgate) if x is not None]
    o = forgetting_attn(*inputs[:3], inputs[3] if log_fgate is not None else None, **kw)
    do = torch.randn_like(o) if do is None else do
    return o, torch.autograd.grad(o, inputs, do), do


def run_fp64(q, k, v, log_fgate, do, **kw):
    return run(*(x.double() if x is not None else None for x in (q, k, v, log_fgate)), do=do.double(),
               impl="torch", **kw)


def check(o, grads, o_ref, grads_ref, tol):
    errs = [rel_err(o, o_ref)] + [rel_err(g, r) for g, r in zip(grads, grads_ref)]
    print("rel errors o, dq, dk, dv, dlogf:", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < tol, f"rel errors o, dq, dk, dv, dlogf = {errs}"


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

def test_reference_matches_definition():
    """The materialized reference equals a per-row loop over the definition with products of f."""
    B, H, L, D = 1, 2, 7, 4
    q, k, v, log_fgate = (x.double() for x in make_inputs(B, H, L, D, device="cpu"))
    f = log_fgate.exp()
    scale = 0.7
    expected = torch.zeros_like(v)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                w = torch.stack([torch.exp(scale * q[b, h, i] @ k[b, h, j]) * f[b, h, j + 1:i + 1].prod()
                                 for j in range(i + 1)])
                expected[b, h, i] = (w[:, None] * v[b, h, :i + 1]).sum(0) / w.sum()
    out = forgetting_attn(q, k, v, log_fgate, scale=scale, impl="torch")
    assert rel_err(out, expected) < 1e-12


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gate_one_is_causal_attention(impl):
    """log f = 0 (F = 1 in eq (11)) gives causal softmax attention, forward and dq/dk/dv; d log f still right."""
    q, k, v, _ = make_inputs(2, 2, 33, 32)
    zero = torch.zeros(2, 2, 33, device=DEV)
    o, grads, do = run(q, k, v, zero, impl=impl)
    # fp64 SDPA with the gate bias c_i - c_j (c = cumsum log f, -inf above the diagonal): causal
    # attention here, and autograd through c gives d log f without kernels/forgetting
    q, k, v, log_fgate = (x.double().requires_grad_() for x in (q, k, v, zero))
    c = log_fgate.cumsum(-1)
    future = torch.ones(33, 33, dtype=torch.bool, device=DEV).triu(1)
    bias = (c[..., :, None] - c[..., None, :]).masked_fill(future, float("-inf"))
    o_ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v, log_fgate), do.double())
    check(o, grads, o_ref, grads_ref, 1e-5)


@pytest.mark.parametrize("L", [1, 45, 77])
def test_gate_cumsum_kernel(L):
    """The kernel's c = cumsum(log f) in fp64 (times log2 e), padded with log f = 0 and split
    into a value per block and fp32 offsets, equals the same computed by torch; L spans several
    of the scan's chunks and ends in a partial block."""
    log_fgate = F.logsigmoid(3 * torch.randn(2, 3, L, device=DEV))
    log_fgate[..., 0] = -3e5  # a large |c|: the offsets must still be exact
    Lp = -(-L // MAX_BLOCK) * MAX_BLOCK
    offsets, blocks = split_c(log_fgate, Lp)
    c = F.pad(fgate_cumsum(log_fgate), (0, Lp - L), mode="replicate") * math.log2(math.e)
    expected_blocks = c[..., ::MAX_BLOCK]
    expected_offsets = c - expected_blocks.repeat_interleave(MAX_BLOCK, -1)
    assert torch.allclose(blocks, expected_blocks, rtol=1e-14, atol=0)
    assert torch.allclose(offsets.double(), expected_offsets, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("L", [1, 45, 77])
def test_gate_grad_kernel_is_the_cumsum_adjoint(L, dtype):
    """d log f_t = sum_{s >= t} dc_s (dc = dcq + dck from the kernels' row and column sums; App. E,
    Algorithm 2) is the adjoint of c = cumsum(log f); padded positions after L are ignored."""
    Lp = -(-L // MAX_BLOCK) * MAX_BLOCK
    dcq, dck = (torch.randn(2, 3, Lp, device=DEV) for _ in range(2))
    x = torch.randn(2, 3, L, dtype=torch.float64, device=DEV, requires_grad=True)
    (expected,) = torch.autograd.grad(x.cumsum(-1), x, (dcq + dck)[..., :L].double())
    got = gate_grad(dcq, dck, L, dtype)
    assert got.dtype == dtype and got.shape == (2, 3, L)
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Triton kernels against the fp64 reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("decay", ["strong", "weak"])
@pytest.mark.parametrize("L,D", [(1, 32), (17, 64), (45, 32)])
def test_triton_matches_reference(L, D, decay, dtype, tol):
    """Forward and all four gradients against the reference, odd L (padded tails), several tiles."""
    q, k, v, log_fgate = make_inputs(2, 2, L, D, dtype, decay)
    o, grads, do = run(q, k, v, log_fgate, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do)
    assert o.dtype == dtype and all(g.dtype == x.dtype for g, x in zip(grads, (q, k, v, log_fgate)))
    check(o, grads, o_ref, grads_ref, tol)


@pytest.mark.skipif(not interpreting(), reason="on a GPU the autotuned tiles run (test_gpu_*)")
def test_triton_dq_subtile_differs(monkeypatch):
    """The backward's dQ loop with key sub-tiles twice the dK/dV loop's query sub-tiles (as the GPU's
    autotuned 32 / 64): 32-token tiles under the interpreter, so L = 70 crosses several of each."""
    monkeypatch.setattr(fox_triton, "MAX_BLOCK", 32)
    monkeypatch.setattr(fox_triton, "C_BLOCK", 32)
    monkeypatch.setitem(fox_triton.BWD_FIXED, "interpret", dict(BLOCK_SMALL=16, BLOCK_SMALL_DQ=32, BLOCK_LARGE=32))
    q, k, v, log_fgate = make_inputs(1, 2, 70, 32, decay="weak")
    o, grads, do = run(q, k, v, log_fgate, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do)
    check(o, grads, o_ref, grads_ref, 2e-5)


@pytest.mark.parametrize("L,D", [(32, 32), (23, 48)])
def test_triton_scale_and_strides(L, D):
    """Non-default scale and (B, L, H, D) views as inputs: passed to the kernel with their strides
    when L and D need no padding, copied when they do (D = 48 is zero-padded to 64)."""
    B, H = 1, 3
    q, k, v = (torch.randn(B, L, H, D, device=DEV).transpose(1, 2) for _ in range(3))
    log_fgate = F.logsigmoid(3 * torch.randn(B, H, L, device=DEV))
    o, grads, do = run(q, k, v, log_fgate, scale=0.5, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do, scale=0.5)
    check(o, grads, o_ref, grads_ref, 2e-5)


def test_extremes():
    """f -> 0 gives O = V; a constant gate is ALiBi (§3, "Connection to ALiBi")."""
    q, k, v, _ = make_inputs(1, 2, 20, 32)
    tiny_gate = torch.full((1, 2, 20), -1e4, device=DEV)
    assert torch.allclose(forgetting_attn(q, k, v, tiny_gate, impl="triton"), v, atol=1e-6)

    slopes = torch.tensor([0.1, 0.7], device=DEV)  # -log f per head
    log_fgate = (-slopes)[None, :, None].expand(1, 2, 20).contiguous()
    pos = torch.arange(20, device=DEV)
    alibi = -slopes[:, None, None] * (pos[:, None] - pos[None, :])
    alibi = alibi.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi)
    for impl in ("torch", "triton"):
        assert rel_err(forgetting_attn(q, k, v, log_fgate, impl=impl), expected) < 1e-5


def test_causality():
    """Inputs after position t change neither o_{<=t} nor its gradients."""
    t, L = 21, 40
    q, k, v, log_fgate = make_inputs(1, 2, L, 32, decay="weak")
    inputs = [x.requires_grad_() for x in (q, k, v, log_fgate)]
    o = forgetting_attn(*inputs, impl="triton")
    grads = torch.autograd.grad(o[:, :, :t + 1].sum(), inputs)
    for g in grads:
        assert g[:, :, t + 1:].abs().max() == 0
    perturbed = [x.detach().clone() for x in inputs]
    for x in perturbed:
        x[:, :, t + 1:] = -x[:, :, t + 1:] - 1
    o2 = forgetting_attn(*perturbed, impl="triton")
    assert torch.equal(o[:, :, :t + 1], o2[:, :, :t + 1])


# ---------------------------------------------------------------------------------------------
# Long-sequence precision policy: c in fp64, re-referenced per tile
# ---------------------------------------------------------------------------------------------

def _naive_fp32_global_cumsum(q, k, v, log_fgate):
    """What the precision policy avoids: c = cumsum(log f) in fp32, bias c_i - c_j in fp32."""
    L = q.shape[-2]
    c = log_fgate.float().cumsum(-1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + (c[..., :, None] - c[..., None, :])
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_large_cumsum_offset(impl):
    """Shifting c by 3e5 (|c| of log f ~ -5 at 64K tokens), here by changing
    only log f_1, changes neither O nor the gradients, d log f_1 = 0 (i.e. sum_t dc_t = 0);
    an fp32 global cumsum fails this by orders of magnitude."""
    q, k, v, log_fgate = make_inputs(1, 2, 50, 32, decay="strong")
    shifted = log_fgate.clone()
    shifted[..., 0] = -3e5
    o, grads, do = run(q, k, v, log_fgate, impl=impl)
    o_shift, grads_shift, _ = run(q, k, v, shifted, do=do, impl=impl)
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do)
    check(o_shift, grads_shift, o_ref, grads_ref, 2e-5)
    check(o, grads, o_ref, grads_ref, 2e-5)
    assert grads_shift[3][..., 0].abs().max() < 1e-5
    assert rel_err(_naive_fp32_global_cumsum(q, k, v, shifted), o_ref) > 1e-3


# ---------------------------------------------------------------------------------------------
# Decoding with a cache
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 5])
def test_decode_matches_parallel(chunk):
    """Prefill, then decode `chunk` tokens at a time with an appended
    (K, V, c) cache; every position equals the parallel op. log f_1 = -3e5 checks that the
    fp64 c cache keeps long-sequence precision too."""
    L, prefill = 23, 7
    q, k, v, log_fgate = make_inputs(2, 2, L, 32, decay="strong", device="cpu")
    log_fgate[..., 0] = -3e5
    expected = forgetting_attn(*(x.double() for x in (q, k, v, log_fgate)), impl="torch")

    c_cache = fgate_cumsum(log_fgate[..., :prefill])
    outs = [forgetting_attn(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill],
                            log_fgate[..., :prefill], impl="torch")]
    for t in range(prefill, L, chunk):
        new = slice(t, min(t + chunk, L))
        c_cache = torch.cat([c_cache, fgate_cumsum(log_fgate[..., new], c_cache)], -1)
        k_cache, v_cache = k[:, :, :new.stop], v[:, :, :new.stop]
        outs.append(forgetting_decode(q[:, :, new], k_cache, v_cache, c_cache))
    assert rel_err(torch.cat(outs, 2), expected) < 1e-5
    assert torch.allclose(c_cache, fgate_cumsum(log_fgate), rtol=1e-12)


def test_log_fgate_must_be_fp32():
    """A 16-bit log gate is rejected rather than silently upcast."""
    q, k, v, log_fgate = make_inputs(1, 1, 8, 16, device="cpu")
    with pytest.raises(TypeError):
        forgetting_attn(q, k, v, log_fgate.bfloat16())


# ---------------------------------------------------------------------------------------------
# Sliding window (Transformer-SWA, arXiv:2503.02130 §F.4) and the ungated kernels
# ---------------------------------------------------------------------------------------------

def _band_attention(q, k, v, log_fgate, window, scale=None):
    """fp64 SDPA with an explicit mask: keys i-W+1 .. i, plus the gate bias c_i - c_j if gated."""
    L = q.shape[-2]
    d = torch.arange(L, device=q.device)[:, None] - torch.arange(L, device=q.device)[None, :]
    bias = torch.zeros(L, L, dtype=torch.float64, device=q.device)
    if log_fgate is not None:
        c = log_fgate.double().cumsum(-1)
        bias = c[..., :, None] - c[..., None, :]
    bias = bias.masked_fill((d < 0) | (d >= window), float("-inf"))
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias, scale=scale)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_window_reference_is_band_attention(gated):
    """The reference's window: query i attends keys i-W+1 .. i only (W = 1: o = v)."""
    q, k, v, log_fgate = (x.double() for x in make_inputs(1, 2, 13, 8, device="cpu"))
    log_fgate = log_fgate if gated else None
    for window in (1, 4, 13, 20):
        out = forgetting_attn(q, k, v, log_fgate, window=window, impl="torch")
        assert rel_err(out, _band_attention(q, k, v, log_fgate, window)) < 1e-12
    assert rel_err(forgetting_attn(q, k, v, log_fgate, window=1, impl="torch"), v) < 1e-12


# windows below, at and above the interpreter's 16-token tile and below, at and above L = 37
@pytest.mark.parametrize("window,gated", [(1, True), (5, False), (16, True), (23, False), (37, True), (50, False)])
def test_window_triton_matches_reference(window, gated):
    """Forward and every gradient of the windowed kernels against the fp64 reference, gated and not."""
    q, k, v, log_fgate = make_inputs(1, 2, 37, 32)
    log_fgate = log_fgate if gated else None
    o, grads, do = run(q, k, v, log_fgate, window=window, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do, window=window)
    assert len(grads) == (4 if gated else 3)
    # at W = 1 each query sees its own key only, so d log f is exactly zero and rel_err's floor makes its check
    # absolute: the fp32 rowsum - colsum leaves ~1e-6 per position, which the reverse cumsum accumulates
    check(o, grads, o_ref, grads_ref, 1e-4 if window == 1 else 2e-5)


@pytest.mark.skipif(not interpreting(), reason="on a GPU the autotuned tiles run (test_gpu_*)")
@pytest.mark.parametrize("window", [3, 20])
def test_window_subtiles(monkeypatch, window):
    """The GPU's tile shapes (query tiles twice the key sub-tiles): with a window narrower than a
    sub-tile a row sees no key of a whole masked sub-tile of the diagonal (no NaN from exp2(-inf + inf))."""
    monkeypatch.setattr(fox_triton, "MAX_BLOCK", 32)
    monkeypatch.setattr(fox_triton, "C_BLOCK", 32)
    monkeypatch.setitem(fox_triton.FWD_FIXED, "interpret", dict(BLOCK_M=32, BLOCK_N=16))
    monkeypatch.setitem(fox_triton.BWD_FIXED, "interpret", dict(BLOCK_SMALL=16, BLOCK_SMALL_DQ=16, BLOCK_LARGE=32))
    q, k, v, log_fgate = make_inputs(1, 2, 70, 16)
    o, grads, do = run(q, k, v, log_fgate, window=window, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do, window=window)
    check(o, grads, o_ref, grads_ref, 2e-5)


def test_window_skips_tiles():
    """The kernels never visit a tile outside the window: NaN in the values of keys 0..15 (tile 0)
    reaches no output of queries >= 32 (window 4), NaN in the output gradient of queries >= 32 no
    gradient of keys 0..15; a masked visit would multiply the NaN by 0 and keep it."""
    q, k, v, log_fgate = make_inputs(1, 2, 48, 16)
    v[:, :, :16] = float("nan")
    assert torch.isfinite(forgetting_attn(q, k, v, log_fgate, window=4, impl="triton")[:, :, 32:]).all()
    q, k, v, log_fgate = (x.requires_grad_() for x in make_inputs(1, 2, 48, 16))
    do = torch.randn(1, 2, 48, 16, device=DEV)
    do[:, :, 32:] = float("nan")
    dk, dv = torch.autograd.grad(forgetting_attn(q, k, v, log_fgate, window=4, impl="triton"), (k, v), do)
    assert torch.isfinite(dk[:, :, :16]).all() and torch.isfinite(dv[:, :, :16]).all()


def test_ungated_is_sdpa():
    """log_fgate=None is causal softmax attention (the kernels' ungated variant): equals SDPA."""
    q, k, v, _ = make_inputs(2, 2, 29, 32)
    o, grads, do = run(q, k, v, None, impl="triton")
    inputs = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref = F.scaled_dot_product_attention(*inputs, is_causal=True)
    check(o, grads, o_ref, torch.autograd.grad(o_ref, inputs, do.double()), 2e-5)


@pytest.mark.parametrize("chunk", [1, 4])
def test_window_decode_matches_parallel(chunk):
    """forgetting_decode with the window over the full cache equals the windowed parallel op."""
    L, prefill, window = 19, 6, 5
    q, k, v, log_fgate = (x.double() for x in make_inputs(1, 2, L, 8, device="cpu"))
    expected = forgetting_attn(q, k, v, log_fgate, window=window, impl="torch")
    c = fgate_cumsum(log_fgate)
    outs = [forgetting_attn(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], log_fgate[..., :prefill],
                            window=window, impl="torch")]
    for t in range(prefill, L, chunk):
        end = min(t + chunk, L)
        outs.append(forgetting_decode(q[:, :, t:end], k[:, :, :end], v[:, :, :end], c[..., :end], window=window))
    assert rel_err(torch.cat(outs, 2), expected) < 1e-12


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_window_must_be_positive_int(window):
    q, k, v, log_fgate = make_inputs(1, 1, 8, 16, device="cpu")
    with pytest.raises(ValueError, match="window"):
        forgetting_attn(q, k, v, log_fgate, window=window)


# ---------------------------------------------------------------------------------------------
# Adaptive Computation Pruning (prune_log_eps; arXiv:2504.06949 §3)
# ---------------------------------------------------------------------------------------------

def test_acp_plan_is_the_block_rule():
    """skip and q_end describe one set of block pairs, and prune only what the rule lets go: key block b < a
    may go for query block a iff c_first[a] - c_last[b] + bounds[a, b] < log eps - log L (brute force over every
    pair). skip[a] is the shortest run of such leading blocks over a and the later query blocks; with bounds
    constant per head (the paper's form) it is the run itself."""
    n, log_eps, L = 9, -3.0, 36
    c = F.logsigmoid(torch.randn(3, 2, n * 4, dtype=torch.float64) - 1).cumsum(-1)
    c_first, c_last = c[..., ::4], c[..., 3::4]
    per_pair = 12 * torch.rand(3, 2, n, n, dtype=torch.float64)
    per_head = torch.rand(3, 2, 1, 1, dtype=torch.float64).expand(3, 2, n, n)
    for bounds in (per_pair, per_head):
        skip, q_end = reference.acp_plan(c_first, c_last, bounds, log_eps, L)
        may_go = c_first[..., :, None] - c_last[..., None, :] + bounds < log_eps - math.log(L)
        leading = torch.tensor([[[next((b for b in range(a) if not may_go[i, h, a, b]), a) for a in range(n)]
                                 for h in range(2)] for i in range(3)])
        assert torch.equal(skip.long(), torch.stack([leading[..., a:].amin(-1) for a in range(n)], -1))
        if bounds is per_head:  # c never increases, so the leading runs never shrink
            assert torch.equal(skip.long(), leading)
        else:  # the case that needs the lowering occurs
            assert (leading[..., 1:] < leading[..., :-1]).any()
        for i, h, a, b in ((i, h, a, b) for i in range(3) for h in range(2) for a in range(n) for b in range(a + 1)):
            assert (b >= skip[i, h, a]) == (a < q_end[i, h, b])
        assert 0 < (skip > 0).float().mean() < 1  # both outcomes occur


def test_acp_block_bounds_hold():
    """bounds[a, b] >= scale q_i.k_j - scale q_i.k_i for every i of block a and j of block b (brute force; L is
    not a multiple of the block), and the bound is not slack by more than the norms' product allows."""
    B, H, L, D, block = 2, 3, 29, 8, 8
    q, k = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(2))
    bounds = reference.acp_block_bounds(q, k, 0.3, block)
    logits = 0.3 * q @ k.transpose(-1, -2)
    excess = logits - logits.diagonal(dim1=-2, dim2=-1)[..., :, None]   # [i, j]: s q_i.k_j - s q_i.k_i
    n = -(-L // block)
    assert bounds.shape == (B, H, n, n)
    for a, b in ((a, b) for a in range(n) for b in range(n)):
        worst = excess[..., a * block:(a + 1) * block, b * block:(b + 1) * block].amax((-2, -1))
        assert (bounds[..., a, b] >= worst - 1e-12).all()
        assert (bounds[..., a, b] <= worst + 2 * 0.3 * q.norm(dim=-1).amax(-1) * k.norm(dim=-1).amax(-1)).all()


def _lost_weight(q, k, log_fgate, log_eps):
    """Per row, the exact attention weight of the entries ACP prunes (fp64); and how many it prunes."""
    q, k, log_fgate = q.double(), k.double(), log_fgate.double()
    L, scale = q.shape[-2], q.shape[-1] ** -0.5
    c = fgate_cumsum(log_fgate)
    s = scale * q @ k.transpose(-1, -2) + c[..., :, None] - c[..., None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    pruned = causal & ~reference.acp_kept(q, k, c, scale, log_eps, fox_triton.MAX_BLOCK)
    return (p * pruned).sum(-1), pruned.sum().item() / causal.sum().item()


@pytest.mark.parametrize("log_eps", [-1.0, -10.0])
def test_acp_bound(log_eps):
    """What a row loses weighs less than eps (acp_block_bounds' guarantee), and pruning happens."""
    q, k, v, log_fgate = make_inputs(2, 3, 3 * MAX_BLOCK + 5, 16, decay="strong")
    lost, fraction = _lost_weight(2 * q, k, log_fgate, log_eps)
    print(f"log eps {log_eps}: pruned {fraction:.0%} of the causal entries, largest row loss {lost.max():.1e}")
    assert fraction > 0.2 and lost.max() < math.exp(log_eps)


def test_acp_changes_outputs_by_eps():
    """forgetting_attn(prune_log_eps=-10), Triton, against the exact fp64 reference: output and every gradient
    as close as without pruning, while most of the entries are pruned."""
    q, k, v, log_fgate = make_inputs(1, 2, 3 * MAX_BLOCK + 5, 32, decay="strong")
    assert _lost_weight(q, k, log_fgate, -10.0)[1] > 0.3
    o, grads, do = run(q, k, v, log_fgate, prune_log_eps=-10.0, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do)
    check(o, grads, o_ref, grads_ref, 2e-5)


@pytest.fixture
def aggressive_acp(monkeypatch):
    """Bounds of -13.5 for every block pair: with log eps -10 and L = 67 to 150 a key block goes once c has
    dropped by more than 0.7-1.5 from it, pruning that changes the outputs visibly, so that a kernel which
    skips other block pairs than the plan's fails a comparison with the masked reference."""
    def bounds(q, k, scale, block):
        n = -(-q.shape[-2] // block)
        return torch.full((*q.shape[:2], n, n), -13.5, dtype=torch.float64, device=q.device)
    monkeypatch.setattr(fox_triton, "acp_block_bounds", bounds)
    monkeypatch.setattr(reference, "acp_block_bounds", bounds)


@pytest.mark.usefixtures("aggressive_acp")
@pytest.mark.parametrize("window", [None, 23])
def test_acp_triton_matches_masked_reference(window):
    """The kernels skip exactly the plan's block pairs: forward and every gradient against the fp64
    reference that masks them (and far from the unpruned op), with and without a window."""
    q, k, v, log_fgate = make_inputs(1, 2, 4 * MAX_BLOCK + 3, 32, decay="mixed")
    o, grads, do = run(q, k, v, log_fgate, window=window, prune_log_eps=-10.0, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do, window=window, prune_log_eps=-10.0)
    check(o, grads, o_ref, grads_ref, 2e-5)
    assert rel_err(o, run_fp64(q, k, v, log_fgate, do, window=window)[0]) > 1e-2


@pytest.mark.skipif(not interpreting(), reason="on a GPU the autotuned tiles run (test_gpu_*)")
@pytest.mark.usefixtures("aggressive_acp")
def test_acp_blocks_span_tiles(monkeypatch):
    """The GPU's case: plan blocks larger than every tile (32 positions here, tiles of 16), so a tile's
    loop bounds come from the block it lies in."""
    monkeypatch.setattr(fox_triton, "MAX_BLOCK", 32)
    monkeypatch.setattr(fox_triton, "C_BLOCK", 32)
    monkeypatch.setitem(fox_triton.FWD_FIXED, "interpret", dict(BLOCK_M=16, BLOCK_N=16))
    monkeypatch.setitem(fox_triton.BWD_FIXED, "interpret", dict(BLOCK_SMALL=16, BLOCK_SMALL_DQ=16, BLOCK_LARGE=16))
    q, k, v, log_fgate = make_inputs(1, 2, 150, 16, decay="mixed")
    o, grads, do = run(q, k, v, log_fgate, prune_log_eps=-10.0, impl="triton")
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do, prune_log_eps=-10.0)
    check(o, grads, o_ref, grads_ref, 2e-5)


@pytest.mark.parametrize("prune_log_eps", [0.0, 1, True, "-10"])
def test_acp_option_checked(prune_log_eps):
    q, k, v, log_fgate = make_inputs(1, 1, 8, 16, device="cpu")
    with pytest.raises(ValueError, match="prune_log_eps"):
        forgetting_attn(q, k, v, log_fgate, prune_log_eps=prune_log_eps)


def test_acp_needs_the_gate():
    q, k, v, _ = make_inputs(1, 1, 8, 16, device="cpu")
    with pytest.raises(ValueError, match="prune_log_eps needs a forget gate"):
        forgetting_attn(q, k, v, None, prune_log_eps=-10.0)


# ---------------------------------------------------------------------------------------------
# GPU: real shapes
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("decay", ["strong", "mixed"])
def test_gpu_real_shape_bf16(D, decay):
    """bf16 at L = 4096 against the fp32 reference (catches fp32-accumulation bugs)."""
    q, k, v, log_fgate = make_inputs(1, 2048 // D, 4096, D, torch.bfloat16, decay)
    o, grads, do = run(q, k, v, log_fgate)
    o_ref, grads_ref, _ = run(*(x.float() for x in (q, k, v)), log_fgate, do=do.float(), impl="torch")
    check(o, grads, o_ref, grads_ref, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_acp_bf16(D):
    """prune_log_eps=-10 in bf16 at L = 4096, strongly decaying gates (most blocks pruned), against the
    exact fp32 reference: as close as the unpruned kernels (test_gpu_real_shape_bf16)."""
    q, k, v, log_fgate = make_inputs(1, 2048 // D, 4096, D, torch.bfloat16, "strong")
    assert _lost_weight(q[:, :2], k[:, :2], log_fgate[:, :2], -10.0)[1] > 0.8
    o, grads, do = run(q, k, v, log_fgate, prune_log_eps=-10.0)
    o_ref, grads_ref, _ = run(*(x.float() for x in (q, k, v)), log_fgate, do=do.float(), impl="torch")
    check(o, grads, o_ref, grads_ref, 1e-2)


# every tile config the autotuner may pick (another GPU, shape or Triton version may pick any of them)
TUNED = ([("fwd", i) for i in range(len(getattr(fox_triton, "FWD_CONFIGS", ())))]
         + [("bwd", i) for i in range(len(getattr(fox_triton, "BWD_CONFIGS", ())))])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("D,window", [(64, None), (128, 300)])
@pytest.mark.parametrize("which,index", TUNED, ids=[f"{w}{i}" for w, i in TUNED])
def test_gpu_every_tuned_config(monkeypatch, which, index, D, window):
    """One autotune config alone (the other pass on its first config), bf16, gated, L = 1100 (padded), with
    and without a window that cuts tiles, against the fp32 reference."""
    for name, configs, kernel in (("fwd", fox_triton.FWD_CONFIGS, fox_triton.fwd_kernel),
                                  ("bwd", fox_triton.BWD_CONFIGS, fox_triton.bwd_kernel)):
        chosen = configs[index if name == which else 0]
        monkeypatch.setattr(fox_triton, f"{name}_tuned", triton.autotune([chosen], key=fox_triton.TUNING_KEY)(kernel))
    q, k, v, log_fgate = make_inputs(1, 4, 1100, D, torch.bfloat16, "mixed")
    o, grads, do = run(q, k, v, log_fgate, window=window)
    o_ref, grads_ref, _ = run(*(x.float() for x in (q, k, v)), log_fgate, do=do.float(), window=window,
                              impl="torch")
    check(o, grads, o_ref, grads_ref, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 2048, 5000])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_gpu_window_bf16(window, gated):
    """Sliding window, bf16 at L = 4096 (odd windows cut tiles), against the fp32 reference."""
    q, k, v, log_fgate = make_inputs(1, 16, 4096, 64, torch.bfloat16, "mixed")
    log_fgate = log_fgate if gated else None
    o, grads, do = run(q, k, v, log_fgate, window=window)
    o_ref, grads_ref, _ = run(*(x.float() for x in (q, k, v)), log_fgate, do=do.float(), window=window,
                              impl="torch")
    check(o, grads, o_ref, grads_ref, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_gpu_odd_shapes(dtype, tol):
    """Odd L, D = 96 (padded), strided inputs, fp32 (3xTF32 dots) and bf16, vs the fp64 reference."""
    B, H, L, D = 1, 16, 1100, 96  # L padded to 1152: the gate scan masks a partial chunk
    q, k, v = (torch.randn(B, L, H, D, device=DEV, dtype=dtype).transpose(1, 2) for _ in range(3))
    log_fgate = F.logsigmoid(3 * torch.randn(B, H, L, device=DEV))
    o, grads, do = run(q, k, v, log_fgate)
    o_ref, grads_ref, _ = run_fp64(q, k, v, log_fgate, do)
    check(o, grads, o_ref, grads_ref, tol)


@pytest.mark.gpu
def test_gpu_long_sequence_precision():
    """L = 65536, log f ~ -5 (|c| ~ 3e5), bf16, against an fp64 reference on sampled rows
    whose bias is a local sum of log f over (j, i], never a difference of global cumsums."""
    L, D, H = 65536, 64, 32  # all heads are computed; head 0 is checked
    q, k, v, _ = make_inputs(1, H, L, D, torch.bfloat16)
    log_fgate = F.logsigmoid(-5 + 0.5 * torch.randn(1, H, L, device=DEV))
    o = forgetting_attn(q, k, v, log_fgate)
    lf, qd, kd, vd = log_fgate[0, 0].double(), q[0, 0].double(), k[0, 0].double(), v[0, 0].double()
    rows = list(range(L // 2 - 32, L // 2 + 32)) + list(range(L - 128, L))
    c32 = log_fgate[0, 0].cumsum(0)  # what the policy avoids, printed for comparison
    expected, naive = [], []
    for i in rows:
        logits = qd[i] @ kd[:i + 1].T * D ** -0.5
        bias = torch.cat([lf[1:i + 1].flip(0).cumsum(0).flip(0), lf.new_zeros(1)])
        expected.append(torch.softmax(logits + bias, 0) @ vd[:i + 1])
        naive.append(torch.softmax(logits + (c32[i] - c32[:i + 1]).double(), 0) @ vd[:i + 1])
    expected = torch.stack(expected)
    err = rel_err(o[0, 0, rows], expected)
    print(f"L = {L}, log f ~ -5: rel error {err:.1e} (fp32 global cumsum: "
          f"{rel_err(torch.stack(naive), expected):.1e})")
    assert err < 1e-2
