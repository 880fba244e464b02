"""The CASTLE UQ-KV cache (kernels/castle/decode.py): prefill + one-position decode steps against the parallel
form of CASTLE (arXiv:2509.07301, Theorem 1) and the lookahead keys U^t of eq (3), for the PyTorch-op step and
the fused Triton step, dynamic and static caches, CASTLE-SWL and the ablations of §5.2; gpu-marked tests at
real sizes in bf16. The kernels' training paths and the shared oracles are in test_castle_kernels.py."""
import pytest
import torch
from test_castle_kernels import ABLATIONS, _double, ablated, inputs, lookahead_keys, rel, slow

from kernels.castle import CastleCache, castle_attn, castle_decode, castle_prefill
from kernels.castle import decode as castle_decode_module

# every output and gradient buffer starts as NaN (conftest.nan_filled_empty): unwritten entries fail
pytestmark = pytest.mark.usefixtures("nan_filled_empty")



def _decode_all(xs, prompt, window, max_len=None, scale=None, impl="auto", silu=None):
    """Prefill `prompt` positions, then decode the rest one at a time; checks the cache at every step.
    xs[1] None: no causal keys (the cache then holds none)."""
    out, cache = castle_prefill(*[x if x is None else x[..., :prompt, :] for x in xs], window=window, scale=scale,
                                silu=silu, max_len=max_len)
    outs = [out]
    u_dtype = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    for t in range(prompt, xs[0].shape[-2]):
        o, nxt = castle_decode(cache, *[x if x is None else x[..., t:t + 1, :] for x in xs], impl=impl)
        assert nxt is cache                                                # updated in place
        outs.append(o)
        assert isinstance(cache, CastleCache) and cache.length == t + 1 <= cache.capacity
        assert cache.u.shape == cache.vc.shape and cache.u.dtype == u_dtype
        assert cache.kc is None if xs[1] is None else cache.kc.shape == cache.vc.shape
        assert cache.u[..., -1, :].abs().max() == 0                       # u^t_t = 0
        assert cache.qu.shape[-2] == (t + 1 if window is None else min(t + 1, window))
        assert torch.equal(cache.qu[..., -1:, :], xs[3][..., t:t + 1, :]) or window == 0
        if window is not None:                                             # SWL keeps O(W) rows of Q^U
            assert cache.qu_buf.shape[-2] <= max(16, 4 * window)
    return torch.cat(outs, dim=-2), cache


@pytest.mark.parametrize("window", [None, 0, 1, 3, 20])
@pytest.mark.parametrize("prompt", [0, 1, 3, 5, 17])
def test_prefill_decode_matches_parallel(window, prompt):
    """Invariants 7 and 8: every decoded position equals the parallel output; U equals eq (3) at t.
    Without max_len the buffers start at the prompt length and double (16, 32, 64) on the way to 40."""
    L = 40
    xs = inputs(2, 2, L, 4)
    got, cache = _decode_all(xs, prompt, window)
    assert rel(got, castle_attn(*xs, window=window, impl="torch")) < 1e-13
    assert rel(cache.u, lookahead_keys(*xs[3:], L, window)) < 1e-13


@pytest.mark.parametrize("window", [None, 2, 7])
@pytest.mark.parametrize("max_len", [5, 9, 23, 100])
def test_decode_capacity_growth(window, max_len):
    """max_len below, at the middle of and above the final length: buffers grow by doubling only when a
    step finds them full, the data survive the copy, and the outputs stay exact."""
    L, prompt = 23, 5
    xs = inputs(1, 2, L, 4)
    _, cache = castle_prefill(*[x[..., :prompt, :] for x in xs], window=window, max_len=max_len)
    assert cache.capacity == max_len
    for t in range(prompt, L):
        before = cache.capacity
        castle_decode(cache, *[x[..., t:t + 1, :] for x in xs])
        assert cache.capacity == (before if t < before else max(2 * before, 16))
    assert cache.capacity == {5: 32, 9: 36, 23: 23, 100: 100}[max_len]
    got, cache = _decode_all(xs, prompt, window, max_len)
    assert rel(got[..., prompt:, :], castle_attn(*xs, window=window, impl="torch")[..., prompt:, :]) < 1e-13
    assert rel(cache.u, lookahead_keys(*xs[3:], L, window)) < 1e-13


