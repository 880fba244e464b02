"""CASTLE and CASTLE-SWL attention: causal attention with lookahead keys (Song et al., 2025).

The math is in ../shared/spec/castle.md; section numbers below refer to it. Per head, with
s = scale = d ** -0.5 (eqs 11/12, spec §1.5):

    A_U   = sigmoid(s * Qu Ku^T)  masked to owner j < contributor i (SWL: i <= j + W)
    S^U   = (s * Qc Vu^T, causal) @ A_U^T                                   (strictly lower triangular)
    out   = softmax(s * Qc Kc^T - SiLU(S^U), causal) @ Vc

Public API (tensors are (B, H, L, D); fp32/bf16 in, same dtype out, fp32 math inside):

    castle_attn(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, impl="auto")
    castle_prefill(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, max_len=None) -> (out, CastleCache)
    castle_decode(cache, qc, kc, vc, qu, ku, vu, *, impl="auto") -> (out, CastleCache)   one position, in place

impl:
    "torch"     the parallel form above, L x L matrices and an L x L x L product (O(L^3)); the
                reference, differentiable by autograd in any dtype (fp64 in the tests).
    "blockwise" the O(L^2 d) block algorithm of spec §3 in plain PyTorch: the paper's anti-diagonal
                sweep, vectorised over each anti-diagonal, with a hand-written backward; nothing
                larger than an L x block strip is ever held. For CPU at moderate lengths.
    "triton"    the same block algorithm as GPU kernels (below); runs on CPU under TRITON_INTERPRET=1.
    "auto"      "triton" on CUDA, "torch" on CPU (and for fp64).

How the Triton kernels schedule the block algorithm (equivalent to the paper's anti-diagonal sweep):
  * Forward, one program per (query row block a, batch*head), m rows; key blocks have n rows (n | m).
    It walks its own key blocks left to right, then the earlier ones c = ..., 0 right to left, keeping
    the online-softmax state in registers as FlashAttention does. Besides the inputs a tile (a, c) needs
    U_c, the lookahead keys of block c as they stand at the start of row block a (the spec's
    D^{(a-c)}, transposed). All of U lives in one fp32 (L x d) buffer: program a reads U_c written by
    program a-1, adds the contributors of its own rows and hands U_c on to program a+1. So each sigma
    tile is computed once and used twice (spec §3.7), and R_a once per row block. Program a waits on
    program a-1 through a per-(head, row block) progress counter (release/acquire atomics); programs draw
    tickets from an atomic counter, so a program only ever waits on one that has already started: no
    deadlock whatever order the GPU starts them in. Rows run as a wave one tile apart, in one launch. The
    step loop is software-pipelined: the next key block's tiles load while this one computes (9% off the
    forward on an H200; the wait and a barrier are inline PTX for that, see _wait_at_least).
  * Backward, one program per (key block c, batch*head), with no waiting: it starts from the saved U_c (its
    value where the backward's last row block starts), walks the row blocks from the last one down, and
    recovers the earlier values by subtraction (spec eq 33), carrying U_c, dU_c and the key-block gradients
    dKc, dVc, dQu; a pass that needs no dU walks up instead, building U_c as the forward does. Row gradients
    dQc, dKu, dVu are fp32 atomic adds, so the backward is not bitwise deterministic (like FlashAttention's
    dQ); the forward is. The two gradient paths into a sigma tile (the local term, and the update of U_c)
    are summed before one use. E (eq 31), the score gradient's path into the local term, only meets operands
    of its row block, so the backward sums its tiles per row block (fp32, L x m per head); "finish" programs,
    ticketed after all the columns (so they fill the slots the columns' tail leaves idle) and each waiting
    for its head's columns, take its two products once per row block and cast the row gradients to the
    output dtype. A step recomputes ~8 tiles and keeps most of them live, so it runs out of registers (255
    and spills at every tile size, scripts/castle_regs.py); three schedules of the same code trade registers
    for work (CASTLE_BWD_VARIANT, default "stored"; see BWD_VARIANTS):
      "fused"   one launch, one pass, the five carried (n x d) fp32 states in registers;
      "split"   two launches that each recompute the scores: dVc, dKc, dQc and E (carrying U, dKc, dVc),
                then the sigma paths dU, dQu, dKu, dVu (carrying U, dU, dQu);
      "stored"  the two passes of "split" one after the other in one program: the first stores each
                tile's dS (bf16, as the matmuls take it) in a strip of scratch memory, the second reads
                it back instead of recomputing the scores (no U), and forms E: 11 + 9 tile matmuls per
                step instead of 12 + 13. Strips are recycled between programs (4 per SM, linear in L:
                138 MB at L = 2048; fewer where they would take over a quarter of the free memory).
    On an H100 (bf16, B8 H9 L2048 D64) fwd+bwd took 2.91 ms with "stored" (3.05 before Delta became one
    launch, when "split" took 3.41), both 64/64 tiles; on an H200 2.83 ms since the finish items joined
    the backward's launch, 2.59 since its row loop keeps its invariants inside, 2.51 since the second
    pass is software-pipelined when there is no window, 2.44 since the forward is, 2.43 with its loop in 3
    stages and 8 heads' row blocks interleaved in its launch order, 2.38 with the factor s out of the
    backward's steps, 2.31 with the causal mask a real branch and fewer instructions per tile
    (scripts/NOTES_castle.md).
  * CASTLE-SWL: tiles whose sigma block is all zero (spec §3.6) skip the sigma work, the local term and
    the U update; only Qc U_c^T and the causal part remain there.
  * Memory beyond the inputs: O (L x d), logsumexp (L), U (L x d fp32; kept for the backward only by "fused"
    and "split"), fp32 gradient accumulators, E per row block (L x m fp32), and for "stored" the dS strips (4
    per SM, L x n each, capped at a quarter of the free memory).
  * Precision: bf16 matmul operands (U, sigma, R, P, dS ... rounded as FlashAttention rounds P), fp32
    accumulators, statistics, U and dU. On long unit-variance inputs the gradients then carry ~2e-2
    relative error, as much as the parallel form run with bf16 matmuls (autocast) has; fp32 inputs
    take exact fp32 matmuls (~1e-6).
"""
from __future__ import annotations

import ast
import functools
import math
import os
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F

from kernels.sdpa import decode_sdpa

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs still get the torch paths
    triton = None

__all__ = ["castle_attn", "castle_prefill", "castle_decode", "CastleCache"]

_IMPLS = ("auto", "torch", "blockwise", "triton")


# ----------------------------------------------------------------------------------------------------
# Shared helpers


def _check(qc, kc, vc, qu, ku, vu, window):
    if qc.dim() != 4:
        raise ValueError(f"CASTLE expects (B, H, L, D) tensors, got shape {tuple(qc.shape)}")
    for name, t in zip(("kc", "vc", "qu", "ku", "vu"), (kc, vc, qu, ku, vu)):
        if t.shape != qc.shape or t.dtype != qc.dtype or t.device != qc.device:
            raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; all six inputs must match "
                             f"qc: {tuple(qc.shape)} {qc.dtype} on {qc.device}")
    if not (window is None or (isinstance(window, int) and window >= 0)):
        raise ValueError(f"window must be None (CASTLE) or an int >= 0 (CASTLE-SWL), got {window!r}")


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _window_or_len(window, L):
    """SWL with W >= L - 1 is CASTLE (spec §1.6), so CASTLE is run as W = L."""
    return L if window is None else min(window, L)


# ----------------------------------------------------------------------------------------------------
# impl="torch": the parallel form (Theorem 1, eqs 10-12)


def _attn_parallel(qc, kc, vc, qu, ku, vu, window, scale):
    dtype, L = qc.dtype, qc.shape[-2]
    qc, kc, vc, qu, ku, vu = (t.to(_compute_dtype(dtype)) for t in (qc, kc, vc, qu, ku, vu))
    idx = torch.arange(L, device=qc.device)
    causal = idx[:, None] >= idx[None, :]                                # (query t, key j)
    ahead = idx[:, None] < idx[None, :]                                  # (owner j, contributor i)
    if window is not None:
        ahead = ahead & (idx[None, :] <= idx[:, None] + window)
    a_u = torch.sigmoid(scale * qu @ ku.mT).masked_fill(~ahead, 0.0)
    r = (scale * qc @ vu.mT).masked_fill(~causal, 0.0)
    s_u = r @ a_u.mT                                                     # eq (11)
    scores = (scale * qc @ kc.mT - F.silu(s_u)).masked_fill(~causal, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vc).to(dtype)               # eq (12)


# ----------------------------------------------------------------------------------------------------
# impl="blockwise": spec §3 in PyTorch, vectorised over each anti-diagonal k (tiles (j + k, j), all j)


