"""Forgetting Attention's Triton kernels (FlashAttention-2 style forward and backward, FoX
arXiv:2503.02130 App. E, Algorithms 1 and 2) and the gate's cumsum and its adjoint.

- Forward: the per-row term c_i cancels in the softmax, so the logits are only
  scale*q.k - c_j (one FMA, as in FlashAttention); c_i is added back into the stored
  logsumexp so the backward sees the true one. Base-2 exponentials with log2(e) folded in.
- Backward: one fused launch; program t computes dK/dV (and -colsum(dS)) for key tile t and
  dQ (and rowsum(dS)) for query tile t. The causal work of the two halves sums to a constant,
  so programs are balanced, and every output has one owner: no atomics. dc = rowsum - colsum,
  d log f = reverse cumsum of dc (Algorithm 2).
- c reaches the kernels in two parts (split_c, the precision policy of kernels/forgetting/__init__.py):
  a float64 value per MAX_BLOCK positions and every position's fp32 offset from it. Every kernel
  program takes the block value of the tile it owns as its reference c_ref; a position's bias is its
  offset plus (its block's value - c_ref), that difference taken in fp64 once per tile and then cast:
  per position one fp32 load and add, no fp64 arithmetic.
- The gate's fp64 cumsum and its adjoint run as one small launch each (one program per (batch, head)
  row), so that short sequences are not bound by a dozen host-side torch ops per call.
- Sliding window (window=W: query i sees keys i-W+1..i; Transformer-SWA, FoX arXiv:2503.02130 §F.4):
  every loop runs over the tiles the window touches only, as in CASTLE-SWL; the tiles it cuts take
  the mask, those it covers whole run unmasked like the causal interior. Forward and backward then do
  O(L W) work. The masked forward tiles exponentiate against 0 for a row that has seen no key yet.
- No gate (c_parts=None): c = 0 without loading it and no row or column sums, i.e. plain causal
  softmax attention (with a window: sliding-window attention). GATED and WINDOWED are constexpr, so
  each variant compiles on its own and the gated causal kernel is the code it was without them.
- Adaptive Computation Pruning (ACP, arXiv:2504.06949 §3; optional, plan=acp_plan_of(...)): the block
  pairs whose entries provably weigh too little (reference.acp_block_bounds) are skipped. The plan is per
  MAX_BLOCK block, a multiple of every tile, so the forward, both backward loops and every tile config skip
  the same pairs: each loop's bounds move (SKIP: the first kept key block of a query block; QEND: the end of
  the query blocks that keep a key block), no branch inside a loop.
- Any L: inputs are zero-padded at the end to a multiple of MAX_BLOCK. Padded positions
  come after every real one, so causality keeps them out of the real outputs and gradients.
  Kernels therefore need no tail masks. Head dims that are not powers of two are zero-padded.
- Block sizes are autotuned per (L, W, D, dtype, variant) on CUDA for 16-bit inputs; fp32 inputs use
  3xTF32 dots (about fp32 accuracy) and one fixed tile config, the interpreter tiny tiles.

Internal API (tests, scripts/bench_forgetting.py): MAX_BLOCK, C_BLOCK, FWD_FIXED, BWD_FIXED,
padded_length, pad, split_c, acp_plan_of, gate_grad, triton_fwd, triton_bwd, fwd_kernel, bwd_kernel, fwd_tuned,
bwd_tuned.
"""
import math

import torch
import torch.nn.functional as F

from kernels.forgetting.reference import acp_block_bounds, acp_plan
from kernels.triton_utils import interpreting, tl, triton

MAX_BLOCK = 16 if interpreting() else 128  # every tile size divides this; L is padded to it

# without autotuning: tiny tiles under the interpreter; fp32, a correctness path, gets one small
# config (fp32 tiles take twice the registers and shared memory)
FWD_FIXED = {"interpret": dict(BLOCK_M=16, BLOCK_N=16),
             "fp32": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)}
BWD_FIXED = {"interpret": dict(BLOCK_SMALL=16, BLOCK_SMALL_DQ=16, BLOCK_LARGE=16),
             "fp32": dict(BLOCK_SMALL=16, BLOCK_SMALL_DQ=16, BLOCK_LARGE=32, num_warps=4, num_stages=2)}


