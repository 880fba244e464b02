"""CASTLE / CASTLE-SWL kernels (kernels/castle/) against the definitions of CASTLE (arXiv:2509.07301).

Oracle chain: the recurrent definition (§2.2, explicit U^t for every t, fp64) checks the parallel form
(Theorem 1); autograd of the parallel form (fp64) is the gradient oracle for the blockwise PyTorch path and the
Triton kernels. On CPU the Triton kernels run under TRITON_INTERPRET=1 on tiny shapes with 16/32-row
tiles, so several blocks, ragged tails and window edges are all exercised, and once at L = 173 with
the tiles a GPU uses by default; the interpreter computes the tiles in fp32 (it cannot multiply
bf16), so the bf16 rounding of the kernels is checked by the gpu-marked tests at real shapes, against
what plain bf16 matmuls achieve on the same inputs. The same goes for the 16-bit path's sigmoid (one
tanh.approx, inline PTX the interpreter cannot run): only the gpu-marked bf16 tests reach it, at odd
lengths, forward and all six gradients.
"""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401  (pinned in CI: a broken install must fail these tests, not skip them)

import kernels.castle.op as castle_op
import kernels.castle.triton as castle_triton
from kernels.castle import castle_attn, castle_decode, castle_prefill
from kernels.castle.op import attn_triton
from kernels.castle.reference import attn_blockwise, blockwise_backward, blockwise_forward, to_blocks
from kernels.castle.triton import BWD_VARIANTS, TritonConfig
from kernels.triton_utils import interpreting, padded_head_dim

TILE16 = TritonConfig(16, 16, 4, 16, 16, 4, 1)
TILE32_16 = TritonConfig(32, 16, 4, 16, 16, 4, 1)  # row tiles of two key tiles; backward rows < forward rows
TILE32 = TritonConfig(32, 16, 4, 32, 16, 4, 1)     # row tiles of two key tiles in both passes


def rel(a, b):
    """||a - b|| / ||b||; for an exactly-zero reference (e.g. L = 1 gradients) the RMS of a instead.
    A NaN (an unwritten output) gives inf, since max() over a list of errors would skip a NaN."""
    a, b = a.double(), b.double()
    if b.norm() == 0:
        err = (a.norm() / math.sqrt(a.numel())).item()
    else:
        err = ((a - b).norm() / b.norm()).item()
    return err if math.isfinite(err) else math.inf


# every output and gradient buffer starts as NaN (conftest.nan_filled_empty): unwritten entries fail
pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def slow(*values):
    """A parameter set that only the full suite runs (the fast subset is `-m "not slow"`)."""
    return pytest.param(*values, marks=pytest.mark.slow)


# the fast subset runs each backward variant once in the tests below (the *_matches_reference tests run all three)
ONE_VARIANT_FAST = [BWD_VARIANTS[0], *(slow(v) for v in BWD_VARIANTS[1:])]


def inputs(B, H, L, D, dtype=torch.float64, device="cpu", grad=False):
    return [torch.randn(B, H, L, D, dtype=torch.float64, device=device).to(dtype).requires_grad_(grad)
            for _ in range(6)]


def lookahead_keys(qu, ku, vu, t, window=None, scale=None):
    """U^t of eq (3) (rows 0..t-1), fp64."""
    scale = qu.shape[-1] ** -0.5 if scale is None else scale
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = (i < j) & ((j <= i + window) if window is not None else True)
    return torch.where(allowed, torch.sigmoid(scale * qu[..., :t, :] @ ku[..., :t, :].mT), 0.0) @ vu[..., :t, :]


def recurrent(qc, kc, vc, qu, ku, vu, window=None, scale=None, silu=True):
    """The recurrent definition (§2.2): for every t rebuild U^t from eq (3), then eqs (5)-(8). fp64, O(L^3 d).
    The ablations (§5.2): kc None drops s^C, silu=False takes s^U for SiLU(s^U) in eq (7)."""
    L, D = qc.shape[-2:]
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty_like(qc)
    for t in range(1, L + 1):
        ut = lookahead_keys(qu, ku, vu, t, window, scale)
        q = qc[..., t - 1:t, :]
        s_u = scale * q @ ut.mT
        score = (0.0 if kc is None else scale * q @ kc[..., :t, :].mT) - (F.silu(s_u) if silu else s_u)
        out[..., t - 1:t, :] = torch.softmax(score, dim=-1) @ vc[..., :t, :]
    return out


# ----------------------------------------------------------------------------------------------------
# The parallel reference (impl="torch") against the definition


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_golden_example_1():
    """A worked example (d = 1, L = 3), its numbers derived from eqs (3)-(8)."""
    qc, kc, vc, qu, ku, vu = (_t(x).view(1, 1, 3, 1) for x in (
        [1, 2, 0.5], [0.5, -1, 1], [1, 2, 3], [1, -1, 2], [0, 1, -2], [2, -1, 0.5]))
    out = castle_attn(qc, kc, vc, qu, ku, vu, impl="torch").flatten()
    assert torch.allclose(out, _t([1, 1.036436, 2.046914]), atol=1e-6)
    out = castle_attn(qc, kc, vc, qu, ku, vu, window=1, impl="torch").flatten()
    assert torch.allclose(out, _t([1, 1.036436, 2.042781]), atol=1e-6)
    _, cache = castle_prefill(qc, kc, vc, qu, ku, vu)
    assert torch.allclose(cache.u.flatten(), _t([-0.671457, 0.440399, 0]), atol=1e-6)
    _, cache = castle_prefill(qc, kc, vc, qu, ku, vu, window=1)
    assert torch.allclose(cache.u.flatten(), _t([-0.731059, 0.440399, 0]), atol=1e-6)


