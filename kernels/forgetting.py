"""Forgetting Attention (FoX): softmax attention with a per-position forget gate.

    o_i = sum_{j<=i} softmax_j( scale * q_i.k_j + c_i - c_j ) v_j,    c = cumsum(log f)

Tensors are (B, H, L, D); `log_fgate` is (B, H, L), the log forget gate (<= 0), float32.
The bias c_i - c_j is not scaled by `scale`. See shared/spec/fox.md §1.

Contents
- `forgetting_attn`: the op; `impl="torch"` is the materialized reference (also works in fp64),
  `impl="triton"` the FlashAttention-2 style kernels below (forward + backward).
- `fgate_cumsum`, `forgetting_decode`: cached decoding (fox.md §1.6).
- The gate's fp64 cumsum (split as below) and its adjoint run as one small Triton launch each, so
  that short sequences are not bound by a dozen host-side torch ops per call.

Precision policy for c (fox.md §1.5, §8.9). An fp32 global cumsum cancels catastrophically:
with log f ~ -5 at 64K tokens |c| ~ 3e5, so each c_i carries an absolute error of ~0.02 and so
does every bias c_i - c_j, including the near-diagonal ones that carry the weight (~2% error in
the probabilities). Instead c is kept in float64 (8 bytes per head per token, nothing next to
Q/K/V). The kernels get it in two parts (`_split_c`): a float64 value per 128-position block (c at
its first position) and every position's fp32 offset from its block's value, a small number.
Every kernel program takes the block value of the tile it owns as its reference c_ref; a position's
bias is its offset plus (its block's value - c_ref), that difference taken in fp64 once per tile
and then cast: per position one fp32 load and add, no fp64 arithmetic (fp64 loads and
subtractions per position cost the kernels 4-5% of forward+backward on an H100). An entry (i, j)
that carries weight has |c_i - c_j| small, so its fp32 bias error is about
6e-8 * (|c_i - c_j| + sum of |log f| over two 128-token blocks):
bounded independently of L and of |c| (about 1e-4 for |log f| <= 10; entries with a large
|c_i - c_j| get an error relative to it, but their weight is ~exp(-|c_i - c_j|) anyway).
The op is thus invariant to adding a constant to c (i.e. to changing log f_1), which the tests
check with an offset of 3e5. The reverse cumsum of the gate gradient is done in fp64 too.
The torch reference and the decode path take c_i - c_j in fp64 directly.

Kernel notes
- Forward: the per-row term c_i cancels in the softmax, so the logits are only
  scale*q.k - c_j (one FMA, as in FlashAttention); c_i is added back into the stored
  logsumexp so the backward sees the true one. Base-2 exponentials with log2(e) folded in.
- Backward: one fused launch; program t computes dK/dV (and -colsum(dS)) for key tile t and
  dQ (and rowsum(dS)) for query tile t. The causal work of the two halves sums to a constant,
  so programs are balanced, and every output has one owner: no atomics. dc = rowsum - colsum,
  d log f = reverse cumsum of dc (fox.md §1.4).
- Any L: inputs are zero-padded at the end to a multiple of the largest tile. Padded positions
  come after every real one, so causality keeps them out of the real outputs and gradients.
  Kernels therefore need no tail masks. Head dims that are not powers of two are zero-padded.
- Block sizes are autotuned per (L, D, dtype) on CUDA for 16-bit inputs; fp32 inputs use
  3xTF32 dots (about fp32 accuracy) and one fixed tile config.
"""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = tl.constexpr(1.4426950408889634)  # kernels use exp2/log2: logits are scaled by log2(e)
_MAX_BLOCK = 16 if _INTERPRET else 128  # every tile size divides this; L is padded to it
_C_BLOCK = tl.constexpr(_MAX_BLOCK)  # c is split into a float64 value per block + fp32 offsets


# ---------------------------------------------------------------------------------------------
# PyTorch reference (materialized L x L; autograd gives the backward)
# ---------------------------------------------------------------------------------------------

