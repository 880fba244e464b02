"""The Gluon kernel of kernels/llama_step: the batch-1 decode step with every static byte streamed ahead.

Same phases, shares and grid barriers as triton.py (read its docstring first). What differs is where the
bytes come from: the weights and the cache rows written by earlier steps do not depend on anything computed
within the step, so each program streams its own share of them, in the exact order its phases consume them,
through a ring of SLOTS shared-memory tiles filled by asynchronous copies (cp.async). The ring runs ahead
across phase boundaries and grid barriers: while a program waits at a barrier its next phase's tiles are
already arriving, so a phase after the barrier computes on data in shared memory instead of waiting for its
first loads from HBM (the fixed per-phase latency that bounds the Triton kernel, docs/decoding.md).

The schedule: at the start each program writes its tiles of one layer, then the head's, into a table in
shared memory (_build_schedule: offset from WQKV, step per layer, row stride, valid rows and columns); tile j
of the step is entry j mod the layer's count, shifted by its layer. The consumer takes tiles in that order
(_take) and, after each, issues tile j + SLOTS - 1 into the slot it just freed (_issue, branch-free: decoding
a tile with branches and divisions cost more than the copies). Past the last tile it commits empty groups,
so exactly SLOTS - 1 groups are always in flight and the wait count is a constant. A weight tile is WR rows
by WK columns of a matrix (one K piece of a chunk of rows); a cache tile is BT contiguous keys (or values) of
one (head, split) item, viewed as (R, KG, D) so that each thread's keys share a running softmax. The key the
step itself writes (row `position`) is never in the ring: the item that holds it reads it after the barrier.

Batch 1 only. Every matrix and cache is addressed from WQKV, so they share its dtype and 16-byte alignment,
and every row length (d, F, H D) is a multiple of 16 bytes (cp.async copies 16 bytes per thread).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from kernels.llama_step.triton import _grid_sync, _share, _split_range
from kernels.triton_utils import LOG2E, deal_keys, split_keys

WR = gl.constexpr(8)   # rows per weight tile
SLOT_BYTES = 16384    # bytes per ring slot
SHARED_BYTES = 232448 - 24576  # Hopper's shared memory per program, less the compiler's scratch (up to ~21 KiB
                               # at head dim 128); the ring's depth past 6 slots does not change the time


@gluon.jit
def _item_keys(it, S, split, pos):
    """(head, first key, end of its ring keys, whether it holds key `pos`) of attention item it = h * S + s: the
    ring streams the keys earlier steps wrote; key `pos`, this step's, is loaded apart."""
    h, t0, t1 = _split_range(it, S, split, pos)
    return h, t0, gl.minimum(t1, pos), (t0 <= pos) & (pos < t1)


@gluon.jit
def _weight_entry(row, row_end, p, K, base, WK: gl.constexpr):
    """(offset, rows, columns) of the tile of WR rows from `row` (of at most row_end) and K piece p of a
    row-major matrix of rows of K at element offset `base`."""
    return base + row.to(gl.int64) * K + p * WK, gl.minimum(row_end - row, WR), gl.minimum(K - p * WK, WK)


@gluon.jit
def _where(sel, entry, tile, step, K):
    """The fields (offset, rows, columns, step per layer, row stride) of `entry` with those of a weight tile
    (_weight_entry's three, step, K) where sel."""
    off, rows, cols, old_step, old_K = entry
    new_off, new_rows, new_cols = tile
    return (gl.where(sel, new_off, off), gl.where(sel, new_rows, rows), gl.where(sel, new_cols, cols),
            gl.where(sel, step, old_step), gl.where(sel, K, old_K))