def test_bad_calls_are_named():
    xs = inputs(1, 1, 4, 8)
    with pytest.raises(ValueError, match="impl='fast'.*blockwise"):
        castle_attn(*xs, impl="fast")
    _, cache = castle_prefill(*[x[..., :2, :] for x in xs])
    with pytest.raises(ValueError, match="one position at a time, got 2.*castle_prefill"):
        castle_decode(cache, *[x[..., 2:, :] for x in xs])


def test_golden_example_2_and_scaling():
    """A worked example (d = 2, L = 4); d >= 2 tells the right 1/sqrt(d) placement from the wrong one."""
    xs = [_t(x).view(1, 1, 4, 2) for x in (
        [[1, 0], [0.5, -1], [2, 1], [-1, 0.5]], [[0, 1], [1, 1], [-0.5, 2], [1, -1]],
        [[1, -1], [0, 2], [3, 0], [-2, 1]], [[1, 1], [-1, 0], [0.5, 0.5], [2, -1]],
        [[0, 2], [1, -1], [1, 1], [-1, 0]], [[1, 0], [0, 1], [-1, 1.5], [0.5, 0.5]])]
    expect = {
        None: [[1, -1], [0.448260, 0.655221], [0.628290, 1.224381], [1.956338, 0.202285]],
        1: [[1, -1], [0.448260, 0.655221], [0.619089, 1.279436], [1.848370, 0.029217]],
        2: [[1, -1], [0.448260, 0.655221], [0.628290, 1.224381], [1.963503, 0.211292]],
    }
    for window, rows in expect.items():
        for impl in ("torch", "blockwise"):
            out = castle_attn(*xs, window=window, impl=impl)[0, 0]
            assert torch.allclose(out, _t(rows), atol=1e-6), (window, impl)
    wrong = _t([1.893753, 0.161970])
    assert (castle_attn(*xs, impl="torch")[0, 0, 3] - wrong).abs().max() > 0.05


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("window", [None, 0, 1, 2, 3, 4, 5, 13, 11, 40])
def test_parallel_matches_recurrent(window, scale):
    """Invariant 1; windows around the 4-block size used elsewhere (B - 1, B, B + 1, 3B + 1, L - 1, >= L)."""
    xs = inputs(2, 2, 12, 4)
    out = castle_attn(*xs, window=window, scale=scale, impl="torch")
    assert rel(out, recurrent(*xs, window=window, scale=scale)) < 1e-13


def test_window_limits():
    """Invariant 2: W >= L - 1 is CASTLE bitwise; W = 0 or V^U = 0 is plain causal attention."""
    qc, kc, vc, qu, ku, vu = inputs(2, 3, 9, 4)
    full = castle_attn(qc, kc, vc, qu, ku, vu, impl="torch")
    for w in (8, 9, 100):
        assert torch.equal(castle_attn(qc, kc, vc, qu, ku, vu, window=w, impl="torch"), full)
    causal = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    assert rel(castle_attn(qc, kc, vc, qu, ku, vu, window=0, impl="torch"), causal) < 1e-13
    assert rel(castle_attn(qc, kc, vc, qu, ku, torch.zeros_like(vu), impl="torch"), causal) < 1e-13


@pytest.mark.parametrize("impl", ["torch", "blockwise"])
@pytest.mark.parametrize("window", [None, 2])
def test_causality(impl, window):
    """Invariant 3: later inputs change neither earlier outputs nor their gradients; prefixes agree."""
    L, t = 11, 6
    xs = inputs(1, 2, L, 4, grad=True)
    out = castle_attn(*xs, window=window, impl=impl)
    grads = torch.autograd.grad(out[..., :t, :].sum(), xs)
    assert all(g[..., t:, :].abs().max() == 0 for g in grads)
    bumped = [x.detach().clone() for x in xs]
    for x in bumped:
        x[..., t:, :] += torch.randn_like(x[..., t:, :])
    out2 = castle_attn(*bumped, window=window, impl=impl)
    assert rel(out2[..., :t, :], out[..., :t, :]) < 1e-14
    prefix = castle_attn(*[x[..., :t, :] for x in xs], window=window, impl=impl)
    assert rel(prefix, out[..., :t, :]) < 1e-14
    assert torch.allclose(out[..., 0, :], xs[2][..., 0, :])  # the first output is v^C_1


def test_gradcheck_reference():
    """Invariant 6: autograd of the parallel form is a correct gradient oracle."""
    for window in (None, 1):
        xs = inputs(1, 1, 5, 3, grad=True)
        assert torch.autograd.gradcheck(lambda *a: castle_attn(*a, window=window, impl="torch"), xs)


# ----------------------------------------------------------------------------------------------------
# The blockwise PyTorch path


