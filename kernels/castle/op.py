"""castle_attn and the Triton path's registration as custom ops.

The Triton path is two custom ops (castle::triton_fwd, castle::triton_bwd) joined by autograd:
torch.compile keeps each one call in its graph (opaque, no graph break) instead of tracing into the
launch code. The tile config travels as the literal of its field tuple (ops take plain types only;
dynamo can trace building that string, not repr or json of a dataclass).
"""
import ast
import functools
from dataclasses import fields
from typing import Optional

import torch

from kernels.castle.reference import attn_blockwise, attn_parallel, check_inputs
from kernels.castle.triton import (TritonConfig, default_config, forward_buffers, same_layout, triton_backward,
                                   triton_forward)
from kernels.triton_utils import padded_head_dim, require_triton, triton

IMPLS = ("auto", "torch", "blockwise", "triton")


def _config_key(cfg):
    return str(tuple(getattr(cfg, f.name) for f in fields(cfg)))


@functools.lru_cache(maxsize=None)  # parsed twice per fwd+bwd: a cache keeps it off the CPU's path
def _config_from_key(key):
    return TritonConfig(*ast.literal_eval(key))


@torch.library.custom_op("castle::triton_fwd", mutates_args=())
def _triton_fwd_op(qc: torch.Tensor, kc: Optional[torch.Tensor], vc: torch.Tensor, qu: torch.Tensor,
                   ku: torch.Tensor, vu: torch.Tensor, window: Optional[int], scale: float, silu: bool,
                   cfg_key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> out, lse, and the U the backward starts from (empty for "stored", which rebuilds it)."""
    cfg = _config_from_key(cfg_key)
    L = qc.shape[-2]
    save_t = (triton.cdiv(L, cfg.m_bwd) - 1) * cfg.m_bwd  # start of the backward's last row block
    out, lse, u = triton_forward(qc, kc, vc, qu, ku, vu, window, scale, cfg, save_t, silu)
    return out, lse, _u_kept(u, cfg)


@_triton_fwd_op.register_fake
def _(qc, kc, vc, qu, ku, vu, window, scale, silu, cfg_key):
    cfg = _config_from_key(cfg_key)
    out, lse, u = forward_buffers(_laid_out_qc(qc, kc, vc, qu, ku, vu), cfg)
    return out, lse, _u_kept(u, cfg)


def _laid_out_qc(qc, kc, vc, qu, ku, vu):
    """qc as the kernels take it: out and the gradients are allocated like it (fakes must give their strides)."""
    return same_layout([qc, kc, vc, qu, ku, vu])[0]


def _u_kept(u, cfg):
    """The forward's U as the backward needs it: "stored" rebuilds U, so an empty stand-in (ops return tensors)."""
    return u if cfg.bwd_variant != "stored" else u.new_empty(0)


@torch.library.custom_op("castle::triton_bwd", mutates_args=())
def _triton_bwd_op(do: torch.Tensor, qc: torch.Tensor, kc: Optional[torch.Tensor], vc: torch.Tensor,
                   qu: torch.Tensor, ku: torch.Tensor, vu: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   u: torch.Tensor, window: Optional[int], scale: float, silu: bool,
                   cfg_key: str) -> list[torch.Tensor]:
    """-> dqc, dkc, dvc, dqu, dku, dvu, laid out like qc (same_layout), in the inputs' dtype (dkc empty without
    causal keys: ops return tensors)."""
    grads = triton_backward(do, qc, kc, vc, qu, ku, vu, out, lse, u if u.numel() else None, window, scale,
                            _config_from_key(cfg_key), silu)
    return [qc.new_empty(0) if g is None else g for g in grads]


@_triton_bwd_op.register_fake
def _(do, qc, kc, vc, qu, ku, vu, out, lse, u, window, scale, silu, cfg_key):
    like = _laid_out_qc(qc, kc, vc, qu, ku, vu)
    return [qc.new_empty(0) if t is None else torch.empty_like(like) for t in (qc, kc, vc, qu, ku, vu)]


def _save_for_backward(ctx, inputs, output):
    *xs, window, scale, silu, cfg_key = inputs
    ctx.save_for_backward(*xs, *output)
    ctx.window, ctx.scale, ctx.silu, ctx.cfg_key = window, scale, silu, cfg_key
    ctx.causal_keys = xs[1] is not None


def _triton_fwd_op_backward(ctx, do, _dlse, _du):
    grads = _triton_bwd_op(do, *ctx.saved_tensors, ctx.window, ctx.scale, ctx.silu, ctx.cfg_key)
    if not ctx.causal_keys:
        grads[1] = None
    return (*grads, None, None, None, None)


_triton_fwd_op.register_autograd(_triton_fwd_op_backward, setup_context=_save_for_backward)


def attn_triton(qc, kc, vc, qu, ku, vu, window, scale, cfg=None, silu=True):
    """The Triton kernels, differentiable; cfg: the tiles (default: default_config's); kc None: no causal
    keys."""
    require_triton("impl='triton'", "use impl='blockwise' or 'torch' without it")
    if qc.shape[-1] > 128:
        raise ValueError(f"the Triton kernels take head dims up to 128, got {qc.shape[-1]}; "
                         "use impl='blockwise' or a smaller head_dim")
    cfg = cfg or default_config(padded_head_dim(qc.shape[-1]), qc.dtype)
    assert cfg.m_fwd % cfg.n_fwd == 0 and cfg.m_bwd % cfg.n_bwd == 0 and cfg.m_fwd % cfg.m_bwd == 0, cfg
    # Laid out here, not only inside the op: under torch.compile the copies (if any) are then Inductor's, and
    # fuse with the RoPE that produces the inputs
    qc, kc, vc, qu, ku, vu = same_layout([qc, kc, vc, qu, ku, vu])
    return _triton_fwd_op(qc, kc, vc, qu, ku, vu, window, scale, silu, _config_key(cfg))[0]


def castle_attn(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, silu=True, impl="auto"):
    """CASTLE (window=None) or CASTLE-SWL (window=W) attention; inputs (B, H, L, D) -> (B, H, L, D).
    The ablations of arXiv:2509.07301 §5.2: kc=None, no causal keys (Table 5); silu=False, the logits
    s^C - s^U (Table 10); reference.lookahead_logit states both."""
    check_inputs(qc, kc, vc, qu, ku, vu, window)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; choose one of {IMPLS}")
    scale = qc.shape[-1] ** -0.5 if scale is None else float(scale)
    if qc.shape[-2] == 0:
        return torch.empty_like(qc)
    if impl == "auto":
        impl = "triton" if qc.is_cuda and triton is not None and qc.dtype != torch.float64 else "torch"
    if impl == "torch":
        return attn_parallel(qc, kc, vc, qu, ku, vu, window, scale, silu)
    if impl == "blockwise":
        return attn_blockwise(qc, kc, vc, qu, ku, vu, window, scale, silu=silu)
    return attn_triton(qc, kc, vc, qu, ku, vu, window, scale, silu=silu)

