"""Triton kernels of the memory-bound elementwise work around the matmuls: SwiGLU and RMSNorm (+ residual add),
forward and backward. Each reads its inputs once and writes its outputs once; math in fp32, loads and stores in
the tensors' own dtypes. On CPU they run under TRITON_INTERPRET=1.

    swiglu_forward(gate_up) -> h                       gate_up (..., 2H) = [a | b], h = silu(a) * b (..., H)
    swiglu_backward(dh, gate_up) -> (d gate_up, h)     [dh * b * silu'(a) | dh * silu(a)], and h = silu(a) * b
        again (the down projection's weight gradient reads it: h need not be kept from the forward)
        every output with 16-byte aligned rows (aligned_empty)
    rms_norm_forward(x, y, w, eps, out_dtype) -> (out, rstd, s)
        s = x + y (y None: s = x, returned as an empty tensor), out = s * rstd * w in out_dtype,
        rstd = 1 / sqrt(mean(s^2) + eps) in fp32 (M,)
    rms_norm_backward(dout, ds, s, w, rstd, dx_dtype, dy_dtype) -> (dx, dy, dw)
        d s = rstd * (g - s_hat * mean(g * s_hat)) + ds, g = dout * w, s_hat = s * rstd; dx = d s in dx_dtype,
        dy the same in dy_dtype (None: not written, an empty tensor), dw = sum over rows of dout * s_hat
    cross_entropy_grad_(logits, targets, keep, n_counted) -> losses
        per row of logits (n, V): lse - logit[target] where keep, else 0 (fp32 (n,)); the row is then overwritten
        with its gradient (softmax - onehot(target)) * keep / n_counted (the chunked loss's), in the logits'
        dtype; one program per row

SwiGLU's programs each take BLOCK consecutive outputs of the flattened (M, H), whatever the rows' padding (so an
odd H wastes no lanes). RMSNorm's rows are the last axis (contiguous); a program takes whole rows (in one block
of next_pow2(C) lanes), so each reduction is in registers. The RMSNorm backward's programs each walk a strip of
rows, a few rows per step (one row per step leaves too few loads in flight to reach the memory bandwidth),
summing their share of dw in fp32; the strips' partial sums are added by torch.
"""
import functools

import torch

from kernels.triton_utils import tl, triton