def _fwd_bwd(fn, xs, go):
    """(out, gradients of the inputs); an input given as None (kc without causal keys) gets None."""
    xs = [x if x is None else x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    grads = iter(torch.autograd.grad(out, [x for x in xs if x is not None], go.to(out.dtype)))
    return out, [None if x is None else next(grads) for x in xs]


@pytest.mark.parametrize("L,bs,scale", [(1, 4, None), (13, 4, None), (13, 4, 0.3), (16, 4, None), (23, 8, None)])
@pytest.mark.parametrize("window", [None, 0, 1, 3, 4, 5, 9, 30])
def test_blockwise_matches_reference(L, bs, scale, window):
    """Invariant 5 for the PyTorch block algorithm, forward and all six gradients, fp64."""
    xs = inputs(2, 2, L, 5)
    go = torch.randn(2, 2, L, 5, dtype=torch.float64)
    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=window, scale=scale, impl="torch"), xs, go)
    scale = 5 ** -0.5 if scale is None else scale
    out, g = _fwd_bwd(lambda *a: attn_blockwise(*a, window, scale, bs), xs, go)
    assert rel(out, ref) < 1e-12
    assert max(rel(a, b) for a, b in zip(g, gref)) < 1e-11


def test_blockwise_state_and_bf16():
    """Saved state = U at the start of the last block (D of eqs (21)-(24)); fp32/bf16 in, same dtype out."""
    L, bs = 14, 4
    xs = inputs(1, 2, L, 4)
    blocks = [to_blocks(x, bs) for x in xs]
    out, lse, u = blockwise_forward(*blocks, None, 0.5, bs, keep_last=False)
    t0 = (math.ceil(L / bs) - 1) * bs
    assert rel(u.flatten(2, 3)[:, :, :t0], lookahead_keys(*xs[3:], t0)) < 1e-13
    assert u.flatten(2, 3)[:, :, t0:].abs().max() == 0
    _, _, u_all = blockwise_forward(*blocks, None, 0.5, bs, keep_last=True)
    assert rel(u_all.flatten(2, 3)[:, :, :L], lookahead_keys(*xs[3:], L)) < 1e-13
    xb = [x.to(torch.bfloat16) for x in xs]
    out = castle_attn(*xb, impl="blockwise")
    assert out.dtype == torch.bfloat16
    assert rel(out, castle_attn(*[x.double() for x in xb], impl="torch")) < 1e-2


def test_blockwise_backward_rebuilds_u_to_zero():
    """Invariant 6: the backward undoes every update of U (eq 33), so the state it started from comes
    back as zeros, up to the rounding of the subtractions."""
    L, bs = 23, 4
    xs = inputs(2, 3, L, 5)
    blocks = [to_blocks(x, bs) for x in xs]
    out, lse, u = blockwise_forward(*blocks, None, 0.5, bs, keep_last=False)
    assert u.abs().max() > 0.1
    do = to_blocks(torch.randn(2, 3, L, 5, dtype=torch.float64), bs)
    blockwise_backward(do, *blocks, out, lse, u, None, 0.5, bs)
    assert u.abs().max() < 1e-13


def _permuted_fwd_bwd(fn, xs, go):
    """(outputs and gradients as computed, and as computed on batch- and head-permuted inputs then
    permuted back): nothing flows between batch items or heads."""
    pb, ph = torch.randperm(xs[0].shape[0]), torch.randperm(xs[0].shape[1])
    out, g = _fwd_bwd(fn, xs, go)
    out_p, g_p = _fwd_bwd(fn, [x[pb][:, ph] for x in xs], go[pb][:, ph])
    return [out, *g], [t[pb.argsort()][:, ph.argsort()] for t in (out_p, *g_p)]


@pytest.mark.parametrize("impl", ["torch", "blockwise"])
def test_batch_and_head_permutation(impl):
    xs = inputs(3, 4, 13, 5)
    go = torch.randn(3, 4, 13, 5, dtype=torch.float64)
    plain, permuted = _permuted_fwd_bwd(lambda *a: castle_attn(*a, window=3, impl=impl), xs, go)
    assert max(rel(a, b) for a, b in zip(permuted, plain)) < 1e-14


# ----------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU)

TRITON_CASES = [
    # L, D, window, config, dtype, scale (None: D ** -0.5)
    (1, 32, None, TILE16, torch.float32, None),
    (17, 32, None, TILE16, torch.float32, None),
    (37, 32, None, TILE16, torch.float32, None),
    (37, 32, 1, TILE16, torch.float32, None),
    (37, 32, 5, TILE16, torch.float32, None),
    (37, 32, 5, TILE16, torch.float32, 0.3),
    (37, 32, 5, dataclasses.replace(TILE16, row_guard=True), torch.float32, None),
    (37, 32, 16, TILE16, torch.float32, None),
    (37, 32, 17, TILE16, torch.float32, None),
    (37, 32, 100, TILE16, torch.float32, None),
    (37, 32, 0, TILE16, torch.float32, None),
    (37, 64, None, TILE32_16, torch.float32, None),
    (40, 64, 7, TILE32, torch.float32, None),
    (33, 64, None, TILE32, torch.float32, None),
    (70, 32, 20, TILE32, torch.float32, None),
    (21, 96, None, TILE16, torch.float32, None),
    (21, 96, 5, TILE16, torch.float32, None),
    (37, 24, None, TILE16, torch.float32, None),
    (37, 32, None, TILE16, torch.bfloat16, None),
    (37, 64, 5, TILE32_16, torch.bfloat16, None),
    (37, 64, 5, dataclasses.replace(TILE32_16, row_guard=True), torch.bfloat16, None),
    (17, 96, 40, TILE16, torch.bfloat16, None),
    (48, 32, None, TILE16, torch.bfloat16, None),     # every tile in bounds: loads and adds unmasked
    (64, 64, 20, TILE32, torch.float32, None),
]


