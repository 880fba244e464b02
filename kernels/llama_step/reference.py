"""The decode step of kernels/llama_step in plain PyTorch, over the same packed weights: what the Triton
kernel is tested against. fp32 math (fp64 for fp64 weights); the cache keeps its dtype, so a key is rounded
to it before any query reads it, as in the kernel."""
import torch

from kernels.fused.reference import rms_norm, swiglu
from kernels.triton_utils import at_least_fp32


def unpair_rows(y, head_dim):
    """(..., n * head_dim) in the packed pair order (kernels/llama_step pack_qkv) -> head_dim order."""
    *lead, n = y.shape
    return y.reshape(*lead, n // head_dim, head_dim // 2, 2).transpose(-1, -2).reshape(*lead, n)


def decode_step(x, position, w, k_cache, v_cache, eps):
    """One token through every layer: x (B, d) token embeddings, position (1,) int64 (the cache row this
    token takes), w a LlamaStepWeights, k_cache / v_cache (L, B, H, CAP, D), written at `position`.
    Returns the logits (B, V) in fp32 (fp64 for fp64 weights)."""
    L, B, H, _, D = k_cache.shape
    ct = at_least_fp32(w.head.dtype)
    pos = int(position[0])
    cos, sin = w.cos[pos].to(ct), w.sin[pos].to(ct)
    x = x.to(ct)
    for layer in range(L):
        h = rms_norm(x, w.norms[layer, 0].to(ct), eps)
        q, k, v = unpair_rows(h @ w.wqkv[layer].to(ct).T, D).view(B, 3, H, D).unbind(1)
        q, k = (torch.cat([t[..., :D // 2] * cos - t[..., D // 2:] * sin,
                           t[..., :D // 2] * sin + t[..., D // 2:] * cos], dim=-1) for t in (q, k))
        k_cache[layer, :, :, pos] = k.to(k_cache.dtype)
        v_cache[layer, :, :, pos] = v.to(v_cache.dtype)
        keys, values = k_cache[layer, :, :, :pos + 1].to(ct), v_cache[layer, :, :, :pos + 1].to(ct)
        p = torch.softmax(torch.einsum("bhd,bhtd->bht", q, keys) * D ** -0.5, dim=-1)
        attn = torch.einsum("bht,bhtd->bhd", p, values).reshape(B, H * D)
        x = x + attn @ w.wo[layer].to(ct).T
        x = x + swiglu(rms_norm(x, w.norms[layer, 1].to(ct), eps) @ w.wgu[layer].to(ct).T) @ w.wd[layer].to(ct).T
    return rms_norm(x, w.norm_f.to(ct), eps) @ w.head.to(ct).T
