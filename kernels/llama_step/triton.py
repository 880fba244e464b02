"""The Triton kernel of kernels/llama_step: a whole LLaMA-block decode step in one persistent launch.

One program per SM (a cooperative launch, so all are resident), each owning a contiguous share of every
phase's work. Five phases per layer, then the head:
  0 qkv:   RMSNorm, this program's q/k/v rows, RoPE; q to a buffer, k and v into the cache row `position`
  1 attn:  split-KV attention over (batch, head, split) items, about one per program; the program that
           completes the last split of a (batch, head) merges its partials (an atomic counter per head)
  2 out:   its rows of the output projection, added to the residual stream x
  3 gate:  RMSNorm, its units of silu(x W_gate) * (x W_up)
  4 down:  its rows of the down projection, added to x
  head:    the final RMSNorm and its rows of the logits
A grid-wide barrier separates the phases (each reads what all programs wrote in the one before). The loops
over row chunks and key tiles are software-pipelined (`stages` chunks in flight through shared memory), so
a program keeps loads in flight instead of waiting on each chunk, and no reduction inside them crosses warps
(a cross-warp reduction is a round trip through shared memory and a CTA barrier): each warp owns whole rows
of a weight chunk, and attention keeps a running softmax per group of keys. Every normalising product is
computed in fp32 from the weights' dtype; the stream stays fp32 across layers.

Memory order: a barrier is bar.sync, then one release atomic per program, a spin on an acquire load, and
bar.sync; everything one program wrote before it is visible to all after it. Data written within the
step is read with .cg loads (L2, not the SM's non-coherent L1), since buffers are rewritten every layer.

Under TRITON_INTERPRET=1 programs run one after another, so no barrier could complete: the launcher then
runs each phase as its own launch (SYNC off).
"""
import torch

from kernels.triton_utils import LOG2E, deal_keys, interpreting, split_keys, tl, triton

STAGES = 5          # phases per layer
ROWS = 8            # rows of a matrix per chunk at most (the GEMV's output features)
TILE_BYTES = 16384  # bytes of weights per chunk at most
BLOCK_T = 128       # keys per attention tile at most (64: 17% slower at 32K, 2% at 4K)
GROUP = 4           # keys per running softmax within a tile (the groups of a tile merge after the item)