def test_triton_cases_take_both_sigma_scalings():
    """Sigma's operand carries s / 2 only where that is exact (_half_scaled in kernels/castle/triton.py); the
    cases below must run both ways."""
    scales = {castle_triton.sigma_prescaled(D ** -0.5 if s is None else s) for _, D, *_, s in TRITON_CASES}
    assert scales == {True, False}
    assert castle_triton.sigma_prescaled(64 ** -0.5) and not castle_triton.sigma_prescaled(128 ** -0.5)


def test_triton_cases_take_both_tile_bounds():
    """Tiles load and add unmasked only where every one lies inside the head (castle_triton.in_bounds); the cases
    below must run both ways, in the forward and in the backward."""
    for m in ("m_fwd", "m_bwd"):
        bounds = {castle_triton.in_bounds(L, getattr(cfg, m), D, padded_head_dim(D))
                  for L, D, _, cfg, *_ in TRITON_CASES}
        assert bounds == {True, False}
    assert castle_triton.in_bounds(2048, 64, 64, 64) and not castle_triton.in_bounds(2000, 64, 64, 64)
    assert not castle_triton.in_bounds(2048, 64, 96, 128)


# the fast subset: one row, ragged blocks, and bf16 with a window and a padded head dimension
FAST_TRITON_CASES = (0, 1, 21)


def _same(a, b):
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _forward_once(monkeypatch):
    """For the rest of the test the Triton path runs its forward kernel once: later calls, which must pass
    equal inputs and a config that differs at most in bwd_variant, get copies of the first call's out, lse
    and U. The forward takes nothing from bwd_variant (fwd_constexprs, forward_buffers) and is bitwise
    deterministic, so each backward variant still starts from what its own forward would give, and the
    variants of one case share one forward (under the interpreter a forward is ~1/3 of a variant's fwd + bwd)."""
    first = []

    def forward(*args):
        args_key = [dataclasses.replace(a, bwd_variant=None) if isinstance(a, TritonConfig) else a for a in args]
        if not first:
            first.extend([args_key, castle_triton.triton_forward(*args)])
        assert len(args_key) == len(first[0]) and all(map(_same, args_key, first[0])), "not the same forward"
        return tuple(t.clone() for t in first[1])  # clones: no backward can change another one's inputs

    monkeypatch.setattr(castle_op, "triton_forward", forward)


@pytest.mark.parametrize("L,D,window,cfg,dtype,scale",
                         [c if i in FAST_TRITON_CASES else slow(*c) for i, c in enumerate(TRITON_CASES)])
def test_triton_matches_reference(L, D, window, cfg, dtype, scale, monkeypatch):
    """Invariants 5 and 6 for the kernels: forward and all six gradients vs fp64 autograd, for every
    backward variant (CASTLE_BWD_VARIANT), all on the same inputs and reference."""
    xs = inputs(2, 3, L, D, dtype)
    go = torch.randn(2, 3, L, D).to(dtype)
    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=window, scale=scale, impl="torch"),
                         [x.double() for x in xs], go)
    scale = D ** -0.5 if scale is None else scale
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    _forward_once(monkeypatch)
    for variant in BWD_VARIANTS:
        vcfg = dataclasses.replace(cfg, bwd_variant=variant)
        out, g = _fwd_bwd(lambda *a: attn_triton(*a, window, scale, vcfg), xs, go)
        assert out.dtype == dtype and all(t.dtype == dtype for t in g), variant
        assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in g), variant
        assert rel(out, ref) < tol, variant
        errs = [rel(a, b) for a, b in zip(g, gref)]
        assert max(errs) < 2 * tol, (variant, errs)


@pytest.mark.parametrize("variant", ONE_VARIANT_FAST)
def test_triton_backward_head_groups(variant):
    """Both launches take heads in groups (fwd_head_group, BWD_HEAD_GROUP): B*H = 10 makes a full group
    and a partial one, and every head's output and gradients must still be its own."""
    B, H, L, D = 2, 5, 33, 32
    cfg = dataclasses.replace(TILE16, bwd_variant=variant)
    for group in (castle_triton.fwd_head_group(cfg, L), castle_triton.BWD_HEAD_GROUP):
        assert B * H > group and B * H % group != 0
    xs = inputs(B, H, L, D, torch.float32)
    go = torch.randn(B, H, L, D)
    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=5, impl="torch"), [x.double() for x in xs], go)
    out, g = _fwd_bwd(lambda *a: attn_triton(*a, 5, D ** -0.5, cfg), xs, go)
    assert rel(out, ref) < 4e-6 and max(rel(a, b) for a, b in zip(g, gref)) < 4e-6


def test_stored_backward_with_one_strip(monkeypatch):
    """Memory-capped "stored" backward: every (head, key block) program recycles a single dS strip."""
    monkeypatch.setattr(castle_triton, "ds_strips", lambda device, work, strip_bytes: 1)
    xs = inputs(2, 2, 37, 32, torch.float32)
    go = torch.randn(2, 2, 37, 32)
    cfg = dataclasses.replace(TILE16, bwd_variant="stored")
    _, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=7, impl="torch"), [x.double() for x in xs], go)
    _, g = _fwd_bwd(lambda *a: attn_triton(*a, 7, 32 ** -0.5, cfg), xs, go)
    assert max(rel(a, b) for a, b in zip(g, gref)) < 4e-6