@pytest.mark.parametrize("window", [None, 0, 3])
def test_decode_in_place_without_realloc(window):
    """With enough capacity a step allocates no cache buffer: every buffer keeps its storage (SWL's
    Q^U buffer slides within its 2W rows), and the rows of earlier positions are left as they were."""
    L, prompt = 30, 6
    xs = inputs(1, 2, L, 4, torch.float32)
    _, cache = castle_prefill(*[x[..., :prompt, :] for x in xs], window=window, max_len=L)
    bufs = ("u_buf", "qu_buf", "kc_buf", "vc_buf")
    ptrs = {name: getattr(cache, name).data_ptr() for name in bufs}
    for t in range(prompt, L):
        kc_before = cache.kc.clone()
        castle_decode(cache, *[x[..., t:t + 1, :] for x in xs])
        assert {name: getattr(cache, name).data_ptr() for name in bufs} == ptrs
        assert torch.equal(cache.kc[..., :t, :], kc_before)
    assert cache.capacity == L
    if window:
        assert cache.qu_buf.shape[-2] == 2 * window


def test_decode_swl_freezes_old_rows():
    """Invariant 7 (SWL): a decode step leaves U rows older than t - W untouched."""
    W = 3
    xs = inputs(1, 2, 10, 4)
    _, cache = castle_prefill(*[x[..., :8, :] for x in xs], window=W)
    before = cache.u.clone()
    castle_decode(cache, *[x[..., 8:9, :] for x in xs])
    assert torch.equal(cache.u[..., : 8 - W, :], before[..., : 8 - W, :])
    assert not torch.equal(cache.u[..., 8 - W: 8, :], before[..., 8 - W:, :])


@pytest.mark.parametrize("window", [None, 70])
def test_prefill_several_blocks(window):
    """A prompt spanning several 64-row blocks of the blockwise prefill, then decode steps, at a
    non-default scale (kept in the cache for the decode steps)."""
    xs = inputs(1, 2, 140, 4)
    got, cache = _decode_all(xs, 133, window, scale=0.3)
    assert rel(got, castle_attn(*xs, window=window, scale=0.3, impl="torch")) < 1e-13
    assert rel(cache.u, lookahead_keys(*xs[3:], 140, window, scale=0.3)) < 1e-13


def test_prefill_into_a_given_cache():
    """castle_prefill(cache=...) fills the empty cache a model layer made (its window, scale, capacity) as a
    cache of its own would be filled; it refuses a second window or scale, and a static cache."""
    xs = inputs(2, 3, 12, 8)
    out, own = castle_prefill(*[x[..., :9, :] for x in xs], window=4, scale=0.3, max_len=12)
    given = CastleCache(2, 3, 8, max_len=12, dtype=torch.float64, device="cpu", window=4, scale=0.3)
    out2, cache = castle_prefill(*[x[..., :9, :] for x in xs], cache=given)
    assert cache is given and torch.equal(out2, out) and cache.capacity == own.capacity == 12
    for name in ("u", "qu", "kc", "vc"):
        assert torch.equal(getattr(cache, name), getattr(own, name)), name
    for t in range(9, 12):
        one = [x[..., t:t + 1, :] for x in xs]
        assert torch.equal(castle_decode(cache, *one)[0], castle_decode(own, *one)[0])
    with pytest.raises(ValueError, match="no window, scale, silu or max_len"):
        castle_prefill(*xs, window=4, cache=CastleCache(2, 3, 8, max_len=12, dtype=torch.float64, device="cpu"))
    cache.to_static(torch.tensor([12]))
    with pytest.raises(ValueError, match="static steps"):
        castle_prefill(*[x[..., :2, :] for x in xs], cache=cache)