def fgate_cumsum(log_fgate, c_prev=None):
    """c = cumsum(log f) in float64 along the last axis, continuing after c_prev[..., -1] if given.

    This is how a decoding cache appends: c_cache = cat([c_cache, fgate_cumsum(log_f_new, c_cache)]).
    """
    c = torch.cumsum(log_fgate.to(torch.float64), dim=-1)
    if c_prev is not None and c_prev.shape[-1] > 0:
        c = c + c_prev[..., -1:].to(torch.float64)
    return c


def _attend(q, k, v, c_q, c_k, scale):
    """Softmax attention of queries at the last M of N positions, bias c_q[i] - c_k[j], causal.

    The bias difference is taken in float64 and only then rounded (see the precision policy).
    Computes in fp32 (fp64 for fp64 inputs) and returns q's dtype.
    """
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    M, N = q.shape[-2], k.shape[-2]
    bias = (c_q.to(torch.float64)[..., :, None] - c_k.to(torch.float64)[..., None, :]).to(ct)
    s = scale * (q.to(ct) @ k.to(ct).transpose(-1, -2)) + bias
    future = torch.ones(M, N, dtype=torch.bool, device=q.device).triu(N - M + 1)
    p = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1)
    return (p @ v.to(ct)).to(q.dtype)


def _reference(q, k, v, log_fgate, scale):
    c = fgate_cumsum(log_fgate)
    return _attend(q, k, v, c, c, scale)


# ---------------------------------------------------------------------------------------------
# Decoding with a cache (fox.md §1.6). Cache layout: K, V (B, H, N, D) and c (B, H, N) float64.
# ---------------------------------------------------------------------------------------------

