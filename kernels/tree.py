"""Tree attention: exact decode attention over a KV cache sharded along the sequence axis.

Tree Attention (Shyam et al., arXiv:2408.04093): the exact merge of partial attention results (§5.2,
Algorithm 3), the local step as split-KV flash decoding, the ring and all-gather baselines, and the
round-robin layout of a sharded cache (RoundRobinRows).

Every rank of a sequence-parallel group holds the same query (the replicated decode stream: every
rank runs the same token through the same weights) and its own slice of the cache. Each rank
attends to its slice alone and keeps a tiny partial state: the normalised output o_r and the
natural-log log-sum-exp lse_r of its logits, both fp32. Partial states merge exactly,
    lse = logaddexp(lse_a, lse_b),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b,
and the merge is associative and commutative, so collectives can evaluate it. K/V never move.

Shapes: q (B, Hq, n, D); k_local, v_local (B, Hkv, t, D) with Hq % Hkv == 0 (GQA: query head h
reads KV head h // (Hq // Hkv)); n query tokens per step (1 for plain decode); t local positions,
t = 0 allowed. Logits are  scale * q.k_j + bias[..., j]  with scale = D ** -0.5 by default.

  tree_decode(q, k_local, v_local, *, group=None, scale=None, bias_local=None,
              combine="gather", impl="auto", return_lse=False, length=None, gate_local=None)
      -> out (B, Hq, n, D) in q.dtype [, lse (B, Hq, n) fp32]: attention over the union of all
         ranks' slices, bitwise identical on every rank. group=None is the default process group once
         torch.distributed is initialised (one process otherwise); a group of one rank gives exactly
         the local result and no collective. Caches call RoundRobinRows.merged_attention, which never
         communicates without a group of their own.
  attn_partial(q, k, v, *, scale=None, bias=None, impl="auto", length=None, gate=None) -> (out, lse),
      fp32: the local step, over the given keys only (length: a static step's filled rows; gate: FoX's
      cumulative log gates of the keys). Empty or fully masked rows: out 0, lse NEG.
  tree_merge(out, lse, group=None, *, combine="gather") -> (out, lse) merged over the group.
      combine="paper":  all-reduce MAX of lse, then SUM of numerators and SUM of denominators;
      combine="packed": all-reduce MAX, then one SUM of [numerator | denominator];
      combine="gather": one all-gather of [out | lse], then each rank merges in rank order.
      "gather" is the default: one collective; the three cost about the same (scripts/bench_tree.py),
      all far below the local attention at long contexts.
  merge_states(out, lse) -> merge of partial states stacked along dim 0, on one device.
  ring_decode / allgather_decode: the baselines (move K/V instead of states), same signature.
  RoundRobinRows: the rows of a sharded cache (model/cache.py's KVCache, kernels.castle.CastleCache).
  Internal API (tests and scripts/bench_tree.py): attn_partial_triton, split_states, all_gather.

bias is any additive per-(query, key) logit term, broadcastable to (B, Hq, n, t), -inf excludes
a key. It covers every attention variant of this repo, because each variant's logit for a cached
position is computed from that position's own cached data and the replicated query:
  baseline   bias_local=None, or mask_bias(q_pos, k_pos) for padded slots, the causal mask inside
             a multi-token chunk, or a sliding window (positions are global).
  FoX        bias_local=fox_bias(c_local), i.e. -c_j with c the *global* cumulative log forget
             gate stored with each cached key; or gate_local=(c_local, c_ref), -(c_j - c_ref) computed by
             the kernel as it reads the keys (what the caches pass). The query's own c_i is common to every key and
             cancels in the softmax (the returned lse then lacks +c_i). model/gpt.py computes c on
             the replicated token stream; sharded_cumsum builds it when each rank only holds its
             own gates. Rebase c by subtracting the same constant on all ranks.
  CASTLE     every rank first adds the new token's term to the lookahead keys of its own rows, the
             owner appends (u=0, q^U, k^C, v^C), then bias_local = -SiLU(scale * qc.u_j), with q, k, v
             the causal qc, kc, vc (kernels.castle.CastleCache with a group does all of it). Holds for
             CASTLE-SWL (window on global positions). In a chunk of n queries each sees a different U,
             so the bias carries each query's own lookahead terms (castle_prefill onto a cache).
Whatever acts on a head's output (FoX-Pro output norm and gate, W_O) goes after the merge.

Model code, one decode step of a layer on every rank of the sequence-parallel group `sp`:
    q, k, v = qkv(x)                                   # replicated, RoPE at the global position
    if owns_new_token: cache.append(k, v)              # e.g. the last rank, or round-robin pages
    y = tree_decode(q, cache.k, cache.v, group=sp)     # FoX / CASTLE: add bias_local as above
"""
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.triton_utils import deal_keys, padded_head_dim, tl, triton