def test_strip_count_capped_by_free_memory():
    """Four strips per SM unless they would take over a quarter of the free memory; never below one."""
    mb = 2 ** 20
    assert castle_triton.strip_count(work=10_000, wanted=528, strip_bytes=mb, free_bytes=80_000 * mb) == 528
    assert castle_triton.strip_count(work=100, wanted=528, strip_bytes=mb, free_bytes=80_000 * mb) == 100
    assert castle_triton.strip_count(work=10_000, wanted=528, strip_bytes=35 * mb, free_bytes=40_000 * mb) == 285
    assert castle_triton.strip_count(work=10_000, wanted=528, strip_bytes=35 * mb, free_bytes=10 * mb) == 1


def test_strips_read_allocator_statistics_only_when_capped(monkeypatch):
    """The allocator's unused blocks count as free memory, but its statistics (slow to read) are only read
    where the device's own free memory would cap the strips."""
    mb, reads = 2 ** 20, []
    monkeypatch.setattr(castle_triton, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reads.append("reserved") or 8_000 * mb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: reads.append("allocated") or 1_000 * mb)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80_000 * mb, 141_000 * mb))
    assert castle_triton.ds_strips("cuda", 10_000, mb) == 528 and reads == []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1_000 * mb, 141_000 * mb))
    # 1000 MB free on the device and 7000 MB unused in the allocator: a quarter of 8000 MB holds 57 strips of 35 MB
    assert castle_triton.ds_strips("cuda", 10_000, 35 * mb) == 57 and sorted(reads) == ["allocated", "reserved"]


@pytest.mark.parametrize("variant", ONE_VARIANT_FAST)
def test_triton_batch_and_head_permutation(variant):
    """Invariant 14 for the kernels, with B*H = 10 across two backward head groups."""
    xs = inputs(2, 5, 21, 32, torch.float32)
    go = torch.randn(2, 5, 21, 32)
    cfg = dataclasses.replace(TILE16, bwd_variant=variant)
    plain, permuted = _permuted_fwd_bwd(lambda *a: attn_triton(*a, 5, 32 ** -0.5, cfg), xs, go)
    assert torch.equal(permuted[0], plain[0])  # the forward is deterministic
    assert max(rel(a, b) for a, b in zip(permuted, plain)) < 1e-6


@pytest.mark.parametrize("variant", ONE_VARIANT_FAST)
def test_triton_backward_twice(variant):
    """retain_graph: a second backward gives the same gradients (no variant consumes the saved U)."""
    xs = inputs(1, 2, 37, 32, torch.float32, grad=True)
    cfg = dataclasses.replace(TILE32_16, bwd_variant=variant)
    out = attn_triton(*xs, 3, 32 ** -0.5, cfg)
    go = torch.randn_like(out)
    first = torch.autograd.grad(out, xs, go, retain_graph=True)
    second = torch.autograd.grad(out, xs, go)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(first, second))


@pytest.mark.parametrize("variant", BWD_VARIANTS)
def test_triton_saves_u_only_when_read(variant):
    """Activation memory: "stored" rebuilds U_c in its first pass, so autograd keeps only the inputs, the
    output and lse (and an empty U); the variants that start from the saved U keep its fp32 (BH, rows,
    block_d) buffer."""
    xs = inputs(1, 2, 37, 32, torch.float32, grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attn_triton(*xs, None, 32 ** -0.5, dataclasses.replace(TILE16, bwd_variant=variant))
    saved = [t for t in saved if t.numel()]
    u_like = [t for t in saved if t.dim() == 3 and t.shape[-1] == 32]
    assert len(saved) == 8 + (variant != "stored") and len(u_like) == (variant != "stored")


@pytest.mark.parametrize("variant", ONE_VARIANT_FAST)
def test_triton_under_torch_compile(variant):
    """To torch.compile the Triton path is two custom ops (forward, backward): a function around it
    compiles as one graph (fullgraph=True raises on a graph break), with the ops' shapes from their fake
    implementations, and gives eager's output and gradients."""
    xs = inputs(1, 2, 37, 32, torch.float32, grad=True)
    go = torch.randn(1, 2, 37, 32)
    cfg = dataclasses.replace(TILE16, bwd_variant=variant)

    def fn(*a):
        return attn_triton(*[2 * x for x in a], 5, 32 ** -0.5, cfg).sin()

    torch._dynamo.reset()
    out, g = _fwd_bwd(torch.compile(fn, fullgraph=True, backend="aot_eager"), xs, go)
    ref, gref = _fwd_bwd(fn, xs, go)
    assert torch.equal(out, ref)
    assert max(rel(a, b) for a, b in zip(g, gref)) < 1e-6


@pytest.mark.parametrize("variant", ONE_VARIANT_FAST)
@pytest.mark.parametrize("D", [64, slow(128)])
@pytest.mark.parametrize("window", [None, slow(37)])
def test_triton_gpu_default_tiles(D, window, variant):
    """The tiles a GPU runs by default (gpu_config, bf16) on a shape crossing several blocks of each
    (L = 173: ragged tails; W = 37 ends inside blocks): forward and all six gradients vs fp64
    autograd. On CPU this checks the schedule at those tiles (the gpu tests check the bf16 numerics)."""
    L, dtype = 173, torch.bfloat16
    cfg = castle_triton.gpu_config(D, dtype, variant)
    xs = inputs(1, 2, L, D, dtype)
    go = torch.randn(1, 2, L, D).to(dtype)
    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=window, impl="torch"), [x.double() for x in xs], go)
    out, g = _fwd_bwd(lambda *a: attn_triton(*a, window, D ** -0.5, cfg), xs, go)
    assert out.dtype == dtype and all(t.dtype == dtype for t in g)
    # The interpreter computes in fp32: only the bf16 rounding of the results remains (~2e-3).
    tol = 4e-3 if interpreting() else 1e-2
    assert rel(out, ref) < tol
    errs = [rel(a, b) for a, b in zip(g, gref)]
    assert max(errs) < 2 * tol, errs