def forgetting_decode(q, k_cache, v_cache, c_cache, *, scale=None):
    """Output for the M newest positions, whose keys, values and c are already in the cache.

    q: (B, H, M, D), the queries of cache positions N-M .. N-1; k_cache, v_cache: (B, H, N, D);
    c_cache: (B, H, N) cumulative log gates (keep it float64, from `fgate_cumsum`).
    Equals rows N-M .. N-1 of `forgetting_attn` over the whole sequence. Works for one token
    (M = 1) and for chunked prefill on top of a cache (M > 1).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    M = q.shape[-2]
    return _attend(q, k_cache, v_cache, c_cache[..., -M:], c_cache, scale)


# ---------------------------------------------------------------------------------------------
# Triton forward
# ---------------------------------------------------------------------------------------------

@triton.jit
def _rel_c(CO, CB, offs, start, c_ref):
    # log2(e) * (c[offs] - c_ref) in fp32, for positions offs in the c block that holds `start`:
    # one fp32 load and add per position, the fp64 part once per tile (see _split_c)
    return tl.load(CO + offs) + (tl.load(CB + start // _C_BLOCK) - c_ref).to(tl.float32)


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m, lo, hi, scale2,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               DOT_PREC: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(K + cols[None, :] * stride_kl + offs_d[:, None])
        ck = _rel_c(CO, CB, cols, start_n, c_ref)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * scale2 - ck[None, :]
        if MASK:
            s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + cols[:, None] * stride_vl + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


# The float scales are constexpr: torch.compile (Inductor) would pass a Python float as an fp64
# scalar and promote the logits to fp64; as constants they stay fp32 in eager and compiled runs.
@triton.jit
def _fwd_kernel(Q, K, V, CO, CB, O, LSE2, scale2: tl.constexpr,
                stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
                stride_vb, stride_vh, stride_vl, H, L,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PREC: tl.constexpr):
    # grid (B*H, L/BLOCK_M); the longest (last) query tiles are launched first
    bh = tl.program_id(0)
    start_m = (L // BLOCK_M - 1 - tl.program_id(1)) * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    CO += bh.to(tl.int64) * L
    CB += bh.to(tl.int64) * (L // _C_BLOCK)
    O += bh.to(tl.int64) * L * HEAD_DIM
    LSE2 += bh.to(tl.int64) * L

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * stride_ql + offs_d[None, :])
    c_ref = tl.load(CB + start_m // _C_BLOCK)  # fp64; this program's biases are relative to it
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys strictly before the tile need no mask; the diagonal tile does
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m,
                               0, start_m, scale2, HEAD_DIM, BLOCK_N, False, DOT_PREC)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m,
                               start_m, start_m + BLOCK_M, scale2, HEAD_DIM, BLOCK_N, True,
                               DOT_PREC)
    o = acc / l_i[:, None]
    tl.store(O + offs_m[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty))
    # the row term c_i was left out of the logits (it cancels in the softmax); put it back so
    # that LSE2 is the true base-2 logsumexp of scale*q.k + c_i - c_j
    cq = _rel_c(CO, CB, offs_m, start_m, c_ref)
    tl.store(LSE2 + offs_m, m_i + tl.math.log2(l_i) + cq)


# ---------------------------------------------------------------------------------------------
# Triton backward
# ---------------------------------------------------------------------------------------------

@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # Delta_i = rowsum(dO * O), over all B*H*L rows at once (O and dO are contiguous)
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    offs = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offs).to(tl.float32)
    do = tl.load(DO + offs).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1))


@triton.jit
def _bwd_dkdv_inner(dk, dv, dck, k, v, ck, Q, DO, CO, CB, LSE2, DELTA, c_ref, stride_ql, offs_n,
                    lo, hi, scale2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    # one key tile against query tiles [lo, hi); works on transposed tiles (keys x queries)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        qt = tl.load(Q + rows[None, :] * stride_ql + offs_d[:, None])
        cq = _rel_c(CO, CB, rows, start_m, c_ref)
        row_bias = cq - tl.load(LSE2 + rows)
        st = tl.dot(k, qt, input_precision=DOT_PREC) * scale2 + row_bias[None, :] - ck[:, None]
        if MASK:
            st = tl.where(rows[None, :] >= offs_n[:, None], st, float("-inf"))
        pt = tl.math.exp2(st)
        do = tl.load(DO + rows[:, None] * HEAD_DIM + offs_d[None, :])
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dst = pt * (dpt - tl.load(DELTA + rows)[None, :])
        dck -= tl.sum(dst, 1)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PREC)
    return dk, dv, dck


@triton.jit
def _bwd_dq_inner(dq, dcq, q, do, row_bias, delta, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m,
                  lo, hi, scale2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    # one query tile against key tiles [lo, hi)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(K + cols[None, :] * stride_kl + offs_d[:, None])
        vt = tl.load(V + cols[None, :] * stride_vl + offs_d[:, None])
        ck = _rel_c(CO, CB, cols, start_n, c_ref)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * scale2 + row_bias[:, None] - ck[None, :]
        if MASK:
            s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        p = tl.math.exp2(s)
        dp = tl.dot(do, vt, input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dcq += tl.sum(ds, 1)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PREC)
    return dq, dcq


@triton.jit
def _bwd_kernel(Q, K, V, CO, CB, DO, LSE2, DELTA, DQ, DK, DV, DCQ, DCK,
                scale: tl.constexpr, scale2: tl.constexpr,
                stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
                stride_vb, stride_vh, stride_vl, H, L,
                HEAD_DIM: tl.constexpr, BLOCK_SMALL: tl.constexpr, BLOCK_SMALL_DQ: tl.constexpr,
                BLOCK_LARGE: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid (B*H, L/BLOCK_LARGE): program t owns key tile t (dK, dV, colsums) and query tile t
    # (dQ, rowsums); both tiles are BLOCK_LARGE long; the dK/dV loop takes BLOCK_SMALL queries a
    # step, the dQ loop BLOCK_SMALL_DQ keys
    bh = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_LARGE
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    offset = bh.to(tl.int64) * L  # into the contiguous (B, H, L[, D]) buffers
    CO += offset
    CB += bh.to(tl.int64) * (L // _C_BLOCK)
    LSE2 += offset
    DELTA += offset
    DCQ += offset
    DCK += offset
    DO += offset * HEAD_DIM
    DQ += offset * HEAD_DIM
    DK += offset * HEAD_DIM
    DV += offset * HEAD_DIM

    offs = start + tl.arange(0, BLOCK_LARGE)
    offs_d = tl.arange(0, HEAD_DIM)
    c_ref = tl.load(CB + start // _C_BLOCK)
    c_tile = _rel_c(CO, CB, offs, start, c_ref)

    # dK, dV for keys `offs`: queries from the diagonal tile (masked) to the end
    k = tl.load(K + offs[:, None] * stride_kl + offs_d[None, :])
    v = tl.load(V + offs[:, None] * stride_vl + offs_d[None, :])
    dk = tl.zeros([BLOCK_LARGE, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_LARGE, HEAD_DIM], tl.float32)
    dck = tl.zeros([BLOCK_LARGE], tl.float32)
    dk, dv, dck = _bwd_dkdv_inner(dk, dv, dck, k, v, c_tile, Q, DO, CO, CB, LSE2, DELTA, c_ref,
                                  stride_ql, offs, start, start + BLOCK_LARGE, scale2,
                                  HEAD_DIM, BLOCK_SMALL, True, DOT_PREC)
    dk, dv, dck = _bwd_dkdv_inner(dk, dv, dck, k, v, c_tile, Q, DO, CO, CB, LSE2, DELTA, c_ref,
                                  stride_ql, offs, start + BLOCK_LARGE, L, scale2,
                                  HEAD_DIM, BLOCK_SMALL, False, DOT_PREC)
    out = offs[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + out, dv.to(DV.dtype.element_ty))
    tl.store(DCK + offs, dck)

    # dQ for queries `offs`: keys from the diagonal tile (masked) back to the start
    q = tl.load(Q + offs[:, None] * stride_ql + offs_d[None, :])
    do = tl.load(DO + out)
    row_bias = c_tile - tl.load(LSE2 + offs)
    delta = tl.load(DELTA + offs)
    dq = tl.zeros([BLOCK_LARGE, HEAD_DIM], tl.float32)
    dcq = tl.zeros([BLOCK_LARGE], tl.float32)
    dq, dcq = _bwd_dq_inner(dq, dcq, q, do, row_bias, delta, K, V, CO, CB, c_ref, stride_kl,
                            stride_vl, offs, start, start + BLOCK_LARGE, scale2,
                            HEAD_DIM, BLOCK_SMALL_DQ, True, DOT_PREC)
    dq, dcq = _bwd_dq_inner(dq, dcq, q, do, row_bias, delta, K, V, CO, CB, c_ref, stride_kl,
                            stride_vl, offs, 0, start, scale2,
                            HEAD_DIM, BLOCK_SMALL_DQ, False, DOT_PREC)
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty))
    tl.store(DCQ + offs, dcq)


# ---------------------------------------------------------------------------------------------
# The gate's cumsum and its adjoint, one launch each (one program per (batch, head) row)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _gate_cumsum_kernel(LOGF, CO, CB, L_in, L, CHUNK: tl.constexpr):
    # log2(e) * cumsum(log f) in fp64, split as _split_c describes: every _C_BLOCK positions' base
    # (fp64) into CB, each position's fp32 offset from it into CO. Positions L_in..L (padding)
    # get log f = 0, so c stays constant there.
    bh = tl.program_id(0).to(tl.int64)
    LOGF += bh * L_in
    CO += bh * L
    CB += bh * (L // _C_BLOCK)
    carry = tl.zeros([1], tl.float64)  # c before the chunk
    for start in range(0, L, CHUNK):
        pos = start + tl.arange(0, CHUNK)
        log_f = tl.load(LOGF + pos, mask=pos < L_in, other=0.0).to(tl.float64)
        c = carry + tl.cumsum(log_f, 0)
        carry = carry + tl.sum(log_f, 0)
        c = tl.reshape(c * tl.full([1], _LOG2E, tl.float64), (CHUNK // _C_BLOCK, _C_BLOCK))
        base = tl.sum(tl.where(tl.arange(0, _C_BLOCK)[None, :] == 0, c, 0.0), 1)
        blocks = start // _C_BLOCK + tl.arange(0, CHUNK // _C_BLOCK)
        tl.store(CB + blocks, base, mask=blocks < L // _C_BLOCK)
        tl.store(CO + pos, tl.reshape((c - base[:, None]).to(tl.float32), (CHUNK,)), mask=pos < L)


@triton.jit
def _gate_grad_kernel(DCQ, DCK, DLOGF, L_out, L, CHUNK: tl.constexpr):
    # d log f_t = sum_{s >= t} dc_s with dc = DCQ + DCK (fox.md §1.4), accumulated in fp64, last
    # chunk first; only the L_out real positions are written
    bh = tl.program_id(0).to(tl.int64)
    DCQ += bh * L
    DCK += bh * L
    DLOGF += bh * L_out
    carry = tl.zeros([1], tl.float64)  # sum of dc after the chunk
    n_chunks = tl.cdiv(L, CHUNK)
    for i in range(0, n_chunks):
        pos = (n_chunks - 1 - i) * CHUNK + tl.arange(0, CHUNK)
        keep = pos < L_out
        dc = (tl.load(DCQ + pos, mask=keep, other=0.0) + tl.load(DCK + pos, mask=keep, other=0.0)).to(tl.float64)
        tl.store(DLOGF + pos, (carry + tl.cumsum(dc, 0, reverse=True)).to(DLOGF.dtype.element_ty),
                 mask=keep)
        carry = carry + tl.sum(dc, 0)


# ---------------------------------------------------------------------------------------------
# Launch configuration: autotuned on GPU for 16-bit inputs, fixed for fp32 and the interpreter
# ---------------------------------------------------------------------------------------------

def _cfg(num_warps, num_stages, **blocks):
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


# H100, bf16, D = 64 (scripts/bench_forgetting.py --show-tuning): forward 128 x 64 with 4 warps
# wins at every L; the backward with 128-token tiles, 32-query sub-tiles for dK/dV and 64-key ones
# for dQ (4 warps, 3 stages; 3-4% faster fwd+bwd than 32 for both, scripts/NOTES_forgetting.md).
# The others stay for D = 128 and other GPUs.
_FWD_CONFIGS = [
    _cfg(4, 3, BLOCK_M=128, BLOCK_N=64),
    _cfg(4, 4, BLOCK_M=128, BLOCK_N=64),
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=64),
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=128),
    _cfg(4, 4, BLOCK_M=128, BLOCK_N=32),
]
_BWD_CONFIGS = [
    _cfg(4, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
    _cfg(4, 4, BLOCK_SMALL=32, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
    _cfg(4, 5, BLOCK_SMALL=32, BLOCK_SMALL_DQ=32, BLOCK_LARGE=128),
    _cfg(8, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
    _cfg(8, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=32, BLOCK_LARGE=128),
    _cfg(8, 2, BLOCK_SMALL=64, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
    _cfg(4, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=32, BLOCK_LARGE=64),
    _cfg(4, 2, BLOCK_SMALL=64, BLOCK_SMALL_DQ=64, BLOCK_LARGE=64),
]
_KEY = ["L", "HEAD_DIM", "DOT_PREC"]
_fwd_tuned = triton.autotune(_FWD_CONFIGS, key=_KEY)(_fwd_kernel)
_bwd_tuned = triton.autotune(_BWD_CONFIGS, key=_KEY)(_bwd_kernel)
assert all(c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0 for c in _FWD_CONFIGS)
assert all(c.kwargs["BLOCK_LARGE"] % c.kwargs[sub] == 0
           for c in _BWD_CONFIGS for sub in ("BLOCK_SMALL", "BLOCK_SMALL_DQ"))
# without autotuning: tiny tiles under the interpreter; fp32, a correctness path, gets one small
# config (fp32 tiles take twice the registers and shared memory)
_FWD_FIXED = {"interpret": dict(BLOCK_M=16, BLOCK_N=16),
              "fp32": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)}
_BWD_FIXED = {"interpret": dict(BLOCK_SMALL=16, BLOCK_SMALL_DQ=16, BLOCK_LARGE=16),
              "fp32": dict(BLOCK_SMALL=16, BLOCK_SMALL_DQ=16, BLOCK_LARGE=32, num_warps=4, num_stages=2)}


def _launch(tuned, kernel, fixed, grid_fn, *args, **kwargs):
    mode = "interpret" if _INTERPRET else "fp32" if kwargs["DOT_PREC"] == "tf32x3" else None
    if mode:
        kernel[grid_fn(fixed[mode])](*args, **kwargs, **fixed[mode])
    else:
        tuned[grid_fn](*args, **kwargs)


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _dot_prec(dtype):
    # fp32: three TF32 products per dot (about fp32 accuracy, on tensor cores); the setting is
    # ignored for 16-bit inputs
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _gate_chunk(L):
    """Positions per step of the gate kernels' sequential scan (L is a multiple of _MAX_BLOCK): a
    power of two and a multiple of _MAX_BLOCK; small under the interpreter, so tests cross chunks."""
    return min(2 * _MAX_BLOCK if _INTERPRET else 2048, triton.next_power_of_2(L))


def _split_c(log_fgate, L):
    """c = cumsum(log f), float64, times log2(e), padded to length L (log f = 0 there), in two
    parts: one float64 value per _MAX_BLOCK positions (c at the block's first position) and every
    position's fp32 offset from its block's value (a small number)."""
    B, H, L_in = log_fgate.shape
    offsets = torch.empty(B, H, L, dtype=torch.float32, device=log_fgate.device)
    blocks = torch.empty(B, H, L // _MAX_BLOCK, dtype=torch.float64, device=log_fgate.device)
    _gate_cumsum_kernel[(B * H,)](log_fgate.contiguous(), offsets, blocks, L_in, L,
                                  CHUNK=_gate_chunk(L))
    return offsets, blocks


def _gate_grad(dcq, dck, L_out, dtype):
    """d log f (B, H, L_out) from the kernels' row and column sums: the reverse cumsum of
    dc = dcq + dck (fox.md §1.4), in float64."""
    B, H, L = dcq.shape
    dlog_fgate = torch.empty(B, H, L_out, dtype=dtype, device=dcq.device)
    _gate_grad_kernel[(B * H,)](dcq, dck, dlog_fgate, L_out, L, CHUNK=_gate_chunk(L))
    return dlog_fgate


def _triton_fwd(q, k, v, c_parts, scale):
    B, H, L, D = q.shape
    o = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    lse2 = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    _launch(_fwd_tuned, _fwd_kernel, _FWD_FIXED,
            lambda meta: (B * H, L // meta["BLOCK_M"]),
            q, k, v, *c_parts, o, lse2, scale * _LOG2E.value,
            *_strides(q), *_strides(k), *_strides(v), H, L,
            HEAD_DIM=D, DOT_PREC=_dot_prec(q.dtype))
    return o, lse2


def _triton_bwd(q, k, v, c_parts, o, lse2, do, scale):
    B, H, L, D = q.shape
    delta = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    _bwd_delta_kernel[(B * H * L // _MAX_BLOCK,)](o, do, delta, HEAD_DIM=D, BLOCK=_MAX_BLOCK)
    dq, dk, dv = (torch.empty(B, H, L, D, dtype=q.dtype, device=q.device) for _ in range(3))
    dcq, dck = (torch.empty(B, H, L, dtype=torch.float32, device=q.device) for _ in range(2))
    _launch(_bwd_tuned, _bwd_kernel, _BWD_FIXED,
            lambda meta: (B * H, L // meta["BLOCK_LARGE"]),
            q, k, v, *c_parts, do, lse2, delta, dq, dk, dv, dcq, dck, scale,
            scale * _LOG2E.value,
            *_strides(q), *_strides(k), *_strides(v), H, L,
            HEAD_DIM=D, DOT_PREC=_dot_prec(q.dtype))
    return dq, dk, dv, dcq, dck


def _pad(x, L, D):
    """Zero-pad a (B, H, L', D') tensor at the end of the sequence and head axes."""
    if x.shape[-2:] == (L, D):
        return x
    return F.pad(x, (0, D - x.shape[-1], 0, L - x.shape[-2]))


class _ForgettingAttnTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_fgate, scale):
        L, D = q.shape[-2:]
        Lp = -(-L // _MAX_BLOCK) * _MAX_BLOCK
        Dp = max(16, triton.next_power_of_2(D))
        q, k, v = (_pad(x, Lp, Dp) for x in (q, k, v))
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        c_parts = _split_c(log_fgate, Lp)
        o, lse2 = _triton_fwd(q, k, v, c_parts, scale)
        ctx.save_for_backward(q, k, v, *c_parts, o, lse2)
        ctx.scale, ctx.L, ctx.D, ctx.gate_dtype = scale, L, D, log_fgate.dtype
        return o[..., :L, :D]

    @staticmethod
    def backward(ctx, do):
        q, k, v, c_offsets, c_blocks, o, lse2 = ctx.saved_tensors
        L, D = ctx.L, ctx.D
        do = _pad(do, *o.shape[-2:]).contiguous()
        dq, dk, dv, dcq, dck = _triton_bwd(q, k, v, (c_offsets, c_blocks), o, lse2, do, ctx.scale)
        dlog_fgate = _gate_grad(dcq, dck, L, ctx.gate_dtype)
        return dq[..., :L, :D], dk[..., :L, :D], dv[..., :L, :D], dlog_fgate, None


# ---------------------------------------------------------------------------------------------
# Public op
# ---------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, log_fgate):
    if not (q.shape == k.shape == v.shape and q.dim() == 4):
        raise ValueError(f"q, k, v must share one (B, H, L, D) shape, got {q.shape}, {k.shape}, {v.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if log_fgate.shape != q.shape[:3]:
        raise ValueError(f"log_fgate must be (B, H, L) = {tuple(q.shape[:3])}, got {tuple(log_fgate.shape)}")
    if log_fgate.dtype not in (torch.float32, torch.float64):
        # a 16-bit log gate would already have lost the precision that c needs (fox.md §1.5)
        raise TypeError(f"log_fgate must be float32 (compute logsigmoid in fp32), got {log_fgate.dtype}")


def forgetting_attn(q, k, v, log_fgate, *, scale=None, impl="auto"):
    """Causal Forgetting Attention; returns (B, H, L, D) in q's dtype.

    q, k, v: (B, H, L, D) in fp32, bf16 or fp16 (fp64 too with impl="torch").
    log_fgate: (B, H, L) float32, log of the forget gate (<= 0); its fp32 cumsum is never formed.
    scale: logit scale, default D ** -0.5 (it does not multiply the gate bias).
    impl: "auto" (Triton on CUDA, torch elsewhere), "torch" (materialized reference) or
          "triton" (on CPU only under TRITON_INTERPRET=1).
    """
    _check_inputs(q, k, v, log_fgate)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    if impl == "torch":
        return _reference(q, k, v, log_fgate, scale)
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if not (q.is_cuda or _INTERPRET):
        raise RuntimeError("impl='triton' needs a CUDA tensor or TRITON_INTERPRET=1")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or q.shape[-1] > 128:
        raise ValueError(f"triton path supports fp32/bf16/fp16 and D <= 128, got {q.dtype}, D={q.shape[-1]}")
    return _ForgettingAttnTriton.apply(q, k, v, log_fgate, scale)
