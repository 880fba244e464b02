"""CASTLE's Triton training kernels: the block algorithm of CASTLE (arXiv:2509.07301) Theorem 2
(Appendix 8, Algorithms 1-3) on the GPU; on CPU they run under TRITON_INTERPRET=1.

How the kernels schedule the block algorithm (equivalent to the paper's anti-diagonal sweep):
  * Forward, one program per (query row block a, batch*head), m rows; key blocks have n rows (n | m).
    It walks its own key blocks left to right, then the earlier ones c = ..., 0 right to left, keeping
    the online-softmax state in registers as FlashAttention does (Algorithm 2). Besides the inputs a tile
    (a, c) needs U_c, the lookahead keys of block c as they stand at the start of row block a (the paper's
    D^{(a-c)}, eqs (21)-(24), transposed). All of U lives in one fp32 (L x d) buffer: program a reads U_c
    written by program a-1, adds the contributors of its own rows and hands U_c on to program a+1. So each
    sigma tile is computed once and used twice, and R_a once per row block. Program a waits on program a-1
    through a per-(head, row block) progress counter (release/acquire atomics); programs draw tickets from
    an atomic counter, so a program only ever waits on one that has already started: no deadlock whatever
    order the GPU starts them in. Rows run as a wave one tile apart, in one launch. The step loop is
    software-pipelined: the next key block's tiles load while this one computes (the wait and a barrier
    are inline PTX for that, see _wait_at_least).
  * Backward, one program per (key block c, batch*head), with no waiting: it starts from the saved U_c (its
    value where the backward's last row block starts), walks the row blocks from the last one down, and
    recovers the earlier values by subtraction (eq (33)), carrying U_c, dU_c and the key-block gradients
    dKc, dVc, dQu; a pass that needs no dU walks up instead, building U_c as the forward does. Row gradients
    dQc, dKu, dVu are fp32 atomic adds, so the backward is not bitwise deterministic (like FlashAttention's
    dQ); the forward is. The two gradient paths into a sigma tile (the local term, and the update of U_c)
    are summed before one use. E (eq 31), the score gradient's path into the local term, only meets operands
    of its row block, so the backward sums its tiles per row block (fp32, L x m per head); "finish" programs,
    ticketed after all the columns (so they fill the slots the columns' tail leaves idle) and each waiting
    for its head's columns, take its two products once per row block and cast the row gradients to the
    output dtype. A step recomputes ~8 tiles and keeps most of them live, so it runs out of registers (255
    and spills at every tile size, scripts/castle_regs.py); three schedules of the same code trade registers
    for work (CASTLE_BWD_VARIANT, default "stored"; see BWD_VARIANTS):
      "fused"   one launch, one pass, the five carried (n x d) fp32 states in registers;
      "split"   two launches that each recompute the scores: dVc, dKc, dQc and E (carrying U, dKc, dVc),
                then the sigma paths dU, dQu, dKu, dVu (carrying U, dU, dQu);
      "stored"  the two passes of "split" one after the other in one program: the first stores each
                tile's dS (bf16, as the matmuls take it) in a strip of scratch memory, the second reads
                it back instead of recomputing the scores (no U), and forms E: 11 + 9 tile matmuls per
                step instead of 12 + 13. Strips are recycled between programs (4 per SM, linear in L;
                fewer where they would take over a quarter of the free memory).
  * CASTLE-SWL: tiles whose sigma block is all zero (every contributor of the row block beyond the window
    of every owner of the key block) skip the sigma work, the local term and the U update; only Qc U_c^T
    and the causal part remain there (S^U stays dense below the diagonal).
  * The ablations (arXiv:2509.07301 §5.2; kernels/castle/reference.py lookahead_logit): kc=None (no causal
    keys: no Qc Kc^T, no dKc) and silu=False (-S^U for -SiLU(S^U)), constexprs of the same kernels.
  * Memory beyond the inputs: O (L x d), logsumexp (L), U (L x d fp32; kept for the backward only by "fused"
    and "split"), fp32 gradient accumulators, E per row block (L x m fp32), and for "stored" the dS strips (4
    per SM, L x n each, capped at a quarter of the free memory).
  * Precision: bf16 matmul operands (U, sigma, R, P, dS ... rounded as FlashAttention rounds P), fp32
    accumulators, statistics, U and dU. On long unit-variance inputs the gradients then carry ~2e-2
    relative error, as much as the parallel form run with bf16 matmuls (autocast) has; fp32 inputs
    take exact fp32 matmuls (~1e-6).

Internal API (tests, scripts/bench_castle.py, scripts/castle_regs.py): TritonConfig, BWD_VARIANTS,
default_config, gpu_config, triton_forward, triton_backward, forward_buffers, same_layout, fwd_constexprs,
bwd_kernels, fwd_head_group, BWD_HEAD_GROUP, ds_strips, strip_count, sigma_prescaled, in_bounds,
dot_dtype, castle_fwd_kernel, castle_bwd_kernel.
"""
import math
import os
from dataclasses import dataclass

import torch

from kernels.castle.reference import window_or_len
from kernels.triton_utils import interpreting, padded_head_dim, tl, triton

if triton is not None:
    from kernels.triton_utils import LOG2E

# ----------------------------------------------------------------------------------------------------
# Tiles

# Backward schedules (module docstring): "stored" (two passes per program, the second reading the
# first's dS from scratch strips), "split" (the two passes as two launches, recomputing the scores) or
# "fused" (one pass).
BWD_VARIANTS = ("fused", "split", "stored")
BWD_VARIANT = os.environ.get("CASTLE_BWD_VARIANT", "stored")
if BWD_VARIANT not in BWD_VARIANTS:
    raise ValueError(f"CASTLE_BWD_VARIANT={BWD_VARIANT!r} is unknown; set it to one of {BWD_VARIANTS} "
                     "or unset it (default stored)")


@dataclass(frozen=True)
class TritonConfig:
    """Tiles: m = query rows per tile, n = key columns per tile (n divides m; powers of two >= 16);
    the backward's m must divide the forward's m (the forward saves U where the backward starts).
    stages_bwd: software-pipelining stages of the "stored" backward's second (sigma) pass, used when there
    is no window (1 = not pipelined; see _bwd_column). stages_fwd: those of the forward's step loop.
    head_group_fwd: how many heads the forward's launch order interleaves at most (fwd_head_group)."""
    m_fwd: int
    n_fwd: int
    warps_fwd: int
    m_bwd: int
    n_bwd: int
    warps_bwd: int
    stages_bwd: int
    bwd_variant: str = BWD_VARIANT
    row_guard: bool = False      # a register-allocation knob of the backward's row loop (_bwd_column)
    stages_fwd: int = 2
    head_group_fwd: int = 8


