"""Choosing F.scaled_dot_product_attention's backend.

On Hopper GPUs PyTorch runs SDPA through cuDNN first. cuDNN is the fastest backend for training
shapes, but it builds an execution plan for every new shape (tens of milliseconds), and cached decoding
attends over a cache one position longer at every step: a new plan per token. `decode_sdpa` therefore
leaves cuDNN out; `prefer_sdpa_backend` picks the backend tried first for training.
"""
import contextlib

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefer_sdpa_backend(name):
    """Context in which SDPA tries backend `name` first (the others stay available as fallbacks);
    "auto" keeps PyTorch's order. torch.compile bakes in the backend chosen while it traces, so
    enter this before the first compiled call."""
    if name == "auto":
        return contextlib.nullcontext()
    if name not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_backend={name!r} (train.sdpa_backend / --sdpa-backend) is unknown; "
                         f"choose auto or one of {sorted(SDPA_BACKENDS)}")
    order = [SDPA_BACKENDS[name]] + [b for b in SDPA_BACKENDS.values() if b != SDPA_BACKENDS[name]]
    return sdpa_kernel(order, set_priority=True)


def decode_sdpa(q, k, v, attn_mask=None, scale=None, dropout_p=0.0):
    """SDPA of new queries over a cache whose length changes every call: any backend but cuDNN."""
    with sdpa_kernel(_DECODE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