if triton is not None:
    @triton.jit
    def _grid_sync(bar, target):
        """Wait until every program has arrived; bar counts arrivals, target = (barrier index + 1) * programs."""
        tl.debug_barrier()
        tl.atomic_add(bar, 1, sem="release", scope="gpu")
        while tl.atomic_add(bar, 0, sem="acquire", scope="gpu") < target:
            pass
        tl.debug_barrier()

    @triton.jit
    def _share(n, P):
        """This program's contiguous share [lo, hi) of n items (shares differ by at most one)."""
        p = tl.program_id(0)
        return p * n // P, (p + 1) * n // P

    @triton.jit
    def _dot(W, K, rows, rmask, A, a_stride, B, G, eps, BP2: tl.constexpr, CH: tl.constexpr, KB: tl.constexpr,
             KP: tl.constexpr, NORMED: tl.constexpr):
        """acc (BP2, CH) fp32: acc[b, r] = sum_k W[rows[r], k] A[b, k], W row-major with rows of K <= KP; NORMED:
        of rms_norm(A[b]) * G instead, as rsqrt(mean(A[b]^2) + eps) * sum_k W[rows[r], k] A[b, k] G[k], so the
        norm needs no pass of its own before the chunk's loads. The K loop is unrolled (no inner loop), so the
        caller's loop over row chunks can be software-pipelined. Each thread sums its products over all of K
        and reduces once at the end: a piece of KB columns is one warp's width (launch_constants), so the warps
        split the rows and the reductions stay inside a warp (every warp holds all of A, so each sums A^2)."""
        bs = tl.arange(0, BP2)
        part = tl.zeros([BP2, CH, KB], dtype=tl.float32)
        squares = tl.zeros([BP2, CH, KB], dtype=tl.float32)
        for k0 in tl.static_range(0, KP, KB):
            ks = k0 + tl.arange(0, KB)
            km = ks < K
            w = tl.load(W + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rmask[:, None] & km[None, :],
                        other=0.0)
            a = tl.load(A + bs[:, None] * a_stride + ks[None, :], mask=(bs[:, None] < B) & km[None, :],
                        other=0.0, cache_modifier=".cg")
            if NORMED:
                squares += a[:, None, :] * a[:, None, :]
                a = a * tl.load(G + ks, mask=km, other=0.0).to(tl.float32)[None, :]
            part += w.to(tl.float32)[None, :, :] * a[:, None, :]
        acc = tl.sum(part, axis=2)
        if NORMED:
            acc = acc * tl.rsqrt(tl.sum(squares, axis=2) / K + eps)
        return acc

    @triton.jit
    def _add_rows(X, acc, rows, rmask, B, d, BP2: tl.constexpr):
        """X[b, rows] += acc (the residual stream; each row has one owner)."""
        bs = tl.arange(0, BP2)
        m = (bs[:, None] < B) & rmask[None, :]
        off = bs[:, None] * d + rows[None, :]
        tl.store(X + off, tl.load(X + off, mask=m, other=0.0, cache_modifier=".cg") + acc, mask=m)

    @triton.jit
    def _qkv_phase(X, W, G, Q, KC, VC, COS, SIN, layer, pos, B, d, H, CAP, eps, P,
                   D: tl.constexpr, BP2: tl.constexpr, DP: tl.constexpr, CH: tl.constexpr, KB: tl.constexpr,
                   NS: tl.constexpr):
        DH: tl.constexpr = D // 2
        UC: tl.constexpr = CH // 2
        u0, u1 = _share(3 * H * DH, P)        # units: the row pair (i, i + D/2) of a head, rows 2u and 2u + 1
        bs = tl.arange(0, BP2)
        for c in tl.range(u0, u1, UC, num_stages=NS):
            rows = 2 * c + tl.arange(0, CH)
            acc = _dot(W, d, rows, rows < 2 * u1, X, d, B, G, eps, BP2, CH, KB, DP, True)
            lo, hi = tl.split(tl.reshape(acc, [BP2, UC, 2]))
            units = c + tl.arange(0, UC)
            live = (units < u1)[None, :] & (bs[:, None] < B)
            i = units % DH
            kind = units // DH // H               # 0 q, 1 k, 2 v
            head = units // DH % H
            cos = tl.load(COS + pos * DH + i)[None, :]
            sin = tl.load(SIN + pos * DH + i)[None, :]
            rot = (kind < 2)[None, :]
            lo, hi = tl.where(rot, lo * cos - hi * sin, lo), tl.where(rot, hi * cos + lo * sin, hi)
            q = (bs[:, None] * H + head[None, :]) * D + i[None, :]
            tl.store(Q + q, lo, mask=live & (kind == 0)[None, :])
            tl.store(Q + q + DH, hi, mask=live & (kind == 0)[None, :])
            row = ((layer * B + bs[:, None]) * H + head[None, :]).to(tl.int64) * CAP + pos
            kv = row * D + i[None, :]
            tl.store(KC + kv, lo.to(KC.dtype.element_ty), mask=live & (kind == 1)[None, :])
            tl.store(KC + kv + DH, hi.to(KC.dtype.element_ty), mask=live & (kind == 1)[None, :])
            tl.store(VC + kv, lo.to(VC.dtype.element_ty), mask=live & (kind == 2)[None, :])
            tl.store(VC + kv + DH, hi.to(VC.dtype.element_ty), mask=live & (kind == 2)[None, :])

    @triton.jit
    def _split_range(it, S, SPLIT, pos):
        """(b * H + h, first key, end) of attention item it = (b * H + h) * S + s."""
        t0 = it % S * SPLIT
        return it // S, t0, tl.minimum(t0 + SPLIT, pos + 1)

    @triton.jit
    def _attn_phase(Q, KC, VC, PO, PM, PL, CNT, ATT, layer, pos, B, H, CAP, S, qk_scale, P,
                    D: tl.constexpr, SP2: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
                    NS: tl.constexpr):
        """Split-KV attention: each item (b, h, split) leaves its partial (unnormalised output, base-2 max, sum);
        the program that completes the last split of a (b, h) merges them all into ATT (b, h D + j). Within an
        item every group of GROUP keys of a tile keeps its own running max, sum and output, and the groups merge
        once after the last tile: a tile's reductions then stay inside a warp (a tile-wide max and sum cost two
        cross-warp reductions per tile). A group can see only masked keys, so its max may be -inf: m_safe."""
        dd = tl.arange(0, D)
        SPLIT = split_keys(pos + 1, S, BLOCK_T)   # keys 0..pos
        i0, i1 = _share(B * H * S, P)
        for it in range(i0, i1):
            bh, t0, t1 = _split_range(it, S, SPLIT, pos)
            q = tl.load(Q + bh * D + dd, cache_modifier=".cg") * qk_scale
            base = (layer * B * H + bh).to(tl.int64) * CAP
            NG: tl.constexpr = BLOCK_T // GROUP
            keys = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]   # (group, key in group)
            mg = tl.full([NG], float("-inf"), tl.float32)
            dg = tl.zeros([NG], tl.float32)
            ag = tl.zeros([NG, D], tl.float32)
            for t in tl.range(t0, t1, BLOCK_T, num_stages=NS):
                ts = t + keys
                tm = ts < t1
                off = (base + ts[:, :, None]) * D + dd[None, None, :]
                k = tl.load(KC + off, mask=tm[:, :, None], other=0.0, cache_modifier=".cg").to(tl.float32)
                v = tl.load(VC + off, mask=tm[:, :, None], other=0.0, cache_modifier=".cg").to(tl.float32)
                sc = tl.where(tm, tl.sum(k * q[None, None, :], axis=2), float("-inf"))
                m_new = tl.maximum(mg, tl.max(sc, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(mg - m_safe)
                p = tl.exp2(sc - m_safe[:, None])
                dg = dg * alpha + tl.sum(p, axis=1)
                ag = ag * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)
                mg = m_new
            m = tl.max(mg, axis=0)
            wg = tl.exp2(mg - tl.where(m == float("-inf"), 0.0, m))
            den = tl.sum(wg * dg, axis=0)
            acc = tl.sum(wg[:, None] * ag, axis=0)
            tl.store(PO + it * D + dd, acc)
            tl.store(PM + it, m)
            tl.store(PL + it, den)
            tl.debug_barrier()                   # every thread's partial stored before the release below
            if tl.atomic_add(CNT + bh, 1, sem="acq_rel", scope="gpu") == S - 1:
                ss = tl.arange(0, SP2)
                sm = ss < S
                pm = tl.load(PM + bh * S + ss, mask=sm, other=float("-inf"), cache_modifier=".cg")
                w = tl.exp2(pm - tl.max(pm, axis=0))          # split 0 is never empty: the max is finite
                den = tl.sum(w * tl.load(PL + bh * S + ss, mask=sm, other=0.0, cache_modifier=".cg"), axis=0)
                po = tl.load(PO + (bh * S + ss)[:, None] * D + dd[None, :], mask=sm[:, None], other=0.0,
                             cache_modifier=".cg")
                tl.store(ATT + bh * D + dd, tl.sum(w[:, None] * po, axis=0) / den)
                tl.store(CNT + bh, 0)            # for the next layer, which starts after two grid barriers

    @triton.jit
    def _residual_phase(X, A, a_stride, W, K, B, d, P, BP2: tl.constexpr, CH: tl.constexpr, KB: tl.constexpr,
                        KP: tl.constexpr, NS: tl.constexpr):
        """X[b, r] += sum_k W[r, k] A[b, k] for this program's rows r of the stream."""
        r0, r1 = _share(d, P)
        for c in tl.range(r0, r1, CH, num_stages=NS):
            rows = c + tl.arange(0, CH)
            rm = rows < r1
            _add_rows(X, _dot(W, K, rows, rm, A, a_stride, B, X, 0.0, BP2, CH, KB, KP, False), rows, rm, B, d, BP2)

    @triton.jit
    def _normed_phase(X, W, G, OUT, B, d, N, eps, P, BP2: tl.constexpr, DP: tl.constexpr, CH: tl.constexpr,
                      KB: tl.constexpr, NS: tl.constexpr, GATED: tl.constexpr):
        """OUT (B, N) = rms_norm(X) * G times this program's rows of W (N, d); GATED: W is (2 N, d), gate rows
        then up rows, and OUT = silu(gate) * up (the MLP's hidden units). The head is the plain case."""
        bs = tl.arange(0, BP2)
        n0, n1 = _share(N, P)
        for c in tl.range(n0, n1, CH, num_stages=NS):
            rows = c + tl.arange(0, CH)
            rm = rows < n1
            out = _dot(W, d, rows, rm, X, d, B, G, eps, BP2, CH, KB, DP, True)
            if GATED:
                out = out * tl.sigmoid(out) * _dot(W + N * d, d, rows, rm, X, d, B, G, eps, BP2, CH, KB, DP, True)
            tl.store(OUT + bs[:, None] * N + rows[None, :], out, mask=(bs[:, None] < B) & rm[None, :])

    @triton.jit
    def _llama_step_kernel(X, Q, PO, PM, PL, CNT, ATT, HID, LOGITS, BAR, POS,
                           WQKV, WO, WGU, WD, NORMS, NORM_F, WH, COS, SIN, KC, VC,
                           B, d, H, F, V, CAP, S, L, eps, qk_scale, ph0, ph1,
                           D: tl.constexpr, SP2: tl.constexpr, BP2: tl.constexpr, DP: tl.constexpr,
                           FP: tl.constexpr, HDP: tl.constexpr, CH_D: tl.constexpr, CH_F: tl.constexpr,
                           CH_HD: tl.constexpr, KB: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
                           NS: tl.constexpr, SYNC: tl.constexpr):
        P = tl.num_programs(0)
        pos = tl.load(POS).to(tl.int32)
        HD = H * D
        for ph in range(ph0, ph1):
            if SYNC:
                if ph > ph0:
                    _grid_sync(BAR, (ph - ph0) * P)
            layer = ph // 5                          # STAGES phases per layer
            stage = ph % 5
            if layer == L:
                _normed_phase(X, WH, NORM_F, LOGITS, B, d, V, eps, P, BP2, DP, CH_D, KB, NS, False)
            elif stage == 0:
                _qkv_phase(X, WQKV + layer.to(tl.int64) * 3 * HD * d, NORMS + layer * 2 * d, Q, KC, VC,
                           COS, SIN, layer, pos, B, d, H, CAP, eps, P, D, BP2, DP, CH_D, KB, NS)
            elif stage == 1:
                _attn_phase(Q, KC, VC, PO, PM, PL, CNT, ATT, layer, pos, B, H, CAP, S, qk_scale, P,
                            D, SP2, BLOCK_T, GROUP, NS)
            elif stage == 2:
                _residual_phase(X, ATT, HD, WO + layer.to(tl.int64) * d * HD, HD, B, d, P, BP2, CH_HD, KB, HDP, NS)
            elif stage == 3:
                _normed_phase(X, WGU + layer.to(tl.int64) * 2 * F * d, NORMS + (layer * 2 + 1) * d, HID,
                              B, d, F, eps, P, BP2, DP, CH_D, KB, NS, True)
            else:
                _residual_phase(X, HID, F, WD + layer.to(tl.int64) * d * F, F, B, d, P, BP2, CH_F, KB, FP, NS)


def _chunk_rows(K, element_size, warps):
    """Rows per pipelined chunk of a matrix with rows of K: about TILE_BYTES a chunk (the pipeline keeps
    `stages` of them in shared memory), at least one per warp (each warp reduces whole rows; this also keeps
    a RoPE pair in one chunk)."""
    rows = max(2, warps, min(ROWS, TILE_BYTES // (triton.next_power_of_2(K) * element_size)))
    return 1 << (rows.bit_length() - 1)          # a power of two


def launch_constants(B, d, F, H, D, CAP, element_size, programs, stages=3, warps=4):
    """(S splits of the keys per (batch, head), the kernel's compile-time constants) for these sizes: what
    decode_step_triton launches, and what the tests compile for Hopper to check that every supported shape fits
    its shared memory."""
    BP2 = triton.next_power_of_2(B)
    # keys per attention tile: BLOCK_T, fewer where a tile's keys and values would pass 2 x TILE_BYTES
    block_t = max(16, min(BLOCK_T, 2 * TILE_BYTES // (2 * D * element_size)))
    # splits per (batch, head): about one item per program (an item more on some programs would double the
    # phase), at least a tile each
    _, S = deal_keys(CAP, max(1, min(programs // (B * H), triton.cdiv(CAP, block_t))), block_t)
    KB = 32 * 16 // element_size   # columns per piece of a weight chunk: a warp's 32 lanes x 16 bytes

    def whole_pieces(n):           # a row of n columns, padded to whole pieces (the masks cover the padding)
        return triton.cdiv(n, KB) * KB
    return S, dict(
        D=D, SP2=triton.next_power_of_2(S), BP2=BP2, DP=whole_pieces(d), FP=whole_pieces(F), HDP=whole_pieces(H * D),
        CH_D=_chunk_rows(d, element_size, warps), CH_F=_chunk_rows(F, element_size, warps),
        CH_HD=_chunk_rows(H * D, element_size, warps), KB=KB,
        BLOCK_T=block_t, GROUP=min(GROUP, block_t),
        NS=stages if B == 1 else min(stages, 2))   # more rows: bigger tiles per stage


def decode_step_triton(x, position, w, k_cache, v_cache, eps, programs=None, num_warps=4, stages=3,
                       single_launch=None):
    """kernels.llama_step.decode_step on CUDA (or the interpreter). programs: the grid (default: one per SM;
    3 under the interpreter); stages: software-pipelining depth of the loops over row chunks and key tiles;
    single_launch (default: on CUDA) runs every phase in one launch with grid barriers, else one launch per
    phase (what the interpreter needs, and a baseline for the barriers)."""
    L, B, H, CAP, D = k_cache.shape
    d, F, V = x.size(1), w.wd.size(2), w.head.size(0)
    if D != triton.next_power_of_2(D) or D < 16:
        raise ValueError(f"the fused decode step takes head dims that are powers of two >= 16, not {D}")
    on_gpu = x.is_cuda and not interpreting()
    P = programs or (torch.cuda.get_device_properties(x.device).multi_processor_count if on_gpu else 3)
    single_launch = on_gpu if single_launch is None else single_launch
    S, constants = launch_constants(B, d, F, H, D, CAP, w.wqkv.element_size(), P, stages, num_warps)
    f32 = dict(device=x.device, dtype=torch.float32)
    X = x.float().contiguous()
    q, att = torch.empty(B, H, D, **f32), torch.empty(B, H, D, **f32)
    po, pm, pl = torch.empty(B * H * S, D, **f32), torch.empty(B * H * S, **f32), torch.empty(B * H * S, **f32)
    hid = torch.empty(B, F, **f32)
    logits = torch.empty(B, V, **f32)
    counters = torch.zeros(B * H + 1, device=x.device, dtype=torch.int32)   # per (b, h), then the barrier's
    phases = STAGES * L + 1
    spans = [(0, phases)] if single_launch else [(p, p + 1) for p in range(phases)]
    extra = dict(launch_cooperative_grid=True) if single_launch else {}
    for ph0, ph1 in spans:
        _llama_step_kernel[(P,)](
            X, q, po, pm, pl, counters, att, hid, logits, counters[B * H:], position,
            w.wqkv, w.wo, w.wgu, w.wd, w.norms, w.norm_f, w.head, w.cos, w.sin, k_cache, v_cache,
            B, d, H, F, V, CAP, S, L, eps, D ** -0.5 * LOG2E.value, ph0, ph1,
            SYNC=single_launch, num_warps=num_warps, **constants, **extra)
    return logits