def test_triton_public_api_and_strides():
    """impl="triton" through castle_attn, on views of one fused projection (shared non-unit strides)."""
    B, H, L, D = 2, 2, 20, 32
    fused = torch.randn(B, L, 6, H, D, requires_grad=True)
    xs = fused.permute(2, 0, 3, 1, 4).unbind(0)
    out = castle_attn(*xs, window=3, impl="triton")
    (g,) = torch.autograd.grad(out.square().sum(), fused)
    ref_in = fused.detach().double().requires_grad_()
    ref = castle_attn(*ref_in.permute(2, 0, 3, 1, 4).unbind(0), window=3, impl="torch")
    (gref,) = torch.autograd.grad(ref.square().sum(), ref_in)
    assert rel(out, ref) < 2e-6 and rel(g, gref) < 4e-6


@pytest.mark.parametrize("layout", ["heads_inner", "fused_projection", "mixed"])
def test_triton_layouts(layout):
    """One set of strides serves the inputs, out, dO and the gradients (same_layout): inputs in (B, L, H, D)
    storage, as a model's heads come, run as they are, and out and every gradient come in that storage (a
    model's merge of the heads is then a view); views of one fused projection, and a mix of the two (RoPE'd
    and plain heads), are laid out first. The results equal those of contiguous inputs bitwise."""
    B, H, L, D = 2, 3, 37, 32
    values = torch.randn(6, B, L, H, D)
    go = torch.randn(B, L, H, D)
    cfg = TILE16

    def run(xs, do):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = attn_triton(*xs, 3, D ** -0.5, cfg)
        return out, torch.autograd.grad(out, xs, do)

    ref, gref = run([v.transpose(1, 2).contiguous() for v in values], go.transpose(1, 2).contiguous())
    heads_inner = [v.transpose(1, 2) for v in values]          # (B, L, H, D) storage
    if layout == "heads_inner":
        out, g = run(heads_inner, go.transpose(1, 2))
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(g, gref))
        assert out.transpose(1, 2).is_contiguous() and all(t.transpose(1, 2).is_contiguous() for t in g)
        return
    fused = values.permute(1, 2, 0, 3, 4).contiguous().requires_grad_()   # (B, L, 6, H, D): one projection
    views = fused.permute(2, 0, 3, 1, 4).unbind(0)
    xs = views if layout == "fused_projection" else [*heads_inner[:2], *views[2:]]   # mixed: RoPE'd q^C, k^C
    out = attn_triton(*xs, 3, D ** -0.5, cfg)
    (g,) = torch.autograd.grad(out, fused, go.transpose(1, 2))
    first = 0 if layout == "fused_projection" else 2            # the views' gradients reach the projection
    assert torch.equal(out, ref) and torch.equal(g.permute(2, 0, 3, 1, 4)[first:], torch.stack(gref[first:]))


@pytest.mark.parametrize("window", [None, 3, 20])
def test_triton_saved_state(window):
    """Invariant 5: the kernel's U buffer holds U^t at t = save_t; lse is the row logsumexp (log2)."""
    L, D = 37, 32
    xs = inputs(1, 2, L, D, torch.float32)
    cfg = TritonConfig(32, 16, 4, 16, 16, 4, 1)
    x64 = [x.double() for x in xs]
    for save_t in (32, L):  # the backward's start, and prefill
        out, lse, u = castle_triton.triton_forward(*xs, window, D ** -0.5, cfg, save_t)
        u = u.view(1, 2, -1, u.shape[-1])
        assert rel(u[:, :, :save_t], lookahead_keys(*x64[3:], save_t, window)) < 2e-6
    scale = D ** -0.5
    idx = torch.arange(L)
    causal = idx[:, None] >= idx[None, :]
    ahead = (idx[:, None] < idx[None, :]) & ((idx[None, :] <= idx[:, None] + window) if window is not None else True)
    qc, kc, vc, qu, ku, vu = x64
    su = (scale * qc @ vu.mT).masked_fill(~causal, 0) @ (torch.sigmoid(scale * qu @ ku.mT) * ahead).mT
    scores = (scale * qc @ kc.mT - F.silu(su)).masked_fill(~causal, float("-inf"))
    lse_ref = torch.logsumexp(scores, -1) / math.log(2)
    assert rel(lse.view(1, 2, -1)[:, :, :L], lse_ref) < 1e-6


# ----------------------------------------------------------------------------------------------------
# The ablations of §5.2: no causal keys (kc=None, Table 5) and no SiLU gate (silu=False, Table 10)

ABLATIONS = [(False, True), (True, False), (False, False)]   # (causal_keys, silu); (True, True) is CASTLE


def ablated(xs, causal_keys):
    """The six inputs with kc dropped (None) without causal keys."""
    return [xs[0], xs[1] if causal_keys else None, *xs[2:]]


def _errs(g, gref):
    """Relative errors of the gradients the reference has (none for an absent kc)."""
    assert [a is None for a in g] == [b is None for b in gref]
    return [rel(a, b) for a, b in zip(g, gref) if b is not None]


def _double(xs):
    return [x if x is None else x.double() for x in xs]