if triton is not None:
    from kernels.triton_utils import LOG2E

    C_BLOCK = tl.constexpr(MAX_BLOCK)  # c is split into a float64 value per block + fp32 offsets

    # ---------------------------------------------------------------------------------------------
    # Forward
    # ---------------------------------------------------------------------------------------------

    @triton.jit
    def _rel_c(CO, CB, offs, start, c_ref, GATED: tl.constexpr):
        # log2(e) * (c[offs] - c_ref) in fp32, for positions offs in the c block that holds `start`:
        # one fp32 load and add per position, the fp64 part once per tile (see split_c); 0 without a gate
        # (constexpr branches assign and one return follows: a return inside a static branch would not
        # end the function for Triton's code generator)
        if GATED:
            c = tl.load(CO + offs) + (tl.load(CB + start // C_BLOCK) - c_ref).to(tl.float32)
        else:
            c = tl.zeros(offs.shape, tl.float32)
        return c

    @triton.jit
    def _c_ref(CB, start, GATED: tl.constexpr):
        # the fp64 reference of a program's biases: c at the first position of `start`'s c block
        if GATED:
            c_ref = tl.load(CB + start // C_BLOCK)
        else:
            c_ref = 0.0
        return c_ref

    @triton.jit
    def _visible(q_pos, k_pos, WINDOW, WINDOWED: tl.constexpr):
        # may queries q_pos see keys k_pos (broadcast against each other): causal, and inside the sliding
        # window (the last WINDOW positions, the query's own included) if there is one
        ok = q_pos >= k_pos
        if WINDOWED:
            ok = ok & (q_pos - k_pos < WINDOW)
        return ok

    # Tile ranges of the sliding window (all positions multiples of the step, so every range is whole
    # tiles). The window empties every tile outside them; the kernels never visit those.

    @triton.jit
    def _keys_from(q_start, WINDOW, STEP: tl.constexpr, WINDOWED: tl.constexpr):
        # the first key tile that a query >= q_start sees
        lo = 0
        if WINDOWED:
            lo = tl.maximum(q_start - WINDOW + 1, 0) // STEP * STEP
        return lo

    @triton.jit
    def _keys_whole_from(q_start, q_end, WINDOW, STEP: tl.constexpr, WINDOWED: tl.constexpr):
        # the first key tile that every query of [q_start, q_end) sees whole (clamped to
        # [_keys_from, q_start]); the tiles before it are cut by the window and need the mask
        whole = 0
        if WINDOWED:
            whole = tl.cdiv(tl.maximum(q_end - WINDOW, 0), STEP) * STEP
            whole = tl.minimum(tl.maximum(whole, _keys_from(q_start, WINDOW, STEP, WINDOWED)), q_start)
        return whole

    @triton.jit
    def _queries_to(k_end, L, WINDOW, STEP: tl.constexpr, WINDOWED: tl.constexpr):
        # the end of the query tiles that see a key < k_end
        hi = L
        if WINDOWED:
            hi = tl.minimum(tl.cdiv(k_end - 1 + WINDOW, STEP) * STEP, L)
        return hi

    @triton.jit
    def _queries_whole_to(k_start, k_end, L, WINDOW, STEP: tl.constexpr, WINDOWED: tl.constexpr):
        # the end of the query tiles (from k_end on) that see every key of [k_start, k_end) (clamped
        # to [k_end, _queries_to]); the tiles after it are cut by the window and need the mask
        whole = L
        if WINDOWED:
            whole = tl.minimum((k_start + WINDOW) // STEP * STEP, _queries_to(k_end, L, WINDOW, STEP, WINDOWED))
            whole = tl.maximum(whole, k_end)
        return whole

    # Adaptive Computation Pruning (acp_plan in reference.py): per c block, the first key block its queries
    # keep and the end of the query blocks that keep it, in blocks of C_BLOCK positions (whole tiles)

    @triton.jit
    def _acp_keys_from(SKIP, start, lo, PRUNED: tl.constexpr):
        # lo, or the first key that ACP keeps for the queries of `start`'s block if that is later
        if PRUNED:
            lo = tl.maximum(lo, tl.load(SKIP + start // C_BLOCK) * C_BLOCK)
        return lo

    @triton.jit
    def _acp_queries_to(QEND, start, hi, PRUNED: tl.constexpr):
        # hi, or the end of the queries that ACP keeps for the keys of `start`'s block if that is earlier
        if PRUNED:
            hi = tl.minimum(hi, tl.load(QEND + start // C_BLOCK) * C_BLOCK)
        return hi

    @triton.jit
    def _fwd_inner(acc, m_i, l_i, q, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m, lo, hi, scale2,
                   WINDOW, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                   DOT_PREC: tl.constexpr, GATED: tl.constexpr, WINDOWED: tl.constexpr):
        offs_d = tl.arange(0, HEAD_DIM)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            kt = tl.load(K + cols[None, :] * stride_kl + offs_d[:, None])
            ck = _rel_c(CO, CB, cols, start_n, c_ref, GATED)
            s = tl.dot(q, kt, input_precision=DOT_PREC) * scale2 - ck[None, :]
            if MASK:
                s = tl.where(_visible(offs_m[:, None], cols[None, :], WINDOW, WINDOWED), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_exp = m_new
            if WINDOWED:
                if MASK:
                    # a row may have seen no key yet (the window; causal rows see key 0 first): exponentiate
                    # against 0 there, so that exp2(-inf - m) is 0, not NaN; its max stays -inf until it sees one
                    m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_exp[:, None])
            alpha = tl.math.exp2(m_i - m_exp)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + cols[:, None] * stride_vl + offs_d[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
            m_i = m_new
        return acc, m_i, l_i

    # The float scales are constexpr: torch.compile (Inductor) would pass a Python float as an fp64
    # scalar and promote the logits to fp64; as constants they stay fp32 in eager and compiled runs.
    @triton.jit
    def fwd_kernel(Q, K, V, CO, CB, SKIP, QEND, O, LSE2, scale2: tl.constexpr,
                    stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
                    stride_vb, stride_vh, stride_vl, H, L, WINDOW,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PREC: tl.constexpr, GATED: tl.constexpr, WINDOWED: tl.constexpr,
                    PRUNED: tl.constexpr):
        # grid (B*H, L/BLOCK_M); the longest (last) query tiles are launched first
        bh = tl.program_id(0)
        start_m = (L // BLOCK_M - 1 - tl.program_id(1)) * BLOCK_M
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        Q += b * stride_qb + h * stride_qh
        K += b * stride_kb + h * stride_kh
        V += b * stride_vb + h * stride_vh
        CO += bh.to(tl.int64) * L
        CB += bh.to(tl.int64) * (L // C_BLOCK)
        SKIP += bh.to(tl.int64) * (L // C_BLOCK)
        O += bh.to(tl.int64) * L * HEAD_DIM
        LSE2 += bh.to(tl.int64) * L

        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + offs_m[:, None] * stride_ql + offs_d[None, :])
        c_ref = _c_ref(CB, start_m, GATED)  # fp64; this program's biases are relative to it
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # keys strictly before the tile that every row sees need no mask; the diagonal tile does, and
        # so do the tiles that the window cuts (none without a window); ACP skips the leading ones
        lo = _acp_keys_from(SKIP, start_m, _keys_from(start_m, WINDOW, BLOCK_N, WINDOWED), PRUNED)
        whole = _acp_keys_from(SKIP, start_m, _keys_whole_from(start_m, start_m + BLOCK_M, WINDOW, BLOCK_N, WINDOWED),
                               PRUNED)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m,
                                   whole, start_m, scale2, WINDOW, HEAD_DIM, BLOCK_N, False, DOT_PREC,
                                   GATED, WINDOWED)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m,
                                   start_m, start_m + BLOCK_M, scale2, WINDOW, HEAD_DIM, BLOCK_N, True,
                                   DOT_PREC, GATED, WINDOWED)
        if WINDOWED:
            acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m,
                                       lo, whole, scale2, WINDOW, HEAD_DIM, BLOCK_N, True, DOT_PREC,
                                       GATED, WINDOWED)
        o = acc / l_i[:, None]
        tl.store(O + offs_m[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty))
        # the row term c_i was left out of the logits (it cancels in the softmax); put it back so
        # that LSE2 is the true base-2 logsumexp of scale*q.k + c_i - c_j
        cq = _rel_c(CO, CB, offs_m, start_m, c_ref, GATED)
        tl.store(LSE2 + offs_m, m_i + tl.math.log2(l_i) + cq)

    # ---------------------------------------------------------------------------------------------
    # Backward
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
                        lo, hi, scale2, WINDOW, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        MASK: tl.constexpr, DOT_PREC: tl.constexpr, GATED: tl.constexpr,
                        WINDOWED: tl.constexpr):
        # one key tile against query tiles [lo, hi); works on transposed tiles (keys x queries)
        offs_d = tl.arange(0, HEAD_DIM)
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            qt = tl.load(Q + rows[None, :] * stride_ql + offs_d[:, None])
            cq = _rel_c(CO, CB, rows, start_m, c_ref, GATED)
            row_bias = cq - tl.load(LSE2 + rows)
            st = tl.dot(k, qt, input_precision=DOT_PREC) * scale2 + row_bias[None, :] - ck[:, None]
            if MASK:
                st = tl.where(_visible(rows[None, :], offs_n[:, None], WINDOW, WINDOWED), st, float("-inf"))
            pt = tl.math.exp2(st)
            do = tl.load(DO + rows[:, None] * HEAD_DIM + offs_d[None, :])
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            dst = pt * (dpt - tl.load(DELTA + rows)[None, :])
            if GATED:
                dck -= tl.sum(dst, 1)
            dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PREC)
        return dk, dv, dck

    @triton.jit
    def _bwd_dq_inner(dq, dcq, q, do, row_bias, delta, K, V, CO, CB, c_ref, stride_kl, stride_vl, offs_m,
                      lo, hi, scale2, WINDOW, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASK: tl.constexpr, DOT_PREC: tl.constexpr, GATED: tl.constexpr,
                      WINDOWED: tl.constexpr):
        # one query tile against key tiles [lo, hi)
        offs_d = tl.arange(0, HEAD_DIM)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            kt = tl.load(K + cols[None, :] * stride_kl + offs_d[:, None])
            vt = tl.load(V + cols[None, :] * stride_vl + offs_d[:, None])
            ck = _rel_c(CO, CB, cols, start_n, c_ref, GATED)
            s = tl.dot(q, kt, input_precision=DOT_PREC) * scale2 + row_bias[:, None] - ck[None, :]
            if MASK:
                s = tl.where(_visible(offs_m[:, None], cols[None, :], WINDOW, WINDOWED), s, float("-inf"))
            p = tl.math.exp2(s)
            dp = tl.dot(do, vt, input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            if GATED:
                dcq += tl.sum(ds, 1)
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PREC)
        return dq, dcq

    @triton.jit
    def bwd_kernel(Q, K, V, CO, CB, SKIP, QEND, DO, LSE2, DELTA, DQ, DK, DV, DCQ, DCK,
                    scale: tl.constexpr, scale2: tl.constexpr,
                    stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
                    stride_vb, stride_vh, stride_vl, H, L, WINDOW,
                    HEAD_DIM: tl.constexpr, BLOCK_SMALL: tl.constexpr, BLOCK_SMALL_DQ: tl.constexpr,
                    BLOCK_LARGE: tl.constexpr, DOT_PREC: tl.constexpr, GATED: tl.constexpr,
                    WINDOWED: tl.constexpr, PRUNED: tl.constexpr):
        # grid (B*H, L/BLOCK_LARGE): program t owns key tile t (dK, dV, colsums) and query tile t
        # (dQ, rowsums); both tiles are BLOCK_LARGE long; the dK/dV loop takes BLOCK_SMALL queries a
        # step, the dQ loop BLOCK_SMALL_DQ keys. Without a gate (GATED false) c is 0 and there are no
        # row and column sums. With ACP (PRUNED) every loop is cut to the block pairs that acp_plan keeps.
        bh = tl.program_id(0)
        start = tl.program_id(1) * BLOCK_LARGE
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        Q += b * stride_qb + h * stride_qh
        K += b * stride_kb + h * stride_kh
        V += b * stride_vb + h * stride_vh
        offset = bh.to(tl.int64) * L  # into the contiguous (B, H, L[, D]) buffers
        CO += offset
        CB += bh.to(tl.int64) * (L // C_BLOCK)
        SKIP += bh.to(tl.int64) * (L // C_BLOCK)
        QEND += bh.to(tl.int64) * (L // C_BLOCK)
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
        end = start + BLOCK_LARGE
        c_ref = _c_ref(CB, start, GATED)
        c_tile = _rel_c(CO, CB, offs, start, c_ref, GATED)

        # dK, dV for keys `offs`: queries from the diagonal tile (masked) to the end, or with a window to
        # the last query that sees them (the tiles it cuts masked)
        k = tl.load(K + offs[:, None] * stride_kl + offs_d[None, :])
        v = tl.load(V + offs[:, None] * stride_vl + offs_d[None, :])
        dk = tl.zeros([BLOCK_LARGE, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_LARGE, HEAD_DIM], tl.float32)
        dck = tl.zeros([BLOCK_LARGE], tl.float32)
        whole_to = _acp_queries_to(QEND, start, _queries_whole_to(start, end, L, WINDOW, BLOCK_SMALL, WINDOWED),
                                   PRUNED)
        dk, dv, dck = _bwd_dkdv_inner(dk, dv, dck, k, v, c_tile, Q, DO, CO, CB, LSE2, DELTA, c_ref,
                                      stride_ql, offs, start, end, scale2, WINDOW,
                                      HEAD_DIM, BLOCK_SMALL, True, DOT_PREC, GATED, WINDOWED)
        dk, dv, dck = _bwd_dkdv_inner(dk, dv, dck, k, v, c_tile, Q, DO, CO, CB, LSE2, DELTA, c_ref,
                                      stride_ql, offs, end, whole_to, scale2, WINDOW,
                                      HEAD_DIM, BLOCK_SMALL, False, DOT_PREC, GATED, WINDOWED)
        if WINDOWED:
            dk, dv, dck = _bwd_dkdv_inner(dk, dv, dck, k, v, c_tile, Q, DO, CO, CB, LSE2, DELTA, c_ref,
                                          stride_ql, offs, whole_to,
                                          _acp_queries_to(QEND, start, _queries_to(end, L, WINDOW, BLOCK_SMALL,
                                                                                   WINDOWED), PRUNED), scale2,
                                          WINDOW, HEAD_DIM, BLOCK_SMALL, True, DOT_PREC, GATED, WINDOWED)
        out = offs[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty))
        tl.store(DV + out, dv.to(DV.dtype.element_ty))
        if GATED:
            tl.store(DCK + offs, dck)

        # dQ for queries `offs`: keys from the diagonal tile (masked) back to the start, or with a window
        # to the first key they see (the tiles it cuts masked)
        q = tl.load(Q + offs[:, None] * stride_ql + offs_d[None, :])
        do = tl.load(DO + out)
        row_bias = c_tile - tl.load(LSE2 + offs)
        delta = tl.load(DELTA + offs)
        dq = tl.zeros([BLOCK_LARGE, HEAD_DIM], tl.float32)
        dcq = tl.zeros([BLOCK_LARGE], tl.float32)
        whole_from = _acp_keys_from(SKIP, start, _keys_whole_from(start, end, WINDOW, BLOCK_SMALL_DQ, WINDOWED),
                                    PRUNED)
        dq, dcq = _bwd_dq_inner(dq, dcq, q, do, row_bias, delta, K, V, CO, CB, c_ref, stride_kl,
                                stride_vl, offs, start, end, scale2, WINDOW,
                                HEAD_DIM, BLOCK_SMALL_DQ, True, DOT_PREC, GATED, WINDOWED)
        dq, dcq = _bwd_dq_inner(dq, dcq, q, do, row_bias, delta, K, V, CO, CB, c_ref, stride_kl,
                                stride_vl, offs, whole_from, start, scale2, WINDOW,
                                HEAD_DIM, BLOCK_SMALL_DQ, False, DOT_PREC, GATED, WINDOWED)
        if WINDOWED:
            dq, dcq = _bwd_dq_inner(dq, dcq, q, do, row_bias, delta, K, V, CO, CB, c_ref, stride_kl,
                                    stride_vl, offs,
                                    _acp_keys_from(SKIP, start, _keys_from(start, WINDOW, BLOCK_SMALL_DQ, WINDOWED),
                                                   PRUNED),
                                    whole_from, scale2, WINDOW, HEAD_DIM, BLOCK_SMALL_DQ, True, DOT_PREC,
                                    GATED, WINDOWED)
        tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty))
        if GATED:
            tl.store(DCQ + offs, dcq)

    # ---------------------------------------------------------------------------------------------
    # The gate's cumsum and its adjoint, one launch each (one program per (batch, head) row)
    # ---------------------------------------------------------------------------------------------

    @triton.jit
    def _gate_cumsum_kernel(LOGF, CO, CB, L_in, L, CHUNK: tl.constexpr):
        # log2(e) * cumsum(log f) in fp64, split as split_c describes: every C_BLOCK positions' base
        # (fp64) into CB, each position's fp32 offset from it into CO. Positions L_in..L (padding)
        # get log f = 0, so c stays constant there.
        bh = tl.program_id(0).to(tl.int64)
        LOGF += bh * L_in
        CO += bh * L
        CB += bh * (L // C_BLOCK)
        carry = tl.zeros([1], tl.float64)  # c before the chunk
        for start in range(0, L, CHUNK):
            pos = start + tl.arange(0, CHUNK)
            log_f = tl.load(LOGF + pos, mask=pos < L_in, other=0.0).to(tl.float64)
            c = carry + tl.cumsum(log_f, 0)
            carry = carry + tl.sum(log_f, 0)
            c = tl.reshape(c * tl.full([1], LOG2E, tl.float64), (CHUNK // C_BLOCK, C_BLOCK))
            base = tl.sum(tl.where(tl.arange(0, C_BLOCK)[None, :] == 0, c, 0.0), 1)
            blocks = start // C_BLOCK + tl.arange(0, CHUNK // C_BLOCK)
            tl.store(CB + blocks, base, mask=blocks < L // C_BLOCK)
            tl.store(CO + pos, tl.reshape((c - base[:, None]).to(tl.float32), (CHUNK,)), mask=pos < L)

    @triton.jit
    def _gate_grad_kernel(DCQ, DCK, DLOGF, L_out, L, CHUNK: tl.constexpr):
        # d log f_t = sum_{s >= t} dc_s with dc = DCQ + DCK (FoX App. E, Algorithm 2), accumulated in fp64, last
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

    # -----------------------------------------------------------------------------------------
    # Launch configuration: autotuned on GPU for 16-bit inputs, fixed for fp32 and the interpreter
    # -----------------------------------------------------------------------------------------

    def _cfg(num_warps, num_stages, **blocks):
        return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)

    # First in each list: the winner at bf16, D = 64 (`python -m scripts.bench_forgetting --show-tuning`
    # prints the tuner's choice): the forward 128 x 64 with 4 warps at every L; the backward with 128-token
    # tiles, 32-query sub-tiles for dK/dV and 64-key ones for dQ (4 warps, 3 stages). The others stay for
    # D = 128 and other GPUs.
    FWD_CONFIGS = [
        _cfg(4, 3, BLOCK_M=128, BLOCK_N=64),
        _cfg(4, 4, BLOCK_M=128, BLOCK_N=64),
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=64),
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=128),
        _cfg(4, 4, BLOCK_M=128, BLOCK_N=32),
    ]
    BWD_CONFIGS = [
        _cfg(4, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
        _cfg(4, 4, BLOCK_SMALL=32, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
        _cfg(4, 5, BLOCK_SMALL=32, BLOCK_SMALL_DQ=32, BLOCK_LARGE=128),
        _cfg(8, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
        _cfg(8, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=32, BLOCK_LARGE=128),
        _cfg(8, 2, BLOCK_SMALL=64, BLOCK_SMALL_DQ=64, BLOCK_LARGE=128),
        _cfg(4, 3, BLOCK_SMALL=32, BLOCK_SMALL_DQ=32, BLOCK_LARGE=64),
        _cfg(4, 2, BLOCK_SMALL=64, BLOCK_SMALL_DQ=64, BLOCK_LARGE=64),
    ]
    TUNING_KEY = ["L", "WINDOW", "HEAD_DIM", "DOT_PREC", "GATED", "WINDOWED"]
    # Pruned launches take fixed tiles per head dim (<= 64, 128), the tuner's picks for the full causal work:
    # how much ACP skips depends on the gates of the call that would tune (at init most blocks), and tiles
    # tuned for that little work ran 20% slower once the gates kept every block (docs/forgetting_kernels.md)
    # (one-config autotuners: the launch compiles under torch.compile as the tuned ones do)
    fwd_pruned = {64: triton.autotune([FWD_CONFIGS[0]], key=TUNING_KEY)(fwd_kernel),
                  128: triton.autotune([FWD_CONFIGS[2]], key=TUNING_KEY)(fwd_kernel)}
    bwd_pruned = {64: triton.autotune([BWD_CONFIGS[0]], key=TUNING_KEY)(bwd_kernel),
                  128: triton.autotune([BWD_CONFIGS[3]], key=TUNING_KEY)(bwd_kernel)}
    fwd_tuned = triton.autotune(FWD_CONFIGS, key=TUNING_KEY)(fwd_kernel)
    bwd_tuned = triton.autotune(BWD_CONFIGS, key=TUNING_KEY)(bwd_kernel)
    assert all(c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0 for c in FWD_CONFIGS)
    assert all(c.kwargs["BLOCK_LARGE"] % c.kwargs[sub] == 0
               for c in BWD_CONFIGS for sub in ("BLOCK_SMALL", "BLOCK_SMALL_DQ"))


def _launch(tuned, pruned, kernel, fixed, grid_fn, *args, **kwargs):
    """kernel with the fixed config of the interpreter or fp32, else the pruned variant's config for its head
    dim (pruned), else its autotuner (tuned)."""
    mode = "interpret" if interpreting() else "fp32" if kwargs["DOT_PREC"] == "tf32x3" else None
    if mode:
        kernel[grid_fn(fixed[mode])](*args, **kwargs, **fixed[mode])
    elif kwargs["PRUNED"]:
        pruned[64 if kwargs["HEAD_DIM"] <= 64 else 128][grid_fn](*args, **kwargs)
    else:
        tuned[grid_fn](*args, **kwargs)


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _dot_prec(dtype):
    # fp32: three TF32 products per dot (about fp32 accuracy, on tensor cores); the setting is
    # ignored for 16-bit inputs
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _gate_chunk(L):
    """Positions per step of the gate kernels' sequential scan (L is a multiple of MAX_BLOCK): a
    power of two and a multiple of MAX_BLOCK; small under the interpreter, so tests cross chunks."""
    return min(2 * MAX_BLOCK if interpreting() else 2048, triton.next_power_of_2(L))


def split_c(log_fgate, L):
    """c = cumsum(log f), float64, times log2(e), padded to length L (log f = 0 there), in two
    parts: one float64 value per MAX_BLOCK positions (c at the block's first position) and every
    position's fp32 offset from its block's value (a small number)."""
    B, H, L_in = log_fgate.shape
    offsets = torch.empty(B, H, L, dtype=torch.float32, device=log_fgate.device)
    blocks = torch.empty(B, H, L // MAX_BLOCK, dtype=torch.float64, device=log_fgate.device)
    _gate_cumsum_kernel[(B * H,)](log_fgate.contiguous(), offsets, blocks, L_in, L,
                                  CHUNK=_gate_chunk(L))
    return offsets, blocks


def gate_grad(dcq, dck, L_out, dtype):
    """d log f (B, H, L_out) from the kernels' row and column sums: the reverse cumsum of
    dc = dcq + dck (FoX App. E, Algorithm 2), in float64."""
    B, H, L = dcq.shape
    dlog_fgate = torch.empty(B, H, L_out, dtype=dtype, device=dcq.device)
    _gate_grad_kernel[(B * H,)](dcq, dck, dlog_fgate, L_out, L, CHUNK=_gate_chunk(L))
    return dlog_fgate


def acp_plan_of(q, k, c_parts, scale, log_eps, L):
    """acp_plan (reference.py) at the kernels' blocks (MAX_BLOCK positions) for the padded q, k and the c
    that split_c gave; L: the real length."""
    offsets, blocks = c_parts  # log2(e) * c
    c_last = blocks + offsets[..., MAX_BLOCK - 1::MAX_BLOCK].double()
    return acp_plan(blocks * math.log(2), c_last * math.log(2), acp_block_bounds(q, k, scale, MAX_BLOCK), log_eps, L)


def _variant(c_parts, window, L, plan=None):
    """The kernels' WINDOW and constexpr flags: GATED without c_parts is plain softmax attention (no c
    loads, no row or column sums: a variant of its own, so the gated one pays nothing for it); a window
    that covers the whole (padded) sequence is no window; PRUNED with an ACP plan."""
    windowed = window is not None and window < L
    return dict(WINDOW=window if windowed else L, GATED=c_parts is not None, WINDOWED=windowed,
                PRUNED=plan is not None)


def triton_fwd(q, k, v, c_parts, scale, window=None, plan=None):
    """c_parts: split_c's pair, or None for no gate; window: the sliding window W, or None; plan: None,
    or acp_plan_of's pair, which skips the block pairs it prunes (needs the gate)."""
    B, H, L, D = q.shape
    o = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    lse2 = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    _launch(fwd_tuned, fwd_pruned, fwd_kernel, FWD_FIXED,
            lambda meta: (B * H, L // meta["BLOCK_M"]),
            q, k, v, *(c_parts or (q, q)), *(plan or (q, q)), o, lse2, scale * LOG2E.value,
            *_strides(q), *_strides(k), *_strides(v), H, L,
            HEAD_DIM=D, DOT_PREC=_dot_prec(q.dtype), **_variant(c_parts, window, L, plan))
    return o, lse2


def triton_bwd(q, k, v, c_parts, o, lse2, do, scale, window=None, plan=None):
    """Returns dq, dk, dv and the row and column sums dcq, dck (None without a gate); plan as in
    triton_fwd (the same one: the backward differentiates the forward's function)."""
    B, H, L, D = q.shape
    delta = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    _bwd_delta_kernel[(B * H * L // MAX_BLOCK,)](o, do, delta, HEAD_DIM=D, BLOCK=MAX_BLOCK)
    dq, dk, dv = (torch.empty(B, H, L, D, dtype=q.dtype, device=q.device) for _ in range(3))
    dcq, dck = ((torch.empty(B, H, L, dtype=torch.float32, device=q.device) for _ in range(2))
                if c_parts is not None else (None, None))
    _launch(bwd_tuned, bwd_pruned, bwd_kernel, BWD_FIXED,
            lambda meta: (B * H, L // meta["BLOCK_LARGE"]),
            q, k, v, *(c_parts or (q, q)), *(plan or (q, q)), do, lse2, delta, dq, dk, dv,
            *((dcq, dck) if c_parts is not None else (delta, delta)), scale,
            scale * LOG2E.value,
            *_strides(q), *_strides(k), *_strides(v), H, L,
            HEAD_DIM=D, DOT_PREC=_dot_prec(q.dtype), **_variant(c_parts, window, L, plan))
    return dq, dk, dv, dcq, dck


def pad(x, L, D):
    """Zero-pad a (B, H, L', D') tensor at the end of the sequence and head axes."""
    if x.shape[-2:] == (L, D):
        return x
    return F.pad(x, (0, D - x.shape[-1], 0, L - x.shape[-2]))


def padded_length(L):
    """The sequence length the kernels take: L rounded up to a multiple of MAX_BLOCK (zeros at the end)."""
    return -(-L // MAX_BLOCK) * MAX_BLOCK