@pytest.mark.parametrize("causal_keys, silu", [(True, True)] + ABLATIONS)
@pytest.mark.parametrize("window", [None, 0, 1, 3, 7])
@pytest.mark.parametrize("cuts, block", [((5,), 3), ((1, 2, 20), 2), ((9, 13, 14, 33), 16)])
def test_prefill_continues_a_cache_in_chunks(monkeypatch, cuts, block, window, causal_keys, silu):
    """A prompt fed in chunks: the first fills the cache in one pass, each later one is scored against the cache
    and itself in blocks of `block` positions (a chunk spans several, or one, or a part of one). Every output
    equals the parallel form over the whole sequence, the cache then holds U^t of eq (3) and the Q^U rows the next
    token reads, and decoding continues as after a one-pass prefill."""
    monkeypatch.setattr(castle_decode_module, "_EXTEND_BLOCK", (block, block))
    L, prompt = 40, 36
    xs = ablated(inputs(2, 3, L, 8), causal_keys)
    bounds = (0, *cuts, prompt)
    cache = CastleCache(2, 3, 8, max_len=L, dtype=torch.float64, device="cpu", window=window,
                        causal_keys=causal_keys, silu=silu)
    outs = [castle_prefill(*[x if x is None else x[..., a:b, :] for x in xs], cache=cache)[0]
            for a, b in zip(bounds, bounds[1:])]
    assert cache.length == prompt
    assert rel(cache.u, lookahead_keys(*xs[3:], prompt, window)) < 1e-13
    _, whole = castle_prefill(*[x if x is None else x[..., :prompt, :] for x in xs], window=window, silu=silu)
    assert torch.equal(cache.qu, whole.qu)
    for t in range(prompt, L):
        outs.append(castle_decode(cache, *[x if x is None else x[..., t:t + 1, :] for x in xs])[0])
    assert rel(torch.cat(outs, dim=-2), castle_attn(*xs, window=window, silu=silu, impl="torch")) < 1e-13