@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
@pytest.mark.parametrize("window", [None, 0, 1, 4, 13])
def test_ablation_parallel_matches_recurrent(causal_keys, silu, window):
    """Invariant 1 for the ablations: the parallel form equals eqs (3)-(8) with s^C dropped or SiLU removed."""
    xs = ablated(inputs(2, 2, 12, 4), causal_keys)
    out = castle_attn(*xs, window=window, silu=silu, impl="torch")
    assert rel(out, recurrent(*xs, window=window, silu=silu)) < 1e-13


def test_ablation_limits():
    """Without lookahead keys (V^U = 0): no SiLU is still plain causal attention, no causal keys the mean of
    the values so far (every logit 0). With them, each flag changes the output."""
    qc, kc, vc, qu, ku, vu = inputs(2, 3, 9, 4)
    zero = torch.zeros_like(vu)
    causal = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    assert rel(castle_attn(qc, kc, vc, qu, ku, zero, silu=False, impl="torch"), causal) < 1e-13
    mean = vc.cumsum(-2) / torch.arange(1, 10, dtype=vc.dtype)[:, None]
    assert rel(castle_attn(qc, None, vc, qu, ku, zero, impl="torch"), mean) < 1e-13
    full = castle_attn(qc, kc, vc, qu, ku, vu, impl="torch")
    for causal_keys, silu in ABLATIONS:
        out = castle_attn(*ablated([qc, kc, vc, qu, ku, vu], causal_keys), silu=silu, impl="torch")
        assert rel(out, full) > 1e-2


@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
def test_ablation_gradcheck_reference(causal_keys, silu):
    """Invariant 6: autograd of the ablated parallel form is a correct gradient oracle."""
    for window in (None, 1):
        xs = inputs(1, 1, 5, 3, grad=True)[: 6 if causal_keys else 5]

        def fn(*a):
            return castle_attn(*(a if causal_keys else (a[0], None, *a[1:])), window=window, silu=silu,
                               impl="torch")

        assert torch.autograd.gradcheck(fn, xs)


@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
@pytest.mark.parametrize("L,bs,window", [(1, 4, None), (13, 4, None), (13, 4, 3), (16, 4, 0), (23, 8, 9)])
def test_ablation_blockwise_matches_reference(causal_keys, silu, L, bs, window):
    """Invariant 5 for the PyTorch block algorithm with the ablations: forward and gradients, fp64."""
    xs = ablated(inputs(2, 2, L, 5), causal_keys)
    go = torch.randn(2, 2, L, 5, dtype=torch.float64)
    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=window, silu=silu, impl="torch"), xs, go)
    out, g = _fwd_bwd(lambda *a: attn_blockwise(*a, window, 5 ** -0.5, bs, silu=silu), xs, go)
    assert rel(out, ref) < 1e-12
    assert max(_errs(g, gref)) < 1e-11


ABLATION_TRITON_CASES = [
    # L, D, window, config, dtype
    (37, 32, 5, TILE16, torch.float32),
    (1, 32, None, TILE16, torch.float32),
    (37, 32, None, TILE16, torch.float32),
    (40, 64, 7, TILE32, torch.float32),           # every tile in bounds
    (21, 96, None, TILE16, torch.float32),        # padded head dim; sigma's scale not a power of two
    (37, 64, 5, TILE32_16, torch.bfloat16),
]


@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
@pytest.mark.parametrize("L,D,window,cfg,dtype",
                         [c if i == 0 else slow(*c) for i, c in enumerate(ABLATION_TRITON_CASES)])
def test_ablation_triton_matches_reference(L, D, window, cfg, dtype, causal_keys, silu, monkeypatch):
    """Invariants 5 and 6 for the kernels with the ablations (constexprs CAUSAL_KEYS, SILU): forward and
    every gradient vs fp64 autograd, for every backward variant on the same inputs and reference; without
    causal keys there is no dKc."""
    xs = ablated(inputs(2, 3, L, D, dtype), causal_keys)
    go = torch.randn(2, 3, L, D).to(dtype)
    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=window, silu=silu, impl="torch"), _double(xs), go)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    _forward_once(monkeypatch)
    for variant in BWD_VARIANTS:
        vcfg = dataclasses.replace(cfg, bwd_variant=variant)
        out, g = _fwd_bwd(lambda *a: attn_triton(*a, window, D ** -0.5, vcfg, silu=silu), xs, go)
        assert out.dtype == dtype and all(t is None or t.dtype == dtype for t in g), variant
        assert rel(out, ref) < tol, variant
        errs = _errs(g, gref)
        assert max(errs) < 2 * tol, (variant, errs)


@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
def test_ablation_through_castle_attn_and_compile(causal_keys, silu):
    """castle_attn(impl="triton") with the flags, eager and under torch.compile (the custom ops take an
    absent kc and the silu flag): the same output and gradients."""
    xs = ablated(inputs(1, 2, 21, 32, torch.float32), causal_keys)
    go = torch.randn(1, 2, 21, 32)

    def fn(*a):
        return castle_attn(*a, window=3, silu=silu, impl="triton")

    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=3, silu=silu, impl="torch"), _double(xs), go)
    out, g = _fwd_bwd(fn, xs, go)
    assert rel(out, ref) < 2e-6 and max(_errs(g, gref)) < 4e-6
    torch._dynamo.reset()
    out_c, g_c = _fwd_bwd(torch.compile(fn, fullgraph=True, backend="aot_eager"), xs, go)
    assert torch.equal(out_c, out) and max(_errs(g_c, g)) < 1e-6