NEG = -1e30  # finite "log 0": exp(NEG - x) is exactly 0, where exp(-inf - -inf) would be NaN
COMBINES = ("paper", "packed", "gather")


# ----------------------------------------------------------------------------- process groups

def _world(group):
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_gather(x, group):
    """(p, *x.shape): every rank's x, in rank order (one all-gather)."""
    out = x.new_empty((_world(group) * x.shape[0],) + x.shape[1:])
    _gather_into(out, x.detach().contiguous(), group=group)   # decode is forward-only
    return out.view((-1,) + x.shape)


# renamed in torch 2.13; the old name still works and is all older versions have
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _peer(group, group_rank):
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# ----------------------------------------------------------------------------- local attention

def attn_partial(q, k, v, *, scale=None, bias=None, impl="auto", length=None, gate=None):
    """Local step: softmax(scale * q k^T + bias) v over the given keys, and its log-sum-exp.

    Returns (out (B, Hq, n, D), lse (B, Hq, n)) in fp32 (fp64 for fp64 inputs).
    impl: "torch" (reference), "triton" (split-KV flash-decoding kernel), "auto" (Triton on CUDA).
    length: None, or a (1,) integer tensor on the keys' device: only the first `length` keys count (a static
    decode step's filled rows, read on the device); the kernel skips the tiles past it, torch masks them.
    gate: FoX's per-key logits as (c (B, Hq, t), c_ref (B, Hq, 1)), float64 cumulative log forget gates of the
    keys and a reference: adds -(c_j - c_ref), the difference taken in float64 and rounded to the statistics'
    dtype (fp32: fox_bias(c - c_ref)); the kernel computes it from c as it reads the keys.
    """
    B, Hq, n, D = q.shape
    Hkv, t = k.shape[1], k.shape[2]
    assert Hq % Hkv == 0 and v.shape[:3] == k.shape[:3], (q.shape, k.shape, v.shape)
    scale = D ** -0.5 if scale is None else scale
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    if t == 0:  # empty shard: the merge identity
        return q.new_zeros(B, Hq, n, v.shape[-1], dtype=stat), q.new_full((B, Hq, n), NEG, dtype=stat)
    if impl == "auto":
        impl = "triton" if q.is_cuda and triton is not None and stat == torch.float32 else "torch"
    if impl == "triton":
        return attn_partial_triton(q, k, v, scale, bias, length=length, gate=gate)
    if gate is not None:
        fox = fox_bias(gate[0] - gate[1], stat)
        bias = fox if bias is None else bias + fox
    if length is not None:
        past = torch.arange(t, device=k.device) >= length
        bias = torch.where(past, float("-inf"), 0.0 if bias is None else bias)
    return _attn_partial_torch(q, k, v, scale, bias, stat)