def default_config(block_d, dtype, variant=BWD_VARIANT):
    """The tiles castle_attn / castle_prefill use: gpu_config's, or under the interpreter the smallest
    legal ones, so that tiny tests cross blocks."""
    if interpreting():
        return TritonConfig(32, 16, 4, 16, 16, 4, 1, variant)
    return gpu_config(block_d, dtype, variant)


def gpu_config(block_d, dtype, variant=BWD_VARIANT):
    """Tiles per head dim on a GPU: the fastest of `python -m scripts.bench_castle --sweep [--sweep-fwd]`
    (bf16, L = 2048) for each variant, D <= 64 and D = 128. At D = 128 the backward takes 8 warps and the
    row guard (_bwd_column), and the forward neither 3 pipeline stages nor interleaved heads, which were
    slower there. fp32 operands take twice the registers and shared memory, so smaller tiles."""
    if dtype == torch.float32:
        return TritonConfig(32, 16, 4, 32, 16, 4, 1, variant)
    if block_d <= 64:
        return TritonConfig(64, 64, 4, *((64, 32) if variant == "fused" else (64, 64)), 4, 2, variant,
                            stages_fwd=3)
    return TritonConfig(64, 32, 4, 64, 64, 8, 1, variant, row_guard=True, head_group_fwd=1)


