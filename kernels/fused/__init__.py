"""Fused kernels of the model around attention: linear + cross-entropy without the full logits, SwiGLU, and
RMSNorm (+ residual add), forward and backward; model/gpt.py switches them on with GPTConfig's fused_* options.

    linear_cross_entropy(x, weight, targets, ignore_index=-1, impl="chunked", chunk_size=DEFAULT_CHUNK)
    swiglu_linear(gate_up, weight, bias)    F.linear(silu(a) * b, weight, bias) of a packed [a | b] (..., 2H)
    rms_norm(x, weight, eps, out_dtype=None)
    add_rms_norm(x, y, weight, eps, out_dtype=None) -> (x + y, rms_norm(x + y))

Modules: reference.py (the unfused torch forms, what the tests compare against), cross_entropy.py (the chunked
linear + cross-entropy: PyTorch around a Triton softmax/gradient kernel, and Liger-Kernel's behind the same
contract), triton.py (the SwiGLU, RMSNorm and cross-entropy kernels), op.py (their custom ops, which
torch.compile sees as single calls).
"""
from kernels.fused.cross_entropy import DEFAULT_CHUNK, LOSSES
from kernels.fused.op import add_rms_norm, rms_norm, swiglu_linear

LOSS_IMPLS = ("none",) + tuple(LOSSES)   # "none": the unfused logits + F.cross_entropy of GPT.forward


def linear_cross_entropy(x, weight, targets, ignore_index=-1, impl="chunked", chunk_size=DEFAULT_CHUNK):
    """Mean cross-entropy of x @ weight^T (x (N, d), weight (V, d), targets (N,)) over targets != ignore_index;
    chunk_size: tokens per chunk of impl="chunked" (Liger picks its own)."""
    if impl not in LOSSES:
        raise ValueError(f"fused loss {impl!r} is unknown; choose one of {sorted(LOSSES)}")
    if impl == "chunked":
        return LOSSES[impl](x, weight, targets, ignore_index, chunk_size)
    return LOSSES[impl](x, weight, targets, ignore_index)


__all__ = ["linear_cross_entropy", "swiglu_linear", "rms_norm", "add_rms_norm", "LOSS_IMPLS", "DEFAULT_CHUNK"]