def _attn_partial_torch(q, k, v, scale, bias, stat):
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    # fold the g query heads of a KV group into rows so K/V are never repeated
    qg = q.to(stat).reshape(B, Hkv, Hq // Hkv * n, D)
    s = (qg @ k.to(stat).transpose(-1, -2)).view(B, Hq, n, -1) * scale
    if bias is not None:
        s = s + bias.to(stat)
    m = s.amax(-1, keepdim=True).clamp_min(NEG)  # a fully masked row has max -inf
    p = torch.exp(s - m)
    den = p.sum(-1)
    out = (p.view(B, Hkv, -1, s.shape[-1]) @ v.to(stat)).view(B, Hq, n, -1)
    out = out / den.clamp_min(torch.finfo(stat).tiny).unsqueeze(-1)
    lse = torch.where(den > 0, m.squeeze(-1) + den.log(), NEG)
    return out, lse


def merge_states(out, lse):
    """Merge partial states stacked along dim 0: out (S, ..., D), lse (S, ...) -> (..., D), (...).

    Uses the max lse as reference, so every weight is <= 1 and the denominator >= 1.
    """
    ref = lse.amax(0)
    w = torch.exp(lse - ref)  # 0 for empty states, 1 for the arg-max state
    den = w.sum(0)
    return (w.unsqueeze(-1) * out).sum(0) / den.unsqueeze(-1), ref + den.log()


# ----------------------------------------------------------------------------- the combine

def tree_merge(out, lse, group=None, *, combine="gather"):
    """Exact merge of every rank's partial state (out fp32 (..., D), lse fp32 (...)).

    Returns the merged (out, lse), bitwise identical on every rank (all-reduce returns one
    buffer to all ranks; the gather path merges the same buffer in the same order everywhere).
    """
    assert combine in COMBINES, combine
    p = _world(group)
    if p == 1:
        return out, lse
    if combine == "gather":
        states = all_gather(torch.cat([out, lse.unsqueeze(-1)], -1), group)
        return merge_states(states[..., :-1], states[..., -1])
    ref = lse.clone()
    dist.all_reduce(ref, op=dist.ReduceOp.MAX, group=group)
    w = torch.exp(lse - ref).unsqueeze(-1)
    if combine == "packed":
        buf = torch.cat([w * out, w], -1)
        dist.all_reduce(buf, group=group)
        num, den = buf[..., :-1], buf[..., -1:]
    else:  # the paper's Algorithm 3: numerator and denominator reduced separately
        num, den = w * out, w.clone()
        dist.all_reduce(num, group=group)
        dist.all_reduce(den, group=group)
    return num / den, ref + den.squeeze(-1).log()


def tree_decode(q, k_local, v_local, *, group=None, scale=None, bias_local=None,
                combine="gather", impl="auto", return_lse=False, length=None, gate_local=None):
    """Exact attention of the replicated query q over the union of every rank's (k_local, v_local).

    See the module docstring for shapes, bias_local and the combine options; length and gate_local: attn_partial's
    length (a static step's filled local rows) and gate (FoX's gates of the local keys).
    """
    out, lse = attn_partial(q, k_local, v_local, scale=scale, bias=bias_local, impl=impl, length=length,
                            gate=gate_local)
    out, lse = tree_merge(out, lse, group, combine=combine)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- baselines

def _blocks(q, k, v, bias, group):
    """This rank's block padded to the longest shard, plus every rank's length (one host sync)."""
    lens = all_gather(torch.tensor([k.shape[2]], device=k.device), group).squeeze(-1).tolist()
    pad = max(lens) - k.shape[2]
    block = [F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))] if pad else [k, v]
    if bias is not None:  # the bias of a key travels with the key
        block.append(F.pad(bias.float().expand(q.shape[:3] + (k.shape[2],)), (0, pad)))
    return [x.contiguous() for x in block], lens


def _attend_block(q, block, length, scale, impl):
    k, v = block[0][:, :, :length], block[1][:, :, :length]
    bias = block[2][..., :length] if len(block) > 2 else None
    return attn_partial(q, k, v, scale=scale, bias=bias, impl=impl)


def _finish(q, states, return_lse):
    out, lse = merge_states(torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states]))
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def ring_decode(q, k_local, v_local, *, group=None, scale=None, bias_local=None, impl="auto",
                return_lse=False):
    """Ring-attention decode (the paper's baseline): p - 1 rounds pass the K/V blocks around the
    ring, each overlapped with attention on the block in hand. States are merged in rank order at
    the end, so every rank gets the same bits."""
    p = _world(group)
    if p == 1:
        return tree_decode(q, k_local, v_local, scale=scale, bias_local=bias_local, impl=impl,
                           return_lse=return_lse)
    r = dist.get_rank(group)
    block, lens = _blocks(q, k_local, v_local, bias_local, group)
    # receive buffers, used alternately; the caller's cache (block at step 0) is never written
    recv = [[torch.empty_like(x) for x in block] for _ in range(min(2, p - 1))]
    states = [None] * p
    src = r
    for step in range(p):
        if step < p - 1:  # send what we hold to the next rank, receive the previous rank's
            nxt = recv[step % 2]
            ops = [dist.P2POp(dist.isend, x, _peer(group, (r + 1) % p), group) for x in block]
            ops += [dist.P2POp(dist.irecv, x, _peer(group, (r - 1) % p), group) for x in nxt]
            reqs = dist.batch_isend_irecv(ops)
        states[src] = _attend_block(q, block, lens[src], scale, impl)
        if step < p - 1:
            for req in reqs:
                req.wait()
            block, src = nxt, (src - 1) % p
    return _finish(q, states, return_lse)


