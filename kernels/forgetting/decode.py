"""Decoding with a cache: K, V (B, H, N, D) and c (B, H, N) float64, the cumulative log forget gate of
every cached position (FoX, arXiv:2503.02130; storing c is equivalent to storing log f)."""
from kernels.forgetting.reference import attend


def forgetting_decode(q, k_cache, v_cache, c_cache, *, scale=None, window=None):
    """Output for the M newest positions, whose keys, values and c are already in the cache.

    q: (B, H, M, D), the queries of cache positions N-M .. N-1; k_cache, v_cache: (B, H, N, D);
    c_cache: (B, H, N) cumulative log gates (keep it float64, from `fgate_cumsum`).
    Equals rows N-M .. N-1 of `forgetting_attn` over the whole sequence (with the same window). Works
    for one token (M = 1) and for chunked prefill on top of a cache (M > 1).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    M = q.shape[-2]
    return attend(q, k_cache, v_cache, c_cache[..., -M:], c_cache, scale, window)
