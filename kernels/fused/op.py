"""swiglu, rms_norm and add_rms_norm: the Triton kernels (triton.py) as torch custom ops joined by autograd, so
torch.compile keeps each kernel one opaque call in its graph (no graph break), with the torch reference where
Triton cannot run (CPU without TRITON_INTERPRET=1; fp64)."""
from typing import Optional

import torch

from kernels.fused import reference
from kernels.fused.triton import aligned_empty, rms_norm_backward, rms_norm_forward, swiglu_backward, swiglu_forward
from kernels.triton_utils import interpreting, triton


def use_triton(x):
    """Whether the Triton kernels take this tensor: on CUDA, or on CPU under the interpreter; fp64 never."""
    return triton is not None and (x.is_cuda or interpreting()) and x.dtype != torch.float64


# ----------------------------------------------------------------------------- SwiGLU

@torch.library.custom_op("fused::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(gate_up)


@_swiglu_fwd.register_fake
def _(gate_up):
    return aligned_empty((*gate_up.shape[:-1], gate_up.size(-1) // 2), gate_up)


@torch.library.custom_op("fused::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dh: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu_backward(dh, gate_up)


@_swiglu_bwd.register_fake
def _(dh, gate_up):
    return aligned_empty(gate_up.shape, gate_up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, dh):
    return _swiglu_bwd(dh, *ctx.saved_tensors)


_swiglu_fwd.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate_up):
    """silu(a) * b of a packed projection gate_up (..., 2H) = [a | b] -> (..., H), in gate_up's dtype."""
    if gate_up.size(-1) % 2:
        raise ValueError(f"swiglu takes a packed [gate | up] last axis of even size, got {gate_up.size(-1)}")
    if not use_triton(gate_up):
        return reference.swiglu(gate_up)
    return _swiglu_fwd(gate_up)


# ----------------------------------------------------------------------------- RMSNorm (+ residual add)

@torch.library.custom_op("fused::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: torch.Tensor, y: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> out, rstd, and the sum s = x + y (an empty tensor without y: s is x)."""
    return rms_norm_forward(x, y, weight, eps, out_dtype)


@_rms_norm_fwd.register_fake
def _(x, y, weight, eps, out_dtype):
    s = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, y.dtype)) if y is not None else x.new_empty(0)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape[:-1], dtype=torch.float32), s


@torch.library.custom_op("fused::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dout: torch.Tensor, ds: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
                  rstd: torch.Tensor, dx_dtype: torch.dtype,
                  dy_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx, dy (an empty tensor without dy_dtype), dweight."""
    return rms_norm_backward(dout, ds, s, weight, rstd, dx_dtype, dy_dtype)


@_rms_norm_bwd.register_fake
def _(dout, ds, s, weight, rstd, dx_dtype, dy_dtype):
    dy = s.new_empty(s.shape, dtype=dy_dtype) if dy_dtype is not None else s.new_empty(0)
    return s.new_empty(s.shape, dtype=dx_dtype), dy, torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, y, weight, _, _ = inputs
    _, rstd, s = output
    ctx.save_for_backward(s if y is not None else x, weight, rstd)
    ctx.dx_dtype, ctx.dy_dtype = x.dtype, (y.dtype if y is not None else None)


def _rms_norm_grad(ctx, dout, _drstd, ds):
    s, weight, rstd = ctx.saved_tensors
    ds = ds.contiguous() if ctx.dy_dtype is not None and ds is not None else None
    dx, dy, dw = _rms_norm_bwd(dout.contiguous(), ds, s, weight, rstd, ctx.dx_dtype, ctx.dy_dtype)
    return dx, (dy if ctx.dy_dtype is not None else None), dw, None, None


_rms_norm_fwd.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def _check_norm(x, weight):
    if weight.shape != (x.size(-1),):
        raise ValueError(f"RMSNorm weight of shape {tuple(weight.shape)} does not match the last axis of x "
                         f"{tuple(x.shape)}")


def rms_norm(x, weight, eps, out_dtype=None):
    """F.rms_norm over the last axis, scaled by weight; out_dtype: the output's (default: that of x and weight)."""
    _check_norm(x, weight)
    out_dtype = out_dtype or torch.promote_types(x.dtype, weight.dtype)
    if not use_triton(x):
        return reference.rms_norm(x, weight, eps).to(out_dtype)
    return _rms_norm_fwd(x.contiguous(), None, weight, eps, out_dtype)[0]


def add_rms_norm(x, y, weight, eps, out_dtype=None):
    """(s, rms_norm(s)) of the residual sum s = x + y, in one pass; s in the dtype of x and y."""
    _check_norm(x, weight)
    if x.shape != y.shape:
        raise ValueError(f"add_rms_norm adds tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    out_dtype = out_dtype or torch.promote_types(torch.promote_types(x.dtype, y.dtype), weight.dtype)
    if not use_triton(x):
        s, out = reference.add_rms_norm(x, y, weight, eps)
        return s, out.to(out_dtype)
    out, _, s = _rms_norm_fwd(x.contiguous(), y.contiguous(), weight, eps, out_dtype)
    return s, out
