"""CASTLE's definitions in PyTorch: the parallel form (impl="torch") and the block algorithm
(impl="blockwise", with a hand-written backward). CASTLE (arXiv:2509.07301) per head, with
s = scale = d ** -0.5 used as in eqs (11)/(12) (the proof of Theorem 1 in Appendix 6 divides S^U by
sqrt(d) once more: a typo; eqs (6), (11), (12) agree on one factor s):

    A_U   = sigmoid(s * Qu Ku^T)  masked to owner j < contributor i (SWL: i <= j + W)     eqs (3), (4), (9)
    S^U   = (s * Qc Vu^T, causal) @ A_U^T                                   (strictly lower triangular)
    out   = softmax(s * Qc Kc^T - SiLU(S^U), causal) @ Vc                  eqs (10)-(12)

Two ablations of CASTLE (arXiv:2509.07301) §5.2 ride on every entry point: kc=None removes the causal keys
(Table 5; the logits are then -SiLU(S^U) alone, see lookahead_logit) and silu=False drops the SiLU gate
(Table 10: s * Qc Kc^T - S^U).

    attn_parallel   L x L matrices and an L x L x L product (O(L^3)); the reference, differentiable by
                    autograd in any dtype (fp64 in the tests). parallel_logits: its logits and A_U (a prompt
                    chunk's block scores itself with them, decode.py).
    attn_blockwise  the O(L^2 d) block algorithm of Theorem 2 (Appendix 8): the paper's anti-diagonal sweep,
                    vectorised over each anti-diagonal, with a hand-written backward (Algorithm 3); nothing
                    larger than an L x block strip is ever held. For CPU at moderate lengths.
"""
import torch
import torch.nn.functional as F

from kernels.triton_utils import at_least_fp32


# ----------------------------------------------------------------------------------------------------
# Shared by every entry point


def check_inputs(qc, kc, vc, qu, ku, vu, window):
    """kc may be None: CASTLE without causal keys."""
    if qc.dim() != 4:
        raise ValueError(f"CASTLE expects (B, H, L, D) tensors, got shape {tuple(qc.shape)}")
    for name, t in zip(("kc", "vc", "qu", "ku", "vu"), (kc, vc, qu, ku, vu)):
        if t is None and name == "kc":
            continue
        if t.shape != qc.shape or t.dtype != qc.dtype or t.device != qc.device:
            raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; all six inputs must match "
                             f"qc: {tuple(qc.shape)} {qc.dtype} on {qc.device}")
    if not (window is None or (isinstance(window, int) and window >= 0)):
        raise ValueError(f"window must be None (CASTLE) or an int >= 0 (CASTLE-SWL), got {window!r}")


def lookahead_logit(s_u, silu):
    """The lookahead keys' share of the logits: -SiLU(S^U) (eq (12)), or -S^U without the gate (silu=False,
    the "w/o SiLU" ablation of Table 10, which the paper leaves as s^C - s^U).

    Without causal keys (kc=None, Table 5) this is the whole logit: softmax(-SiLU(S^U) + M^C). The paper
    states no formula for that variant; dropping s^C from eq (7) is the one reading that removes W^C_K
    alone (6 matrices per head, so 7 heads carry the parameters of 6 CASTLE heads, as Table 5 has it) and
    leaves the lookahead path exactly as CASTLE has it. Note that the newest position then always scores 0
    (its lookahead key is zero) and earlier ones at most 0.28 (the minimum of -SiLU)."""
    return -F.silu(s_u) if silu else -s_u


def window_or_len(window, L):
    """SWL with W >= L - 1 is CASTLE (its mask, eq (9), is then CASTLE's), so CASTLE is run as W = L."""
    return L if window is None else min(window, L)


# ----------------------------------------------------------------------------------------------------
# The parallel form (Theorem 1, eqs 10-12)


def parallel_logits(qc, kc, qu, ku, vu, window, scale, silu=True):
    """The logits of eq (12) over L positions, (..., L query, L key) with -inf above the diagonal, and A_U
    (..., L owner, L contributor), both in at_least_fp32 of the inputs' dtype."""
    qc, kc, qu, ku, vu = (None if t is None else t.to(at_least_fp32(qc.dtype)) for t in (qc, kc, qu, ku, vu))
    L = qc.shape[-2]
    idx = torch.arange(L, device=qc.device)
    causal = idx[:, None] >= idx[None, :]                                # (query t, key j)
    ahead = idx[:, None] < idx[None, :]                                  # (owner j, contributor i)
    if window is not None:
        ahead = ahead & (idx[None, :] <= idx[:, None] + window)
    a_u = torch.sigmoid(scale * qu @ ku.mT).masked_fill(~ahead, 0.0)
    r = (scale * qc @ vu.mT).masked_fill(~causal, 0.0)
    s_u = r @ a_u.mT                                                     # eq (11)
    scores = lookahead_logit(s_u, silu)
    if kc is not None:
        scores = scores + scale * qc @ kc.mT
    return scores.masked_fill(~causal, float("-inf")), a_u


def attn_parallel(qc, kc, vc, qu, ku, vu, window, scale, silu=True):
    scores, _ = parallel_logits(qc, kc, qu, ku, vu, window, scale, silu)
    return (torch.softmax(scores, dim=-1) @ vc.to(scores.dtype)).to(qc.dtype)    # eq (12)


# ----------------------------------------------------------------------------------------------------
# The block algorithm (Appendix 8) in PyTorch, vectorised over each anti-diagonal k (tiles (j + k, j), all j)