def _to_blocks(x, bs):
    n = -(-x.shape[-2] // bs)
    return F.pad(x, (0, 0, 0, n * bs - x.shape[-2])).unflatten(-2, (n, bs))


def _sigma_mask(k, bs, window, device):
    """Lookahead mask of the sigma tiles on anti-diagonal k: owner j = row r, contributor i = k*bs + col c."""
    off = k * bs + torch.arange(bs, device=device)[None, :] - torch.arange(bs, device=device)[:, None]
    keep = off > 0
    return keep & (off <= window) if window is not None else keep


def _last_sigma_diagonal(n, bs, window):
    """Anti-diagonals k > this have all-zero sigma tiles (spec §3.6): k*bs > bs - 1 + W."""
    return n - 1 if window is None else (bs - 1 + window) // bs


def _blockwise_forward(qc, kc, vc, qu, ku, vu, window, scale, bs, keep_last):
    """Blocked inputs (B, H, N, bs, D) in compute dtype -> out, lse (B, H, N, bs), u.

    u[:, :, b] holds the lookahead keys of block b at the start of the row block being processed
    (spec's D^{(k)}, transposed). On return it holds them at the start of the last row block, or, with
    keep_last, after every contributor (= U^L, what prefill caches)."""
    n = qc.shape[2]
    tril = torch.ones(bs, bs, dtype=torch.bool, device=qc.device).tril()
    r = (scale * qc @ vu.mT).masked_fill(~tril, 0.0)                     # R_a of every row block
    u = torch.zeros_like(qu)
    m = torch.full(qc.shape[:-1], float("-inf"), dtype=qc.dtype, device=qc.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(vc)
    for k in range(n):
        a, b = slice(k, n), slice(0, n - k)
        s = scale * qc[:, :, a] @ u[:, :, b].mT                          # eq (24), first term
        if k <= _last_sigma_diagonal(n, bs, window):
            sig = torch.sigmoid(scale * qu[:, :, b] @ ku[:, :, a].mT) * _sigma_mask(k, bs, window, qc.device)
            s = s + r[:, :, a] @ sig.mT                                  # eq (22) / (24), local term
            upd = sig @ vu[:, :, a]                                      # eq (23)
            if not keep_last:
                upd[:, :, -1] = 0.0                                      # the tile in the last row block
            u[:, :, b] += upd
        sc = scale * qc[:, :, a] @ kc[:, :, b].mT - F.silu(s)            # eq (19)
        if k == 0:
            sc = sc.masked_fill(~tril, float("-inf"))
        m_new = torch.maximum(m[:, :, a], sc.amax(-1))                   # online softmax (Algorithm 2)
        alpha = torch.exp(m[:, :, a] - m_new)
        p = torch.exp(sc - m_new[..., None])
        denom[:, :, a] = denom[:, :, a] * alpha + p.sum(-1)
        acc[:, :, a] = acc[:, :, a] * alpha[..., None] + p @ vc[:, :, b]
        m[:, :, a] = m_new
    return acc / denom[..., None], m + torch.log(denom), u


def _blockwise_backward(do, qc, kc, vc, qu, ku, vu, out, lse, u, window, scale, bs):
    """Spec §3.5 in reverse anti-diagonal order; u (state at the start of the last row block) is consumed."""
    n = qc.shape[2]
    tril = torch.ones(bs, bs, dtype=torch.bool, device=qc.device).tril()
    r = (scale * qc @ vu.mT).masked_fill(~tril, 0.0)
    delta = (do * out).sum(-1)
    du = torch.zeros_like(u)
    dqc, dkc, dvc, dqu, dku, dvu = (torch.zeros_like(t) for t in (qc, kc, vc, qu, ku, vu))
    for k in range(n - 1, -1, -1):
        a, b = slice(k, n), slice(0, n - k)
        in_window = k <= _last_sigma_diagonal(n, bs, window)
        if in_window:
            sig = torch.sigmoid(scale * qu[:, :, b] @ ku[:, :, a].mT) * _sigma_mask(k, bs, window, qc.device)
            # Undo the update that row block a made to u_b (none for the last row block), eq (33),
            # and route du (from rows after a) into that update: eq (32).
            prev, rows = slice(0, n - k - 1), slice(k, n - 1)
            u[:, :, prev] -= sig[:, :, :-1] @ vu[:, :, rows]
            dsig = torch.zeros_like(sig)
            dsig[:, :, :-1] = du[:, :, prev] @ vu[:, :, rows].mT
            dvu[:, :, rows] += sig[:, :, :-1].mT @ du[:, :, prev]
        s = scale * qc[:, :, a] @ u[:, :, b].mT if k > 0 else 0.0
        if in_window:
            s = s + r[:, :, a] @ sig.mT
        sc = scale * qc[:, :, a] @ kc[:, :, b].mT - F.silu(s)
        if k == 0:
            sc = sc.masked_fill(~tril, float("-inf"))
        p = torch.exp(sc - lse[:, :, a, :, None])                        # eq (25)
        da = p * (do[:, :, a] @ vc[:, :, b].mT - delta[:, :, a, :, None])  # eqs (26), (28)
        sg = torch.sigmoid(s)                                            # (k = 0 is always in the window)
        ds = -da * sg * (1 + s * (1 - sg))                                # eq (29)
        dvc[:, :, b] += p.mT @ do[:, :, a]                                # eq (27)
        dkc[:, :, b] += scale * da.mT @ qc[:, :, a]                       # eq (30)
        dqc[:, :, a] += scale * da @ kc[:, :, b]
        if k > 0:
            dqc[:, :, a] += scale * ds @ u[:, :, b]
            du[:, :, b] += scale * ds.mT @ qc[:, :, a]
        if in_window:
            e = (ds @ sig).masked_fill(~tril, 0.0)                        # eq (31)
            dqc[:, :, a] += scale * e @ vu[:, :, a]
            dvu[:, :, a] += scale * e.mT @ qc[:, :, a]
            dz = (dsig + ds.mT @ r[:, :, a]) * sig * (1 - sig)            # both paths into sigma_{b,a}
            dqu[:, :, b] += scale * dz @ ku[:, :, a]
            dku[:, :, a] += scale * dz.mT @ qu[:, :, b]
    return dqc, dkc, dvc, dqu, dku, dvu


class _CastleBlockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qc, kc, vc, qu, ku, vu, window, scale, bs):
        blocks = [_to_blocks(t.to(_compute_dtype(qc.dtype)), bs) for t in (qc, kc, vc, qu, ku, vu)]
        out, lse, u = _blockwise_forward(*blocks, window, scale, bs, keep_last=False)
        ctx.save_for_backward(*blocks, out, lse, u)
        ctx.window, ctx.scale, ctx.bs, ctx.L, ctx.dtype = window, scale, bs, qc.shape[-2], qc.dtype
        return out.flatten(2, 3)[:, :, : ctx.L].to(qc.dtype)

    @staticmethod
    def backward(ctx, do):
        *blocks, out, lse, u = ctx.saved_tensors
        do = _to_blocks(do.to(out.dtype), ctx.bs)
        grads = _blockwise_backward(do, *blocks, out, lse, u.clone(), ctx.window, ctx.scale, ctx.bs)
        return (*(g.flatten(2, 3)[:, :, : ctx.L].to(ctx.dtype) for g in grads), None, None, None)


# ----------------------------------------------------------------------------------------------------
# impl="triton": kernels (see the module docstring for the schedule)

# Backward schedules (module docstring): "stored" (two passes per program, the second reading the
# first's dS from scratch strips), "split" (the two passes as two launches, recomputing the scores) or
# "fused" (one pass).
BWD_VARIANTS = ("fused", "split", "stored")
BWD_VARIANT = os.environ.get("CASTLE_BWD_VARIANT", "stored")
if BWD_VARIANT not in BWD_VARIANTS:
    raise ValueError(f"CASTLE_BWD_VARIANT={BWD_VARIANT!r} is unknown; set it to one of {BWD_VARIANTS} "
                     "or unset it (default stored)")


@dataclass(frozen=True)
class TritonConfig:
    """Tiles: m = query rows per tile, n = key columns per tile (n divides m; powers of two >= 16);
    the backward's m must divide the forward's m (the forward saves U where the backward starts).
    stages_bwd: software-pipelining stages of the "stored" backward's second (sigma) pass, used when there
    is no window (1 = not pipelined; see _bwd_column). stages_fwd: those of the forward's step loop.
    head_group_fwd: how many heads the forward's launch order interleaves at most (_fwd_head_group)."""
    m_fwd: int
    n_fwd: int
    warps_fwd: int
    m_bwd: int
    n_bwd: int
    warps_bwd: int
    stages_bwd: int
    bwd_variant: str = BWD_VARIANT
    row_guard: bool = False      # a register-allocation knob of the backward's row loop (_bwd_column)
    stages_fwd: int = 2
    head_group_fwd: int = 8


def _default_config(block_d, dtype, variant=BWD_VARIANT):
    """The tiles castle_attn / castle_prefill use: _gpu_config's, or under the interpreter the smallest
    legal ones, so that tiny tests cross blocks."""
    if _interpreting():
        return TritonConfig(32, 16, 4, 16, 16, 4, 1, variant)
    return _gpu_config(block_d, dtype, variant)


def _gpu_config(block_d, dtype, variant=BWD_VARIANT):
    """Tiles per head dim on a GPU. Forward: the fastest of scripts/bench_castle.py --sweep on an H100
    (bf16, L = 2048). Backward, D <= 64: the sweep's winners (H100, B8 H9 L2048: stored and split 64/64,
    fwd+bwd 3.20 / 3.57 ms in session 16; H200, B8 H16: fused 64/32; stored 64/64 again on an H200 with
    the row loop of session 23, 2.60 ms; 2.51 with the sigma pass in 2 stages). D = 128: the sweep's winner
    on an H100 for every variant, 64/64 with 8 warps (B8 H16 L2048 fwd+bwd: stored 13.0 ms, split 14.5), with
    the row guard on an H200 11.1 (2 stages: no faster, so 1). The forward on an H200: its step loop in 3
    stages and 8 heads interleaved 3% faster than 2 stages and one head at a time at D <= 64; at D = 128 3
    stages were 20% slower and 8 heads 1%."""
    if dtype == torch.float32:  # fp32 operands take twice the registers and shared memory
        return TritonConfig(32, 16, 4, 32, 16, 4, 1, variant)
    if block_d <= 64:
        return TritonConfig(64, 64, 4, *((64, 32) if variant == "fused" else (64, 64)), 4, 2, variant,
                            stages_fwd=3)
    return TritonConfig(64, 32, 4, 64, 64, 8, 1, variant, row_guard=True, head_group_fwd=1)


if triton is not None:
    _LOG2E = tl.constexpr(1.4426950408889634)  # softmax runs in base 2; LSE is stored in log2 units

    @triton.jit
    def _tanh_approx(y):
        """tanh on one tanh.approx (absolute error <= 5e-4): sigmoid(x) = 0.5 + 0.5 tanh(x / 2) then takes a
        single special-function op where tl.sigmoid takes two, ex2 and rcp, with an error below the bf16
        rounding every sigmoid here meets next. The kernels spend much of a tile on the special-function
        units: this took 21% off the forward and 11% off the backward on an H100 (scripts/NOTES_castle.md).
        For 16-bit operands only; fp32 ones keep the exact forms."""
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [y], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _sigmoid_of_half(y, DT: tl.constexpr):
        """sigmoid(2 y) in fp32 (_tanh_approx with 16-bit operands)."""
        if DT == tl.float32:
            return tl.sigmoid(2.0 * y)
        else:
            return 0.5 + 0.5 * _tanh_approx(y)

    @triton.jit
    def _neg_silu(x, DT: tl.constexpr):
        """-SiLU(x) in fp32. With 16-bit operands g - g tanh(g) for g = -x / 2 (_tanh_approx): the sign sits
        in the FMA, where -(h + h tanh(h)) for h = x / 2 cost an add."""
        if DT == tl.float32:
            return -x * tl.sigmoid(x)
        else:
            g = x * -0.5
            return g - g * _tanh_approx(g)

    @triton.jit
    def _silu_and_sigmoid(s, scale: tl.constexpr, DT: tl.constexpr):
        """(SiLU(x), sigmoid(x)) of x = scale * s in fp32. With 16-bit operands from h = x / 2 (_tanh_approx):
        sigmoid = 0.5 + 0.5 tanh(h) and SiLU = x sigmoid = h + h tanh(h), a multiply fewer than x, x / 2, x
        sigmoid."""
        if DT == tl.float32:
            x = s * scale
            sg = tl.sigmoid(x)
            return x * sg, sg
        else:
            h = s * (0.5 * scale)
            t = _tanh_approx(h)
            return h + h * t, 0.5 + 0.5 * t

    @triton.jit
    def _half_scaled(x, scale: tl.constexpr, SIGMA_PRE: tl.constexpr, DT: tl.constexpr):
        """x * s / 2 as a matmul operand where that is exact (SIGMA_PRE: s a power of two, as for D = 16, 64,
        256): sigma's logit s q^U k^U then leaves its matmul halved, as tanh takes it (_lookahead_sigma),
        with no multiply per tile (1% off fwd+bwd at D = 64 on an H200, with the other factors s moved out
        of the backward's steps). Otherwise x as it is, and sigma takes the multiply."""
        if SIGMA_PRE:
            return (x.to(tl.float32) * (0.5 * scale)).to(DT)
        else:
            return x.to(DT)

    @triton.jit
    def _lookahead_sigma(qu_c, ku_a, c, a, scale: tl.constexpr, W, BN: tl.constexpr, BM: tl.constexpr,
                         SIGMA_PRE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
        """sigma_{c,a}: weight of contributor i (row block a) in the lookahead key of owner j (key block
        c), eq (3) with mask (4) / (9): j < i <= j + W. Tiles the mask keeps whole skip it. With SIGMA_PRE one
        of the operands comes _half_scaled, so the logit leaves the matmul halved; otherwise it is halved here."""
        half_logit = tl.dot(qu_c, tl.trans(ku_a), input_precision=PREC)
        if not SIGMA_PRE:
            half_logit *= 0.5 * scale
        sig = _sigmoid_of_half(half_logit, DT)
        if (a * BM <= c * BN + BN - 1) | (a * BM + BM - 1 > c * BN + W):
            rows_c = c * BN + tl.arange(0, BN)
            rows_a = a * BM + tl.arange(0, BM)
            keep = (rows_a[None, :] > rows_c[:, None]) & (rows_a[None, :] <= rows_c[:, None] + W)
            sig = tl.where(keep, sig, 0.0)
        return sig

    @triton.jit
    def _causal(sc, a, c, BM: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
        """Scores -inf above the diagonal; masked only on tiles that meet it."""
        if a * BM < c * BN + BN - 1:
            rows_a = _kept_in_branch(a, ASM) * BM + tl.arange(0, BM)
            rows_c = c * BN + tl.arange(0, BN)
            sc = tl.where(rows_a[:, None] >= rows_c[None, :], sc, float("-inf"))
        return sc

    @triton.jit
    def _kept_in_branch(x, ASM: tl.constexpr):
        """The int32 x, passed on a GPU (ASM) through inline PTX that the compiler must assume has side effects:
        the code of a branch that takes it then stays a branch. Otherwise LLVM turns a mask under a runtime
        test into selects on every tile (the causal mask: ~100 instructions a tile; as a branch 3% off the
        forward and 2% off fwd+bwd at D = 64 on an H200)."""
        if ASM:
            return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
        else:
            return x

    @triton.jit
    def _load_tile(ptrs, mask, IN_BOUNDS: tl.constexpr):
        """tl.load of an input tile, zero where mask is false. IN_BOUNDS (the tile's rows are all < L and
        BLOCK_D = HEAD_DIM, as when L is a multiple of the row block): no mask, so the kernels build none and
        fill no zeros (the row loops, every step)."""
        if IN_BOUNDS:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _atomic_add_tile(ptrs, x, mask, IN_BOUNDS: tl.constexpr):
        """Relaxed fp32 atomic adds of the tile x where mask holds (everywhere with IN_BOUNDS, see _load_tile)."""
        if IN_BOUNDS:
            tl.atomic_add(ptrs, x, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=mask, sem="relaxed")

    @triton.jit
    def _last_row_block(c, W, NR, BM: tl.constexpr, BN: tl.constexpr):
        """Last row block whose contributors reach key block c (spec §3.6): i <= (c+1)*BN - 1 + W."""
        return tl.minimum(((c + 1) * BN - 1 + W) // BM, NR - 1)

    @triton.jit
    def _fold_count(c, r, BM: tl.constexpr, BN: tl.constexpr):
        """How many U blocks row program r has written once it has written block c. It visits its own
        (diagonal) key blocks left to right, then the earlier ones right to left."""
        first = r * (BM // BN)
        return tl.where(c >= first, c - first + 1, first + BM // BN - c)

    @triton.jit
    def _grouped_ticket(t, NBH, N, HEAD_GROUP):
        """(head, item) of ticket t, for NBH heads of N items each, in groups of HEAD_GROUP heads whose
        heads take turns: item 0 of each head of the group, then item 1, ... Each head's items in order;
        a group keeps the data its running programs share in L2 (all heads at once was slower: the
        backward ~20% at 144 heads, the forward 10-40% on an H200)."""
        g0 = t // (HEAD_GROUP * N) * HEAD_GROUP                   # first head of the ticket's group
        group_size = tl.minimum(HEAD_GROUP, NBH - g0)
        return g0 + (t - g0 * N) % group_size, (t - g0 * N) // group_size

    # The forward's step loop is software-pipelined (Triton prefetches the next key block's tiles), and Triton
    # 3.6's pipeliner skips any loop holding a nested loop or a barrier op. So on a GPU (ASM) the hand-off's
    # spin-wait and the barrier before its release are inline PTX; the interpreter, which cannot run PTX (and
    # runs programs one after another), takes the plain forms.
    @triton.jit
    def _wait_at_least(flag_ptr, need, ASM: tl.constexpr):
        """Spin until the int32 at flag_ptr is >= need (acquire, GPU scope); returns the value seen."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; WAIT: ld.acquire.gpu.global.b32 $0, [$1]; setp.lt.s32 p, $0, $2; @p bra WAIT; }",
                "=r,l,r", [flag_ptr, need], dtype=tl.int32, is_pure=False, pack=1)
        else:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            while seen < need:
                seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            return seen

    @triton.jit
    def _block_barrier(dummy, ASM: tl.constexpr):
        """All threads of the program meet here (bar.sync: their earlier writes are then ordered before a
        later release by any of them). dummy: any int scalar (inline PTX needs an operand)."""
        if ASM:
            tl.inline_asm_elementwise("bar.sync 0; mov.b32 $0, $1;", "=r,r", [dummy], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.debug_barrier()

    # `scale` is constexpr: Inductor, launching a user kernel, passes a Python float as an fp64 scalar, which
    # promotes the tiles to fp64 and fails to compile; as a constant it stays fp32 everywhere. (The custom ops
    # below now keep torch.compile from launching these kernels itself; the constant costs nothing.)
    @triton.jit
    def _castle_fwd_kernel(
        QC, KC, VC, QU, KU, VU, OUT, LSE, U, SYNC,
        stride_b, stride_h, stride_l, H, L, NR, W, save_t, HEAD_GROUP, scale: tl.constexpr,
        HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr, SIGMA_PRE: tl.constexpr,
        IN_BOUNDS: tl.constexpr,
    ):
        # SYNC[bh * NR + r] counts the U blocks row program r of head bh has written; SYNC[-1] hands out
        # tickets: ticket -> (head, row block), each head's row blocks in increasing order, HEAD_GROUP heads
        # taking turns, so that their last (longest) rows start together rather than one head's after
        # another's (1% off the forward at D = 64 with 8 on an H200).
        ticket = tl.atomic_add(SYNC + tl.num_programs(0), 1)
        bh, a = _grouped_ticket(ticket, tl.num_programs(0) // NR, NR, HEAD_GROUP)
        off = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
        u_base = U + bh.to(tl.int64) * (NR * BM * BLOCK_D)
        flags = SYNC + bh * NR

        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d[None, :] < HEAD_DIM
        rows_a = a * BM + offs_m
        mask_a = (rows_a[:, None] < L) & dmask
        ptr_a = off + rows_a[:, None] * stride_l + offs_d[None, :]
        # Qc pre-scaled by s, since every product that takes it is scaled: the scale then costs one multiply
        # per row block instead of three per tile, and Qc Kc^T accumulates onto -SiLU(S^U) in the matmul
        # (4% off the forward on an H100). Exact when s is a power of two (D = 16, 64, 256); otherwise one
        # more rounding of Qc in 16-bit operands.
        qc_a = (_load_tile(QC + ptr_a, mask_a, IN_BOUNDS).to(tl.float32) * scale).to(DT)
        ku_a = _half_scaled(_load_tile(KU + ptr_a, mask_a, IN_BOUNDS), scale, SIGMA_PRE, DT)
        vu_a = _load_tile(VU + ptr_a, mask_a, IN_BOUNDS).to(DT)
        # R_a = s * q^C_t . v^U_i for contributors i <= t inside the row block: once per row (spec §3.7).
        r = tl.dot(qc_a, tl.trans(vu_a), input_precision=PREC)
        r = tl.where(offs_m[:, None] >= offs_m[None, :], r, 0.0).to(DT)
        # The contributors this row folds into U; the last row only those before save_t (where the
        # backward starts, or L for prefill), and only if that leaves anything to fold.
        vu_fold = tl.where(rows_a[:, None] < save_t, vu_a, 0.0).to(DT)
        do_write = (a < NR - 1) | (save_t > a * BM)

        m = tl.full([BM], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BLOCK_D], dtype=tl.float32)
        first = a * (BM // BN)                       # first key block inside the row block
        for step in tl.range(0, first + BM // BN, num_stages=STAGES):
            # Own key blocks left to right (the first one leaves every row's running max finite, spec
            # §3.4 point 5), then the earlier ones right to left.
            c = tl.where(step < BM // BN, first + step, first + BM // BN - 1 - step)
            own = c >= first
            rows_c = c * BN + offs_n
            mask_c = (rows_c[:, None] < L) & dmask
            ptr_c = off + rows_c[:, None] * stride_l + offs_d[None, :]
            qu_c = _load_tile(QU + ptr_c, mask_c, IN_BOUNDS).to(DT)
            kc_c = _load_tile(KC + ptr_c, mask_c, IN_BOUNDS).to(DT)
            vc_c = _load_tile(VC + ptr_c, mask_c, IN_BOUNDS).to(DT)
            u_ptr = u_base + rows_c[:, None] * BLOCK_D + offs_d[None, :]
            last_row = _last_row_block(c, W, NR, BM, BN)

            s = tl.zeros([BM, BN], dtype=tl.float32)
            if not own:
                # U_c as of the start of row block a: written by row a-1, or frozen earlier by the window.
                writer = tl.minimum(a - 1, last_row)
                need = _fold_count(c, writer, BM, BN)
                seen = _wait_at_least(flags + writer, need, ASM)
                # Volatile (past L1, and never prefetched by the pipeliner), and masked by the wait's result
                # (always true) so that no compiler moves it before the wait.
                u_c = tl.load(u_ptr, mask=seen >= need, other=0.0, volatile=True).to(DT)
                s = tl.dot(qc_a, tl.trans(u_c), input_precision=PREC)             # eq (24), first term
            if a <= last_row:
                sig = _lookahead_sigma(qu_c, ku_a, c, a, scale, W, BN, BM, SIGMA_PRE, PREC, DT).to(DT)
                s += tl.dot(r, tl.trans(sig), input_precision=PREC)               # eqs (22)/(24), local
                if do_write:
                    upd = tl.dot(sig, vu_fold, input_precision=PREC)              # eq (23)
                    if own:
                        tl.store(u_ptr, upd)
                    else:  # only this program touches U_c now: a relaxed add is exact, no fp32 copy held
                        tl.atomic_add(u_ptr, upd, sem="relaxed")
                    _block_barrier(step, ASM)
                    tl.atomic_xchg(flags + a, step + 1, sem="release", scope="gpu")
            sc = tl.dot(qc_a, tl.trans(kc_c), _neg_silu(s, DT), input_precision=PREC)        # eq (19)
            sc = _causal(sc, a, c, BM, BN, ASM)
            # online softmax (Algorithm 2) in base 2: the scores take log2(e) in the exponent's FMA
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp2((m - m_new) * _LOG2E)
            p = tl.exp2(sc * _LOG2E - (m_new * _LOG2E)[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(DT), vc_c, acc * alpha[:, None], input_precision=PREC)
            m = m_new

        o_ptr = OUT + bh.to(tl.int64) * L * HEAD_DIM + rows_a[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptr, (acc / denom[:, None]).to(OUT.dtype.element_ty), mask=mask_a)
        tl.store(LSE + bh.to(tl.int64) * (NR * BM) + rows_a, m * _LOG2E + tl.log2(denom))

    @triton.jit
    def _bwd_column(
        bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU, E, DS, ds_slot,
        stride_b, stride_h, stride_l, H, L, NR, W, scale: tl.constexpr, lse_rows,
        HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, CAUSAL_GRADS: tl.constexpr, SIGMA_GRADS: tl.constexpr,
        DS_MODE: tl.constexpr, ROW_GUARD: tl.constexpr, SIGMA_STAGES: tl.constexpr, SIGMA_PRE: tl.constexpr,
        ASM: tl.constexpr, IN_BOUNDS: tl.constexpr,
    ):
        """The backward of key block c of head bh: walks the row blocks a = NR-1 .. own block of c, or,
        without SIGMA_GRADS (no dU to carry), up from the own block of c.

        Carried for key block c: U_c (walking down: as of the start of row block a + 1 on entering a step, read
        from this program's rows of the fp32 (BH, lse_rows, BLOCK_D) buffer; walking up: as of the start of row
        block a, from zero), dU_c (gradient of the rows after a) and dKc, dVc, dQu, all in registers and all
        without their factors s, which each takes once: dKc, dVc, dQu (s^2: the sigma logit's too), which only
        this column writes, when they go to their (B, H, L, D) outputs in the output dtype, the row gradients'
        fp32 sums in _finish_rows (so R_a, dU_c, Qu_c's share of dKu and every atomic add are unscaled; Qu_c
        comes _half_scaled for sigma). Which gradients a pass computes: CAUSAL_GRADS dVc, dKc, dQc and E (eqs
        27, 30, 31; E, unmasked, added to the fp32 (BH, NR*BM, BM) buffer E), SIGMA_GRADS the paths through
        sigma, dU (eq 32), dQu, dKu, dVu. DS_MODE: 0 recomputes the score gradient dS (eq 29) of every tile;
        1 also stores it in this program's (NR*BM, BN) strip of DS at ds_slot, leaving E to the pass that reads
        it back; 2 loads dS from there instead of recomputing the scores (then U is not needed at all) and
        forms E; its row loop then runs software-pipelined with SIGMA_STAGES stages (Triton prefetches the next
        step's tiles)."""
        off = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
        g_off = bh.to(tl.int64) * L * HEAD_DIM                    # row gradients and DO: contiguous (B, H, L, D)
        lse_off = bh.to(tl.int64) * lse_rows                      # LSE and DELTA: (BH, lse_rows)
        e_off = bh.to(tl.int64) * (NR * BM * BM)                  # E: (BH, NR*BM, BM)

        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d[None, :] < HEAD_DIM
        tril = offs_m[:, None] >= offs_m[None, :]
        rows_c = c * BN + offs_n
        mask_c = (rows_c[:, None] < L) & dmask
        ptr_c = off + rows_c[:, None] * stride_l + offs_d[None, :]
        qu_c = _half_scaled(_load_tile(QU + ptr_c, mask_c, IN_BOUNDS), scale, SIGMA_PRE, DT)
        if DS_MODE != 2:
            kc_c = _load_tile(KC + ptr_c, mask_c, IN_BOUNDS).to(DT)
            vc_c = _load_tile(VC + ptr_c, mask_c, IN_BOUNDS).to(DT)
        last_row = _last_row_block(c, W, NR, BM, BN)
        own_row = c // (BM // BN)                                 # the row block holding key block c
        u = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        if SIGMA_GRADS:
            # dU flows from the later rows: walk the row blocks down, from U_c as of the start of the last
            # one (saved by the forward; read only), undoing each row's update of it (eq 33).
            a = NR - 1
            step = -1
            if DS_MODE == 0:
                u = tl.load(U + bh.to(tl.int64) * lse_rows * BLOCK_D + rows_c[:, None] * BLOCK_D + offs_d[None, :])
        else:
            # Without dU, walk up and build U_c as the forward does. (For "stored", the second pass then
            # reads the strip and the row tiles back in the reverse order of the first: L2 still has them.)
            a = own_row
            step = 1
        du = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        dkc = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        dvc = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        dqu = tl.zeros([BN, BLOCK_D], dtype=tl.float32)

        # Loop invariants stay inside the loop (disable_licm): hoisted, they are live across every step, and
        # at 255 registers ptxas spills them and reloads them in the loop (stored, D = 64, 64/64: 428/436 ->
        # 48/56 bytes per thread, fwd+bwd 8% faster on an H200). ROW_GUARD wraps the body in a test that is
        # always true: it only changes how ptxas allocates registers, for the better at D = 128 (64/64/8:
        # 740/548 -> 360/476 bytes, 14% faster) and for the worse at D = 64 (1% slower); scripts/NOTES_castle.md.
        # The sigma pass (DS_MODE 2) pipelined, SIGMA_STAGES = 2, took 3% off fwd+bwd on an H200 (D = 64). The
        # launch passes 1 with a window: Triton 3.6 then addressed shared memory out of range on the steps
        # outside it. (SIGMA_STAGES also picks how Vu_a is loaded, in both passes; below.)
        for _ in tl.range(0, NR - own_row, num_stages=SIGMA_STAGES if DS_MODE == 2 else 1, disable_licm=True):
            if ((a >= own_row) & (a < NR)) | (not ROW_GUARD):
                rows_a = a * BM + offs_m
                mask_a = (rows_a[:, None] < L) & dmask
                ptr_a = off + rows_a[:, None] * stride_l + offs_d[None, :]
                g_ptr = g_off + rows_a[:, None] * HEAD_DIM + offs_d[None, :]
                e_ptr = e_off + rows_a[:, None] * BM + offs_m[None, :]
                qc_a = _load_tile(QC + ptr_a, mask_a, IN_BOUNDS).to(DT)
                ku_a = _load_tile(KU + ptr_a, mask_a, IN_BOUNDS).to(DT)
                # Vu_a^T. For the pipelined sigma pass loaded as a (D, m) tile, which its products take as it is:
                # loaded as (m, D), they read it through one transposed view, and Triton 3.6 gave it a single
                # buffer, which the next step's prefetch overwrote before its last read (wrong gradients).
                # Unpipelined, the (m, D) load is 1% faster (D = 128).
                if SIGMA_STAGES > 1:
                    vu_t = _load_tile(VU + off + rows_a[None, :] * stride_l + offs_d[:, None], tl.trans(mask_a),
                                      IN_BOUNDS).to(DT)
                else:
                    vu_t = tl.trans(_load_tile(VU + ptr_a, mask_a, IN_BOUNDS).to(DT))
                in_window = a <= last_row
                folded = in_window & (a < NR - 1)           # row a added sigma_{c,a} Vu_a to U_c (eq 23)
                after = a * BM >= (c + 1) * BN              # key block c lies before the row block (U_c != 0)

                sig = tl.zeros([BN, BM], dtype=DT)
                r = tl.zeros([BM, BM], dtype=DT)
                if in_window:
                    sig = _lookahead_sigma(qu_c, ku_a, c, a, scale, W, BN, BM, SIGMA_PRE, PREC, DT).to(DT)
                    r = tl.where(tril, tl.dot(qc_a, vu_t, input_precision=PREC), 0.0).to(DT)   # R_a / s
                if DS_MODE == 2:
                    ds = tl.load(DS + ds_slot + rows_a[:, None] * BN + offs_n[None, :], cache_modifier=".cg")
                else:
                    do_a = _load_tile(DO + g_ptr, mask_a, IN_BOUNDS).to(DT)
                    lse_a = tl.load(LSE + lse_off + rows_a)
                    delta_a = tl.load(DELTA + lse_off + rows_a)
                    # Recompute the scores of the tile (eqs 22/24, 19) from U_c as of the start of row block a.
                    s = tl.zeros([BM, BN], dtype=tl.float32)
                    if in_window:
                        if SIGMA_GRADS and folded:
                            u -= tl.dot(sig, tl.trans(vu_t), input_precision=PREC)
                        s = tl.dot(r, tl.trans(sig), input_precision=PREC)
                    u_t = u.to(DT)
                    if after:
                        s += tl.dot(qc_a, tl.trans(u_t), input_precision=PREC)
                    if not SIGMA_GRADS and folded:
                        u += tl.dot(sig, tl.trans(vu_t), input_precision=PREC)               # eq (23)
                    # Scores (eq 19) and their gradients (eqs 25-29, 27); every (m x n) fp32 tile dies as
                    # soon as it can (SiLU'(S) before the softmax, dVc before dP): the peak is three.
                    silu, sg = _silu_and_sigmoid(s, scale, DT)
                    sc = tl.dot(qc_a, tl.trans(kc_c), input_precision=PREC) * scale - silu
                    dsilu = sg + silu * (1.0 - sg)
                    sc = _causal(sc, a, c, BM, BN, ASM)
                    p = tl.exp2(sc * _LOG2E - lse_a[:, None])                               # eq (25)
                    if CAUSAL_GRADS:
                        dvc += tl.dot(tl.trans(p.to(DT)), do_a, input_precision=PREC)       # eq (27)
                    dp = tl.dot(do_a, tl.trans(vc_c), input_precision=PREC)                 # eq (26)
                    da = p * (dp - delta_a[:, None])                                        # eq (28)
                    ds = (-da * dsilu).to(DT)                                               # eq (29)
                    if DS_MODE == 1:
                        tl.store(DS + ds_slot + rows_a[:, None] * BN + offs_n[None, :], ds)
                    if CAUSAL_GRADS:
                        da = da.to(DT)
                        dkc += tl.dot(tl.trans(da), qc_a, input_precision=PREC)             # eq (30), dQc
                        dqc_a = tl.dot(da, kc_c, input_precision=PREC)
                        if after:
                            dqc_a += tl.dot(ds, u_t, input_precision=PREC)
                if DS_MODE != 1 and in_window:  # a pass that stores dS leaves E to the one that reads it back
                    if DS_MODE == 2 or CAUSAL_GRADS:
                        # E (eq 31) only meets operands of row block a: summed over the key blocks here, its
                        # mask and its products with Vu_a and Qc_a are taken once per row block (_finish_rows).
                        tl.atomic_add(E + e_ptr, tl.dot(ds, sig, input_precision=PREC), sem="relaxed")
                    if SIGMA_GRADS:
                        # Row a's update of U_c (eq 23) takes the upstream gradient dU of the rows after a
                        # (eq 32), so dU gets this tile's own contribution only at the end.
                        if folded:
                            dvu_a = tl.dot(tl.trans(sig), du.to(DT), input_precision=PREC)
                            _atomic_add_tile(DVU + g_ptr, dvu_a, mask_a, IN_BOUNDS)
                        # Both gradient paths into sigma_{c,a}: the local term (via R) and the U_c update.
                        dsig = tl.dot(tl.trans(ds), r, input_precision=PREC)
                        if folded:
                            dsig += tl.dot(du.to(DT), vu_t, input_precision=PREC)
                        # dz: the logit's gradient / s (dsig is unscaled: R_a / s, dU_c / s); dQu and dKu take
                        # s^2 once, this s and the logit's
                        sig32 = sig.to(tl.float32)
                        dz = (dsig * (sig32 - sig32 * sig32)).to(DT)
                        dqu += tl.dot(dz, ku_a, input_precision=PREC)
                        qu_term = tl.dot(tl.trans(dz), qu_c, input_precision=PREC)   # dKu's term / (2s or s^2)
                        _atomic_add_tile(DKU + g_ptr, qu_term, mask_a, IN_BOUNDS)
                if CAUSAL_GRADS:
                    _atomic_add_tile(DQC + g_ptr, dqc_a, mask_a, IN_BOUNDS)
                if SIGMA_GRADS and after:
                    du += tl.dot(tl.trans(ds), qc_a, input_precision=PREC)
            a += step

        gc_ptr = g_off + rows_c[:, None] * HEAD_DIM + offs_d[None, :]
        if CAUSAL_GRADS:
            tl.store(DKC + gc_ptr, (dkc * scale).to(DKC.dtype.element_ty), mask=mask_c)
            tl.store(DVC + gc_ptr, dvc.to(DVC.dtype.element_ty), mask=mask_c)
        if SIGMA_GRADS:
            tl.store(DQU + gc_ptr, (dqu * (scale * scale)).to(DQU.dtype.element_ty), mask=mask_c)

    @triton.jit
    def _castle_bwd_kernel(
        QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU, E, DS, SYNC,
        DQC_OUT, DKU_OUT, DVU_OUT,
        stride_b, stride_h, stride_l, H, L, NR, NC, NBH, NSLOTS, W, scale: tl.constexpr, lse_rows,
        HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, CAUSAL_GRADS: tl.constexpr, SIGMA_GRADS: tl.constexpr,
        STORED: tl.constexpr, FINISH: tl.constexpr, HEAD_GROUP: tl.constexpr, ROW_GUARD: tl.constexpr,
        SIGMA_STAGES: tl.constexpr, SIGMA_PRE: tl.constexpr, ASM: tl.constexpr, IN_BOUNDS: tl.constexpr,
    ):
        """Programs draw tickets (SYNC[NSLOTS] hands them out): tickets below NBH*NC are (head, key block)
        work items; with FINISH (the variant's last launch) NBH*NR more finish (head, row block) items.
        Tickets, not program ids: a program only ever waits on one that has already started, so no order
        of starting deadlocks.

        A work item without STORED is one pass with the gradients selected. With STORED, the causal pass,
        which stores every tile's dS in a strip of DS, then the sigma pass, which reads dS back instead of
        recomputing the scores. DS holds NSLOTS strips of (NR*BM, BN) (linear in L): ticket t takes strip
        t % NSLOTS once ticket t - NSLOTS has released it (SYNC[strip] counts releases).

        A finish item waits until every key block of its head is done (SYNC[NSLOTS + 1 + head] counts
        them), then takes _finish_rows. Finish items come last, so they run in the slots that the work
        items' tail leaves idle instead of as a launch of their own after it (fwd+bwd at B8 H9 L2048
        2.88 -> 2.83 ms on an H200, 1-2% at every shape timed; scripts/NOTES_castle.md)."""
        t = tl.atomic_add(SYNC + NSLOTS, 1)
        done = SYNC + NSLOTS + 1
        if t < NBH * NC:
            # columns longest first (c = 0 of each head of the group, then c = 1, ...): a shorter tail
            bh, c = _grouped_ticket(t, NBH, NC, HEAD_GROUP)
            if STORED:
                slot = t % NSLOTS
                while tl.atomic_add(SYNC + slot, 0, sem="acquire", scope="gpu") < t // NSLOTS:
                    pass
                ds_slot = slot.to(tl.int64) * (NR * BM * BN)
                _bwd_column(bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU,
                            E, DS, ds_slot, stride_b, stride_h, stride_l, H, L, NR, W, scale, lse_rows,
                            HEAD_DIM, BM, BN, BLOCK_D, DT, PREC, True, False, 1, ROW_GUARD,
                            SIGMA_STAGES, SIGMA_PRE, ASM, IN_BOUNDS)
                tl.debug_barrier()   # the strip is written by every thread and read back by others
                _bwd_column(bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU,
                            E, DS, ds_slot, stride_b, stride_h, stride_l, H, L, NR, W, scale, lse_rows,
                            HEAD_DIM, BM, BN, BLOCK_D, DT, PREC, False, True, 2, ROW_GUARD,
                            SIGMA_STAGES, SIGMA_PRE, ASM, IN_BOUNDS)
                tl.debug_barrier()   # every read of the strip done before the next ticket may overwrite it
                tl.atomic_xchg(SYNC + slot, t // NSLOTS + 1, sem="release", scope="gpu")
            else:
                _bwd_column(bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU,
                            E, DS, 0, stride_b, stride_h, stride_l, H, L, NR, W, scale, lse_rows,
                            HEAD_DIM, BM, BN, BLOCK_D, DT, PREC, CAUSAL_GRADS, SIGMA_GRADS, 0, ROW_GUARD, 1,
                            SIGMA_PRE, ASM, IN_BOUNDS)
            if FINISH:
                tl.debug_barrier()   # every thread's adds issued before the release publishes them
                tl.atomic_add(done + bh, 1, sem="release", scope="gpu")
        else:
            f = t - NBH * NC
            while tl.atomic_add(done + f // NR, 0, sem="acquire", scope="gpu") < NC:
                pass
            _finish_rows(f // NR, f % NR, QC, VU, E, DQC, DKU, DVU, DQC_OUT, DKU_OUT, DVU_OUT, stride_b,
                         stride_h, stride_l, H, L, NR, scale, HEAD_DIM, BM, BLOCK_D, DT, PREC, SIGMA_PRE)

    @triton.jit
    def _castle_delta_kernel(DO, OUT, DELTA, L, rows_out, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK: tl.constexpr):
        """Delta = rowsum(dO * O) in fp32 (spec §3.5) for BLOCK rows of head program_id(0); rows L .. rows_out
        (the padding of LSE's layout) get 0. dO and O: contiguous (B, H, L, D)."""
        bh = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
        ptr = bh * L * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
        do = tl.load(DO + ptr, mask=mask, other=0.0).to(tl.float32)
        out = tl.load(OUT + ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(DELTA + bh * rows_out + rows, tl.sum(do * out, 1), mask=rows < rows_out)

    @triton.jit
    def _finish_rows(bh, a, QC, VU, E, DQC, DKU, DVU, DQC_OUT, DKU_OUT, DVU_OUT, stride_b, stride_h, stride_l,
                     H, L, NR, scale: tl.constexpr, HEAD_DIM: tl.constexpr, BM: tl.constexpr,
                     BLOCK_D: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                     SIGMA_PRE: tl.constexpr):
        """Row block a of head bh, once the backward's adds to it are done: E_a, summed over key blocks and
        masked here (tril), gives dQc_a += E_a Vu_a and dVu_a += E_a^T Qc_a (eq 31); the three fp32 row
        gradients then take their factors (dQc, dVu s; dKu s^2, or 2 s with SIGMA_PRE: its sum came from
        _half_scaled Qu) and are written in the output dtype. The sums are read through L2 (.cg): other
        programs wrote them."""
        off = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
        offs_m = tl.arange(0, BM)
        offs_d = tl.arange(0, BLOCK_D)
        rows_a = a * BM + offs_m
        mask_a = (rows_a[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
        ptr_a = off + rows_a[:, None] * stride_l + offs_d[None, :]
        g_ptr = bh.to(tl.int64) * L * HEAD_DIM + rows_a[:, None] * HEAD_DIM + offs_d[None, :]
        e = tl.load(E + bh.to(tl.int64) * (NR * BM * BM) + rows_a[:, None] * BM + offs_m[None, :],
                    cache_modifier=".cg")
        e = tl.where(offs_m[:, None] >= offs_m[None, :], e, 0.0).to(DT)
        qc_a = tl.load(QC + ptr_a, mask=mask_a, other=0.0).to(DT)
        vu_a = tl.load(VU + ptr_a, mask=mask_a, other=0.0).to(DT)
        dqc = tl.load(DQC + g_ptr, mask=mask_a, other=0.0, cache_modifier=".cg")
        dqc = (dqc + tl.dot(e, vu_a, input_precision=PREC)) * scale
        dvu = tl.load(DVU + g_ptr, mask=mask_a, other=0.0, cache_modifier=".cg")
        dvu = (dvu + tl.dot(tl.trans(e), qc_a, input_precision=PREC)) * scale
        tl.store(DQC_OUT + g_ptr, dqc.to(DQC_OUT.dtype.element_ty), mask=mask_a)
        tl.store(DVU_OUT + g_ptr, dvu.to(DVU_OUT.dtype.element_ty), mask=mask_a)
        dku = tl.load(DKU + g_ptr, mask=mask_a, other=0.0, cache_modifier=".cg")
        if SIGMA_PRE:
            dku *= 2.0 * scale
        else:
            dku *= scale * scale
        tl.store(DKU_OUT + g_ptr, dku.to(DKU_OUT.dtype.element_ty), mask=mask_a)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block_d(D):
    """The head dim the kernels' tiles take: the next power of two, at least 16 (96 -> 128, masked)."""
    return max(16, triton.next_power_of_2(D))


def _dot_dtype(dtype):
    """Matmul operand dtype. The interpreter multiplies bf16 as raw integers (triton 3.6), so there the
    tiles are upcast to fp32: CPU runs check the algorithm, GPU runs the bf16 rounding."""
    if _interpreting():
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _prepare(xs):
    """The kernels take one set of (batch, head, position) strides and unit-stride head dims."""
    if any(t.stride() != xs[0].stride() for t in xs) or xs[0].stride(-1) != 1:
        xs = [t.contiguous() for t in xs]
    return xs


def _forward_buffers(qc, cfg):
    """Empty out (B, H, L, D), lse (BH, NR*m) fp32 and u (BH, NR*m, block_d) fp32 of the forward."""
    B, H, L, D = qc.shape
    rows = triton.cdiv(L, cfg.m_fwd) * cfg.m_fwd
    return (qc.new_empty(B, H, L, D), qc.new_empty(B * H, rows, dtype=torch.float32),
            qc.new_empty(B * H, rows, _block_d(D), dtype=torch.float32))


def _precision(dt):
    """tl.dot's input_precision: exact fp32 products for fp32 operands (16-bit ones are exact either way)."""
    return "ieee" if dt == tl.float32 else "tf32"


def _sigma_prescaled(scale):
    """Whether s / 2 is a power of two, so that sigma's operand may carry it exactly (_half_scaled)."""
    return math.frexp(0.5 * scale)[0] == 0.5


def _in_bounds(L, m, D, block_d):
    """Whether every (m, block_d) tile of a head lies inside it, so that the kernels load it unmasked (_load_tile:
    1-2% off fwd+bwd at L = 2048 on an H200)."""
    return L % m == 0 and D == block_d


def _tile_constexprs(D, block_d, dt, scale, L, m, n):
    """The constexprs the forward and the backward kernels share, for tiles of m rows and n keys."""
    return dict(HEAD_DIM=D, BM=m, BN=n, BLOCK_D=block_d, DT=dt, PREC=_precision(dt), ASM=not _interpreting(),
                SIGMA_PRE=_sigma_prescaled(scale), IN_BOUNDS=_in_bounds(L, m, D, block_d))


def _fwd_constexprs(D, block_d, cfg, dt, scale, L):
    """The forward kernel's constexprs (scripts/castle_regs.py compiles it with them too)."""
    return dict(_tile_constexprs(D, block_d, dt, scale, L, cfg.m_fwd, cfg.n_fwd), STAGES=cfg.stages_fwd)


def _fwd_head_group(cfg, L):
    """Heads the forward's launch order interleaves: cfg.head_group_fwd, fewer where their key blocks and U
    would outgrow L2 (at most 32K positions in flight)."""
    return max(1, min(cfg.head_group_fwd, 32768 // L))


def _triton_forward(qc, kc, vc, qu, ku, vu, window, scale, cfg, save_t):
    """-> out (B, H, L, D), lse (BH, NR*m) in log2 units, u (BH, NR*m, block_d) fp32 = U^{save_t}."""
    qc, kc, vc, qu, ku, vu = _prepare([qc, kc, vc, qu, ku, vu])
    B, H, L, D = qc.shape
    block_d = _block_d(D)
    nr = triton.cdiv(L, cfg.m_fwd)
    out, lse, u = _forward_buffers(qc, cfg)
    sync = torch.zeros(B * H * nr + 1, dtype=torch.int32, device=qc.device)
    dt = _dot_dtype(qc.dtype)
    _castle_fwd_kernel[(B * H * nr,)](
        qc, kc, vc, qu, ku, vu, out, lse, u, sync,
        qc.stride(0), qc.stride(1), qc.stride(2), H, L, nr, _window_or_len(window, L), save_t,
        _fwd_head_group(cfg, L), scale, **_fwd_constexprs(D, block_d, cfg, dt, scale, L), num_warps=cfg.warps_fwd,
        num_stages=1,
    )
    return out, lse, u


# Backward launch order: 8 heads at a time, longest columns first (see the kernel). On an H100 (bf16, D = 64,
# split 64/64) this took 3-6% off the backward against one head at a time: 3.36 vs 3.47 ms at B8 H9 L2048,
# 2.57 vs 2.76 ms for CASTLE-SWL (W = 512); 2 / 4 / 16 heads gained less (scripts/NOTES_castle.md).
_BWD_HEAD_GROUP = 8


def _bwd_kernels(variant, D, block_d, cfg, dt, scale, L, windowed=False):
    """[(label, kernel, constexprs)] of the launches of one backward variant (scripts/castle_regs.py
    reads it too)."""
    consts = dict(_tile_constexprs(D, block_d, dt, scale, L, cfg.m_bwd, cfg.n_bwd), CAUSAL_GRADS=True,
                  SIGMA_GRADS=True, STORED=False, FINISH=True, HEAD_GROUP=_BWD_HEAD_GROUP, ROW_GUARD=cfg.row_guard,
                  SIGMA_STAGES=1 if windowed else cfg.stages_bwd)
    if variant == "fused":
        return [("all", _castle_bwd_kernel, consts)]
    if variant == "stored":
        return [("stored", _castle_bwd_kernel, {**consts, "STORED": True})]
    assert variant == "split", f"backward variant must be one of {BWD_VARIANTS}, got {variant!r}"
    return [("causal", _castle_bwd_kernel, {**consts, "SIGMA_GRADS": False, "FINISH": False}),
            ("sigma", _castle_bwd_kernel, {**consts, "CAUSAL_GRADS": False})]


# Share of the free device memory the dS strips may take. Fewer strips than the programs that run at once
# only make programs wait for one (tickets keep that deadlock-free), so very long L slows down instead of
# running out of memory.
_STRIP_MEMORY_SHARE = 0.25


def _ds_strips(device, work, strip_bytes):
    """dS strips of the "stored" backward: four per SM, twice the programs that run at once (two per SM
    at ~240 registers a thread), so that a strip is free again by the time its next ticket comes, and no
    more than _STRIP_MEMORY_SHARE of the free memory (~35 MB a strip at L = 256K: 18 GB for 528 strips)
    allows, but at least one; under the interpreter two, so that tests reuse strips. Free memory counts the
    caching allocator's unused blocks too, but torch's statistics of them cost ~0.25 ms of CPU a call
    (H200), so they are read only where the device's own free memory would cap the strips."""
    if _interpreting():
        return min(work, 2)
    wanted = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    free = torch.cuda.mem_get_info(device)[0]
    strips = _strip_count(work, wanted, strip_bytes, free)
    if strips < min(work, wanted):  # capped: count the allocator's unused blocks as free too
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        strips = _strip_count(work, wanted, strip_bytes, free + unused)
    return strips


def _strip_count(work, wanted, strip_bytes, free_bytes):
    return max(1, min(work, wanted, int(_STRIP_MEMORY_SHARE * free_bytes) // strip_bytes))


def _triton_backward(do, qc, kc, vc, qu, ku, vu, out, lse, u, window, scale, cfg):
    """u: the U the forward saved for the backward; None for "stored", which rebuilds it."""
    qc, kc, vc, qu, ku, vu = _prepare([qc, kc, vc, qu, ku, vu])
    B, H, L, D = qc.shape
    block_d = _block_d(D)
    nr, nc = triton.cdiv(L, cfg.m_bwd), triton.cdiv(L, cfg.n_bwd)
    do = do.contiguous()
    delta = torch.empty_like(lse)                                                   # spec §3.5, Delta
    _castle_delta_kernel[(B * H, triton.cdiv(lse.shape[1], 64))](do, out, delta, L, lse.shape[1], HEAD_DIM=D,
                                                                  BLOCK_D=block_d, BLOCK=64)
    # The fp32 sums of the row gradients and E per row block, zeroed by one fill (four fills took 0.4% more of
    # fwd+bwd at B8 H9 L2048 on an H200)
    n_rows, n_e = B * H * L * D, B * H * nr * cfg.m_bwd * cfg.m_bwd
    sums = torch.zeros(3 * n_rows + n_e, dtype=torch.float32, device=qc.device)
    dqc, dku, dvu = (sums[i * n_rows:(i + 1) * n_rows].view(B, H, L, D) for i in range(3))
    e = sums[3 * n_rows:].view(B * H, nr * cfg.m_bwd, cfg.m_bwd)
    # the six gradients in the input dtype: the key-block ones written by their one owner each, the row ones
    # finished from the sums
    dkc, dvc, dqu, *outs = (torch.empty(B, H, L, D, dtype=qc.dtype, device=qc.device) for _ in range(6))
    dt = _dot_dtype(qc.dtype)
    strips, ds = 0, None
    if cfg.bwd_variant == "stored":
        ds_dtype = torch.float32 if dt == tl.float32 else qc.dtype
        strips = _ds_strips(qc.device, B * H * nc, nr * cfg.m_bwd * cfg.n_bwd * ds_dtype.itemsize)
        ds = torch.empty(strips, nr * cfg.m_bwd, cfg.n_bwd, device=qc.device, dtype=ds_dtype)
    for _, kernel, consts in _bwd_kernels(cfg.bwd_variant, D, block_d, cfg, dt, scale, L, window is not None):
        sync = torch.zeros(strips + 1 + B * H, dtype=torch.int32, device=qc.device)  # strips, ticket, heads
        kernel[(B * H * (nc + nr * consts["FINISH"]),)](
            qc, kc, vc, qu, ku, vu, do, lse, delta, lse if u is None else u,  # lse: a pointer never read
            dqc, dkc, dvc, dqu, dku, dvu, e, ds, sync, *outs,
            qc.stride(0), qc.stride(1), qc.stride(2), H, L, nr, nc, B * H, strips, _window_or_len(window, L), scale,
            lse.shape[1], **consts, num_warps=cfg.warps_bwd, num_stages=1,
        )
    dqc, dku, dvu = outs
    return dqc, dkc, dvc, dqu, dku, dvu


# The Triton path as two custom ops: torch.compile keeps each one call in its graph (opaque, no graph break)
# instead of tracing into the launch code. The tile config travels as the literal of its field tuple (ops take
# plain types only; dynamo can trace building that string, not repr or json of a dataclass).


def _config_key(cfg):
    return str(tuple(getattr(cfg, f.name) for f in fields(cfg)))


@functools.lru_cache(maxsize=None)  # parsing the key took ~30 us of CPU, twice per fwd+bwd
def _config_from_key(key):
    return TritonConfig(*ast.literal_eval(key))


@torch.library.custom_op("castle::triton_fwd", mutates_args=())
def _triton_fwd_op(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, qu: torch.Tensor, ku: torch.Tensor,
                   vu: torch.Tensor, window: Optional[int], scale: float,
                   cfg_key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> out, lse, and the U the backward starts from (empty for "stored", which rebuilds it)."""
    cfg = _config_from_key(cfg_key)
    L = qc.shape[-2]
    save_t = (triton.cdiv(L, cfg.m_bwd) - 1) * cfg.m_bwd  # start of the backward's last row block
    out, lse, u = _triton_forward(qc, kc, vc, qu, ku, vu, window, scale, cfg, save_t)
    return out, lse, _u_kept(u, cfg)


@_triton_fwd_op.register_fake
def _(qc, kc, vc, qu, ku, vu, window, scale, cfg_key):
    cfg = _config_from_key(cfg_key)
    out, lse, u = _forward_buffers(qc, cfg)
    return out, lse, _u_kept(u, cfg)


def _u_kept(u, cfg):
    """The forward's U as the backward needs it: "stored" rebuilds U, so an empty stand-in (ops return tensors)."""
    return u if cfg.bwd_variant != "stored" else u.new_empty(0)


@torch.library.custom_op("castle::triton_bwd", mutates_args=())
def _triton_bwd_op(do: torch.Tensor, qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, qu: torch.Tensor,
                   ku: torch.Tensor, vu: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, u: torch.Tensor,
                   window: Optional[int], scale: float, cfg_key: str) -> list[torch.Tensor]:
    """-> dqc, dkc, dvc, dqu, dku, dvu, contiguous, in the inputs' dtype."""
    return list(_triton_backward(do, qc, kc, vc, qu, ku, vu, out, lse, u if u.numel() else None, window, scale,
                                 _config_from_key(cfg_key)))


@_triton_bwd_op.register_fake
def _(do, qc, kc, vc, qu, ku, vu, out, lse, u, window, scale, cfg_key):
    return [t.new_empty(t.shape) for t in (qc, kc, vc, qu, ku, vu)]


def _save_for_backward(ctx, inputs, output):
    *xs, window, scale, cfg_key = inputs
    ctx.save_for_backward(*xs, *output)
    ctx.window, ctx.scale, ctx.cfg_key = window, scale, cfg_key


def _triton_fwd_op_backward(ctx, do, _dlse, _du):
    grads = _triton_bwd_op(do, *ctx.saved_tensors, ctx.window, ctx.scale, ctx.cfg_key)
    return (*grads, None, None, None)


_triton_fwd_op.register_autograd(_triton_fwd_op_backward, setup_context=_save_for_backward)


def _attn_triton(qc, kc, vc, qu, ku, vu, window, scale, cfg=None):
    if triton is None:
        raise RuntimeError("impl='triton' needs the triton package (pip install triton); "
                           "use impl='blockwise' or 'torch' without it")
    if qc.shape[-1] > 128:
        raise ValueError(f"the Triton kernels take head dims up to 128, got {qc.shape[-1]}; "
                         "use impl='blockwise' or a smaller head_dim")
    cfg = cfg or _default_config(_block_d(qc.shape[-1]), qc.dtype)
    assert cfg.m_fwd % cfg.n_fwd == 0 and cfg.m_bwd % cfg.n_bwd == 0 and cfg.m_fwd % cfg.m_bwd == 0, cfg
    return _triton_fwd_op(qc, kc, vc, qu, ku, vu, window, scale, _config_key(cfg))[0]


# ----------------------------------------------------------------------------------------------------
# Public entry points


def castle_attn(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, impl="auto"):
    """CASTLE (window=None) or CASTLE-SWL (window=W) attention; inputs (B, H, L, D) -> (B, H, L, D)."""
    _check(qc, kc, vc, qu, ku, vu, window)
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; choose one of {_IMPLS}")
    scale = qc.shape[-1] ** -0.5 if scale is None else float(scale)
    if qc.shape[-2] == 0:
        return torch.empty_like(qc)
    if impl == "auto":
        impl = "triton" if qc.is_cuda and triton is not None and qc.dtype != torch.float64 else "torch"
    if impl == "torch":
        return _attn_parallel(qc, kc, vc, qu, ku, vu, window, scale)
    if impl == "blockwise":
        return _CastleBlockwise.apply(qc, kc, vc, qu, ku, vu, window, scale, 64)
    return _attn_triton(qc, kc, vc, qu, ku, vu, window, scale)


def _grown(buf, filled, rows):
    """A fresh (..., rows, D) buffer holding the first `filled` rows of buf; the rest is uninitialised."""
    new = buf.new_empty(*buf.shape[:-2], rows, buf.shape[-1])
    new[..., :filled, :] = buf[..., :filled, :]
    return new


def _doubled(rows):
    return max(2 * rows, 16)


@dataclass(eq=False)
class CastleCache:
    """UQ-KV cache of one CASTLE layer (spec §4.2) after `length` positions.

    The tensors live in preallocated (B, H, rows, D) buffers: castle_decode writes the new position in
    place and doubles a buffer only when it is full (amortised O(1) copies per step). Read the filled
    part through the views u, qu, kc, vc; a view taken before a step that grows a buffer goes stale.

    u_buf:  lookahead keys U, fp32 (fp64 for fp64 inputs); row j is u_j; the last row, u_{length-1}, is
            zero (spec §4.1).
    kc_buf, vc_buf: causal keys and values, input dtype; row j is position j.
    qu_buf: lookahead queries Q^U, input dtype, holding only the rows read again, i.e. the owners the
            next token reaches (spec §4.2): every position for CASTLE, the last min(length, W) for SWL,
            at rows [qu_end - n, qu_end). When full, it moves the rows still needed to the front if
            they fill at most half of it, else it doubles: SWL's stays under max(4W, 16) rows,
            CASTLE's grows like the others.
    window, scale: as given to castle_prefill; decode reuses them.
    """
    u_buf: torch.Tensor
    qu_buf: torch.Tensor
    kc_buf: torch.Tensor
    vc_buf: torch.Tensor
    length: int
    qu_end: int
    window: int | None
    scale: float

    @property
    def capacity(self):
        return self.kc_buf.shape[-2]

    def owners(self, t):
        """How many positions before position t have a lookahead key that token t adds to (eq 13)."""
        return t if self.window is None else min(t, self.window)

    @property
    def u(self):
        return self.u_buf[..., : self.length, :]

    @property
    def kc(self):
        return self.kc_buf[..., : self.length, :]

    @property
    def vc(self):
        return self.vc_buf[..., : self.length, :]

    @property
    def qu(self):
        """Q^U of the owners the next token reaches (positions length - n .. length - 1)."""
        return self.qu_buf[..., self.qu_end - self.owners(self.length): self.qu_end, :]

    def reserve(self):
        """Room for position `length` in the U, K^C, V^C buffers: a full buffer doubles."""
        t = self.length
        if t == self.capacity:
            rows = _doubled(t)
            self.u_buf, self.kc_buf, self.vc_buf = (_grown(b, t, rows) for b in (self.u_buf, self.kc_buf, self.vc_buf))

    def _qu_keep(self):
        """How many older Q^U rows are still read after position `length` is added; -1 when not even the
        new one is (SWL with W = 0 keeps no Q^U at all)."""
        return self.owners(self.length + 1) - 1

    def qu_slot(self):
        """The Q^U row that position `length` goes to if it fits without moving rows, else None (also when
        no Q^U row is kept)."""
        if self._qu_keep() < 0 or self.qu_end == self.qu_buf.shape[-2]:
            return None
        return self.qu_end

    def push_qu(self, qu, written):
        """Record position `length`'s q^U (B, H, 1, D); `written`: already stored at qu_slot() (by the
        decode kernel). A full buffer first moves the rows still needed to the front if they fill at most
        half of it, else it doubles."""
        keep = self._qu_keep()
        if keep < 0:
            return
        end = self.qu_end
        if not written:
            if end == self.qu_buf.shape[-2]:
                if 0 < end and 2 * keep <= end:                # slide: the kept rows fit in the first half
                    self.qu_buf[..., :keep, :] = self.qu_buf[..., end - keep: end, :]
                    self.qu_end = end = keep
                else:
                    self.qu_buf = _grown(self.qu_buf, end, _doubled(end))
            self.qu_buf[..., end: end + 1, :] = qu
        self.qu_end = end + 1

    def append(self, qu, kc, vc):
        """Store position `length` in place: u = 0 (spec §4.1), and q^U, k^C, v^C given as (B, H, 1, D).
        Call after adding the position to the lookahead keys of its owners (that reads self.qu)."""
        self.reserve()
        t = self.length
        self.u_buf[..., t, :] = 0
        self.kc_buf[..., t: t + 1, :] = kc
        self.vc_buf[..., t: t + 1, :] = vc
        self.push_qu(qu, written=False)
        self.length = t + 1


def castle_cache_from(u, qu, kc, vc, window, scale, max_len):
    """The UQ-KV cache holding a prompt's U, Q^U, K^C, V^C (B, H, L, D), with room for
    max(L, max_len) positions before a buffer grows (castle_prefill builds its cache with this)."""
    L = kc.shape[-2]
    rows = max(L, max_len or 0)
    n = L if window is None else min(L, window)
    qu_rows = rows if window is None else min(rows, 2 * window)
    return CastleCache(u_buf=_grown(u, L, rows), qu_buf=_grown(qu[..., L - n:, :], n, qu_rows),
                       kc_buf=_grown(kc, L, rows), vc_buf=_grown(vc, L, rows),
                       length=L, qu_end=n, window=window, scale=scale)


def castle_prefill(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, max_len=None):
    """Attention over a prompt of L positions plus the UQ-KV cache after it (spec §4.3). The block
    forward (Triton on CUDA, blockwise PyTorch otherwise) also folds the last block into its U state,
    which then is U^L: Algorithm 4 for free. max_len: positions (prompt included) to preallocate the
    cache for; decoding past it still works (the buffers double)."""
    _check(qc, kc, vc, qu, ku, vu, window)
    scale = qc.shape[-1] ** -0.5 if scale is None else float(scale)
    B, H, L, D = qc.shape
    cdt = _compute_dtype(qc.dtype)
    if L == 0:
        out, u = torch.empty_like(qc), qc.new_zeros(B, H, 0, D, dtype=cdt)
    elif qc.is_cuda and triton is not None and qc.dtype != torch.float64:
        cfg = _default_config(_block_d(D), qc.dtype)
        out, _, u = _triton_forward(qc, kc, vc, qu, ku, vu, window, scale, cfg, save_t=L)
        u = u.view(B, H, -1, u.shape[-1])[:, :, :L, :D]
    else:
        bs = 64
        blocks = [_to_blocks(t.to(cdt), bs) for t in (qc, kc, vc, qu, ku, vu)]
        out, _, u = _blockwise_forward(*blocks, window, scale, bs, keep_last=True)
        out, u = out.flatten(2, 3)[:, :, :L].to(qc.dtype), u.flatten(2, 3)[:, :, :L]
    return out, castle_cache_from(u.to(cdt), qu, kc, vc, window, scale, max_len)


def castle_decode(cache, qc, kc, vc, qu, ku, vu, *, impl="auto"):
    """One new position (B, H, 1, D) -> (out, cache), spec §4.1, O(T d) for T cached positions.

    The cache is updated in place (and returned): eq (13) adds the token to the lookahead keys of the
    owners it reaches (every cached row for CASTLE, the last W for SWL; older rows are not touched),
    then the position's own rows are written, then eqs (5)-(8) score every cached position.

    impl: "triton" does the whole step in two launches (_decode_triton), fp32 math on the cached
    operands; "torch" in PyTorch ops, the causal part through SDPA with the per-key bias -SiLU(s q^C u_j^T)
    (for 16-bit inputs the bias is rounded to the input dtype and q^U k^U is a 16-bit matmul);
    "auto" takes "triton" on CUDA unless autograd would need the graph (the kernels keep none)."""
    _check(qc, kc, vc, qu, ku, vu, cache.window)
    if qc.shape[-2] != 1:
        raise ValueError(f"castle_decode takes one position at a time, got {qc.shape[-2]}; "
                         "feed a longer prompt to castle_prefill")
    held = cache.kc_buf
    if (qc.shape[:2], qc.shape[-1], qc.device) != (held.shape[:2], held.shape[-1], held.device):
        raise ValueError(f"the new position is (B, H, 1, D) = {tuple(qc.shape)} on {qc.device}, but the cache "
                         f"holds (B, H, D) = {(*held.shape[:2], held.shape[-1])} on {held.device}; decode with "
                         "the cache castle_prefill made for this layer and batch")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl={impl!r} is unknown; choose auto, torch or triton")
    if impl == "auto":
        tracked = torch.is_grad_enabled() and any(x.requires_grad for x in (qc, kc, vc, qu, ku, vu))
        impl = "triton" if qc.is_cuda and triton is not None and qc.dtype != torch.float64 and not tracked else "torch"
    if impl == "triton":
        return _decode_triton(cache, qc, kc, vc, qu, ku, vu), cache
    t, scale, cdt = cache.length, cache.scale, cache.u_buf.dtype
    owners = cache.qu                                                         # positions t - n .. t - 1
    n = owners.shape[-2]
    if n:
        w = torch.sigmoid(scale * (owners @ ku.mT).to(cdt))                   # (B, H, n, 1)
        cache.u_buf[..., t - n: t, :].addcmul_(w, vu.to(cdt))                 # eq (13)
    cache.append(qu, kc, vc)
    s_u = scale * (qc.to(cdt) @ cache.u.mT)                                   # eq (6), (B, H, 1, t + 1)
    out = decode_sdpa(qc, cache.kc, cache.vc, attn_mask=_bias(s_u, qc.dtype), scale=scale)
    return out, cache                                                         # eqs (5), (7), (8)


if triton is not None:
    @triton.jit(do_not_specialize=["t", "n_owners", "qu_shift", "qu_row", "per_split"])
    def _castle_decode_kernel(
        U, QUB, KCB, VCB, PART, QC, sqc_b, sqc_h, KC, skc_b, skc_h, VC, svc_b, svc_h, QU, squ_b, squ_h,
        KU, sku_b, sku_h, VU, svu_b, svu_h, H, cap, qu_rows, t, n_owners, qu_shift, qu_row, per_split,
        scale: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr,
    ):
        """Program (head bh, split): cached positions [split * per_split, ...) of the new position t, BT at
        a time. Owners j (t - n_owners <= j < t) take the token into their lookahead key, u_j += sigma(s
        q^U_j . k^U_t) v^U_t (eq 13, written back in place); then every position's score s q^C_t . k^C_j -
        SiLU(s q^C_t . u_j) (eqs 5-7) enters an online softmax whose state (m, l, acc), in log2 units, goes
        to PART for _castle_decode_combine_kernel (split-K over positions, as flash-decoding does). The
        split holding t writes the position's rows: u_t = 0, k^C_t, v^C_t, and q^U_t at qu_row (if >= 0).
        U, K^C, V^C buffers: contiguous (BH, cap, D); Q^U buffer (BH, qu_rows, D), position j at row
        j - qu_shift; the new position's six vectors come with their own (batch, head) strides (views of
        the model's projections, some rotated, need no copy)."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        qc = _head_vector(QC, sqc_b, sqc_h, bh, H, offs_d, dmask).to(tl.float32) * scale
        kc_t = _head_vector(KC, skc_b, skc_h, bh, H, offs_d, dmask).to(tl.float32)
        vc_t = _head_vector(VC, svc_b, svc_h, bh, H, offs_d, dmask).to(tl.float32)
        ku_t = _head_vector(KU, sku_b, sku_h, bh, H, offs_d, dmask).to(tl.float32) * scale
        vu_t = _head_vector(VU, svu_b, svu_h, bh, H, offs_d, dmask).to(tl.float32)
        c_base = bh.to(tl.int64) * cap * HEAD_DIM
        q_base = bh.to(tl.int64) * qu_rows * HEAD_DIM

        start = split * per_split
        end = tl.minimum(start + per_split, t + 1)
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        l = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        j0 = start
        while j0 < end:
            j = j0 + tl.arange(0, BT)
            cached = (j < t)[:, None] & dmask[None, :]
            ptr = c_base + j[:, None] * HEAD_DIM + offs_d[None, :]
            u = tl.load(U + ptr, mask=cached, other=0.0)
            if (j0 + BT > t - n_owners) & (j0 < t):
                owner = ((j >= t - n_owners) & (j < t))[:, None] & dmask[None, :]
                qu = tl.load(QUB + q_base + (j - qu_shift)[:, None] * HEAD_DIM + offs_d[None, :], mask=owner,
                             other=0.0).to(tl.float32)
                w = tl.sigmoid(tl.sum(qu * ku_t[None, :], 1))                             # eq (13)
                u = tl.where(owner, u + w[:, None] * vu_t[None, :], u)
                tl.store(U + ptr, u, mask=owner)
            new = (j == t)[:, None]
            kc = tl.where(new, kc_t[None, :], tl.load(KCB + ptr, mask=cached, other=0.0).to(tl.float32))
            vc = tl.where(new, vc_t[None, :], tl.load(VCB + ptr, mask=cached, other=0.0).to(tl.float32))
            s_u = tl.sum(qc[None, :] * u, 1)                                                # eq (6)
            sc = (tl.sum(qc[None, :] * kc, 1) - s_u * tl.sigmoid(s_u)) * _LOG2E             # eqs (5), (7)
            sc = tl.where(j < end, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 0))
            p = tl.exp2(sc - m_new)
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * vc, 0)
            m = m_new
            j0 += BT
        if (start <= t) & (t < end):                     # the new position's own rows (spec §4.1)
            row = c_base + t * HEAD_DIM + offs_d
            tl.store(U + row, tl.zeros([BLOCK_D], dtype=tl.float32), mask=dmask)
            tl.store(KCB + row, kc_t.to(KCB.dtype.element_ty), mask=dmask)
            tl.store(VCB + row, vc_t.to(VCB.dtype.element_ty), mask=dmask)
            if qu_row >= 0:
                qu_t = _head_vector(QU, squ_b, squ_h, bh, H, offs_d, dmask)
                tl.store(QUB + q_base + qu_row * HEAD_DIM + offs_d, qu_t, mask=dmask)
        part = PART + (bh * tl.num_programs(1) + split).to(tl.int64) * (BLOCK_D + 2)
        tl.store(part + offs_d, acc)
        tl.store(part + BLOCK_D + tl.arange(0, 1), m)
        tl.store(part + BLOCK_D + 1 + tl.arange(0, 1), l)

    @triton.jit
    def _head_vector(X, stride_b, stride_h, bh, H, offs_d, dmask):
        """The (D,) vector of head bh of a (B, H, 1, D) tensor with unit stride in D."""
        return tl.load(X + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h + offs_d,
                       mask=dmask, other=0.0)

    @triton.jit
    def _castle_decode_combine_kernel(PART, OUT, splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                      BLOCK_S: tl.constexpr):
        """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of head program_id(0)."""
        bh = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        part = PART + (bh * splits + offs_s).to(tl.int64) * (BLOCK_D + 2)
        smask = offs_s < splits
        m = tl.load(part + BLOCK_D, mask=smask, other=float("-inf"))
        l = tl.load(part + BLOCK_D + 1, mask=smask, other=0.0)
        acc = tl.load(part[:, None] + offs_d[None, :], mask=smask[:, None], other=0.0)
        w = tl.exp2(m - tl.max(m, 0))
        out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
        tl.store(OUT + bh.to(tl.int64) * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)


_DECODE_PROGRAMS_PER_SM = 4


def _decode_tiles(positions, heads, block_d, device):
    """(rows per tile, positions per split, splits) of a decode step: enough programs to fill the GPU,
    each a whole number of row tiles of 4096 elements, 2 warps each. In a sweep over 16-128 rows and 2-8
    warps on an H200 (B1 H16, 32K and 128K positions, CASTLE and SWL W = 512, GPU time) this shape was the
    fastest at 4 of the 8 points and within 6% (D = 64) or 16% (D = 128) at the others, where 32-row
    tiles for CASTLE and 128-row ones for SWL at 4 warps took up to twice as long at D = 128
    (scripts/NOTES_castle.md, session 22). Under the interpreter 16-row tiles and 4 "SMs", so that tiny
    tests cross tiles and splits."""
    if _interpreting():
        rows, sms = 16, 4
    else:
        rows, sms = 4096 // block_d, torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(triton.cdiv(positions, rows), triton.cdiv(_DECODE_PROGRAMS_PER_SM * sms, heads)))
    per_split = triton.cdiv(triton.cdiv(positions, splits), rows) * rows
    return rows, per_split, triton.cdiv(positions, per_split)


def _decode_triton(cache, qc, kc, vc, qu, ku, vu):
    """castle_decode in two launches: the step kernel (U update, the position's rows, split softmax) and
    the combine; the cache's bookkeeping stays on the host."""
    if triton is None:
        raise RuntimeError("castle_decode(impl='triton') needs the triton package; use impl='torch'")
    if qc.dtype == torch.float64:
        raise ValueError("castle_decode(impl='triton') computes in fp32; for fp64 inputs use impl='torch'")
    cache.reserve()
    if not all(b.is_contiguous() for b in (cache.u_buf, cache.qu_buf, cache.kc_buf, cache.vc_buf)):
        raise ValueError("castle_decode(impl='triton') needs contiguous cache buffers (castle_prefill and "
                         "castle_cache_from make them); use impl='torch' for others")
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in (qc, kc, vc, qu, ku, vu)]
    B, H, _, D = qc.shape
    block_d = _block_d(D)
    t, n = cache.length, cache.owners(cache.length)
    slot = cache.qu_slot()
    rows, per_split, splits = _decode_tiles(t + 1, B * H, block_d, qc.device)
    part = torch.empty(B * H, splits, block_d + 2, dtype=torch.float32, device=qc.device)
    _castle_decode_kernel[(B * H, splits)](
        cache.u_buf, cache.qu_buf, cache.kc_buf, cache.vc_buf, part, *[a for x in xs for a in (x, *x.stride()[:2])],
        H, cache.capacity, cache.qu_buf.shape[-2], t, n, t - cache.qu_end,
        -1 if slot is None else slot, per_split, cache.scale, HEAD_DIM=D, BLOCK_D=block_d, BT=rows,
        num_warps=2,
    )
    cache.push_qu(qu, written=slot is not None)
    cache.length = t + 1
    out = torch.empty(B, H, 1, D, dtype=qc.dtype, device=qc.device)
    _castle_decode_combine_kernel[(B * H,)](part, out, splits, HEAD_DIM=D, BLOCK_D=block_d,
                                            BLOCK_S=triton.next_power_of_2(splits))
    return out


def _bias(s_u, dtype):
    """-SiLU(s^U) as an SDPA attn_mask whose rows start 16-element aligned, as the memory-efficient CUDA
    kernel wants them (else SDPA copies the mask into a padded buffer itself, with a warning)."""
    n = s_u.shape[-1]
    bias = s_u.new_empty(*s_u.shape[:-1], -(-n // 16) * 16, dtype=dtype)[..., :n]
    return bias.copy_(F.silu(s_u)).neg_()
