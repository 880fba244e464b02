"""Decoding with a cache: K, V (B, H, N, D) and c (B, H, N) float64, the cumulative log forget gate of
every cached position (FoX, arXiv:2503.02130; storing c is equivalent to storing log f)."""
import torch

from kernels.tree import attn_partial, mask_bias


def forgetting_decode(q, k_cache, v_cache, c_cache, *, scale=None, window=None):
    """Output for the M newest positions, whose keys, values and c are already in the cache.

    q: (B, H, M, D), the queries of cache positions N-M .. N-1; k_cache, v_cache: (B, H, N, D);
    c_cache: (B, H, N) cumulative log gates (keep it float64, from `fgate_cumsum`).
    Equals rows N-M .. N-1 of `forgetting_attn` over the whole sequence (with the same window). Works
    for one token (M = 1) and for chunked prefill on top of a cache (M > 1).

    Runs tree attention's split-KV step (kernels/tree.py attn_partial: on CUDA its Triton kernel, which computes
    the gate's logits from c as it reads the keys), with c taken relative to the newest position's: the query's
    own c_i is common to all its keys and cancels in the softmax, and the keys near the queries, which carry the
    weight, keep small logits exact when rounded to fp32.
    """
    M, N = q.shape[-2], k_cache.shape[-2]
    bias = None
    if M > 1 or window is not None:       # causal inside the chunk; the window
        pos = torch.arange(N, device=q.device)
        bias = mask_bias(pos[N - M:], pos, window=window)
    out, _ = attn_partial(q, k_cache, v_cache, scale=scale, bias=bias, gate=(c_cache, c_cache[..., -1:]))
    return out.to(q.dtype)
