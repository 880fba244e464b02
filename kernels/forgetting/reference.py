"""Forgetting Attention in PyTorch: the materialized reference (impl="torch"), what decoding shares
with it, and the pruning rule of Adaptive Computation Pruning that the kernels share with it. c =
cumsum(log f) is kept in float64 and the bias c_i - c_j is taken in float64 before it is rounded (see
the precision policy in kernels/forgetting/__init__.py)."""
import math

import torch

from kernels.triton_utils import at_least_fp32


def fgate_cumsum(log_fgate, c_prev=None):
    """c = cumsum(log f) in float64 along the last axis, continuing after c_prev[..., -1] if given.

    This is how a decoding cache appends: c_cache = cat([c_cache, fgate_cumsum(log_f_new, c_cache)]).
    """
    c = torch.cumsum(log_fgate.to(torch.float64), dim=-1)
    if c_prev is not None and c_prev.shape[-1] > 0:
        c = c + c_prev[..., -1:].to(torch.float64)
    return c


def attend(q, k, v, c_q, c_k, scale, window=None, kept=None):
    """Softmax attention of queries at the last M of N positions, bias c_q[i] - c_k[j], causal, and
    with a window W only over the last W positions (the query's own included); `kept`, a bool mask
    broadcast against the (M, N) logits, removes the entries where it is False.

    c_q, c_k None: no bias (plain softmax attention). The bias difference is taken in float64 and
    only then rounded (see the precision policy). Computes in fp32 (fp64 for fp64 inputs) and
    returns q's dtype.
    """
    ct = at_least_fp32(q.dtype)
    M, N = q.shape[-2], k.shape[-2]
    s = scale * (q.to(ct) @ k.to(ct).transpose(-1, -2))
    if c_q is not None:
        s = s + (c_q.to(torch.float64)[..., :, None] - c_k.to(torch.float64)[..., None, :]).to(ct)
    seen = visible(M, N, window, q.device)
    if kept is not None:
        seen = seen & kept
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    return (p @ v.to(ct)).to(q.dtype)


def visible(M, N, window, device):
    """(M, N) bool: which of N keys the last M of N positions see, causal and within the window."""
    d = torch.arange(N - M, N, device=device)[:, None] - torch.arange(N, device=device)[None, :]
    return (d >= 0) & (d < (N if window is None else window))


def reference_attn(q, k, v, log_fgate, scale, window=None, prune=None):
    """forgetting_attn(impl="torch"): the whole L x L biased softmax; autograd gives the backward.
    prune: None, or (log_eps, block): the entries that Adaptive Computation Pruning skips (acp_plan) are
    masked out, as the kernels skip them."""
    c = fgate_cumsum(log_fgate) if log_fgate is not None else None
    kept = acp_kept(q, k, c, scale, *prune) if prune is not None else None
    return attend(q, k, v, c, c, scale, window, kept)


# -------------------------------------------------------------------------------------------------
# Adaptive Computation Pruning (ACP; Lin et al., arXiv:2504.06949 §3): skip the (query block, key block)
# pairs whose entries provably weigh so little that all a row loses weighs less than eps.
# -------------------------------------------------------------------------------------------------

def acp_block_bounds(q, k, scale, block):
    """(B, H, n, n) with n = ceil(L / block): for query block a and key block b an upper bound on
    scale q_i.k_j - scale q_i.k_i over the i of a and the j of b,

        bound[a, b] = scale max_{i in a} |q_i| max_{j in b} |k_j| + max_{i in a} (-scale q_i.k_i)

    Why it is what ACP needs: a weight is exp(scale q_i.k_j + c_i - c_j - lse_i), and lse_i >= scale q_i.k_i
    (the diagonal entry: its bias is 0 and it is never pruned). So every entry of the pair weighs less than
    exp(bound[a, b] + c_first[a] - c_last[b]) (c never increases), and a pair where that is below eps / L
    can go: the up to L entries a row loses then weigh less than eps together. Measured on the inputs, the
    bound holds for any q and k; it is tighter than the paper's 2U (U >= |scale q.k| everywhere: one bound
    for the numerator and one for lse_i).
    Positions past L are zeros (norm 0, diagonal logit 0): they only loosen the bound."""
    ct = at_least_fp32(q.dtype)
    L = q.shape[-2]
    n = -(-L // block)

    def per_block(x):  # (B, H, L) -> (B, H, n), the max over each block, zeros past L
        return torch.nn.functional.pad(x, (0, n * block - L)).unflatten(-1, (n, block)).amax(-1)
    q_norm, k_norm = (per_block(torch.linalg.vector_norm(x, dim=-1, dtype=ct)) for x in (q, k))
    diag = per_block(-scale * (q.to(ct) * k.to(ct)).sum(-1))
    return scale * q_norm[..., :, None] * k_norm[..., None, :] + diag[..., :, None]


def acp_kept(q, k, c, scale, log_eps, block):
    """(B, H, L, L) bool: the entries that ACP keeps with blocks of `block` positions, c = cumsum(log f)
    (B, H, L) in natural-log units (causality and a window are separate masks)."""
    L = q.shape[-2]
    first = torch.arange(0, L, block, device=q.device)
    last = (first + block - 1).clamp_max(L - 1)  # c stays constant after L (the kernels' padding)
    skip, _ = acp_plan(c[..., first], c[..., last], acp_block_bounds(q, k, scale, block), log_eps, L)
    keys = torch.arange(L, device=q.device) // block
    return keys[None, :] >= skip.repeat_interleave(block, -1)[..., :L, None]


def acp_plan(c_first, c_last, bounds, log_eps, L):
    """Which block pairs ACP keeps: c (natural log) at each block's first and last position, (B, H, n) with
    n blocks, acp_block_bounds' (B, H, n, n), and log eps for a sequence of L positions. Key block b < a may
    go for query block a iff c_first[a] - c_last[b] + bounds[a, b] < log eps - log L (acp_block_bounds).

    Returns int32 (B, H, n) tensors `skip` (query block a skips key blocks 0 .. skip[a] - 1) and `q_end`
    (key block b is seen by query blocks b .. q_end[b] - 1): the same pairs, for the loops over keys and the
    loop over queries. skip[a] is the run of leading key blocks that may go, lowered where a later query block's
    run is shorter: non-decreasing, so the query blocks that keep a key block are a run too, and never more
    than may go. The diagonal block is always kept."""
    n = c_first.shape[-1]
    blocks = torch.arange(n, device=c_first.device)
    negligible = c_first[..., :, None] - c_last[..., None, :] + bounds < log_eps - math.log(L)  # (B, H, a, b)
    may_go = negligible & (blocks[None, :] < blocks[:, None])
    run = may_go.to(torch.int32).cumprod(-1).sum(-1)
    skip = run.flip(-1).cummin(-1).values.flip(-1)
    q_end = (skip[..., None, :] <= blocks[:, None]).sum(-1)
    return skip.to(torch.int32), q_end.to(torch.int32)
