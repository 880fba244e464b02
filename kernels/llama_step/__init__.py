"""One decode step of a LLaMA-block model (RMSNorm, RoPE softmax attention, SwiGLU, no biases) as a single
persistent Triton launch, for batch-1 decoding.

    decode_step(x, position, weights, k_cache, v_cache, eps, impl="auto") -> logits (B, V) fp32

x (B, d), B <= MAX_BATCH: the token embeddings (an fp32 x becomes the buffer of the residual stream and is
overwritten); position (1,) int64 on the device: the cache row the token takes (the caller advances it);
k_cache / v_cache (L, B, H, CAP, D) are written at that row; weights: a LlamaStepWeights
(LlamaStepWeights.pack). impl: "triton" (CUDA, or the interpreter), "gluon" (batch 1 on Hopper or newer: the
weights and cache streamed through shared memory across the barriers, gluon.py), "torch" (reference.py),
"auto" (on CUDA Gluon where it applies, else Triton; on the CPU the reference).

Why one launch (docs/decoding.md): at batch 1 a 360M step reads ~1 GB, ~0.25 ms at full bandwidth, and a graph
of even 150 small kernels loses more than that to launch gaps and each kernel's ramp-up. Here one program per
SM owns a share of every phase's work and grid-wide barriers separate the phases (triton.py).

Modules: reference.py (the same step in PyTorch), triton.py (the kernel and its launcher), gluon.py (the
batch-1 kernel with explicit asynchronous copies, 14-23% less time than triton.py: docs/decoding.md).
"""
from dataclasses import dataclass

import torch

from kernels.llama_step import reference
from kernels.triton_utils import interpreting

# Batch-1 latency is what the launch is for. Each program multiplies its weight chunks by all B rows of the
# stream at once, and past 4 rows the pipelined tiles outgrow shared memory: larger batches go through the
# compiled step (GPT.generate(cuda_graph="compiled")).
MAX_BATCH = 4


@dataclass
class LlamaStepWeights:
    """Every layer's weights stacked on a leading layer axis, in the dtype of the model:
    wqkv (L, 3 H D, d): q, k, v heads, each head's rows in pair order (pack_qkv); wo (L, d, H D);
    wgu (L, 2 F, d): gate rows then up rows; wd (L, d, F); norms (L, 2, d): the attention and MLP
    RMSNorm scales; norm_f (d,); head (V, d); cos, sin (max_len, D / 2) fp32 RoPE tables (halves convention)."""
    wqkv: torch.Tensor
    wo: torch.Tensor
    wgu: torch.Tensor
    wd: torch.Tensor
    norms: torch.Tensor
    norm_f: torch.Tensor
    head: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def pack(cls, qkv, out, gate, up, down, norm_attn, norm_mlp, norm_f, head, cos, sin, head_dim):
        """Stack per-layer lists (qkv: (3 H D, d) weights in q|k|v, head, dim order; out, gate, up, down:
        nn.Linear weights; the two norm scales) into the packed layout. The head is kept, not copied."""
        return cls(wqkv=torch.stack([pack_qkv(w, head_dim) for w in qkv]), wo=torch.stack(out),
                   wgu=torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)]), wd=torch.stack(down),
                   norms=torch.stack([torch.stack([a, m]) for a, m in zip(norm_attn, norm_mlp)]),
                   norm_f=norm_f, head=head, cos=cos, sin=sin)

    @classmethod
    def random(cls, L, H, D, d, F, V, cos, sin, dtype, generator, scale=0.3):
        """Random weights of these sizes for tests and benchmarks: matrices ~ N(0, scale^2), norm scales
        around 1, drawn from `generator` on its device, then moved to cos's device in `dtype`."""
        def r(*shape, center=0.0):
            x = center + scale * torch.randn(*shape, generator=generator, device=generator.device)
            return x.to(device=cos.device, dtype=dtype)
        return cls.pack([r(3 * H * D, d) for _ in range(L)], [r(d, H * D) for _ in range(L)],
                        [r(F, d) for _ in range(L)], [r(F, d) for _ in range(L)], [r(d, F) for _ in range(L)],
                        [r(d, center=1) for _ in range(L)], [r(d, center=1) for _ in range(L)],
                        r(d, center=1), r(V, d), cos, sin, D)


def pack_qkv(w, head_dim):
    """Reorder each head's rows j = i + half * D/2 to 2 i + half: the two rows RoPE rotates together become
    neighbours, so a program that owns a contiguous run of rows owns whole pairs."""
    n, d = w.shape
    return w.reshape(n // head_dim, 2, head_dim // 2, d).transpose(1, 2).reshape(n, d)


def decode_step(x, position, weights, k_cache, v_cache, eps, impl="auto"):
    """See the module docstring."""
    if impl == "auto" and x.is_cuda:
        from kernels.llama_step.gluon import unsupported     # CUDA has Triton; CPU-only installs may not
        impl = "triton" if unsupported(x, weights, k_cache, v_cache) else "gluon"
    if impl == "auto":
        impl = "torch"
    if impl == "torch":
        return reference.decode_step(x, position, weights, k_cache, v_cache, eps)
    if impl == "gluon":
        from kernels.llama_step.gluon import decode_step_gluon
        return decode_step_gluon(x, position, weights, k_cache, v_cache, eps)
    if impl != "triton":
        raise ValueError(f"impl={impl!r}: choose auto, triton, gluon or torch")
    if x.size(0) > MAX_BATCH:
        raise ValueError(f"the fused decode step takes batches of up to {MAX_BATCH} rows, not {x.size(0)}")
    if not (x.is_cuda or interpreting()):
        raise ValueError("the Triton decode step runs on CUDA (or on the CPU with TRITON_INTERPRET=1)")
    from kernels.llama_step.triton import decode_step_triton
    return decode_step_triton(x, position, weights, k_cache, v_cache, eps)


__all__ = ["LlamaStepWeights", "pack_qkv", "decode_step", "MAX_BATCH"]
