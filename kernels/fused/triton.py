"""Triton kernels of the memory-bound elementwise work around the matmuls: SwiGLU and RMSNorm (+ residual add),
forward and backward. Each reads its inputs once and writes its outputs once; math in fp32, loads and stores in
the tensors' own dtypes. On CPU they run under TRITON_INTERPRET=1.

    swiglu_forward(gate_up) -> h                       gate_up (..., 2H) = [a | b], h = silu(a) * b (..., H)
    swiglu_backward(dh, gate_up) -> d gate_up          [dh * b * silu'(a) | dh * silu(a)]
        both outputs with 16-byte aligned rows (aligned_empty)
    rms_norm_forward(x, y, w, eps, out_dtype) -> (out, rstd, s)
        s = x + y (y None: s = x, returned as an empty tensor), out = s * rstd * w in out_dtype,
        rstd = 1 / sqrt(mean(s^2) + eps) in fp32 (M,)
    rms_norm_backward(dout, ds, s, w, rstd, dx_dtype, dy_dtype) -> (dx, dy, dw)
        d s = rstd * (g - s_hat * mean(g * s_hat)) + ds, g = dout * w, s_hat = s * rstd; dx = d s in dx_dtype,
        dy the same in dy_dtype (None: not written, an empty tensor), dw = sum over rows of dout * s_hat

SwiGLU's programs each take BLOCK consecutive outputs of the flattened (M, H), whatever the rows' padding (so an
odd H wastes no lanes). RMSNorm's rows are the last axis (contiguous); a program takes whole rows (in one block
of next_pow2(C) lanes), so each reduction is in registers. The RMSNorm backward's programs each walk a strip of
rows, summing their share of dw in fp32; the strips' partial sums are added by torch.
"""
import functools

import torch

from kernels.triton_utils import tl, triton

SWIGLU_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _multiprocessors(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _dw_programs(M, device):
    """Programs of the RMSNorm backward: a few per SM (each sums its rows' dw), at most one per row."""
    return max(1, min(M, 4 * _multiprocessors(device)))


if triton is not None:
    @triton.jit
    def _swiglu_offsets(n, H: tl.constexpr, in_row, out_row, BLOCK: tl.constexpr):
        """Element offsets of this program's BLOCK of the n = M * H outputs: into a (row of gate_up) and out."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        row = i // H                     # H constexpr: a multiply and shift, not a division
        col = i - row * H
        return row * in_row + col, row * out_row + col, i < n

    @triton.jit
    def _swiglu_fwd_kernel(gu_ptr, h_ptr, n, H: tl.constexpr, gu_row, h_row, BLOCK: tl.constexpr):
        a_at, h_at, mask = _swiglu_offsets(n, H, gu_row, h_row, BLOCK)
        a = tl.load(gu_ptr + a_at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(gu_ptr + a_at + H, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + h_at, (a * tl.sigmoid(a) * b).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(dh_ptr, gu_ptr, dgu_ptr, n, H: tl.constexpr, dh_row, gu_row, dgu_row,
                           BLOCK: tl.constexpr):
        a_at, dh_at, mask = _swiglu_offsets(n, H, gu_row, dh_row, BLOCK)
        da_at, _, _ = _swiglu_offsets(n, H, dgu_row, dh_row, BLOCK)
        dh = tl.load(dh_ptr + dh_at, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(gu_ptr + a_at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(gu_ptr + a_at + H, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        da = dh * b * sig * (1.0 + a * (1.0 - sig))      # d silu(a) / da = sig * (1 + a (1 - sig))
        out_ty = dgu_ptr.dtype.element_ty
        tl.store(dgu_ptr + da_at, da.to(out_ty), mask=mask)
        tl.store(dgu_ptr + da_at + H, (dh * a * sig).to(out_ty), mask=mask)

    @triton.jit
    def _rms_norm_fwd_kernel(x_ptr, y_ptr, w_ptr, out_ptr, rstd_ptr, s_ptr, C, eps,
                             HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < C
        s = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_Y:
            s += tl.load(y_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
            s = s.to(s_ptr.dtype.element_ty)   # the sum as stored: the norm and the backward see the same s
            tl.store(s_ptr + row * C + cols, s, mask=mask)
            s = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / C + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * C + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_norm_bwd_kernel(dout_ptr, ds_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dy_ptr, dw_ptr, M, C,
                             rows_per_program, HAS_DS: tl.constexpr, HAS_DY: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < C
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        first = pid * rows_per_program
        for r in range(first, tl.minimum(first + rows_per_program, M)):
            row = tl.cast(r, tl.int64)
            s = tl.load(s_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
            dout = tl.load(dout_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            s_hat = s * rstd
            g = dout * w
            d = rstd * (g - s_hat * (tl.sum(g * s_hat, axis=0) / C))
            if HAS_DS:
                d += tl.load(ds_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * C + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_DY:
                tl.store(dy_ptr + row * C + cols, d.to(dy_ptr.dtype.element_ty), mask=mask)
            dw += dout * s_hat
        tl.store(dw_ptr + pid * C + cols, dw, mask=mask)


def aligned_empty(shape, like):
    """An empty tensor of `shape` in like's dtype and device whose rows start 16-byte aligned: a view of a
    buffer with its last axis rounded up, as inductor pads its own buffers (an odd width such as SwiGLU's
    hidden 2389 would otherwise put the next matmul's operand off cuBLAS's aligned fast path)."""
    per = max(1, 16 // like.element_size())
    stride = [1]
    for size in reversed(shape[1:]):
        stride.insert(0, stride[0] * (-(-size // per) * per if len(stride) == 1 else size))
    return torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)


def rows(x):
    """x as (rows, last axis), a view wherever the last axis is contiguous and the rows evenly spaced."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.size(-1))


def swiglu_forward(gate_up):
    H = gate_up.size(-1) // 2
    h = aligned_empty((*gate_up.shape[:-1], H), gate_up)
    gu, h2 = rows(gate_up), h.view(-1, H)
    n = gu.size(0) * H
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](gu, h2, n, H, gu.stride(0), h2.stride(0),
                                                            BLOCK=SWIGLU_BLOCK)
    return h