@gluon.jit
def _build_schedule(tab, plan, d, F, H, CAP, pos, base_wo, base_wgu, base_wd, base_wh, base_kc, base_vc,
                    WK: gl.constexpr, BT: gl.constexpr, D: gl.constexpr, VEC: gl.constexpr, TMAX: gl.constexpr,
                    PD: gl.constexpr, PF: gl.constexpr, PHD: gl.constexpr, S: gl.constexpr, split,
                    TL: gl.constexpr):
    """Fill tab (TMAX, 4) int64 with this program's tiles of one layer, then the head's: (element offset from
    WQKV for layer 0, the offset's step per layer, row stride, rows | columns / VEC << 16 | columns of the row
    after the last full one / VEC << 32). A cache tile is BT contiguous keys: WR rows of WK elements. Returns
    the tiles of one layer (those of attention counted here, as its items' keys are dealt)."""
    (u0, u1, i0, i1, r0, r1, n0, n1, v0, v1, n_qkv, n_out, n_gu, n_down) = plan
    HD = H * D
    e = gl.arange(0, TMAX, layout=gl.SliceLayout(1, TL))
    zero = gl.zeros([TMAX], gl.int64, gl.SliceLayout(1, TL))
    # qkv
    off, rows, cols = _weight_entry(2 * u0 + e // PD * WR, 2 * u1, e % PD, d, zero, WK)
    step = zero + 3 * HD * d
    K = zero + d
    part = gl.zeros([TMAX], gl.int32, gl.SliceLayout(1, TL))
    # attention: K and V tiles of each item in turn
    a = e - n_qkv
    start = 0
    for it in range(i0, i1):
        h, t0, tr, fresh = _item_keys(it, S, split, pos)
        n = 2 * gl.cdiv(gl.maximum(tr - t0, 0), BT)
        sel = (a >= start) & (a < start + n)
        t = t0 + (a - start) // 2 * BT
        flat = gl.minimum(tr - t, BT) * D
        off = gl.where(sel, gl.where((a - start) % 2 == 0, base_kc, base_vc) + (h * CAP + t).to(gl.int64) * D, off)
        rows = gl.where(sel, flat // WK, rows)
        cols = gl.where(sel, WK, cols)
        part = gl.where(sel, flat % WK, part)
        step = gl.where(sel, H * CAP * D, step)
        K = gl.where(sel, WK, K)
        start += n
    n_att = start
    per_layer = n_qkv + n_att + n_out + n_gu + n_down
    # out, gate/up (each chunk: its gate pieces, then its up pieces), down
    a = e - n_qkv - n_att
    off, rows, cols, step, K = _where((a >= 0) & (a < n_out), (off, rows, cols, step, K),
                                     _weight_entry(r0 + a // PHD * WR, r1, a % PHD, HD, zero + base_wo, WK), d * HD, HD)
    a -= n_out
    half = a // PD % 2
    gate_up = _weight_entry(half * F + n0 + a // (2 * PD) * WR, half * F + n1, a % PD, d, zero + base_wgu, WK)
    off, rows, cols, step, K = _where((a >= 0) & (a < n_gu), (off, rows, cols, step, K), gate_up, 2 * F * d, d)
    a -= n_gu
    off, rows, cols, step, K = _where(a >= 0, (off, rows, cols, step, K),
                                     _weight_entry(r0 + a // PF * WR, r1, a % PF, F, zero + base_wd, WK), d * F, F)
    # the head, after the layer's entries
    a = e - per_layer
    off, rows, cols, step, K = _where(a >= 0, (off, rows, cols, step, K),
                                     _weight_entry(v0 + a // PD * WR, v1, a % PD, d, zero + base_wh, WK), 0, d)
    part = gl.where(a >= 0, 0, part)
    packed = gl.maximum(rows, 0).to(gl.int64) | (gl.maximum(cols, 0) // VEC).to(gl.int64) << 16 | \
        (part // VEC).to(gl.int64) << 32
    f = gl.arange(0, 4, layout=gl.SliceLayout(0, TL))[None, :]
    tab.store(gl.where(f == 0, off[:, None], gl.where(f == 1, step[:, None], gl.where(f == 2, K[:, None],
                                                                                     packed[:, None]))))
    gl.thread_barrier()
    return per_layer


@gluon.jit
def _field(entry, f: gl.constexpr, EL: gl.constexpr):
    col = gl.arange(0, 4, layout=gl.SliceLayout(0, EL))[None, :]
    return gl.sum(gl.sum(gl.where(col == f, entry, 0), axis=1), axis=0)


@gluon.jit
def _issue(j, ring, tab, plan, WK: gl.constexpr, VEC: gl.constexpr, SLOTS: gl.constexpr, WLAY: gl.constexpr,
           EL: gl.constexpr):
    """Start the copy of this program's tile j into its ring slot, and commit it as one group (an empty one
    past the last tile). Branch-free, so the compiler can interleave it with the caller's arithmetic."""
    (WQKV, total, L, per_layer, inv_per_layer) = plan
    j = gl.to_tensor(j)
    in_head = j >= L * per_layer
    layer = (j.to(gl.float32) * inv_per_layer).to(gl.int32)          # j // per_layer without a division
    layer = gl.where((layer + 1) * per_layer <= j, layer + 1, layer)
    layer = gl.where(layer * per_layer > j, layer - 1, layer)
    layer = gl.where(in_head, L, layer)
    e = gl.minimum(j - layer * per_layer + gl.where(in_head, per_layer, 0), tab.shape[0] - 1)
    entry = tab.index(e).load(EL)
    packed = _field(entry, 3, EL)
    rows = (packed & 0xFFFF).to(gl.int32)
    cols = (packed >> 16 & 0xFFFF).to(gl.int32)
    part = (packed >> 32).to(gl.int32)
    rr = gl.arange(0, WR, layout=gl.SliceLayout(1, WLAY))[:, None]
    cc = gl.arange(0, WK, layout=gl.SliceLayout(0, WLAY))[None, :]
    offs = _field(entry, 0, EL) + layer.to(gl.int64) * _field(entry, 1, EL) + rr * _field(entry, 2, EL) + cc
    offs = gl.max_contiguous(gl.multiple_of(offs, [1, VEC]), [1, VEC])
    cv = cc // VEC
    mask = (j < total) & (((rr < rows) & (cv < cols)) | ((rr == rows) & (cv < part)))
    cp.async_copy_global_to_shared(ring.index(j % SLOTS), WQKV + offs, mask=mask)
    cp.commit_group()


@gluon.jit
def _take(j, ring, tab, plan, WK: gl.constexpr, VEC: gl.constexpr, SLOTS: gl.constexpr, WLAY: gl.constexpr,
          EL: gl.constexpr):
    """Wait for tile j (every thread's copies: a CTA barrier after the group wait), then refill the slot the
    previous tile freed with tile j + SLOTS - 1. Returns tile j's slot."""
    cp.wait_group(SLOTS - 2)
    gl.thread_barrier()
    _issue(j + SLOTS - 1, ring, tab, plan, WK, VEC, SLOTS, WLAY, EL)
    return ring.index(j % SLOTS)


@gluon.jit
def _gains(G, K, NP: gl.constexpr, WK: gl.constexpr, SLAY: gl.constexpr):
    """A norm's scales G[:K] (zero past K) in registers for _stage. Loaded before the grid barrier ahead of the
    stage: they do not depend on the step, and each layer's are a miss to HBM on the stage's path otherwise."""
    offs = gl.arange(0, NP * WK, layout=SLAY)
    return gl.load(G + offs, mask=offs < K, other=0.0).to(gl.float32)


@gluon.jit
def _stage(vec, SRC, K, gain, eps, NP: gl.constexpr, WK: gl.constexpr, NORMED: gl.constexpr, SLAY: gl.constexpr,
           WLAY: gl.constexpr):
    """vec (NP pieces of WK) fp32 in shared memory := SRC[:K] (zero past K); NORMED: SRC[:K] * gain (_gains).
    Returns the norm's rsqrt(mean(SRC^2) + eps) to scale the products by (else 1) and vec's first piece in
    registers, laid out for the tiles (_gemv)."""
    gl.thread_barrier()                  # the previous phase's reads of vec are done
    offs = gl.arange(0, NP * WK, layout=SLAY)
    x = gl.load(SRC + offs, mask=offs < K, other=0.0, cache_modifier=".cg")
    squares = gl.sum(x * x, axis=0)
    if NORMED:
        x = x * gain
    vec._reinterpret(gl.float32, [NP * WK], gl.SwizzledSharedLayout(1, 1, 1, order=[0])).store(x)
    gl.thread_barrier()
    first = vec.index(0).load(gl.SliceLayout(0, WLAY))
    return gl.rsqrt(squares / K + eps) if NORMED else 1.0, first


@gluon.jit
def _gemv(j, ring, tab, plan, vec, first, NP: gl.constexpr, WK: gl.constexpr, VEC: gl.constexpr,
          SLOTS: gl.constexpr, WLAY: gl.constexpr, EL: gl.constexpr):
    """One chunk of WR rows: sum over its NP pieces of tile . vec[piece]; returns (out (WR,) fp32, next j).
    A vector of one piece comes from registers (`first`, _stage's): every warp needs all of it, so reading it
    from shared memory per tile would read 8x the tile's bytes."""
    part = gl.zeros([WR, WK], gl.float32, WLAY)
    for p in range(NP):
        w = _take(j, ring, tab, plan, WK, VEC, SLOTS, WLAY, EL).load(WLAY)
        a = first if NP == 1 else vec.index(p).load(gl.SliceLayout(0, WLAY))
        part += w.to(gl.float32) * a[None, :]
        j += 1
    return gl.sum(part, axis=1), j


@gluon.jit
def _residual(j, ring, tab, plan, vec, X, A, K, r0, r1, NP: gl.constexpr, PIECES: gl.constexpr, WK: gl.constexpr,
              VEC: gl.constexpr, SLOTS: gl.constexpr, WLAY: gl.constexpr, EL: gl.constexpr, SLAY: gl.constexpr):
    """X[r] += sum_k W[r, k] A[k] for this program's rows r0..r1 of the stream (the matrix's tiles come next in
    the ring, PIECES per chunk of rows); returns the next tile's index."""
    _, first = _stage(vec, A, K, 1.0, 0.0, NP, WK, False, SLAY, WLAY)
    rows = gl.arange(0, WR, layout=gl.SliceLayout(1, WLAY))
    for c in range(r0, r1, WR):
        rm = c + rows < r1
        x = gl.load(X + c + rows, mask=rm, other=0.0, cache_modifier=".cg")   # issued before the tiles: hidden
        out, j = _gemv(j, ring, tab, plan, vec, first, PIECES, WK, VEC, SLOTS, WLAY, EL)
        gl.store(X + c + rows, x + out, mask=rm)
    return j


@gluon.jit
def _llama_step_gluon(X, Q, PO, PM, PL, CNT, ATT, HID, LOGITS, BAR, POS,
                      WQKV, WO, WGU, WD, NORMS, NORM_F, WH, COS, SIN, KC, VC,
                      d, H, F, V, CAP, L, eps, qk_scale, base_wo, base_wgu, base_wd, base_wh, base_kc, base_vc,
                      D: gl.constexpr, S: gl.constexpr, SP2: gl.constexpr, WK: gl.constexpr,
                      BT: gl.constexpr, NP: gl.constexpr, PD: gl.constexpr, PF: gl.constexpr, PHD: gl.constexpr,
                      SLOTS: gl.constexpr, VEC: gl.constexpr, TMAX: gl.constexpr):
    num_warps: gl.constexpr = gl.num_warps()
    WLAY: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [num_warps, 1], [1, 0])
    TD: gl.constexpr = D // VEC if D // VEC < 32 else 32
    CLAY: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TD, TD], [num_warps, 1], [1, 0])
    SLAY: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    KG: gl.constexpr = num_warps * (32 // TD)     # key groups of a cache tile
    R: gl.constexpr = BT // KG                    # keys per group in a tile
    CL3: gl.constexpr = gl.BlockedLayout([R, 1, VEC], [1, 32 // TD, TD], [1, num_warps, 1], [2, 1, 0])
    SC: gl.constexpr = gl.SliceLayout(2, CL3)     # (R, KG) scores
    GL: gl.constexpr = gl.SliceLayout(0, SC)      # (KG,) a group's running max and sum
    AL: gl.constexpr = gl.SliceLayout(0, CL3)     # (KG, D) a group's running output
    DL: gl.constexpr = gl.SliceLayout(0, AL)      # (D,)
    FLAT3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    PAIRS: gl.constexpr = gl.BlockedLayout([2], [32], [num_warps], [0])
    UNITS: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    ring = gl.allocate_shared_memory(WQKV.dtype.element_ty, [SLOTS, WR, WK], flat)
    vec = gl.allocate_shared_memory(gl.float32, [NP, WK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    TL: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [num_warps, 1], [1, 0])   # (TMAX, 4) schedule
    EL: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [num_warps, 1], [1, 0])   # one entry, in every thread
    tab = gl.allocate_shared_memory(gl.int64, [TMAX, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

    P = gl.num_programs(0)
    pos = gl.load(POS).to(gl.int32)
    split = split_keys(pos + 1, S, BT)   # keys 0..pos
    HD = H * D
    DH = D // 2
    u0, u1 = _share(3 * H * DH, P)
    i0, i1 = _share(H * S, P)
    r0, r1 = _share(d, P)
    n0, n1 = _share(F, P)
    v0, v1 = _share(V, P)
    n_qkv = gl.cdiv(2 * (u1 - u0), WR) * PD
    n_out = gl.cdiv(r1 - r0, WR) * PHD
    n_gu = gl.cdiv(n1 - n0, WR) * 2 * PD
    n_down = gl.cdiv(r1 - r0, WR) * PF
    n_head = gl.cdiv(v1 - v0, WR) * PD
    per_layer = _build_schedule(tab, (u0, u1, i0, i1, r0, r1, n0, n1, v0, v1, n_qkv, n_out, n_gu, n_down),
                                d, F, H, CAP, pos, base_wo, base_wgu, base_wd, base_wh, base_kc, base_vc,
                                WK, BT, D, VEC, TMAX, PD, PF, PHD, S, split, TL)
    tab = tab._reinterpret(gl.int64, [TMAX, 1, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    plan = (WQKV, L * per_layer + n_head, L, per_layer, 1.0 / per_layer.to(gl.float32))
    for s in gl.static_range(SLOTS - 1):
        _issue(s, ring, tab, plan, WK, VEC, SLOTS, WLAY, EL)

    rows = gl.arange(0, WR, layout=gl.SliceLayout(1, WLAY))
    j = 0
    nb = 0
    for layer in range(L):
        # 0 qkv: RMSNorm, q/k/v rows (RoPE pairs are neighbours, pack_qkv), q to Q, k and v to the cache
        gain = _gains(NORMS + layer * 2 * d, d, NP, WK, SLAY)
        if layer > 0:
            nb += 1
            _grid_sync(BAR, nb * P)
        rs, first = _stage(vec, X, d, gain, eps, NP, WK, True, SLAY, WLAY)
        for c in range(2 * u0, 2 * u1, WR):
            units = c // 2 + gl.arange(0, WR // 2, layout=UNITS)
            live = units < u1
            i = units % DH
            kind = units // DH // H               # 0 q, 1 k, 2 v
            head = units // DH % H
            cos = gl.load(COS + pos * DH + i)     # loaded before the tiles: their latency hides behind them
            sin = gl.load(SIN + pos * DH + i)
            out, j = _gemv(j, ring, tab, plan, vec, first, PD, WK, VEC, SLOTS, WLAY, EL)
            out = out * rs
            lo, hi = gl.split(gl.reshape(gl.convert_layout(out, PAIRS), [WR // 2, 2]))
            lo = gl.convert_layout(lo, UNITS)
            hi = gl.convert_layout(hi, UNITS)
            rot = kind < 2
            lo, hi = gl.where(rot, lo * cos - hi * sin, lo), gl.where(rot, hi * cos + lo * sin, hi)
            qo = head * D + i
            gl.store(Q + qo, lo, mask=live & (kind == 0))
            gl.store(Q + qo + DH, hi, mask=live & (kind == 0))
            kv = ((layer * H + head).to(gl.int64) * CAP + pos) * D + i
            gl.store(KC + kv, lo.to(KC.dtype.element_ty), mask=live & (kind == 1))
            gl.store(KC + kv + DH, hi.to(KC.dtype.element_ty), mask=live & (kind == 1))
            gl.store(VC + kv, lo.to(VC.dtype.element_ty), mask=live & (kind == 2))
            gl.store(VC + kv + DH, hi.to(VC.dtype.element_ty), mask=live & (kind == 2))
        nb += 1
        _grid_sync(BAR, nb * P)

        # 1 attention: split-KV over (head, split) items; ring tiles for the keys before `pos`, key `pos` read
        # after the barrier. A tile is viewed as (R, KG, D): keys g, g + KG, ... (one thread's rows) share a
        # running softmax, so the per-tile max, sum and products reduce inside each thread; the KG groups
        # merge after the item's last tile.
        dd = gl.arange(0, D, layout=DL)
        kidx = gl.arange(0, R, layout=gl.SliceLayout(1, SC))[:, None] * KG + \
            gl.arange(0, KG, layout=gl.SliceLayout(0, SC))[None, :]
        for it in range(i0, i1):
            h, t0, tr, fresh = _item_keys(it, S, split, pos)
            q = gl.load(Q + h * D + dd, cache_modifier=".cg") * qk_scale
            q3 = gl.expand_dims(gl.expand_dims(q, 0), 0)
            # key and value `pos` (this step's, written before the barrier) loaded before the tiles, used after
            # (`dd < D` only makes the mask a tensor)
            row = ((layer * H + h).to(gl.int64) * CAP + pos) * D + dd
            k_new = gl.load(KC + row, mask=fresh & (dd < D), other=0.0, cache_modifier=".cg")
            v_new = gl.load(VC + row, mask=fresh & (dd < D), other=0.0, cache_modifier=".cg")
            m = gl.full([KG], float("-inf"), gl.float32, GL)
            den = gl.zeros([KG], gl.float32, GL)
            acc = gl.zeros([KG, D], gl.float32, AL)
            for t in range(t0, tr, BT):
                kt = _take(j, ring, tab, plan, WK, VEC, SLOTS, WLAY, EL)._reinterpret(
                    KC.dtype.element_ty, [R, KG, D], FLAT3).load(CL3)
                sc = gl.where(t + kidx < tr, gl.sum(kt.to(gl.float32) * q3, axis=2), float("-inf"))
                m_new = gl.maximum(m, gl.max(sc, axis=0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m - m_safe)
                p = gl.exp2(sc - m_safe[None, :])
                den = den * alpha + gl.sum(p, axis=0)
                m = m_new
                vt = _take(j + 1, ring, tab, plan, WK, VEC, SLOTS, WLAY, EL)._reinterpret(
                    VC.dtype.element_ty, [R, KG, D], FLAT3).load(CL3)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, AL))[:, None] + \
                    gl.sum(p[:, :, None] * vt.to(gl.float32), axis=0)
                j += 2
            mx = gl.max(m, axis=0)
            s_new = float("-inf")
            if fresh:                           # this item holds key `pos`
                s_new = gl.sum(k_new.to(gl.float32) * q, axis=0)
                mx = gl.maximum(mx, s_new)
            w = gl.exp2(m - gl.where(mx == float("-inf"), 0.0, mx))
            total = gl.sum(w * den, axis=0)
            o = gl.sum(gl.convert_layout(w, gl.SliceLayout(1, AL))[:, None] * acc, axis=0)
            if fresh:
                p_new = gl.exp2(s_new - mx)
                total += p_new
                o += p_new * v_new.to(gl.float32)
            gl.store(PO + it * D + dd, o)
            gl.store(PM + it, mx)
            gl.store(PL + it, total)
            gl.thread_barrier()                   # every thread's partial stored before the release below
            if gl.atomic_add(CNT + h, 1, sem="acq_rel", scope="gpu") == S - 1:
                ss = gl.arange(0, SP2, layout=gl.SliceLayout(1, CLAY))
                sm = ss < S
                dm = gl.arange(0, D, layout=gl.SliceLayout(0, CLAY))
                pm = gl.load(PM + h * S + ss, mask=sm, other=float("-inf"), cache_modifier=".cg")
                wm = gl.exp2(pm - gl.max(pm, axis=0))       # split 0 is never empty: the max is finite
                tot = gl.sum(wm * gl.load(PL + h * S + ss, mask=sm, other=0.0, cache_modifier=".cg"), axis=0)
                po = gl.load(PO + (h * S + ss)[:, None] * D + dm[None, :], mask=sm[:, None], other=0.0,
                             cache_modifier=".cg")
                gl.store(ATT + h * D + dm, gl.sum(wm[:, None] * po, axis=0) / tot)
                gl.store(CNT + h, 0)              # for the next layer, which starts after two grid barriers
        nb += 1
        _grid_sync(BAR, nb * P)

        # 2 out: X[rows] += W_o[rows] . att
        j = _residual(j, ring, tab, plan, vec, X, ATT, HD, r0, r1, NP, PHD, WK, VEC, SLOTS, WLAY, EL, SLAY)
        gain = _gains(NORMS + (layer * 2 + 1) * d, d, NP, WK, SLAY)
        nb += 1
        _grid_sync(BAR, nb * P)

        # 3 gate/up: HID[units] = silu(gate . xn) * (up . xn)
        rs, first = _stage(vec, X, d, gain, eps, NP, WK, True, SLAY, WLAY)
        for c in range(n0, n1, WR):
            g, j = _gemv(j, ring, tab, plan, vec, first, PD, WK, VEC, SLOTS, WLAY, EL)
            u, j = _gemv(j, ring, tab, plan, vec, first, PD, WK, VEC, SLOTS, WLAY, EL)
            g = g * rs
            u = u * rs
            gl.store(HID + c + rows, g / (1.0 + gl.exp2(-g * LOG2E)) * u, mask=c + rows < n1)
        nb += 1
        _grid_sync(BAR, nb * P)

        # 4 down: X[rows] += W_down[rows] . hid
        j = _residual(j, ring, tab, plan, vec, X, HID, F, r0, r1, NP, PF, WK, VEC, SLOTS, WLAY, EL, SLAY)
    gain = _gains(NORM_F, d, NP, WK, SLAY)
    nb += 1
    _grid_sync(BAR, nb * P)

    # head: LOGITS[rows] = W_head[rows] . rms_norm(X) * norm_f
    rs, first = _stage(vec, X, d, gain, eps, NP, WK, True, SLAY, WLAY)
    for c in range(v0, v1, WR):
        out, j = _gemv(j, ring, tab, plan, vec, first, PD, WK, VEC, SLOTS, WLAY, EL)
        gl.store(LOGITS + c + rows, out * rs, mask=c + rows < v1)
    cp.wait_group(0)


def launch_constants(d, F, H, D, V, CAP, element_size, programs):
    """(S splits of the keys per head, the kernel's compile-time constants) for these sizes. A split holds at
    most `split` keys (split_keys at the last position), which bounds the schedule."""
    elements = SLOT_BYTES // element_size
    WK, BT = elements // WR.value, elements // D
    pieces = dict(PD=triton.cdiv(d, WK), PF=triton.cdiv(F, WK), PHD=triton.cdiv(H * D, WK))
    NP = triton.next_power_of_2(max(pieces.values()))
    split, S = deal_keys(CAP, max(1, min(programs // H, triton.cdiv(CAP, BT))), BT)
    cd = triton.cdiv
    tiles = (cd(2 * cd(3 * H * D // 2, programs), WR.value) * pieces["PD"]
             + 2 * cd(H * S, programs) * cd(split, BT)
             + cd(cd(d, programs), WR.value) * (pieces["PHD"] + pieces["PF"])
             + cd(cd(F, programs), WR.value) * 2 * pieces["PD"])
    TMAX = triton.next_power_of_2(tiles + cd(cd(V, programs), WR.value) * pieces["PD"])
    slots = (SHARED_BYTES - NP * WK * 4 - TMAX * 32) // SLOT_BYTES
    if slots < 3:
        raise ValueError(f"the Gluon decode step's schedule of {TMAX} tiles leaves no room for its ring: "
                         f"use impl='triton'")
    return S, dict(D=D, S=S, SP2=triton.next_power_of_2(S), WK=WK, BT=BT, NP=NP, SLOTS=slots,
                          VEC=16 // element_size, TMAX=TMAX, **pieces)


def unsupported(x, w, k_cache, v_cache):
    """Why decode_step_gluon cannot take these inputs (None: it can)."""
    L, B, H, CAP, D = k_cache.shape
    d, F, size = x.size(1), w.wd.size(2), w.wqkv.element_size()
    if B != 1:
        return f"the Gluon decode step takes batch 1, not batch {B}"
    if any(n * size % 16 for n in (d, F, H * D)):
        return f"the Gluon decode step takes rows of multiples of 16 bytes, not d {d}, F {F}, H D {H * D}"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (9, 0):
        return "the Gluon decode step runs on Hopper (sm_90) or newer GPUs"
    tensors = (w.wo, w.wgu, w.wd, w.head, k_cache, v_cache)
    if any(t.dtype != w.wqkv.dtype or (t.data_ptr() - w.wqkv.data_ptr()) % 16 for t in tensors):
        return "the Gluon decode step takes weights and caches of one dtype, 16-byte aligned"
    return None


def decode_step_gluon(x, position, w, k_cache, v_cache, eps, programs=None):
    """kernels.llama_step.decode_step at batch 1 on a Hopper (or newer) GPU: one cooperative launch, one program
    per SM (programs: another grid, for experiments)."""
    reason = unsupported(x, w, k_cache, v_cache)
    if reason:
        raise ValueError(f"{reason}: use impl='triton'")
    L, B, H, CAP, D = k_cache.shape
    d, F, V = x.size(1), w.wd.size(2), w.head.size(0)
    P = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    S, constants = launch_constants(d, F, H, D, V, CAP, w.wqkv.element_size(), P)
    # every tile is addressed from WQKV: the other tensors as element offsets from it
    offsets = [(t.data_ptr() - w.wqkv.data_ptr()) // t.element_size()
               for t in (w.wo, w.wgu, w.wd, w.head, k_cache, v_cache)]
    f32 = dict(device=x.device, dtype=torch.float32)
    X = x.float().contiguous()
    q, att = torch.empty(H, D, **f32), torch.empty(H, D, **f32)
    po, pm, pl = torch.empty(H * S, D, **f32), torch.empty(H * S, **f32), torch.empty(H * S, **f32)
    hid, logits = torch.empty(1, F, **f32), torch.empty(1, V, **f32)
    counters = torch.zeros(H + 1, device=x.device, dtype=torch.int32)   # per head, then the barrier's
    _llama_step_gluon[(P,)](
        X, q, po, pm, pl, counters, att, hid, logits, counters[H:], position,
        w.wqkv, w.wo, w.wgu, w.wd, w.norms, w.norm_f, w.head, w.cos, w.sin, k_cache, v_cache,
        d, H, F, V, CAP, L, eps, D ** -0.5 * LOG2E.value, *offsets,
        num_warps=8, launch_cooperative_grid=True, **constants)
    return logits
