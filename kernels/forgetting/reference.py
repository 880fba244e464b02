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


def attend(q, k, v, c_q, c_k, scale):
    """Softmax attention of queries at the last M of N positions, bias c_q[i] - c_k[j], causal.

    The bias difference is taken in float64 and only then rounded (see the precision policy).
    Computes in fp32 (fp64 for fp64 inputs) and returns q's dtype.
    """
    ct = at_least_fp32(q.dtype)
    M, N = q.shape[-2], k.shape[-2]
    bias = (c_q.to(torch.float64)[..., :, None] - c_k.to(torch.float64)[..., None, :]).to(ct)
    s = scale * (q.to(ct) @ k.to(ct).transpose(-1, -2)) + bias
    future = torch.ones(M, N, dtype=torch.bool, device=q.device).triu(N - M + 1)
    p = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1)
    return (p @ v.to(ct)).to(q.dtype)


def reference_attn(q, k, v, log_fgate, scale):
    """forgetting_attn(impl="torch"): the whole L x L biased softmax; autograd gives the backward."""
    c = fgate_cumsum(log_fgate)
    return attend(q, k, v, c, c, scale)
