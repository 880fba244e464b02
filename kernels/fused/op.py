"""swiglu_linear, rms_norm, add_rms_norm and cross_entropy_grad_: the Triton kernels (triton.py) as torch custom
ops (the first three joined by autograd), so torch.compile keeps each kernel one opaque call in its graph (no
graph break), with the torch reference where Triton cannot run (CPU without TRITON_INTERPRET=1; fp64)."""
from typing import Optional

import torch

from kernels.fused import reference
from kernels.fused import triton as fused_triton
from kernels.fused.triton import aligned_empty, rms_norm_backward, rms_norm_forward, swiglu_backward, swiglu_forward
from kernels.triton_utils import interpreting, triton


def use_triton(x):
    """Whether the Triton kernels take this tensor: on CUDA, or on CPU under the interpreter; fp64 never."""
    return triton is not None and (x.is_cuda or interpreting()) and x.dtype != torch.float64


# ----------------------------------------------------------------------------- SwiGLU + down projection

@torch.library.custom_op("fused::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(gate_up)


@_swiglu_fwd.register_fake
def _(gate_up):
    return aligned_empty((*gate_up.shape[:-1], gate_up.size(-1) // 2), gate_up)


@torch.library.custom_op("fused::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dh: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> d gate_up, and h = silu(a) * b recomputed."""
    return swiglu_backward(dh, gate_up)


@_swiglu_bwd.register_fake
def _(dh, gate_up):
    return aligned_empty(gate_up.shape, gate_up), aligned_empty((*gate_up.shape[:-1], gate_up.size(-1) // 2), gate_up)


class SwiGLULinear(torch.autograd.Function):
    """F.linear(silu(a) * b, weight, bias) that keeps only gate_up = [a | b] (and the weight) for the backward:
    the backward kernel, which reads a and b for d gate_up anyway, writes h = silu(a) * b again for the weight
    gradient. So no (..., H) h is held from the forward to the backward, as torch.compile's partitioner does
    not keep it for the unfused silu(a) * b either (it recomputes elementwise work)."""

    @staticmethod
    def forward(ctx, gate_up, weight, bias):
        ctx.save_for_backward(gate_up, weight)
        ctx.has_bias = bias is not None
        with torch.autocast(gate_up.device.type, enabled=False):     # the caller cast weight and bias
            return torch.nn.functional.linear(_swiglu_fwd(gate_up), weight, bias)

    @staticmethod
    def backward(ctx, dout):
        gate_up, weight = ctx.saved_tensors
        d_gate_up, h = _swiglu_bwd(dout @ weight, gate_up)
        dout_rows = dout.reshape(-1, dout.size(-1))
        d_weight = dout_rows.t() @ h.reshape(-1, h.size(-1))
        return d_gate_up, d_weight, (dout_rows.sum(0) if ctx.has_bias else None)


def swiglu_linear(gate_up, weight, bias=None):
    """F.linear(silu(a) * b, weight, bias) of a packed projection gate_up (..., 2H) = [a | b], weight (out, H).
    The Triton path computes in gate_up's dtype: under autocast gate_up is already in autocast's dtype, and
    the weight is cast to it as autocast's linear would."""
    if gate_up.size(-1) % 2:
        raise ValueError(f"swiglu takes a packed [gate | up] last axis of even size, got {gate_up.size(-1)}")
    if weight.size(-1) != gate_up.size(-1) // 2:
        raise ValueError(f"swiglu_linear: weight of shape {tuple(weight.shape)} does not take the hidden size "
                         f"{gate_up.size(-1) // 2} of gate_up {tuple(gate_up.shape)}")
    if not use_triton(gate_up):
        return torch.nn.functional.linear(reference.swiglu(gate_up), weight, bias)
    weight, bias = weight.to(gate_up.dtype), (bias.to(gate_up.dtype) if bias is not None else None)
    return SwiGLULinear.apply(gate_up, weight, bias)


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


# ----------------------------------------------------------------------------- cross-entropy softmax + gradient

@torch.library.custom_op("fused::cross_entropy_grad_", mutates_args=("logits",))
def _cross_entropy_grad_(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor,
                         n_counted: torch.Tensor) -> torch.Tensor:
    return fused_triton.cross_entropy_grad_(logits, targets, keep, n_counted)


@_cross_entropy_grad_.register_fake
def _(logits, targets, keep, n_counted):
    return logits.new_empty(logits.size(0), dtype=torch.float32)


def cross_entropy_grad_(logits, targets, keep, n_counted):
    """Per row of logits (n, V): the loss lse - logit[target] where keep (n,) is True, else 0 (fp32 (n,)), returned;
    and, in place, the logits become the gradient of sum(losses) / n_counted (a 1-element tensor) with respect to
    them, in their dtype: (softmax - onehot(target)) * keep / n_counted, zero on rows not kept. Triton only
    (use_triton). In place, a chunk holds one (n, V) buffer instead of two: under torch.compile the mutation of
    the matmul's output, used nowhere else, is reinplaced (no copy)."""
    n = logits.size(0)
    if logits.dim() != 2 or logits.stride(1) != 1 or targets.shape != (n,) or keep.shape != (n,):
        raise ValueError(f"cross_entropy_grad_ takes logits (n, V) with contiguous rows and targets, keep (n,); got "
                         f"{tuple(logits.shape)} (strides {logits.stride()}), {tuple(targets.shape)}, "
                         f"{tuple(keep.shape)}")
    return _cross_entropy_grad_(logits, targets, keep, n_counted.reshape(1))
