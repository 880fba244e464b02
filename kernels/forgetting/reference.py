"""Forgetting Attention in PyTorch: the materialized reference (impl="torch") and what decoding shares
with it. c = cumsum(log f) is kept in float64 and the bias c_i - c_j is taken in float64 before it is
rounded (see the precision policy in kernels/forgetting/__init__.py)."""
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


def attend(q, k, v, c_q, c_k, scale, window=None):
    """Softmax attention of queries at the last M of N positions, bias c_q[i] - c_k[j], causal, and
    with a window W only over the last W positions (the query's own included).

    c_q, c_k None: no bias (plain softmax attention). The bias difference is taken in float64 and
    only then rounded (see the precision policy). Computes in fp32 (fp64 for fp64 inputs) and
    returns q's dtype.
    """
    ct = at_least_fp32(q.dtype)
    M, N = q.shape[-2], k.shape[-2]
    s = scale * (q.to(ct) @ k.to(ct).transpose(-1, -2))
    if c_q is not None:
        s = s + (c_q.to(torch.float64)[..., :, None] - c_k.to(torch.float64)[..., None, :]).to(ct)
    p = torch.softmax(s.masked_fill(~visible(M, N, window, q.device), float("-inf")), dim=-1)
    return (p @ v.to(ct)).to(q.dtype)


def visible(M, N, window, device):
    """(M, N) bool: which of N keys the last M of N positions see, causal and within the window."""
    d = torch.arange(N - M, N, device=device)[:, None] - torch.arange(N, device=device)[None, :]
    return (d >= 0) & (d < (N if window is None else window))


def reference_attn(q, k, v, log_fgate, scale, window=None):
    """forgetting_attn(impl="torch"): the whole L x L biased softmax; autograd gives the backward."""
    c = fgate_cumsum(log_fgate) if log_fgate is not None else None
    return attend(q, k, v, c, c, scale, window)