def swiglu_backward(dh, gate_up):
    H = gate_up.size(-1) // 2
    d_gate_up = aligned_empty(gate_up.shape, gate_up)
    gu, dgu, dh2 = rows(gate_up), d_gate_up.view(-1, 2 * H), rows(dh)
    n = gu.size(0) * H
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](dh2, gu, dgu, n, H, dh2.stride(0), gu.stride(0),
                                                            dgu.stride(0), BLOCK=SWIGLU_BLOCK)
    return d_gate_up


def rms_norm_forward(x, y, w, eps, out_dtype):
    C = x.size(-1)
    M = x.numel() // C
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    s = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, y.dtype)) if y is not None \
        else x.new_empty(0)
    if M:
        _rms_norm_fwd_kernel[(M,)](x, y if y is not None else x, w, out, rstd, s, C, eps, HAS_Y=y is not None,
                                   BLOCK=triton.next_power_of_2(C))
    return out, rstd, s


def rms_norm_backward(dout, ds, s, w, rstd, dx_dtype, dy_dtype):
    C = s.size(-1)
    M = s.numel() // C
    programs = _dw_programs(M, s.device)
    dx = torch.empty(s.shape, device=s.device, dtype=dx_dtype)
    dy = torch.empty(s.shape, device=s.device, dtype=dy_dtype) if dy_dtype is not None else s.new_empty(0)
    dw = torch.zeros(programs, C, device=s.device, dtype=torch.float32)
    if M:
        _rms_norm_bwd_kernel[(programs,)](dout, ds if ds is not None else s, s, w, rstd, dx, dy if dy.numel() else dx,
                                          dw, M, C, triton.cdiv(M, programs), HAS_DS=ds is not None,
                                          HAS_DY=dy_dtype is not None, BLOCK=triton.next_power_of_2(C))
    return dx, dy, dw.sum(0).to(w.dtype)