def test_prefill_block_follows_the_cache_size(monkeypatch):
    """_extend's blocks: _EXTEND_LOGITS logits over the rows the largest shard will hold once the prompt is in
    (the same on every rank), within _EXTEND_BLOCK; the last block takes the rest."""
    blocks = []
    monkeypatch.setattr(castle_decode_module, "_extend_block", lambda cache, qc, *_: blocks.append(qc.shape[-2]) or qc)
    xs = inputs(1, 2, 300, 4, device="meta")
    low, high = castle_decode_module._EXTEND_BLOCK
    for cached, world, expected in ((64, 1, high), (2 ** 24, 1, low), (2 ** 20 - 300, 1, 32), (2 ** 20 - 300, 2, 64)):
        cache = CastleCache(1, 2, 4, max_len=1, dtype=torch.float64, device="meta")
        cache.world, cache.length = world, cached
        blocks.clear()
        castle_decode_module._extend(cache, *xs)
        assert blocks == [expected] * (300 // expected) + [300 % expected] * (300 % expected > 0), (cached, world)


@pytest.mark.parametrize("window", [None, 0, 3])
def test_extend_in_chunks(window):
    """A cache filled chunk by chunk with extend (as benchmarks fill theirs) holds what one prefill leaves:
    U, K^C, V^C and the Q^U rows the next token reads; decoding then continues identically."""
    L, P = 20, 14
    xs = inputs(1, 2, L, 4)
    _, whole = castle_prefill(*[x[..., :P, :] for x in xs], window=window, max_len=L)
    chunked = CastleCache(1, 2, 4, max_len=L, dtype=torch.float64, device="cpu", window=window)
    for a, b in ((0, 5), (5, 6), (6, 14)):
        chunked.extend(whole.u[..., a:b, :], xs[3][..., a:b, :], xs[1][..., a:b, :], xs[2][..., a:b, :])
    for name in ("u", "qu", "kc", "vc"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    for t in range(P, L):
        one = [x[..., t:t + 1, :] for x in xs]
        assert torch.equal(castle_decode(chunked, *one)[0], castle_decode(whole, *one)[0])


# The fused kernel runs a program per (batch row x head, split), and under the interpreter a step costs three to four
# times as much with B x H = 6 as with 2. So (B, H) = (2, 3) only where the batch and head strides are checked; the
# cases about windows, prompts, capacities and the ablations' constexprs take one batch row of two heads. At L = 45
# both make the same 16-row tiles and 3 splits (_decode_tiles: min(row tiles, cdiv(16, B x H)) splits).
TWO_HEADS = (1, 2)


@pytest.mark.parametrize("window,prompt,max_len,B,H", [slow(None, 0, None, *TWO_HEADS), slow(None, 21, 24, *TWO_HEADS),
                                                        slow(0, 3, None, *TWO_HEADS), (3, 5, 6, 2, 3),
                                                        slow(20, 9, None, *TWO_HEADS)])
def test_decode_triton_matches_parallel(window, prompt, max_len, B, H):
    """The fused decode kernel (16-row tiles and several splits under the interpreter): every output
    equals the parallel form, and U, the new position's rows and Q^U (written by the kernel, or by the
    host once the buffer must slide or grow) equal eq (3) and the inputs at every step."""
    L = 45
    xs = inputs(B, H, L, 8, torch.float32)
    got, cache = _decode_all(xs, prompt, window, max_len, impl="triton")
    ref = castle_attn(*[x.double() for x in xs], window=window, impl="torch")
    assert rel(got[..., prompt:, :], ref[..., prompt:, :]) < 1e-6
    assert rel(cache.u, lookahead_keys(*[x.double() for x in xs[3:]], L, window)) < 1e-6
    assert torch.equal(cache.kc, xs[1]) and torch.equal(cache.vc, xs[2])


@pytest.mark.parametrize("window,capacity", [(None, 36), (None, 200), (0, 200), (3, 200), slow(40, 36)])
@torch.no_grad()
def test_decode_triton_static_cache(window, capacity):
    """The fused kernel on a static cache (CastleCache.to_static: the position read on the device, the splits
    sharing the positions so far, Q^U a ring written after the step) equals dynamic decoding at every step, and
    leaves U, K^C, V^C as the dynamic cache and the Q^U ring as the torch static step do; also with W = 0 (no
    Q^U) and W above the capacity. 16-row tiles and several splits under the interpreter: a capacity of 200 has
    7 splits of 32 rows, of which the 36 positions decoded fill 3 splits of 16."""
    B, H, L, D, P = 1, 2, 36, 8, 5
    xs = inputs(B, H, L, D, torch.float32)
    dynamic, static, static_torch = (castle_prefill(*[x[..., :P, :] for x in xs], window=window, max_len=n)[1]
                                     for n in (L, capacity, capacity))
    position = torch.tensor([P])
    static.to_static(position)
    static_torch.to_static(position)
    for t in range(P, L):
        one = [x[..., t:t + 1, :] for x in xs]
        want = castle_decode(dynamic, *one, impl="torch")[0]
        assert rel(castle_decode(static, *one, impl="triton")[0], want) < 1e-5, t
        castle_decode(static_torch, *one, impl="torch")
        position += 1
    assert static.length == P and dynamic.length == L and static.capacity == capacity  # the host state is kept
    for name in ("u", "kc", "vc"):
        assert rel(getattr(static, name)[..., :L, :], getattr(dynamic, name)) < 1e-5, name
    assert torch.equal(static.qu_buf, static_torch.qu_buf)


@pytest.mark.slow
def test_decode_triton_bf16_and_errors():
    """bf16 through the kernel, with the inputs in two memory layouts as the model passes them ((B, H, L, D),
    and (B, L, H, D) as RoPE leaves q and k): outputs in bf16 within rounding of fp64; K^C, V^C stored
    exactly. fp64 (the kernel computes in fp32) and a non-contiguous cache are refused with the fix. 20 steps: across
    a row tile and into a second split, the window sliding."""
    xs = inputs(2, 3, 24, 8, torch.bfloat16)
    xs[0], xs[1], xs[3] = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (xs[0], xs[1], xs[3]))
    got, cache = _decode_all(xs, 4, 7, impl="triton")
    assert got.dtype == torch.bfloat16 and torch.equal(cache.kc, xs[1])
    assert rel(got, castle_attn(*[x.double() for x in xs], window=7, impl="torch")) < 1e-2
    xs64 = inputs(1, 2, 3, 8)
    _, cache = castle_prefill(*[x[..., :2, :] for x in xs64])
    with pytest.raises(ValueError, match="fp64.*impl='torch'"):
        castle_decode(cache, *[x[..., 2:, :] for x in xs64], impl="triton")
    xs32 = inputs(1, 2, 3, 8, torch.float32)
    _, cache = castle_prefill(*[x[..., :2, :] for x in xs32], max_len=3)    # no growth: the buffer stays
    cache.kc_buf = cache.kc_buf.mT.contiguous().mT                       # same values, column-major
    with pytest.raises(ValueError, match="contiguous.*impl='torch'"):
        castle_decode(cache, *[x[..., 2:, :] for x in xs32], impl="triton")
    with pytest.raises(ValueError, match="impl='cuda' is unknown"):
        castle_decode(cache, *[x[..., 2:, :] for x in xs32], impl="cuda")
    for impl in ("torch", "triton"):     # another layer's or batch's cache: refused before any memory is read
        with pytest.raises(ValueError, match=r"\(1, 2, 1, 4\).*holds \(B, H, D\) = \(1, 2, 8\)"):
            castle_decode(cache, *[x[..., 2:, :4] for x in xs32], impl=impl)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_decode_low_precision(dtype, tol, window):
    """bf16 / fp32 in, same dtype out; the cache keeps U in fp32 (K^C, V^C, Q^U in the input dtype)."""
    xs = inputs(1, 2, 40, 8, dtype)
    got, cache = _decode_all(xs, 4, window)
    assert got.dtype == dtype and cache.u.dtype == torch.float32 and cache.kc.dtype == dtype
    assert rel(got, castle_attn(*[x.double() for x in xs], window=window, impl="torch")) < tol


# ----------------------------------------------------------------------------------------------------
# The ablations' caches: no causal keys, no SiLU gate


@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
@pytest.mark.parametrize("L,window,prompt", [(30, None, 0), (30, None, 5), (30, 3, 1), (30, 0, 3), (70, 20, 66)])
def test_ablation_prefill_decode_matches_parallel(causal_keys, silu, L, window, prompt):
    """Invariants 7 and 8 with the ablations: every decoded position equals the parallel output (a prompt
    of 66 crosses the blockwise prefill's 64-row blocks); U equals eq (3); no K^C is cached without causal
    keys."""
    xs = ablated(inputs(2, 2, L, 4), causal_keys)
    got, cache = _decode_all(xs, prompt, window, silu=silu)
    assert rel(got, castle_attn(*xs, window=window, silu=silu, impl="torch")) < 1e-13
    assert rel(cache.u, lookahead_keys(*xs[3:], L, window)) < 1e-13
    assert cache.causal_keys == causal_keys and cache.silu == silu and (cache.kc_buf is None) != causal_keys


@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
@pytest.mark.parametrize("window,prompt,max_len", [(3, 5, 6), slow(None, 21, 24)])
def test_ablation_decode_triton_matches_parallel(causal_keys, silu, window, prompt, max_len):
    """The fused decode kernel with the ablations (constexprs CAUSAL_KEYS, SILU) equals the parallel form."""
    L = 45
    xs = ablated(inputs(*TWO_HEADS, L, 8, torch.float32), causal_keys)
    got, cache = _decode_all(xs, prompt, window, max_len, impl="triton", silu=silu)
    ref = castle_attn(*_double(xs), window=window, silu=silu, impl="torch")
    assert rel(got[..., prompt:, :], ref[..., prompt:, :]) < 1e-6
    assert rel(cache.u, lookahead_keys(*_double(xs[3:]), L, window)) < 1e-6
    assert torch.equal(cache.vc, xs[2]) and (cache.kc is None) != causal_keys


def test_ablation_cache_refuses_the_other_variant():
    """A cache knows its variant: kc given to a cache without causal keys (or missing for one with them) is
    refused, as is a silu flag for a given cache (it has its own)."""
    xs = inputs(1, 2, 4, 8)
    _, cache = castle_prefill(*ablated([x[..., :2, :] for x in xs], False))
    with pytest.raises(ValueError, match="kc is a tensor.*causal_keys=False"):
        castle_decode(cache, *[x[..., 2:3, :] for x in xs])
    _, cache = castle_prefill(*[x[..., :2, :] for x in xs])
    with pytest.raises(ValueError, match="kc is None.*causal_keys=True"):
        castle_decode(cache, *ablated([x[..., 2:3, :] for x in xs], False))
    given = CastleCache(1, 2, 8, max_len=4, dtype=torch.float64, device="cpu", causal_keys=False)
    with pytest.raises(ValueError, match="kc is a tensor"):
        castle_prefill(*xs, cache=given)
    with pytest.raises(ValueError, match="no window, scale, silu or max_len"):
        castle_prefill(*ablated(xs, False), silu=False, cache=given)


# ----------------------------------------------------------------------------------------------------
# GPU: the fused decode step at real sizes in bf16 (skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 700])
def test_gpu_decode_kernel_matches_torch_ops(window):
    """The fused decode step (64-row tiles, many splits) against the PyTorch-op step on the same caches
    (bf16, 5000 cached positions, 9 heads): outputs and U agree to the torch path's bf16 bias rounding."""
    xs = inputs(2, 9, 5010, 64, torch.bfloat16, device="cuda")
    caches = [castle_prefill(*[x[..., :5000, :] for x in xs], window=window)[1] for _ in range(2)]
    for t in range(5000, 5010):
        one = [x[..., t:t + 1, :] for x in xs]
        o_kernel, _ = castle_decode(caches[0], *one, impl="triton")
        o_torch, _ = castle_decode(caches[1], *one, impl="torch")
        assert rel(o_kernel, o_torch) < 1e-2
    assert rel(caches[0].u, caches[1].u) < 1e-3
    assert torch.equal(caches[0].kc, caches[1].kc) and torch.equal(caches[0].qu, caches[1].qu)


@pytest.mark.gpu
@pytest.mark.parametrize("causal_keys,silu", [(True, True), *ABLATIONS])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_prefill_decode(window, causal_keys, silu):
    """The Triton prefill (which hands its U on to the cache) and the fused decode steps, for CASTLE and
    the ablations."""
    xs = ablated(inputs(1, 2, 300, 64, torch.bfloat16, device="cuda"), causal_keys)
    out, cache = castle_prefill(*[x if x is None else x[..., :290, :] for x in xs], window=window, silu=silu)
    ref64 = _double(xs)
    assert rel(cache.u, lookahead_keys(*[x.cpu() for x in ref64[3:]], 290, window).cuda()) < 1e-2
    outs = [out]
    for t in range(290, 300):
        o, cache = castle_decode(cache, *[x if x is None else x[..., t:t + 1, :] for x in xs])
        outs.append(o)
    assert rel(torch.cat(outs, -2), castle_attn(*ref64, window=window, silu=silu, impl="torch")) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 700])
