"""Choosing the kernel of softmax attention: F.scaled_dot_product_attention's backend, or FlashAttention-4.

On Hopper GPUs PyTorch runs SDPA through cuDNN first. cuDNN is SDPA's fastest backend for training
shapes, but it builds an execution plan for every new shape (tens of milliseconds), and cached decoding
attends over a cache one position longer at every step: a new plan per token. `decode_sdpa` therefore
leaves cuDNN out; `prefer_sdpa_backend` picks the backend tried first for training, or "fa4": the
FlashAttention-4 package's kernels (kernels/fa4.py) for the causal attention of whole sequences
(`causal_attention`), faster than cuDNN where docs/results.md says so; decoding keeps SDPA.
"""
import contextlib

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.fa4 import fa4_causal_attention, fa4_interface

SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
ATTENTION_BACKENDS = ("auto", *SDPA_BACKENDS, "fa4")   # the choices of train.sdpa_backend
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_use_fa4 = False   # set inside prefer_sdpa_backend("fa4"); torch.compile guards on it


def prefer_sdpa_backend(name):
    """Context in which SDPA tries backend `name` first (the others stay available as fallbacks);
    "auto" keeps PyTorch's order; "fa4" runs `causal_attention` through FlashAttention-4 (its package is
    imported here, so a missing one is named before any work). torch.compile bakes in the choice made
    while it traces, so enter this before the first compiled call."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"sdpa_backend={name!r} (train.sdpa_backend / --sdpa-backend) is unknown; "
                         f"choose one of {list(ATTENTION_BACKENDS)}")
    if name == "auto":
        return contextlib.nullcontext()
    if name == "fa4":
        fa4_interface()
        return _fa4_chosen()
    order = [SDPA_BACKENDS[name]] + [b for b in SDPA_BACKENDS.values() if b != SDPA_BACKENDS[name]]
    return sdpa_kernel(order, set_priority=True)


@contextlib.contextmanager
def _fa4_chosen():
    global _use_fa4
    before, _use_fa4 = _use_fa4, True
    try:
        yield
    finally:
        _use_fa4 = before


def causal_attention(q, k, v, dropout_p=0.0):
    """Causal self-attention of whole sequences, (B, H, L, D): SDPA, or FlashAttention-4 where chosen."""
    if not _use_fa4:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    check_fa4_dropout(dropout_p)
    return fa4_causal_attention(q, k, v)


def check_fa4_dropout(dropout):
    """FlashAttention-4 has no attention dropout: train.py refuses the pair before training starts."""
    if dropout:
        raise ValueError(f"train.sdpa_backend=fa4 has no attention dropout, but model.dropout={dropout}: set "
                         "model.dropout=0 or choose another backend")


def decode_sdpa(q, k, v, attn_mask=None, scale=None, dropout_p=0.0):
    """SDPA of new queries over a cache whose length changes every call: any backend but cuDNN."""
    with sdpa_kernel(_DECODE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