if triton is not None:
    @triton.jit
    def _tanh_approx(y):
        """tanh on one tanh.approx (absolute error <= 5e-4): sigmoid(x) = 0.5 + 0.5 tanh(x / 2) then takes a
        single special-function op where tl.sigmoid takes two, ex2 and rcp, with an error below the bf16
        rounding every sigmoid here meets next; the kernels spend much of a tile on the special-function
        units. For 16-bit operands only; fp32 ones keep the exact forms."""
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [y], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _sigmoid_of_half(y, DT: tl.constexpr):
        """sigmoid(2 y) in fp32 (_tanh_approx with 16-bit operands)."""
        if DT == tl.float32:
            return tl.sigmoid(2.0 * y)
        else:
            return 0.5 + 0.5 * _tanh_approx(y)

    @triton.jit
    def _neg_silu(x, DT: tl.constexpr):
        """-SiLU(x) in fp32. With 16-bit operands g - g tanh(g) for g = -x / 2 (_tanh_approx): the sign sits
        in the FMA, where -(h + h tanh(h)) for h = x / 2 cost an add."""
        if DT == tl.float32:
            return -x * tl.sigmoid(x)
        else:
            g = x * -0.5
            return g - g * _tanh_approx(g)

    @triton.jit
    def _lookahead_logit(s, SILU: tl.constexpr, DT: tl.constexpr):
        """The lookahead keys' share of the logits of scaled S^U = s: -SiLU(s), or -s without the gate (the
        ablation of Table 10; kernels/castle/reference.py lookahead_logit)."""
        if SILU:
            return _neg_silu(s, DT)
        else:
            return -s

    @triton.jit
    def _silu_and_sigmoid(s, scale: tl.constexpr, DT: tl.constexpr):
        """(SiLU(x), sigmoid(x)) of x = scale * s in fp32. With 16-bit operands from h = x / 2 (_tanh_approx):
        sigmoid = 0.5 + 0.5 tanh(h) and SiLU = x sigmoid = h + h tanh(h), a multiply fewer than x, x / 2, x
        sigmoid."""
        if DT == tl.float32:
            x = s * scale
            sg = tl.sigmoid(x)
            return x * sg, sg
        else:
            h = s * (0.5 * scale)
            t = _tanh_approx(h)
            return h + h * t, 0.5 + 0.5 * t

    @triton.jit
    def _half_scaled(x, scale: tl.constexpr, SIGMA_PRE: tl.constexpr, DT: tl.constexpr):
        """x * s / 2 as a matmul operand where that is exact (SIGMA_PRE: s a power of two, as for D = 16, 64,
        256): sigma's logit s q^U k^U then leaves its matmul halved, as tanh takes it (_lookahead_sigma),
        with no multiply per tile. Otherwise x as it is, and sigma takes the multiply."""
        if SIGMA_PRE:
            return (x.to(tl.float32) * (0.5 * scale)).to(DT)
        else:
            return x.to(DT)

    @triton.jit
    def _lookahead_sigma(qu_c, ku_a, c, a, scale: tl.constexpr, W, BN: tl.constexpr, BM: tl.constexpr,
                         SIGMA_PRE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
        """sigma_{c,a}: weight of contributor i (row block a) in the lookahead key of owner j (key block
        c), eq (3) with mask (4) / (9): j < i <= j + W. Tiles the mask keeps whole skip it. With SIGMA_PRE one
        of the operands comes _half_scaled, so the logit leaves the matmul halved; otherwise it is halved here."""
        half_logit = tl.dot(qu_c, tl.trans(ku_a), input_precision=PREC)
        if not SIGMA_PRE:
            half_logit *= 0.5 * scale
        sig = _sigmoid_of_half(half_logit, DT)
        if (a * BM <= c * BN + BN - 1) | (a * BM + BM - 1 > c * BN + W):
            rows_c = c * BN + tl.arange(0, BN)
            rows_a = a * BM + tl.arange(0, BM)
            keep = (rows_a[None, :] > rows_c[:, None]) & (rows_a[None, :] <= rows_c[:, None] + W)
            sig = tl.where(keep, sig, 0.0)
        return sig

    @triton.jit
    def _causal(sc, a, c, BM: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
        """Scores -inf above the diagonal; masked only on tiles that meet it."""
        if a * BM < c * BN + BN - 1:
            rows_a = _kept_in_branch(a, ASM) * BM + tl.arange(0, BM)
            rows_c = c * BN + tl.arange(0, BN)
            sc = tl.where(rows_a[:, None] >= rows_c[None, :], sc, float("-inf"))
        return sc

    @triton.jit
    def _kept_in_branch(x, ASM: tl.constexpr):
        """The int32 x, passed on a GPU (ASM) through inline PTX that the compiler must assume has side effects:
        the code of a branch that takes it then stays a branch. Otherwise LLVM turns a mask under a runtime
        test into selects on every tile (the causal mask: ~100 instructions a tile)."""
        if ASM:
            return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
        else:
            return x

    @triton.jit
    def _load_tile(ptrs, mask, IN_BOUNDS: tl.constexpr):
        """tl.load of an input tile, zero where mask is false. IN_BOUNDS (the tile's rows are all < L and
        BLOCK_D = HEAD_DIM, as when L is a multiple of the row block): no mask, so the kernels build none and
        fill no zeros (the row loops, every step)."""
        if IN_BOUNDS:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _atomic_add_tile(ptrs, x, mask, IN_BOUNDS: tl.constexpr):
        """Relaxed fp32 atomic adds of the tile x where mask holds (everywhere with IN_BOUNDS, see _load_tile)."""
        if IN_BOUNDS:
            tl.atomic_add(ptrs, x, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=mask, sem="relaxed")

    @triton.jit
    def _last_row_block(c, W, NR, BM: tl.constexpr, BN: tl.constexpr):
        """Last row block whose contributors reach key block c (the window, eq (9)): i <= (c+1)*BN - 1 + W."""
        return tl.minimum(((c + 1) * BN - 1 + W) // BM, NR - 1)

    @triton.jit
    def _fold_count(c, r, BM: tl.constexpr, BN: tl.constexpr):
        """How many U blocks row program r has written once it has written block c. It visits its own
        (diagonal) key blocks left to right, then the earlier ones right to left."""
        first = r * (BM // BN)
        return tl.where(c >= first, c - first + 1, first + BM // BN - c)

    @triton.jit
    def _grouped_ticket(t, NBH, N, HEAD_GROUP):
        """(head, item) of ticket t, for NBH heads of N items each, in groups of HEAD_GROUP heads whose
        heads take turns: item 0 of each head of the group, then item 1, ... Each head's items in order;
        a group keeps the data its running programs share in L2 (all heads at once was slower)."""
        g0 = t // (HEAD_GROUP * N) * HEAD_GROUP                   # first head of the ticket's group
        group_size = tl.minimum(HEAD_GROUP, NBH - g0)
        return g0 + (t - g0 * N) % group_size, (t - g0 * N) // group_size

    # The forward's step loop is software-pipelined (Triton prefetches the next key block's tiles), and Triton
    # 3.6's pipeliner skips any loop holding a nested loop or a barrier op. So on a GPU (ASM) the hand-off's
    # spin-wait and the barrier before its release are inline PTX; the interpreter, which cannot run PTX (and
    # runs programs one after another), takes the plain forms.
    @triton.jit
    def _wait_at_least(flag_ptr, need, ASM: tl.constexpr):
        """Spin until the int32 at flag_ptr is >= need (acquire, GPU scope); returns the value seen."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; WAIT: ld.acquire.gpu.global.b32 $0, [$1]; setp.lt.s32 p, $0, $2; @p bra WAIT; }",
                "=r,l,r", [flag_ptr, need], dtype=tl.int32, is_pure=False, pack=1)
        else:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            while seen < need:
                seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            return seen

    @triton.jit
    def _block_barrier(dummy, ASM: tl.constexpr):
        """All threads of the program meet here (bar.sync: their earlier writes are then ordered before a
        later release by any of them). dummy: any int scalar (inline PTX needs an operand)."""
        if ASM:
            tl.inline_asm_elementwise("bar.sync 0; mov.b32 $0, $1;", "=r,r", [dummy], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.debug_barrier()

    # `scale` is constexpr: Inductor, launching a user kernel, passes a Python float as an fp64 scalar, which
    # promotes the tiles to fp64 and fails to compile; as a constant it stays fp32 everywhere. (The custom ops
    # of kernels/castle/op.py keep torch.compile from launching these kernels itself; the constant costs
    # nothing.)
    @triton.jit
    def castle_fwd_kernel(
        QC, KC, VC, QU, KU, VU, OUT, LSE, U, SYNC,
        stride_b, stride_h, stride_l, H, L, NR, W, save_t, HEAD_GROUP, scale: tl.constexpr,
        HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr, SIGMA_PRE: tl.constexpr,
        IN_BOUNDS: tl.constexpr, CAUSAL_KEYS: tl.constexpr, SILU: tl.constexpr,
    ):
        # CAUSAL_KEYS, SILU: off for the ablations of arXiv:2509.07301 Tables 5 and 10 (no s^C; -S^U for
        # -SiLU(S^U)); as constexprs they leave CASTLE's own kernel as it is. Without causal keys KC is
        # never read.
        # SYNC[bh * NR + r] counts the U blocks row program r of head bh has written; SYNC[-1] hands out
        # tickets: ticket -> (head, row block), each head's row blocks in increasing order, HEAD_GROUP heads
        # taking turns, so that their last (longest) rows start together rather than one head's after
        # another's.
        ticket = tl.atomic_add(SYNC + tl.num_programs(0), 1)
        bh, a = _grouped_ticket(ticket, tl.num_programs(0) // NR, NR, HEAD_GROUP)
        off = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
        u_base = U + bh.to(tl.int64) * (NR * BM * BLOCK_D)
        flags = SYNC + bh * NR

        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d[None, :] < HEAD_DIM
        rows_a = a * BM + offs_m
        mask_a = (rows_a[:, None] < L) & dmask
        ptr_a = off + rows_a[:, None] * stride_l + offs_d[None, :]
        # Qc pre-scaled by s, since every product that takes it is scaled: the scale then costs one multiply
        # per row block instead of three per tile, and Qc Kc^T accumulates onto -SiLU(S^U) in the matmul.
        # Exact when s is a power of two (D = 16, 64, 256); otherwise one more rounding of Qc in 16-bit
        # operands.
        qc_a = (_load_tile(QC + ptr_a, mask_a, IN_BOUNDS).to(tl.float32) * scale).to(DT)
        ku_a = _half_scaled(_load_tile(KU + ptr_a, mask_a, IN_BOUNDS), scale, SIGMA_PRE, DT)
        vu_a = _load_tile(VU + ptr_a, mask_a, IN_BOUNDS).to(DT)
        # R_a = s * q^C_t . v^U_i for contributors i <= t inside the row block (eq (22)): once per row block.
        r = tl.dot(qc_a, tl.trans(vu_a), input_precision=PREC)
        r = tl.where(offs_m[:, None] >= offs_m[None, :], r, 0.0).to(DT)
        # The contributors this row folds into U; the last row only those before save_t (where the
        # backward starts, or L for prefill), and only if that leaves anything to fold.
        vu_fold = tl.where(rows_a[:, None] < save_t, vu_a, 0.0).to(DT)
        do_write = (a < NR - 1) | (save_t > a * BM)

        m = tl.full([BM], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BLOCK_D], dtype=tl.float32)
        first = a * (BM // BN)                       # first key block inside the row block
        for step in tl.range(0, first + BM // BN, num_stages=STAGES):
            # Own key blocks left to right (the first one, holding the diagonal, leaves every row's running
            # max finite), then the earlier ones right to left.
            c = tl.where(step < BM // BN, first + step, first + BM // BN - 1 - step)
            own = c >= first
            rows_c = c * BN + offs_n
            mask_c = (rows_c[:, None] < L) & dmask
            ptr_c = off + rows_c[:, None] * stride_l + offs_d[None, :]
            qu_c = _load_tile(QU + ptr_c, mask_c, IN_BOUNDS).to(DT)
            if CAUSAL_KEYS:
                kc_c = _load_tile(KC + ptr_c, mask_c, IN_BOUNDS).to(DT)
            vc_c = _load_tile(VC + ptr_c, mask_c, IN_BOUNDS).to(DT)
            u_ptr = u_base + rows_c[:, None] * BLOCK_D + offs_d[None, :]
            last_row = _last_row_block(c, W, NR, BM, BN)

            s = tl.zeros([BM, BN], dtype=tl.float32)
            if not own:
                # U_c as of the start of row block a: written by row a-1, or frozen earlier by the window.
                writer = tl.minimum(a - 1, last_row)
                need = _fold_count(c, writer, BM, BN)
                seen = _wait_at_least(flags + writer, need, ASM)
                # Volatile (past L1, and never prefetched by the pipeliner), and masked by the wait's result
                # (always true) so that no compiler moves it before the wait.
                u_c = tl.load(u_ptr, mask=seen >= need, other=0.0, volatile=True).to(DT)
                s = tl.dot(qc_a, tl.trans(u_c), input_precision=PREC)             # eq (24), first term
            if a <= last_row:
                sig = _lookahead_sigma(qu_c, ku_a, c, a, scale, W, BN, BM, SIGMA_PRE, PREC, DT).to(DT)
                s += tl.dot(r, tl.trans(sig), input_precision=PREC)               # eqs (22)/(24), local
                if do_write:
                    upd = tl.dot(sig, vu_fold, input_precision=PREC)              # eq (23)
                    if own:
                        tl.store(u_ptr, upd)
                    else:  # only this program touches U_c now: a relaxed add is exact, no fp32 copy held
                        tl.atomic_add(u_ptr, upd, sem="relaxed")
                    _block_barrier(step, ASM)
                    tl.atomic_xchg(flags + a, step + 1, sem="release", scope="gpu")
            if CAUSAL_KEYS:                                                               # eq (19)
                sc = tl.dot(qc_a, tl.trans(kc_c), _lookahead_logit(s, SILU, DT), input_precision=PREC)
            else:
                sc = _lookahead_logit(s, SILU, DT)
            sc = _causal(sc, a, c, BM, BN, ASM)
            # online softmax (Algorithm 2) in base 2: the scores take log2(e) in the exponent's FMA
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp2((m - m_new) * LOG2E)
            p = tl.exp2(sc * LOG2E - (m_new * LOG2E)[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(DT), vc_c, acc * alpha[:, None], input_precision=PREC)
            m = m_new

        o_ptr = OUT + off + rows_a[:, None] * stride_l + offs_d[None, :]     # out: the inputs' strides
        tl.store(o_ptr, (acc / denom[:, None]).to(OUT.dtype.element_ty), mask=mask_a)
        tl.store(LSE + bh.to(tl.int64) * (NR * BM) + rows_a, m * LOG2E + tl.log2(denom))

    @triton.jit
    def _bwd_column(
        bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU, E, DS, ds_slot,
        stride_b, stride_h, stride_l, H, L, NR, W, scale: tl.constexpr, lse_rows,
        HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, CAUSAL_GRADS: tl.constexpr, SIGMA_GRADS: tl.constexpr,
        DS_MODE: tl.constexpr, ROW_GUARD: tl.constexpr, SIGMA_STAGES: tl.constexpr, SIGMA_PRE: tl.constexpr,
        ASM: tl.constexpr, IN_BOUNDS: tl.constexpr, CAUSAL_KEYS: tl.constexpr, SILU: tl.constexpr,
    ):
        """The backward of key block c of head bh: walks the row blocks a = NR-1 .. own block of c, or,
        without SIGMA_GRADS (no dU to carry), up from the own block of c.

        Carried for key block c: U_c (walking down: as of the start of row block a + 1 on entering a step, read
        from this program's rows of the fp32 (BH, lse_rows, BLOCK_D) buffer; walking up: as of the start of row
        block a, from zero), dU_c (gradient of the rows after a) and dKc, dVc, dQu, all in registers and all
        without their factors s, which each takes once: dKc, dVc, dQu (s^2: the sigma logit's too), which only
        this column writes, when they go to their (B, H, L, D) outputs in the output dtype, the row gradients'
        fp32 sums in _finish_rows (so R_a, dU_c, Qu_c's share of dKu and every atomic add are unscaled; Qu_c
        comes _half_scaled for sigma). Which gradients a pass computes: CAUSAL_GRADS dVc, dKc, dQc and E (eqs
        27, 30, 31; E, unmasked, added to the fp32 (BH, NR*BM, BM) buffer E), SIGMA_GRADS the paths through
        sigma, dU (eq 32), dQu, dKu, dVu. DS_MODE: 0 recomputes the score gradient dS (eq 29) of every tile;
        1 also stores it in this program's (NR*BM, BN) strip of DS at ds_slot, leaving E to the pass that reads
        it back; 2 loads dS from there instead of recomputing the scores (then U is not needed at all) and
        forms E; its row loop then runs software-pipelined with SIGMA_STAGES stages (Triton prefetches the next
        step's tiles). CAUSAL_KEYS, SILU: as in castle_fwd_kernel (without causal keys no dKc)."""
        off = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
        g_off = bh.to(tl.int64) * L * HEAD_DIM                    # the row gradients' fp32 sums: (B, H, L, D)
        lse_off = bh.to(tl.int64) * lse_rows                      # LSE and DELTA: (BH, lse_rows)
        e_off = bh.to(tl.int64) * (NR * BM * BM)                  # E: (BH, NR*BM, BM)

        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d[None, :] < HEAD_DIM
        tril = offs_m[:, None] >= offs_m[None, :]
        rows_c = c * BN + offs_n
        mask_c = (rows_c[:, None] < L) & dmask
        ptr_c = off + rows_c[:, None] * stride_l + offs_d[None, :]
        qu_c = _half_scaled(_load_tile(QU + ptr_c, mask_c, IN_BOUNDS), scale, SIGMA_PRE, DT)
        if DS_MODE != 2:
            if CAUSAL_KEYS:
                kc_c = _load_tile(KC + ptr_c, mask_c, IN_BOUNDS).to(DT)
            vc_c = _load_tile(VC + ptr_c, mask_c, IN_BOUNDS).to(DT)
        last_row = _last_row_block(c, W, NR, BM, BN)
        own_row = c // (BM // BN)                                 # the row block holding key block c
        u = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        if SIGMA_GRADS:
            # dU flows from the later rows: walk the row blocks down, from U_c as of the start of the last
            # one (saved by the forward; read only), undoing each row's update of it (eq 33).
            a = NR - 1
            step = -1
            if DS_MODE == 0:
                u = tl.load(U + bh.to(tl.int64) * lse_rows * BLOCK_D + rows_c[:, None] * BLOCK_D + offs_d[None, :])
        else:
            # Without dU, walk up and build U_c as the forward does. (For "stored", the second pass then
            # reads the strip and the row tiles back in the reverse order of the first: L2 still has them.)
            a = own_row
            step = 1
        du = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        dkc = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        dvc = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
        dqu = tl.zeros([BN, BLOCK_D], dtype=tl.float32)

        # Loop invariants stay inside the loop (disable_licm): hoisted, they are live across every step, and
        # at 255 registers ptxas spills them and reloads them in the loop (scripts/castle_regs.py shows the
        # spills). ROW_GUARD wraps the body in a test that is always true: it only changes how ptxas allocates
        # registers, for the better at D = 128 (fewer spills) and for the worse at D = 64. The sigma pass
        # (DS_MODE 2) runs pipelined with SIGMA_STAGES > 1; the launch passes 1 with a window: Triton 3.6 then
        # addressed shared memory out of range on the steps outside it. (SIGMA_STAGES also picks how Vu_a is
        # loaded, in both passes; below.)
        for _ in tl.range(0, NR - own_row, num_stages=SIGMA_STAGES if DS_MODE == 2 else 1, disable_licm=True):
            if ((a >= own_row) & (a < NR)) | (not ROW_GUARD):
                rows_a = a * BM + offs_m
                mask_a = (rows_a[:, None] < L) & dmask
                ptr_a = off + rows_a[:, None] * stride_l + offs_d[None, :]
                g_ptr = g_off + rows_a[:, None] * HEAD_DIM + offs_d[None, :]
                e_ptr = e_off + rows_a[:, None] * BM + offs_m[None, :]
                qc_a = _load_tile(QC + ptr_a, mask_a, IN_BOUNDS).to(DT)
                ku_a = _load_tile(KU + ptr_a, mask_a, IN_BOUNDS).to(DT)
                # Vu_a^T. For the pipelined sigma pass loaded as a (D, m) tile, which its products take as it is:
                # loaded as (m, D), they read it through one transposed view, and Triton 3.6 gave it a single
                # buffer, which the next step's prefetch overwrote before its last read (wrong gradients).
                # Unpipelined, the (m, D) load is the faster one.
                if SIGMA_STAGES > 1:
                    vu_t = _load_tile(VU + off + rows_a[None, :] * stride_l + offs_d[:, None], tl.trans(mask_a),
                                      IN_BOUNDS).to(DT)
                else:
                    vu_t = tl.trans(_load_tile(VU + ptr_a, mask_a, IN_BOUNDS).to(DT))
                in_window = a <= last_row
                folded = in_window & (a < NR - 1)           # row a added sigma_{c,a} Vu_a to U_c (eq 23)
                after = a * BM >= (c + 1) * BN              # key block c lies before the row block (U_c != 0)

                sig = tl.zeros([BN, BM], dtype=DT)
                r = tl.zeros([BM, BM], dtype=DT)
                if in_window:
                    sig = _lookahead_sigma(qu_c, ku_a, c, a, scale, W, BN, BM, SIGMA_PRE, PREC, DT).to(DT)
                    r = tl.where(tril, tl.dot(qc_a, vu_t, input_precision=PREC), 0.0).to(DT)   # R_a / s
                if DS_MODE == 2:
                    ds = tl.load(DS + ds_slot + rows_a[:, None] * BN + offs_n[None, :], cache_modifier=".cg")
                else:
                    do_a = _load_tile(DO + ptr_a, mask_a, IN_BOUNDS).to(DT)
                    lse_a = tl.load(LSE + lse_off + rows_a)
                    delta_a = tl.load(DELTA + lse_off + rows_a)
                    # Recompute the scores of the tile (eqs 22/24, 19) from U_c as of the start of row block a.
                    s = tl.zeros([BM, BN], dtype=tl.float32)
                    if in_window:
                        if SIGMA_GRADS and folded:
                            u -= tl.dot(sig, tl.trans(vu_t), input_precision=PREC)
                        s = tl.dot(r, tl.trans(sig), input_precision=PREC)
                    u_t = u.to(DT)
                    if after:
                        s += tl.dot(qc_a, tl.trans(u_t), input_precision=PREC)
                    if not SIGMA_GRADS and folded:
                        u += tl.dot(sig, tl.trans(vu_t), input_precision=PREC)               # eq (23)
                    # Scores (eq 19) and their gradients (eqs 25-29, 27); every (m x n) fp32 tile dies as
                    # soon as it can (SiLU'(S) before the softmax, dVc before dP): the peak is three.
                    if SILU:
                        silu, sg = _silu_and_sigmoid(s, scale, DT)
                    else:
                        silu = s * scale                        # the logit takes -S^U, whose derivative is 1
                    if CAUSAL_KEYS:
                        sc = tl.dot(qc_a, tl.trans(kc_c), input_precision=PREC) * scale - silu
                    else:
                        sc = -silu
                    if SILU:
                        dsilu = sg + silu * (1.0 - sg)
                    sc = _causal(sc, a, c, BM, BN, ASM)
                    p = tl.exp2(sc * LOG2E - lse_a[:, None])                               # eq (25)
                    if CAUSAL_GRADS:
                        dvc += tl.dot(tl.trans(p.to(DT)), do_a, input_precision=PREC)       # eq (27)
                    dp = tl.dot(do_a, tl.trans(vc_c), input_precision=PREC)                 # eq (26)
                    da = p * (dp - delta_a[:, None])                                        # eq (28)
                    if SILU:
                        ds = (-da * dsilu).to(DT)                                           # eq (29)
                    else:
                        ds = (-da).to(DT)
                    if DS_MODE == 1:
                        tl.store(DS + ds_slot + rows_a[:, None] * BN + offs_n[None, :], ds)
                    if CAUSAL_GRADS:
                        if CAUSAL_KEYS:
                            da = da.to(DT)
                            dkc += tl.dot(tl.trans(da), qc_a, input_precision=PREC)         # eq (30), dQc
                            dqc_a = tl.dot(da, kc_c, input_precision=PREC)
                        else:
                            dqc_a = tl.zeros([BM, BLOCK_D], dtype=tl.float32)
                        if after:
                            dqc_a += tl.dot(ds, u_t, input_precision=PREC)
                if DS_MODE != 1 and in_window:  # a pass that stores dS leaves E to the one that reads it back
                    if DS_MODE == 2 or CAUSAL_GRADS:
                        # E (eq 31) only meets operands of row block a: summed over the key blocks here, its
                        # mask and its products with Vu_a and Qc_a are taken once per row block (_finish_rows).
                        tl.atomic_add(E + e_ptr, tl.dot(ds, sig, input_precision=PREC), sem="relaxed")
                    if SIGMA_GRADS:
                        # Row a's update of U_c (eq 23) takes the upstream gradient dU of the rows after a
                        # (eq 32), so dU gets this tile's own contribution only at the end.
                        if folded:
                            dvu_a = tl.dot(tl.trans(sig), du.to(DT), input_precision=PREC)
                            _atomic_add_tile(DVU + g_ptr, dvu_a, mask_a, IN_BOUNDS)
                        # Both gradient paths into sigma_{c,a}: the local term (via R) and the U_c update.
                        dsig = tl.dot(tl.trans(ds), r, input_precision=PREC)
                        if folded:
                            dsig += tl.dot(du.to(DT), vu_t, input_precision=PREC)
                        # dz: the logit's gradient / s (dsig is unscaled: R_a / s, dU_c / s); dQu and dKu take
                        # s^2 once, this s and the logit's
                        sig32 = sig.to(tl.float32)
                        dz = (dsig * (sig32 - sig32 * sig32)).to(DT)
                        dqu += tl.dot(dz, ku_a, input_precision=PREC)
                        qu_term = tl.dot(tl.trans(dz), qu_c, input_precision=PREC)   # dKu's term / (2s or s^2)
                        _atomic_add_tile(DKU + g_ptr, qu_term, mask_a, IN_BOUNDS)
                if CAUSAL_GRADS:
                    _atomic_add_tile(DQC + g_ptr, dqc_a, mask_a, IN_BOUNDS)
                if SIGMA_GRADS and after:
                    du += tl.dot(tl.trans(ds), qc_a, input_precision=PREC)
            a += step

        gc_ptr = off + rows_c[:, None] * stride_l + offs_d[None, :]   # gradients: the inputs' strides
        if CAUSAL_GRADS:
            if CAUSAL_KEYS:
                tl.store(DKC + gc_ptr, (dkc * scale).to(DKC.dtype.element_ty), mask=mask_c)
            tl.store(DVC + gc_ptr, dvc.to(DVC.dtype.element_ty), mask=mask_c)
        if SIGMA_GRADS:
            tl.store(DQU + gc_ptr, (dqu * (scale * scale)).to(DQU.dtype.element_ty), mask=mask_c)

    @triton.jit
    def castle_bwd_kernel(
        QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU, E, DS, SYNC,
        DQC_OUT, DKU_OUT, DVU_OUT,
        stride_b, stride_h, stride_l, H, L, NR, NC, NBH, NSLOTS, W, scale: tl.constexpr, lse_rows,
        HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
        DT: tl.constexpr, PREC: tl.constexpr, CAUSAL_GRADS: tl.constexpr, SIGMA_GRADS: tl.constexpr,
        STORED: tl.constexpr, FINISH: tl.constexpr, HEAD_GROUP: tl.constexpr, ROW_GUARD: tl.constexpr,
        SIGMA_STAGES: tl.constexpr, SIGMA_PRE: tl.constexpr, ASM: tl.constexpr, IN_BOUNDS: tl.constexpr,
        CAUSAL_KEYS: tl.constexpr, SILU: tl.constexpr,
    ):
        """Programs draw tickets (SYNC[NSLOTS] hands them out): tickets below NBH*NC are (head, key block)
        work items; with FINISH (the variant's last launch) NBH*NR more finish (head, row block) items.
        Tickets, not program ids: a program only ever waits on one that has already started, so no order
        of starting deadlocks.

        A work item without STORED is one pass with the gradients selected. With STORED, the causal pass,
        which stores every tile's dS in a strip of DS, then the sigma pass, which reads dS back instead of
        recomputing the scores. DS holds NSLOTS strips of (NR*BM, BN) (linear in L): ticket t takes strip
        t % NSLOTS once ticket t - NSLOTS has released it (SYNC[strip] counts releases).

        A finish item waits until every key block of its head is done (SYNC[NSLOTS + 1 + head] counts
        them), then takes _finish_rows. Finish items come last, so they run in the slots that the work
        items' tail leaves idle instead of as a launch of their own after it."""
        t = tl.atomic_add(SYNC + NSLOTS, 1)
        done = SYNC + NSLOTS + 1
        if t < NBH * NC:
            # columns longest first (c = 0 of each head of the group, then c = 1, ...): a shorter tail
            bh, c = _grouped_ticket(t, NBH, NC, HEAD_GROUP)
            if STORED:
                slot = t % NSLOTS
                while tl.atomic_add(SYNC + slot, 0, sem="acquire", scope="gpu") < t // NSLOTS:
                    pass
                ds_slot = slot.to(tl.int64) * (NR * BM * BN)
                _bwd_column(bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU,
                            E, DS, ds_slot, stride_b, stride_h, stride_l, H, L, NR, W, scale, lse_rows,
                            HEAD_DIM, BM, BN, BLOCK_D, DT, PREC, True, False, 1, ROW_GUARD,
                            SIGMA_STAGES, SIGMA_PRE, ASM, IN_BOUNDS, CAUSAL_KEYS, SILU)
                tl.debug_barrier()   # the strip is written by every thread and read back by others
                _bwd_column(bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU,
                            E, DS, ds_slot, stride_b, stride_h, stride_l, H, L, NR, W, scale, lse_rows,
                            HEAD_DIM, BM, BN, BLOCK_D, DT, PREC, False, True, 2, ROW_GUARD,
                            SIGMA_STAGES, SIGMA_PRE, ASM, IN_BOUNDS, CAUSAL_KEYS, SILU)
                tl.debug_barrier()   # every read of the strip done before the next ticket may overwrite it
                tl.atomic_xchg(SYNC + slot, t // NSLOTS + 1, sem="release", scope="gpu")
            else:
                _bwd_column(bh, c, QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, U, DQC, DKC, DVC, DQU, DKU, DVU,
                            E, DS, 0, stride_b, stride_h, stride_l, H, L, NR, W, scale, lse_rows,
                            HEAD_DIM, BM, BN, BLOCK_D, DT, PREC, CAUSAL_GRADS, SIGMA_GRADS, 0, ROW_GUARD, 1,
                            SIGMA_PRE, ASM, IN_BOUNDS, CAUSAL_KEYS, SILU)
            if FINISH:
                tl.debug_barrier()   # every thread's adds issued before the release publishes them
                tl.atomic_add(done + bh, 1, sem="release", scope="gpu")
        else:
            f = t - NBH * NC
            while tl.atomic_add(done + f // NR, 0, sem="acquire", scope="gpu") < NC:
                pass
            _finish_rows(f // NR, f % NR, QC, VU, E, DQC, DKU, DVU, DQC_OUT, DKU_OUT, DVU_OUT, stride_b,
                         stride_h, stride_l, H, L, NR, scale, HEAD_DIM, BM, BLOCK_D, DT, PREC, SIGMA_PRE)

    @triton.jit
    def _castle_delta_kernel(DO, OUT, DELTA, stride_b, stride_h, stride_l, H, L, rows_out, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
        """Delta = rowsum(dO * O) in fp32 (Algorithm 3) for BLOCK rows of head program_id(0); rows L .. rows_out
        (the padding of LSE's layout) get 0. dO and O: the inputs' strides."""
        bh = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
        ptr = (bh // H) * stride_b + (bh % H) * stride_h + rows[:, None] * stride_l + offs_d[None, :]
        do = tl.load(DO + ptr, mask=mask, other=0.0).to(tl.float32)
        out = tl.load(OUT + ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(DELTA + bh * rows_out + rows, tl.sum(do * out, 1), mask=rows < rows_out)

    @triton.jit
    def _finish_rows(bh, a, QC, VU, E, DQC, DKU, DVU, DQC_OUT, DKU_OUT, DVU_OUT, stride_b, stride_h, stride_l,
                     H, L, NR, scale: tl.constexpr, HEAD_DIM: tl.constexpr, BM: tl.constexpr,
                     BLOCK_D: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                     SIGMA_PRE: tl.constexpr):
        """Row block a of head bh, once the backward's adds to it are done: E_a, summed over key blocks and
        masked here (tril), gives dQc_a += E_a Vu_a and dVu_a += E_a^T Qc_a (eq 31); the three fp32 row
        gradients then take their factors (dQc, dVu s; dKu s^2, or 2 s with SIGMA_PRE: its sum came from
        _half_scaled Qu) and are written in the output dtype. The sums are read through L2 (.cg): other
        programs wrote them."""
        off = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
        offs_m = tl.arange(0, BM)
        offs_d = tl.arange(0, BLOCK_D)
        rows_a = a * BM + offs_m
        mask_a = (rows_a[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
        ptr_a = off + rows_a[:, None] * stride_l + offs_d[None, :]
        g_ptr = bh.to(tl.int64) * L * HEAD_DIM + rows_a[:, None] * HEAD_DIM + offs_d[None, :]
        e = tl.load(E + bh.to(tl.int64) * (NR * BM * BM) + rows_a[:, None] * BM + offs_m[None, :],
                    cache_modifier=".cg")
        e = tl.where(offs_m[:, None] >= offs_m[None, :], e, 0.0).to(DT)
        qc_a = tl.load(QC + ptr_a, mask=mask_a, other=0.0).to(DT)
        vu_a = tl.load(VU + ptr_a, mask=mask_a, other=0.0).to(DT)
        dqc = tl.load(DQC + g_ptr, mask=mask_a, other=0.0, cache_modifier=".cg")
        dqc = (dqc + tl.dot(e, vu_a, input_precision=PREC)) * scale
        dvu = tl.load(DVU + g_ptr, mask=mask_a, other=0.0, cache_modifier=".cg")
        dvu = (dvu + tl.dot(tl.trans(e), qc_a, input_precision=PREC)) * scale
        tl.store(DQC_OUT + ptr_a, dqc.to(DQC_OUT.dtype.element_ty), mask=mask_a)
        tl.store(DVU_OUT + ptr_a, dvu.to(DVU_OUT.dtype.element_ty), mask=mask_a)
        dku = tl.load(DKU + g_ptr, mask=mask_a, other=0.0, cache_modifier=".cg")
        if SIGMA_PRE:
            dku *= 2.0 * scale
        else:
            dku *= scale * scale
        tl.store(DKU_OUT + ptr_a, dku.to(DKU_OUT.dtype.element_ty), mask=mask_a)


def dot_dtype(dtype):
    """Matmul operand dtype: the input's on a GPU; fp32 under the interpreter, so that CPU runs check the
    algorithm at fp32 accuracy (tiny shapes, tight tolerances) and GPU runs the bf16 rounding."""
    if interpreting():
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def same_layout(xs):
    """The (B, H, L, D) inputs as the kernels take them. One set of (batch, head, position) strides serves
    the six inputs, out, dO and the six gradients, which are allocated like qc (empty_like): so the inputs
    must share strides and be dense, either (B, H, L, D) storage or (B, L, H, D) storage, the layout of a
    model's heads (the model's transposes are then views, not copies). Inputs that are not (views of a fused
    projection, or mixed layouts) are copied into (B, L, H, D) storage. None (no causal keys) stays None."""
    first = xs[0]
    dense = first.is_contiguous() or first.transpose(1, 2).is_contiguous()
    if dense and all(t is None or t.stride() == first.stride() for t in xs):
        return xs
    return [None if t is None else t.transpose(1, 2).contiguous().transpose(1, 2) for t in xs]


def forward_buffers(qc, cfg):
    """Empty out (like qc, which same_layout laid out), lse (BH, NR*m) fp32 and u (BH, NR*m, block_d) fp32
    of the forward."""
    B, H, L, D = qc.shape
    rows = triton.cdiv(L, cfg.m_fwd) * cfg.m_fwd
    return (torch.empty_like(qc), qc.new_empty(B * H, rows, dtype=torch.float32),
            qc.new_empty(B * H, rows, padded_head_dim(D), dtype=torch.float32))


def _precision(dt):
    """tl.dot's input_precision: exact fp32 products for fp32 operands (16-bit ones are exact either way)."""
    return "ieee" if dt == tl.float32 else "tf32"


def sigma_prescaled(scale):
    """Whether s / 2 is a power of two, so that sigma's operand may carry it exactly (_half_scaled)."""
    return math.frexp(0.5 * scale)[0] == 0.5


def in_bounds(L, m, D, block_d):
    """Whether every (m, block_d) tile of a head lies inside it, so that the kernels load it unmasked (_load_tile)."""
    return L % m == 0 and D == block_d


def _tile_constexprs(D, block_d, dt, scale, L, m, n, causal_keys, silu):
    """The constexprs the forward and the backward kernels share, for tiles of m rows and n keys."""
    return dict(HEAD_DIM=D, BM=m, BN=n, BLOCK_D=block_d, DT=dt, PREC=_precision(dt), ASM=not interpreting(),
                SIGMA_PRE=sigma_prescaled(scale), IN_BOUNDS=in_bounds(L, m, D, block_d), CAUSAL_KEYS=causal_keys,
                SILU=silu)


def fwd_constexprs(D, block_d, cfg, dt, scale, L, causal_keys=True, silu=True):
    """The forward kernel's constexprs (scripts/castle_regs.py compiles it with them too)."""
    return dict(_tile_constexprs(D, block_d, dt, scale, L, cfg.m_fwd, cfg.n_fwd, causal_keys, silu),
                STAGES=cfg.stages_fwd)


def fwd_head_group(cfg, L):
    """Heads the forward's launch order interleaves: cfg.head_group_fwd, fewer where their key blocks and U
    would outgrow L2 (at most 32K positions in flight)."""
    return max(1, min(cfg.head_group_fwd, 32768 // L))


def triton_forward(qc, kc, vc, qu, ku, vu, window, scale, cfg, save_t, silu=True):
    """-> out (B, H, L, D), lse (BH, NR*m) in log2 units, u (BH, NR*m, block_d) fp32 = U^{save_t}.
    kc None: no causal keys."""
    causal_keys = kc is not None
    qc, kc, vc, qu, ku, vu = same_layout([qc, kc, vc, qu, ku, vu])
    kc = kc if causal_keys else qc                                  # a pointer the kernels never read
    B, H, L, D = qc.shape
    block_d = padded_head_dim(D)
    nr = triton.cdiv(L, cfg.m_fwd)
    out, lse, u = forward_buffers(qc, cfg)
    sync = torch.zeros(B * H * nr + 1, dtype=torch.int32, device=qc.device)
    dt = dot_dtype(qc.dtype)
    castle_fwd_kernel[(B * H * nr,)](
        qc, kc, vc, qu, ku, vu, out, lse, u, sync,
        qc.stride(0), qc.stride(1), qc.stride(2), H, L, nr, window_or_len(window, L), save_t,
        fwd_head_group(cfg, L), scale, **fwd_constexprs(D, block_d, cfg, dt, scale, L, causal_keys, silu),
        num_warps=cfg.warps_fwd,
        num_stages=1,
    )
    return out, lse, u


# Backward launch order: 8 heads at a time, longest columns first (see the kernel): faster than one head at a
# time, and than 2, 4 or 16.
BWD_HEAD_GROUP = 8


def bwd_kernels(variant, D, block_d, cfg, dt, scale, L, windowed=False, causal_keys=True, silu=True):
    """[(label, kernel, constexprs)] of the launches of one backward variant (scripts/castle_regs.py
    reads it too)."""
    consts = dict(_tile_constexprs(D, block_d, dt, scale, L, cfg.m_bwd, cfg.n_bwd, causal_keys, silu),
                  CAUSAL_GRADS=True, SIGMA_GRADS=True, STORED=False, FINISH=True, HEAD_GROUP=BWD_HEAD_GROUP,
                  ROW_GUARD=cfg.row_guard, SIGMA_STAGES=1 if windowed else cfg.stages_bwd)
    if variant == "fused":
        return [("all", castle_bwd_kernel, consts)]
    if variant == "stored":
        return [("stored", castle_bwd_kernel, {**consts, "STORED": True})]
    assert variant == "split", f"backward variant must be one of {BWD_VARIANTS}, got {variant!r}"
    return [("causal", castle_bwd_kernel, {**consts, "SIGMA_GRADS": False, "FINISH": False}),
            ("sigma", castle_bwd_kernel, {**consts, "CAUSAL_GRADS": False})]


# Share of the free device memory the dS strips may take. Fewer strips than the programs that run at once
# only make programs wait for one (tickets keep that deadlock-free), so very long L slows down instead of
# running out of memory.
STRIP_MEMORY_SHARE = 0.25


def ds_strips(device, work, strip_bytes):
    """dS strips of the "stored" backward: four per SM, twice the programs that run at once (two per SM
    at ~240 registers a thread), so that a strip is free again by the time its next ticket comes, and no
    more than STRIP_MEMORY_SHARE of the free memory (~35 MB a strip at L = 256K) allows, but at least one;
    under the interpreter two, so that tests reuse strips. Free memory counts the caching allocator's unused
    blocks too, but reading torch's statistics of them costs CPU time on every call, so they are read only
    where the device's own free memory would cap the strips."""
    if interpreting():
        return min(work, 2)
    wanted = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    free = torch.cuda.mem_get_info(device)[0]
    strips = strip_count(work, wanted, strip_bytes, free)
    if strips < min(work, wanted):  # capped: count the allocator's unused blocks as free too
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        strips = strip_count(work, wanted, strip_bytes, free + unused)
    return strips


def strip_count(work, wanted, strip_bytes, free_bytes):
    return max(1, min(work, wanted, int(STRIP_MEMORY_SHARE * free_bytes) // strip_bytes))


def triton_backward(do, qc, kc, vc, qu, ku, vu, out, lse, u, window, scale, cfg, silu=True):
    """u: the U the forward saved for the backward; None for "stored", which rebuilds it. kc None (no
    causal keys): dkc is None."""
    causal_keys = kc is not None
    qc, kc, vc, qu, ku, vu = same_layout([qc, kc, vc, qu, ku, vu])
    kc = kc if causal_keys else qc                                  # a pointer the kernels never read
    B, H, L, D = qc.shape
    block_d = padded_head_dim(D)
    nr, nc = triton.cdiv(L, cfg.m_bwd), triton.cdiv(L, cfg.n_bwd)
    if do.stride() != qc.stride():
        do = torch.empty_like(qc).copy_(do)
    delta = torch.empty_like(lse)                                                   # Algorithm 3, Delta
    _castle_delta_kernel[(B * H, triton.cdiv(lse.shape[1], 64))](do, out, delta, *qc.stride()[:3], H, L,
                                                                  lse.shape[1], HEAD_DIM=D,
                                                                  BLOCK_D=block_d, BLOCK=64)
    # The fp32 sums of the row gradients and E per row block, zeroed by one fill
    n_rows, n_e = B * H * L * D, B * H * nr * cfg.m_bwd * cfg.m_bwd
    sums = torch.zeros(3 * n_rows + n_e, dtype=torch.float32, device=qc.device)
    dqc, dku, dvu = (sums[i * n_rows:(i + 1) * n_rows].view(B, H, L, D) for i in range(3))
    e = sums[3 * n_rows:].view(B * H, nr * cfg.m_bwd, cfg.m_bwd)
    # the six gradients in the input dtype: the key-block ones written by their one owner each, the row ones
    # finished from the sums
    dkc, dvc, dqu, *outs = (torch.empty_like(qc) for _ in range(6))
    dt = dot_dtype(qc.dtype)
    strips, ds = 0, None
    if cfg.bwd_variant == "stored":
        ds_dtype = torch.float32 if dt == tl.float32 else qc.dtype
        strips = ds_strips(qc.device, B * H * nc, nr * cfg.m_bwd * cfg.n_bwd * ds_dtype.itemsize)
        ds = torch.empty(strips, nr * cfg.m_bwd, cfg.n_bwd, device=qc.device, dtype=ds_dtype)
    for _, kernel, consts in bwd_kernels(cfg.bwd_variant, D, block_d, cfg, dt, scale, L, window is not None,
                                         causal_keys, silu):
        sync = torch.zeros(strips + 1 + B * H, dtype=torch.int32, device=qc.device)  # strips, ticket, heads
        kernel[(B * H * (nc + nr * consts["FINISH"]),)](
            qc, kc, vc, qu, ku, vu, do, lse, delta, lse if u is None else u,  # lse: a pointer never read
            dqc, dkc, dvc, dqu, dku, dvu, e, ds, sync, *outs,
            qc.stride(0), qc.stride(1), qc.stride(2), H, L, nr, nc, B * H, strips, window_or_len(window, L), scale,
            lse.shape[1], **consts, num_warps=cfg.warps_bwd, num_stages=1,
        )
    dqc, dku, dvu = outs
    return dqc, dkc if causal_keys else None, dvc, dqu, dku, dvu