@torch.no_grad()
def test_gpu_static_decode_kernel_matches_dynamic(window):
    """The fused step on a static cache (position on the device, capacity 3100 of which 3000-3009 are decoded,
    GPU tiles and splits) against the dynamic fused step and the fp64 parallel form, bf16."""
    xs = inputs(2, 9, 3010, 64, torch.bfloat16, device="cuda")
    ref = castle_attn(*_double(xs), window=window, impl="torch")[..., 3000:, :]
    dynamic, static = (castle_prefill(*[x[..., :3000, :] for x in xs], window=window, max_len=3100)[1]
                       for _ in range(2))
    position = torch.tensor([3000], device="cuda")
    static.to_static(position)
    got, want = [], []
    for t in range(3000, 3010):
        one = [x[..., t:t + 1, :] for x in xs]
        got.append(castle_decode(static, *one, impl="triton")[0])
        want.append(castle_decode(dynamic, *one, impl="triton")[0])
        position += 1
    got, want = torch.cat(got, -2), torch.cat(want, -2)
    assert rel(got, want) < 4e-3 and rel(got, ref) < 1e-2    # other splits: other fp32 sums, bf16 ties
    assert rel(static.u[..., :3010, :], dynamic.u) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("causal_keys,silu", ABLATIONS)
def test_gpu_ablation_decode_kernel_matches_torch_ops(causal_keys, silu):
    """The fused decode step of the ablations and the PyTorch-op step on the same caches, both against the
    fp64 parallel form (bf16, 3000 cached positions, SWL W = 700). Without SiLU the logits s^C - s^U are
    unbounded and the bf16 rounding of the cached U moves either step by a few percent, so the kernel is
    held to the PyTorch ops' own distance from fp64."""
    xs = ablated(inputs(2, 9, 3010, 64, torch.bfloat16, device="cuda"), causal_keys)
    ref = castle_attn(*_double(xs), window=700, silu=silu, impl="torch")[..., 3000:, :]
    caches = [castle_prefill(*[x if x is None else x[..., :3000, :] for x in xs], window=700, silu=silu)[1]
              for _ in range(2)]
    kernel, torch_ops = [], []
    for t in range(3000, 3010):
        one = [x if x is None else x[..., t:t + 1, :] for x in xs]
        kernel.append(castle_decode(caches[0], *one, impl="triton")[0])
        torch_ops.append(castle_decode(caches[1], *one, impl="torch")[0])
    err_kernel, err_torch = rel(torch.cat(kernel, -2), ref), rel(torch.cat(torch_ops, -2), ref)
    assert err_kernel < max(1e-2, 1.25 * err_torch), (err_kernel, err_torch)
    assert rel(caches[0].u, caches[1].u) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("causal_keys,silu", [(True, True), *ABLATIONS])
