"""The unfused PyTorch forms every fused op of this package is tested against; op for op what
model/gpt.py runs with its fused options off."""
import torch.nn.functional as F


def linear_cross_entropy(x, weight, targets, ignore_index=-1):
    """Mean cross-entropy of the logits x @ weight^T over the targets that are not ignore_index.

    x (N, d), weight (V, d), targets (N,). Every one of the V rows takes part in the softmax, padding
    rows of a vocabulary padded beyond the tokenizer's included, as GPT.forward's loss does."""
    logits = F.linear(x, weight)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)


def swiglu(gate_up):
    """silu(a) * b of a packed (..., 2H) projection [a | b] -> (..., H)."""
    a, b = gate_up.chunk(2, dim=-1)
    return F.silu(a) * b


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, scaled by weight; the dtype of x and weight promoted."""
    return F.rms_norm(x, (x.size(-1),), weight, eps)


def add_rms_norm(x, y, weight, eps):
    """(s, rms_norm(s)) of the residual sum s = x + y."""
    s = x + y
    return s, rms_norm(s, weight, eps)