def allgather_decode(q, k_local, v_local, *, group=None, scale=None, bias_local=None,
                     impl="auto", return_lse=False):
    """All-gather the whole cache onto every rank, then attend locally (context-parallel style)."""
    p = _world(group)
    if p == 1:
        return tree_decode(q, k_local, v_local, scale=scale, bias_local=bias_local, impl=impl,
                           return_lse=return_lse)
    block, lens = _blocks(q, k_local, v_local, bias_local, group)
    gathered = [all_gather(x, group) for x in block]
    states = [_attend_block(q, [g[i] for g in gathered], lens[i], scale, impl) for i in range(p)]
    return _finish(q, states, return_lse)


# ----------------------------------------------------------------------------- sharded caches

class RoundRobinRows:
    """Which positions of a cache split along the sequence axis over a process group this rank holds:
    global position j lives on rank j % p in its local row j // p. Prefill chunks and decode steps then
    spread evenly over the ranks, and the shards never differ by more than one position (a decode step
    waits for the largest). Without a group (or with one rank) row j is position j.

    A cache subclasses this and keeps `length`, the positions of all ranks (the same on every rank), and
    `position`, set for static steps (to_static)."""

    def __init__(self, group, device):
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.device = device
        self.length = 0
        self.position = None       # static steps (to_static): the device-held position

    def to_static(self, position):
        """Continue with static steps, the ones a CUDA graph replays: the next position is read from
        `position`, a (1,) long device tensor the caller advances (the same on every rank)."""
        self.position = position

    def static_row(self):
        """A static step's local row of its position (a device tensor): where the rank that holds it writes.
        (Unsharded, the position itself: no kernel for the division in every layer's step.)"""
        return self.position if self.world == 1 else self.position // self.world

    def static_filled(self):
        """Local rows a static step attends over (device tensor): positions 0 .. position held here, its own
        included where this rank holds it; 0 on a rank that holds none yet."""
        return self.rows_before(self.position + 1)

    def write_static(self, buf, row, x, dim=2):
        """buf's `row` along dim <- x on the rank that holds the static step's position; the others keep the
        row (a masked copy, as the step may not branch on the device-held position)."""
        x = x.to(buf.dtype)
        if self.world > 1:
            x = torch.where(self.owns(self.position), x, buf.index_select(dim, row))
        buf.index_copy_(dim, row, x)

    def max_rows(self, positions):
        """Local rows the rank holding the most of `positions` positions needs."""
        return -(-positions // self.world)

    def owns(self, pos):
        return pos % self.world == self.rank

    def rows_before(self, pos):
        """How many local rows hold positions < pos (= the local row of the first position >= pos); pos >= 0, an
        int or a device tensor (a static step's; unsharded it comes back as is, no kernel in every layer's step)."""
        return pos if self.world == 1 else (pos - self.rank + self.world - 1) // self.world

    @property
    def n_local(self):
        return self.rows_before(self.length)

    def local_rows(self, start, T):
        """The positions start .. start + T - 1 held here: (strided slice of the chunk, local rows)."""
        return (slice((self.rank - start) % self.world, None, self.world),
                slice(self.rows_before(start), self.rows_before(start + T)))

    def key_positions(self, first_row=0):
        """Global positions of the local rows first_row .. n_local - 1."""
        return self.rank + self.world * torch.arange(first_row, self.n_local, device=self.device)

    def merged_state(self, q, k, v, **partial):
        """The state (out, lse) of the replicated queries' attention over the rows k, v held here merged with
        every other rank's (attn_partial, then tree_merge over the cache's group), in the statistics' dtype; an
        unsharded cache attends to its own rows with no collective, also in a process that belongs to a process
        group (rank 0 sampling alone after multi-GPU training). partial: attn_partial's scale, bias, and length
        and gate (a static step's filled rows here, FoX's gates of the rows)."""
        out, lse = attn_partial(q, k, v, **partial)
        return (out, lse) if self.group is None else tree_merge(out, lse, self.group)

    def merged_attention(self, q, k, v, **partial):
        """merged_state's output in the queries' dtype."""
        return self.merged_state(q, k, v, **partial)[0].to(q.dtype)


# ----------------------------------------------------------------------------- variant logits

def mask_bias(q_pos, k_pos, *, window=None):
    """0 where a query at global position i may see a key at global position j, -inf elsewhere:
    0 <= j <= i (a negative k_pos marks an empty cache slot) and, with a window W, i - j < W.

    q_pos (n,) or (B, n), k_pos (t,) or (B, t), integer -> fp32 (1 or B, 1, n, t).
    """
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    ok = (kp >= 0) & (kp <= qp)
    if window is not None:
        ok &= kp > qp - window
    bias = torch.zeros(ok.shape, device=ok.device).masked_fill(~ok, float("-inf"))
    return bias.unsqueeze(-3) if bias.dim() == 3 else bias[None, None]


def fox_bias(c_local, dtype=torch.float32):
    """FoX logits  s q_i.k_j + c_i - c_j : the per-key part -c_j, (B, H, t) -> (B, H, 1, t) in dtype.

    c_local holds the global cumulative log forget gates of the local keys (any common offset)."""
    return -c_local.to(dtype).unsqueeze(-2)


def sharded_cumsum(x_local, group=None):
    """Inclusive cumsum along the last axis of a sequence split contiguously over ranks 0..p-1
    (rank r holds the slice after rank r-1's): builds FoX's global c for a sharded prompt.
    One all-gather of the shard totals; accumulated in fp64, returned in x's dtype."""
    c = x_local.double().cumsum(-1)
    if _world(group) == 1:
        return c.to(x_local.dtype)
    total = c[..., -1] if c.shape[-1] else c.new_zeros(c.shape[:-1])
    totals = all_gather(total, group)
    offset = totals[: dist.get_rank(group)].sum(0)
    return (c + offset.unsqueeze(-1)).to(x_local.dtype)


# ----------------------------------------------------------------------------- Triton kernel

if triton is not None:
    from kernels.triton_utils import split_keys

    _NEG = tl.constexpr(NEG)  # jit code may only read constexpr globals

    # scale is constexpr: torch.compile (Inductor) would pass a Python float as an fp64 scalar,
    # promoting the logits and the loop-carried softmax state to fp64, which Triton refuses.
    @triton.jit
    def _decode_kernel(Q, K, V, Bias, C, CRef, Out, LSE,
                       sqb, sqh, sqn, skb, skh, skl, svb, svh, svl,
                       sbb, sbh, sbn, sbl, scb, sch, scl, srb, srh, sob, soh, son, sos, slb, slh, sln, sls,
                       Hkv, n, rows_per_kv, L, Len, scale: tl.constexpr,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
                       HAS_LEN: tl.constexpr, PREC: tl.constexpr):
        # one program: one split of the keys x one KV head x a block of its query rows;
        # a row is (query head of the group, query token), so K/V tiles are read once per group.
        # HAS_GATE: FoX's logits -(c_j - c_ref) of the row's head, the difference taken in fp64 and then
        # rounded to fp32, as fox_bias(c - c_ref) is (attn_partial's gate)
        split, bh, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, hk = (bh // Hkv).to(tl.int64), (bh % Hkv).to(tl.int64)  # caches exceed 2**31 elements
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < rows_per_kv
        h = hk * (rows_per_kv // n) + rows // n
        i = rows % n
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqn + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if HAS_GATE:
            c_ref = tl.load(CRef + b * srb + h * srh, mask=row_ok, other=0.0)
        keys = L
        if HAS_LEN:  # a static step's filled rows, read on the device: the splits share them, not the buffer
            keys = tl.minimum(tl.load(Len).to(tl.int32), L)
        split_len = split_keys(keys, tl.num_programs(0), BLOCK_N)
        first = split * split_len
        end = tl.minimum(first + split_len, keys)
        m_i = tl.full([BLOCK_M], _NEG, tl.float32)  # finite start: all-masked tiles give p = 0
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(first, end, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < end
            kv_mask = j_ok[:, None] & d_ok[None, :]
            jl = j.to(tl.int64)[:, None]
            k = tl.load(K + b * skb + hk * skh + jl * skl + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            if HAS_BIAS:
                s += tl.load(Bias + b * sbb + h[:, None] * sbh + i[:, None] * sbn + j[None, :] * sbl,
                             mask=row_ok[:, None] & j_ok[None, :], other=0.0)
            if HAS_GATE:
                c = tl.load(C + b * scb + h[:, None] * sch + j[None, :] * scl, mask=row_ok[:, None] & j_ok[None, :],
                            other=0.0)
                s -= (c - c_ref[:, None]).to(tl.float32)
            s = tl.where(j_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + hk * svh + jl * svl + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), _NEG)
        tl.store(Out + b * sob + h[:, None] * soh + i[:, None] * son + split * sos + d[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + b * slb + h * slh + i * sln + split * sls, lse, mask=row_ok)


@functools.lru_cache
def _num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def attn_partial_triton(q, k, v, scale, bias, length=None, gate=None, **launch):
    """attn_partial's Triton path; `launch`: split_states' knobs (tests and scripts/bench_tree.py --sweep)."""
    o, lse = split_states(q, k, v, scale, bias, length=length, gate=gate, **launch)
    if o.shape[3] == 1:
        return o.squeeze(3), lse.squeeze(3)
    return merge_states(o.movedim(3, 0), lse.movedim(3, 0))


def split_states(q, k, v, scale, bias, num_splits=None, block_n=None, num_warps=4, num_stages=None, length=None,
                 gate=None):
    """The split-KV kernel's partial states before their merge: out (B, Hq, n, S, D), lse (B, Hq, n, S), fp32,
    split s over keys s * m .. (s + 1) * m - 1 of the filled ones (split_keys: m whole tiles' worth); bias, length
    and gate as attn_partial takes them."""
    B, Hq, n, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    rows = Hq // Hkv * n
    BLOCK_M = min(64, max(16, triton.next_power_of_2(rows)))
    BLOCK_D = padded_head_dim(D)
    # the tiles the GPU tests validated (scripts/bench_tree.py --sweep times others)
    BLOCK_N = block_n or (64 if BLOCK_D <= 128 else 32)
    # 16-bit heads of 128 without a bias keep 4 tiles of K and V in flight (128 KiB of shared memory): 16% faster
    # over a 1M-key cache than 3; with FoX's bias 4% slower, so 3 there and elsewhere (docs/results.md)
    num_stages = num_stages or (4 if BLOCK_D == 128 and k.element_size() == 2 and bias is None and gate is None
                                else 3)
    m_blocks = triton.cdiv(rows, BLOCK_M)
    if num_splits is None:  # flash-decoding: enough programs to fill the GPU a few times over
        num_splits = triton.cdiv(4 * _num_sms(q.device), B * Hkv * m_blocks)
    _, num_splits = deal_keys(L, num_splits, BLOCK_N)  # none empty when the cache is full
    o = q.new_empty(B, Hq, n, num_splits, D, dtype=torch.float32)
    lse = q.new_empty(B, Hq, n, num_splits, dtype=torch.float32)
    if bias is not None:
        bias = bias.float().expand(B, Hq, n, L)  # broadcast dims keep stride 0
    bstrides = bias.stride() if bias is not None else (0, 0, 0, 0)
    c, c_ref = gate if gate is not None else (q, q)
    _decode_kernel[(num_splits, B * Hkv, m_blocks)](
        q, k, v, bias if bias is not None else q, c, c_ref, o, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *bstrides, *c.stride()[:3], *c_ref.stride()[:2],
        *o.stride()[:4], *lse.stride(),
        Hkv, n, rows, L, length if length is not None else q, scale,
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BIAS=bias is not None, HAS_GATE=gate is not None,
        HAS_LEN=length is not None, PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=num_stages)
    return o, lse