# ----------------------------------------------------------------------------------------------------
# GPU: the kernels at real shapes in bf16 (skipped without CUDA)


def _naive_bf16(qc, kc, vc, qu, ku, vu, window, silu=True):
    """The parallel form with bf16 matmuls and fp32 elementwise math, as autocast would run it: the
    accuracy a straightforward bf16 implementation gets on the same inputs (kc None: no causal keys)."""
    L, D = qc.shape[-2:]
    scale = D ** -0.5
    idx = torch.arange(L, device=qc.device)
    causal = idx[:, None] >= idx[None, :]
    ahead = (idx[:, None] < idx[None, :]) & ((idx[None, :] <= idx[:, None] + window) if window is not None else True)
    a_u = torch.sigmoid(scale * (qu @ ku.mT).float()).masked_fill(~ahead, 0.0)
    r = (scale * (qc @ vu.mT).float()).masked_fill(~causal, 0.0)
    s_u = (r.bfloat16() @ a_u.bfloat16().mT).float()
    scores = (0.0 if kc is None else scale * (qc @ kc.mT).float()) - (F.silu(s_u) if silu else s_u)
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1).bfloat16() @ vc


def _gpu_case(B, H, L, D, window, dtype=torch.bfloat16, cfg=None, causal_keys=True, silu=True):
    """Relative errors vs fp64 autograd of the kernels' output and six gradients (five without causal keys),
    and (bf16) those of the naive bf16 computation on the same inputs."""
    torch.manual_seed(0)
    xs = ablated(inputs(B, H, L, D, dtype, device="cuda"), causal_keys)
    go = torch.randn(B, H, L, D, device="cuda").to(dtype)
    ref, gref = _fwd_bwd(lambda *a: castle_attn(*a, window=window, silu=silu, impl="torch"), _double(xs), go)
    out, g = _fwd_bwd(lambda *a: attn_triton(*a, window, D ** -0.5, cfg, silu=silu), xs, go)
    errs = [rel(out, ref)] + _errs(g, gref)
    naive = [0.0] * len(errs)
    if dtype == torch.bfloat16:
        nout, ng = _fwd_bwd(lambda *a: _naive_bf16(*a, window, silu), xs, go)
        naive = [rel(nout, ref)] + _errs(ng, gref)
    print(f"\nB={B} H={H} L={L} D={D} W={window} {dtype} causal_keys={causal_keys} silu={silu}: "
          f"out {errs[0]:.2e}  grads "
          + " ".join(f"{e:.2e}" for e in errs[1:]) + "  | naive bf16: " + " ".join(f"{e:.2e}" for e in naive))
    return errs, naive


def _assert_bf16(errs, naive):
    """Within 1e-2, or (ill-conditioned long inputs) within 1.25x of what naive bf16 math achieves."""
    assert all(e < max(1e-2, 1.25 * n) for e, n in zip(errs, naive)), (errs, naive)


@pytest.mark.gpu
@pytest.mark.parametrize("L,D,window", [(2048, 64, None), (2048, 128, None), (1537, 64, 512),
                                        (2048, 128, 512), (1000, 96, None), (999, 64, 100)])
def test_gpu_triton_bf16(L, D, window):
    _assert_bf16(*_gpu_case(1, 4, L, D, window))


@pytest.mark.gpu
@pytest.mark.parametrize("L,D,window", [(300, 64, None), (257, 128, 33), (77, 32, 5)])
def test_gpu_triton_fp32(L, D, window):
    errs, _ = _gpu_case(2, 3, L, D, window, torch.float32)
    assert max(errs) < 1e-5, errs


@pytest.mark.gpu
def test_gpu_stored_backward_few_strips(monkeypatch):
    """Strips capped below the programs that run at once (as when memory is short): the programs that wait
    for a strip must neither deadlock nor read another program's dS."""
    monkeypatch.setattr(castle_triton, "ds_strips", lambda device, work, strip_bytes: 3)
    cfg = dataclasses.replace(castle_triton.gpu_config(64, torch.bfloat16), bwd_variant="stored")
    _assert_bf16(*_gpu_case(2, 8, 1031, 64, None, cfg=cfg))


@pytest.mark.gpu
def test_gpu_small_and_ragged_bf16():
    for L, D, window in [(1, 64, None), (17, 64, 1), (65, 128, None), (129, 64, 64), (200, 128, 0)]:
        _assert_bf16(*_gpu_case(2, 2, L, D, window))


@pytest.mark.gpu
def test_gpu_forward_deterministic_and_finite():
    """Invariants 4 and 13: the synchronised forward is bitwise repeatable, and finite at L = 2048."""
    xs = inputs(4, 16, 2048, 64, torch.bfloat16, device="cuda")
    first = castle_attn(*xs)
    assert torch.isfinite(first).all()
    for _ in range(10):
        assert torch.equal(castle_attn(*xs), first)


@pytest.mark.gpu
@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
@pytest.mark.parametrize("L,D,window", [(2048, 64, None), (1537, 128, 512), (999, 64, 100), (17, 64, 1)])
def test_gpu_ablation_triton_bf16(L, D, window, causal_keys, silu):
    """The ablations' kernels (the default "stored" backward and GPU tiles) at real shapes in bf16."""
    _assert_bf16(*_gpu_case(1, 4, L, D, window, causal_keys=causal_keys, silu=silu))