def to_blocks(x, bs):
    n = -(-x.shape[-2] // bs)
    return F.pad(x, (0, 0, 0, n * bs - x.shape[-2])).unflatten(-2, (n, bs))


def _sigma_mask(k, bs, window, device):
    """Lookahead mask of the sigma tiles on anti-diagonal k: owner j = row r, contributor i = k*bs + col c."""
    off = k * bs + torch.arange(bs, device=device)[None, :] - torch.arange(bs, device=device)[:, None]
    keep = off > 0
    return keep & (off <= window) if window is not None else keep


def _last_sigma_diagonal(n, bs, window):
    """Anti-diagonals k > this have all-zero sigma tiles (every contributor beyond the window): k*bs > bs - 1 + W."""
    return n - 1 if window is None else (bs - 1 + window) // bs


def _causal_logit(qc, kc, a, b, scale):
    """s * Qc_a Kc_b^T of the tiles (a, b); 0 without causal keys (kc None)."""
    return 0.0 if kc is None else scale * qc[:, :, a] @ kc[:, :, b].mT


def blockwise_forward(qc, kc, vc, qu, ku, vu, window, scale, bs, keep_last, silu=True):
    """Blocked inputs (B, H, N, bs, D) in compute dtype (kc may be None) -> out, lse (B, H, N, bs), u.

    u[:, :, b] holds the lookahead keys of block b at the start of the row block being processed (the
    paper's D^{(k)}, eqs (21)-(24), transposed). On return it holds them at the start of the last row
    block, or, with keep_last, after every contributor (= U^L, what prefill caches)."""
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
        sc = _causal_logit(qc, kc, a, b, scale) + lookahead_logit(s, silu)
        if k == 0:                                                       # eq (19)
            sc = sc.masked_fill(~tril, float("-inf"))
        m_new = torch.maximum(m[:, :, a], sc.amax(-1))                   # online softmax (Algorithm 2)
        alpha = torch.exp(m[:, :, a] - m_new)
        p = torch.exp(sc - m_new[..., None])
        denom[:, :, a] = denom[:, :, a] * alpha + p.sum(-1)
        acc[:, :, a] = acc[:, :, a] * alpha[..., None] + p @ vc[:, :, b]
        m[:, :, a] = m_new
    return acc / denom[..., None], m + torch.log(denom), u


def blockwise_backward(do, qc, kc, vc, qu, ku, vu, out, lse, u, window, scale, bs, silu=True):
    """Algorithm 3 (eqs 25-39) in reverse anti-diagonal order; u (state at the start of the last row block) is
    consumed. kc None (no causal keys): its gradient is None."""
    n = qc.shape[2]
    tril = torch.ones(bs, bs, dtype=torch.bool, device=qc.device).tril()
    r = (scale * qc @ vu.mT).masked_fill(~tril, 0.0)
    delta = (do * out).sum(-1)
    du = torch.zeros_like(u)
    dqc, dkc, dvc, dqu, dku, dvu = (None if t is None else torch.zeros_like(t) for t in (qc, kc, vc, qu, ku, vu))
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
        sc = _causal_logit(qc, kc, a, b, scale) + lookahead_logit(s, silu)
        if k == 0:
            sc = sc.masked_fill(~tril, float("-inf"))
        p = torch.exp(sc - lse[:, :, a, :, None])                        # eq (25)
        da = p * (do[:, :, a] @ vc[:, :, b].mT - delta[:, :, a, :, None])  # eqs (26), (28)
        if silu:                                                         # (k = 0 is always in the window)
            sg = torch.sigmoid(s)
            ds = -da * sg * (1 + s * (1 - sg))                            # eq (29)
        else:
            ds = -da
        dvc[:, :, b] += p.mT @ do[:, :, a]                                # eq (27)
        if kc is not None:
            dkc[:, :, b] += scale * da.mT @ qc[:, :, a]                   # eq (30)
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


class CastleBlockwise(torch.autograd.Function):
    """attn_blockwise as an autograd function: blockwise_forward, and blockwise_backward for the gradients."""

    @staticmethod
    def forward(ctx, qc, kc, vc, qu, ku, vu, window, scale, bs, silu):
        blocks = [t if t is None else to_blocks(t.to(at_least_fp32(qc.dtype)), bs) for t in (qc, kc, vc, qu, ku, vu)]
        out, lse, u = blockwise_forward(*blocks, window, scale, bs, keep_last=False, silu=silu)
        ctx.save_for_backward(*blocks, out, lse, u)
        ctx.window, ctx.scale, ctx.bs, ctx.L, ctx.dtype, ctx.silu = window, scale, bs, qc.shape[-2], qc.dtype, silu
        return out.flatten(2, 3)[:, :, : ctx.L].to(qc.dtype)

    @staticmethod
    def backward(ctx, do):
        *blocks, out, lse, u = ctx.saved_tensors
        do = to_blocks(do.to(out.dtype), ctx.bs)
        grads = blockwise_backward(do, *blocks, out, lse, u.clone(), ctx.window, ctx.scale, ctx.bs, ctx.silu)
        return (*(g if g is None else g.flatten(2, 3)[:, :, : ctx.L].to(ctx.dtype) for g in grads),
                None, None, None, None)


def attn_blockwise(qc, kc, vc, qu, ku, vu, window, scale, bs=64, silu=True):
    """The block algorithm on bs-row blocks, differentiable; same dtype out as in."""
    return CastleBlockwise.apply(qc, kc, vc, qu, ku, vu, window, scale, bs, silu)