SWIGLU_BLOCK = 1024
RMS_BWD_TILE = 2048    # elements of the RMSNorm backward's (rows x next_pow2(C)) tile: 2 rows of a width <= 1024
RMS_BWD_WARPS = 4


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
    def _swiglu_bwd_kernel(dh_ptr, gu_ptr, dgu_ptr, h_ptr, n, H: tl.constexpr, dh_row, gu_row, dgu_row, h_row,
                           BLOCK: tl.constexpr):
        a_at, dh_at, mask = _swiglu_offsets(n, H, gu_row, dh_row, BLOCK)
        da_at, h_at, _ = _swiglu_offsets(n, H, dgu_row, h_row, BLOCK)
        dh = tl.load(dh_ptr + dh_at, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(gu_ptr + a_at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(gu_ptr + a_at + H, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        silu = a * sig
        da = dh * b * sig * (1.0 + a * (1.0 - sig))      # d silu(a) / da = sig * (1 + a (1 - sig))
        out_ty = dgu_ptr.dtype.element_ty
        tl.store(dgu_ptr + da_at, da.to(out_ty), mask=mask)
        tl.store(dgu_ptr + da_at + H, (dh * silu).to(out_ty), mask=mask)
        tl.store(h_ptr + h_at, (silu * b).to(h_ptr.dtype.element_ty), mask=mask)   # the forward's h, again

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
                             rows_per_program, HAS_DS: tl.constexpr, HAS_DY: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, M)
        for start in range(first, last, ROWS):     # ROWS rows at a time: more loads in flight per program
            row = start + tl.arange(0, ROWS)
            row_ok = row < last
            mask = row_ok[:, None] & (cols < C)[None, :]
            at = row.to(tl.int64)[:, None] * C + cols[None, :]
            s = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
            dout = tl.load(dout_ptr + at, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)[:, None]
            s_hat = s * rstd
            g = dout * w[None, :]
            d = rstd * (g - s_hat * (tl.sum(g * s_hat, axis=1)[:, None] / C))
            if HAS_DS:
                d += tl.load(ds_ptr + at, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + at, d.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_DY:
                tl.store(dy_ptr + at, d.to(dy_ptr.dtype.element_ty), mask=mask)
            dw += tl.sum(dout * s_hat, axis=0)
        tl.store(dw_ptr + pid * C + cols, dw, mask=cols < C)


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
    h = aligned_empty((*gate_up.shape[:-1], H), gate_up)
    gu, dgu, dh2, h2 = rows(gate_up), d_gate_up.view(-1, 2 * H), rows(dh), h.view(-1, H)
    n = gu.size(0) * H
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](dh2, gu, dgu, h2, n, H, dh2.stride(0), gu.stride(0),
                                                            dgu.stride(0), h2.stride(0), BLOCK=SWIGLU_BLOCK)
    return d_gate_up, h


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
        block = triton.next_power_of_2(C)
        _rms_norm_bwd_kernel[(programs,)](dout, ds if ds is not None else s, s, w, rstd, dx, dy if dy.numel() else dx,
                                          dw, M, C, triton.cdiv(M, programs), HAS_DS=ds is not None,
                                          HAS_DY=dy_dtype is not None, ROWS=max(1, RMS_BWD_TILE // block),
                                          BLOCK=block, num_warps=RMS_BWD_WARPS)
    return dx, dy, dw.sum(0).to(w.dtype)


# ----------------------------------------------------------------------------- cross-entropy softmax + gradient

CE_BLOCK = 4096        # columns per iteration: 16 per thread of 8 warps, a row of V ~ 50K in 13 steps
CE_WARPS = 8

if triton is not None:
    @triton.jit
    def _cross_entropy_grad_kernel(logits_ptr, targets_ptr, keep_ptr, n_counted_ptr, losses_ptr, V, row_stride,
                                   BLOCK: tl.constexpr):
        """One row: pass 1 an online max / sum of exp over V (fp32) -> lse and the row's loss; pass 2 overwrites
        each block of the row, after reading it, with (softmax - onehot(target)) * keep / n_counted in the logits'
        dtype. Pass 2 walks the row backwards, so it starts on the blocks pass 1 read last (the likeliest still in
        L2). The target's logit is read before pass 2 overwrites it."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([], -float("inf"), tl.float32)     # running max of the row
        s = tl.zeros([], tl.float32)                   # sum of exp(z - m) over the columns so far
        for start in range(0, V, BLOCK):
            at = start + cols
            z = tl.load(base + at, mask=at < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))     # finite from the first block on (V >= 1, finite logits)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        keep = tl.load(keep_ptr + row) != 0
        target = tl.where(keep, tl.load(targets_ptr + row), 0)     # an ignored row's target may be any id
        z_target = tl.load(base + target).to(tl.float32)
        tl.store(losses_ptr + row, tl.where(keep, lse - z_target, 0.0))
        scale = keep.to(tl.float32) / tl.load(n_counted_ptr).to(tl.float32)
        n_blocks = tl.cdiv(V, BLOCK)
        for i in range(0, n_blocks):
            at = (n_blocks - 1 - i) * BLOCK + cols
            mask = at < V
            z = tl.load(base + at, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            grad = tl.where(at == target, p - 1.0, p) * scale
            tl.store(base + at, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_grad_(logits, targets, keep, n_counted):
    """The cross-entropy of each row of logits (n, V) (bf16, fp16 or fp32; last axis contiguous, rows any stride)
    against targets (n,) where keep (n,) is True, 0 where it is False: fp32 (n,), lse - logit[target]. In place,
    logits become the gradient of sum(losses) / n_counted, (softmax - onehot(target)) * keep / n_counted
    (n_counted: a 1-element tensor, read on the device). Math in fp32, softmax over all V columns."""
    n, V = logits.shape
    losses = torch.empty(n, device=logits.device, dtype=torch.float32)
    if n:
        _cross_entropy_grad_kernel[(n,)](logits, targets, keep, n_counted, losses, V, logits.stride(0),
                                         BLOCK=min(CE_BLOCK, triton.next_power_of_2(V)), num_warps=CE_WARPS)
    return losses
