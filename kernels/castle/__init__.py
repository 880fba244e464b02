"""CASTLE and CASTLE-SWL attention: causal attention with lookahead keys (Song et al., arXiv:2509.07301).

Per head, with s = scale = d ** -0.5 used exactly as in eqs (11)/(12):

    A_U   = sigmoid(s * Qu Ku^T)  masked to owner j < contributor i (SWL: i <= j + W)
    S^U   = (s * Qc Vu^T, causal) @ A_U^T                                   (strictly lower triangular)
    out   = softmax(s * Qc Kc^T - SiLU(S^U), causal) @ Vc

Public API (tensors are (B, H, L, D); fp32/bf16 in, same dtype out, fp32 math inside):

    castle_attn(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, silu=True, impl="auto")
    castle_prefill(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, silu=None, max_len=None, cache=None)
        -> (out, CastleCache)                           a prompt, into a new cache or continuing `cache`
    castle_decode(cache, qc, kc, vc, qu, ku, vu, *, impl="auto") -> (out, CastleCache)   one position, in place
    CastleCache(batch, heads, head_dim, *, max_len, dtype, device, window=None, scale=None, group=None,
                causal_keys=True, silu=True)
        the UQ-KV cache of one layer; with a process group, this rank's share of it (decode.py)

The ablations of §5.2 (reference.lookahead_logit states their logits): kc=None, CASTLE without causal keys
(Table 5: softmax(-SiLU(S^U)), no W^C_K); silu=False, s^C - s^U instead of s^C - SiLU(s^U) (Table 10).

castle_attn's impl:
    "torch"     the parallel form (Theorem 1), L x L matrices and an L x L x L product (O(L^3)); the
                reference, differentiable by autograd in any dtype (fp64 in the tests).
    "blockwise" the O(L^2 d) block algorithm (Theorem 2, Appendix 8) in plain PyTorch, with a hand-written
                backward. For CPU at moderate lengths.
    "triton"    the same block algorithm as GPU kernels (triton.py); runs on CPU under TRITON_INTERPRET=1.
    "auto"      "triton" on CUDA, "torch" on CPU (and for fp64).

Modules: reference.py (the torch forms), triton.py (the Triton training kernels and their schedule),
op.py (castle_attn, the custom ops torch.compile sees), decode.py (CastleCache, prefill, decode and the
decode kernels).

Internal API for tests and benchmarks (documented in each module, no stability promise):
    reference: attn_parallel, parallel_logits, attn_blockwise, to_blocks, blockwise_forward, blockwise_backward
    triton:    TritonConfig, BWD_VARIANTS, default_config, gpu_config, triton_forward, triton_backward, ...
    op:        attn_triton (the Triton path with explicit tiles)
"""
from kernels.castle.decode import CastleCache, castle_decode, castle_prefill
from kernels.castle.op import castle_attn

__all__ = ["castle_attn", "castle_prefill", "castle_decode", "CastleCache"]
