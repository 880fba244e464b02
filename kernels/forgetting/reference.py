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
    seen = visible(M, N, window, q.device) if kept is None else visible(M, N, window, q.device) & kept
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
# pairs whose largest bias c_i - c_j is below a threshold that bounds the weight they could carry.
# -------------------------------------------------------------------------------------------------

def acp_threshold(q, k, scale, log_eps, L):
    """The pruning threshold delta per (batch, head), (B, H), in the units of c (natural log):
    delta = log_eps - 2 U - log L, U = scale * max_i |q_i| * max_j |k_j| >= |scale q_i.k_j|.

    Why it is safe: a weight is exp(scale q_i.k_j + c_i - c_j - lse_i), and lse_i >= scale q_i.k_i >= -U
    (the diagonal term, which is never pruned), so an entry with c_i - c_j < delta weighs less than
    exp(2 U + delta) = eps / L, and the up to L entries a row loses together weigh less than eps.
    U is measured on the inputs, so the bound holds for any q and k (with QK-norm it is at most the
    norms' scales times sqrt(D), the bound of the paper)."""
    ct = at_least_fp32(q.dtype)
    norms = [torch.linalg.vector_norm(x, dim=-1, dtype=ct).amax(-1) for x in (q, k)]
    return log_eps - 2 * scale * norms[0] * norms[1] - math.log(L)


def acp_kept(q, k, c, scale, log_eps, block):
    """(B, H, L, L) bool: the entries that ACP keeps with blocks of `block` positions, c = cumsum(log f)
    (B, H, L) in natural-log units (causality and a window are separate masks)."""
    L = q.shape[-2]
    first = torch.arange(0, L, block, device=q.device)
    last = (first + block - 1).clamp_max(L - 1)  # c stays constant after L (the kernels' padding)
    skip, _ = acp_plan(c[..., first], c[..., last], acp_threshold(q, k, scale, log_eps, L))
    keys = torch.arange(L, device=q.device) // block
    return keys[None, :] >= skip.repeat_interleave(block, -1)[..., :L, None]


def acp_plan(c_first, c_last, threshold):
    """Which block pairs ACP keeps, from c at each block's first and last position, (B, H, n) with
    n blocks, and the threshold (B, H) in the same units. Query block a keeps key block b <= a iff
    c_first[a] - c_last[b] >= threshold (the largest c_i - c_j of the pair: c never increases).

    Returns int32 (B, H, n) tensors `skip` (query block a skips key blocks 0 .. skip[a] - 1) and `q_end`
    (key block b is seen by query blocks b .. q_end[b] - 1): the same pairs, for the loops over keys and
    the loop over queries. The diagonal block is always kept (so the bound of acp_threshold holds), and
    skip is made non-decreasing, so that both describe one set of pairs whatever c is."""
    n = c_first.shape[-1]
    blocks = torch.arange(n, device=c_first.device)
    below = c_first[..., :, None] - c_last[..., None, :] < threshold[..., None, None]  # (B, H, a, b)
    pruned = below & (blocks[None, :] < blocks[:, None])
    skip = pruned.sum(-1).cummax(-1).values
    q_end = (skip[..., None, :] <= blocks[:, None]).sum(-1)
    return skip.to(torch.int32), q_end.to(torch.int32)