@pytest.mark.parametrize("window", [None, 700])
@torch.no_grad()
def test_gpu_prefill_in_chunks(window, causal_keys, silu):
    """A 3000-token prompt in chunks of 1000, bf16: the chunks after the first are scored against the cache in
    blocks (their cached part through the split-KV kernel with a bias per query and row), against the fp64
    parallel form; the lookahead keys are as close to eq (3) in fp64 as a one-pass prefill's (whose Triton
    kernel rounds its operands to bf16 where the blocks take fp32), the Q^U rows the same."""
    xs = ablated(inputs(2, 9, 3000, 64, torch.bfloat16, device="cuda"), causal_keys)
    ref = castle_attn(*_double(xs), window=window, silu=silu, impl="torch")
    cache = CastleCache(2, 9, 64, max_len=3000, dtype=torch.bfloat16, device="cuda", window=window,
                        causal_keys=causal_keys, silu=silu)
    outs = [castle_prefill(*[x if x is None else x[..., a:a + 1000, :] for x in xs], cache=cache)[0]
            for a in range(0, 3000, 1000)]
    assert rel(torch.cat(outs, -2), ref) < 1e-2
    _, whole = castle_prefill(*xs, window=window, silu=silu)
    u64 = lookahead_keys(*[x.cpu() for x in _double(xs)[3:]], 3000, window).cuda()
    err_chunked, err_whole = rel(cache.u, u64), rel(whole.u, u64)
    assert err_chunked <= max(err_whole, 1e-4) and torch.equal(cache.qu, whole.qu), (err_chunked, err_whole)
