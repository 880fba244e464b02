"""CASTLE inference: the UQ-KV cache (CastleCache), prefill and one-position decode steps, and the
decode kernels. CASTLE (arXiv:2509.07301) §2.4 and Appendix 9: eq (13) updates the lookahead keys, eqs
(5)-(8) score the cached positions, Algorithm 4 prefills.

    castle_prefill(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, max_len=None, cache=None)
        -> (out, cache): attention over a prompt and the cache after it; given a cache that holds positions,
        the prompt continues it (a prompt fed in chunks), in blocks scored against the cached rows.
    castle_decode(cache, qc, kc, vc, qu, ku, vu, *, impl="auto") -> (out, cache): one position, in place.

A cache made with a process group holds only this rank's positions (round robin, RoundRobinRows); every
rank runs the same tokens, and a decode step merges the ranks' partial attention exactly by tree attention
(kernels/tree.py). Without a group it holds every position. A step runs in PyTorch ops or as one Triton kernel
over the rows held here (then the merge, sharded). A cache can also take static steps (CastleCache.to_static),
the ones a CUDA graph replays: the position lives on the device and the kernel reads it there (the PyTorch ops
read the whole preallocated buffers with the rows past it masked).

The ablations of arXiv:2509.07301 §5.2 (reference.lookahead_logit) are properties of the cache: one made with
causal_keys=False holds no K^C (a UQ-V cache; prefill and decode then take kc=None), one made with
silu=False scores s^C - s^U.
"""
import torch

from kernels.castle.reference import (blockwise_forward, check_inputs, lookahead_logit, parallel_logits,
                                     to_blocks)
from kernels.castle.triton import default_config, triton_forward
from kernels.sdpa import decode_sdpa
from kernels.tree import NEG, RoundRobinRows, merge_states, tree_merge
from kernels.triton_utils import at_least_fp32, deal_keys, interpreting, padded_head_dim, require_triton, tl, triton

if triton is not None:
    from kernels.triton_utils import LOG2E, split_keys

    _NEG = tl.constexpr(NEG)  # jit code may only read constexpr globals


def _grown(buf, filled, rows):
    """A fresh (..., rows, D) buffer holding the first `filled` rows of buf; the rest is uninitialised."""
    new = buf.new_empty(*buf.shape[:-2], rows, buf.shape[-1])
    new[..., :filled, :] = buf[..., :filled, :]
    return new


def _doubled(rows):
    return max(2 * rows, 16)


class CastleCache(RoundRobinRows):
    """UQ-KV cache of one CASTLE layer (§2.4): lookahead keys U, lookahead queries Q^U, causal keys and
    values K^C, V^C of the positions this rank holds: every position without a process group (row j is
    position j), position j on rank j % p at local row j // p with a group of p ranks.

    The tensors live in preallocated (B, H, rows, D) buffers, max_len positions' worth to begin with: a
    decode step writes the new position in place and doubles a buffer only when it is full (amortised O(1)
    copies per step). Read the filled part through the views u, qu, kc, vc; a view taken before a step
    that grows a buffer goes stale.

    u_buf:  lookahead keys U, fp32 (fp64 for fp64 inputs); the newest position's row is zero (eq (13)).
    kc_buf, vc_buf: causal keys and values, input dtype (kc_buf None without causal keys).
    qu_buf: lookahead queries Q^U, input dtype, holding only the rows read again, i.e. the owners the next
            token reaches (eq (13): every earlier position for CASTLE, the last W for SWL; of these, the
            ones held here), at rows [qu_end - n, qu_end). When full, it moves the rows still needed to
            the front if they fill at most half of it, else it doubles: SWL's stays under max(4W, 16)
            rows, CASTLE's grows like the others.
    length: positions of all ranks; window, scale: CASTLE-SWL's W (None: CASTLE) and the logit scale;
    causal_keys, silu: False for the ablations (module docstring).

    Static steps (`position` set: to_static) keep every buffer and all Python state: the new position is the
    device tensor `position`, U, K^C, V^C row j holds position j, Q^U is a ring (position j at row j % its
    rows) and a step reads every row, masking those past the position; `length`, qu_end and the views keep
    describing the cache as to_static found it. Sharded, each rank keeps its rows in that form: local row r of
    U, K^C, V^C is its r-th position held here (the ring holds local row r at row r % its rows), the rank that
    holds the new position writes its rows (RoundRobinRows.write_static), and the rows past static_filled are
    masked.
    """

    def __init__(self, batch, heads, head_dim, *, max_len, dtype, device, window=None, scale=None, group=None,
                 causal_keys=True, silu=True):
        super().__init__(group, device)
        rows = self.max_rows(max_len)
        self.u_buf = torch.empty(batch, heads, rows, head_dim, dtype=at_least_fp32(dtype), device=device)
        self.kc_buf, self.vc_buf = (torch.empty(batch, heads, rows, head_dim, dtype=dtype, device=device)
                                    if keep else None for keep in (causal_keys, True))
        self.silu = silu
        qu_rows = rows if window is None else min(rows, 2 * window)
        self.qu_buf = torch.empty(batch, heads, qu_rows, head_dim, dtype=dtype, device=device)
        self.qu_end = 0
        self.window = window
        self.scale = head_dim ** -0.5 if scale is None else float(scale)

    @property
    def capacity(self):
        """Local rows the U, K^C, V^C buffers hold before they grow."""
        return self.vc_buf.shape[-2]

    @property
    def causal_keys(self):
        return self.kc_buf is not None

    def owners(self, t):
        """How many positions before position t have a lookahead key that token t adds to (eq 13)."""
        return t if self.window is None else min(t, self.window)

    def _owner_rows(self, t):
        """How many of the owners of token t are held here (the last rows before position t)."""
        return self.rows_before(t) - self.rows_before(t - self.owners(t))

    @property
    def rows(self):
        """Local rows a step reads: the filled ones, or in a static step every row."""
        return self.n_local if self.position is None else self.capacity

    @property
    def u(self):
        return self.u_buf[..., : self.rows, :]

    @property
    def kc(self):
        return self.kc_buf[..., : self.rows, :] if self.causal_keys else None

    @property
    def vc(self):
        return self.vc_buf[..., : self.rows, :]

    @property
    def qu(self):
        """Q^U of the owners the next token reaches that are held here."""
        return self.qu_buf[..., self.qu_end - self._owner_rows(self.length): self.qu_end, :]

    def reserve(self, rows):
        """Room for `rows` local rows in the U, K^C, V^C buffers: a full buffer doubles (or grows to rows)."""
        if rows > self.capacity:
            n, new_rows = self.n_local, max(rows, _doubled(self.capacity))
            self.u_buf, self.kc_buf, self.vc_buf = (b if b is None else _grown(b, n, new_rows)
                                                    for b in (self.u_buf, self.kc_buf, self.vc_buf))

    def _qu_keep(self):
        """How many older Q^U rows held here are still read after position `length` is added; -1 when not
        even the new one is (SWL with W = 0 keeps no Q^U at all)."""
        t = self.length
        return self.rows_before(t) - self.rows_before(t + 1 - self.owners(t + 1))

    def qu_slot(self):
        """The Q^U row that position `length` goes to if it fits without moving rows, else None (also when
        no Q^U row is kept)."""
        if self._qu_keep() < 0 or self.qu_end == self.qu_buf.shape[-2]:
            return None
        return self.qu_end

    def push_qu(self, qu, written):
        """Record position `length`'s q^U (B, H, 1, D) on the rank that holds the position; `written`:
        already stored at qu_slot() (by the decode kernel). A full buffer first moves the rows still needed
        to the front if they fill at most half of it, else it doubles."""
        keep = self._qu_keep()
        if keep < 0:
            return
        end = self.qu_end
        if not written:
            if end == self.qu_buf.shape[-2]:
                if 0 < end and 2 * keep <= end:                # slide: the kept rows fit in the first half
                    self.qu_buf[..., :keep, :] = self.qu_buf[..., end - keep: end, :]
                    self.qu_end = end = keep
                else:
                    self.qu_buf = _grown(self.qu_buf, end, _doubled(end))
            self.qu_buf[..., end: end + 1, :] = qu
        self.qu_end = end + 1

    def to_static(self, position):
        """Continue with static steps (class docstring) from the device-held position, a (1,) long tensor
        that the caller advances after each step and keeps below the capacity. Q^U moves into its ring and
        the unwritten rows are zeroed: a masked row must hold finite values, for the step reads it (its
        zero softmax weight times a NaN value would still be NaN)."""
        super().to_static(position)
        t = self.n_local                                               # local rows filled
        held = self.qu                                                 # local rows t - len(held) .. t - 1
        R = self.capacity if self.window is None else min(self.window, self.capacity)   # owners a token reaches
        ring = self.qu_buf.new_zeros(*self.qu_buf.shape[:2], R, self.qu_buf.shape[-1])
        if R:
            ring.index_copy_(2, torch.arange(t - held.shape[-2], t, device=self.device) % R, held)
        self.qu_buf = ring
        for buf in (self.u_buf, self.kc_buf, self.vc_buf):
            if buf is not None:
                buf[..., t:, :].zero_()

    def _lookahead_weights(self, qu, ku):
        """sigmoid(s q^U_j . k^U_t) of eq (13) for the owners' q^U (B, H, n, D): (B, H, n, 1) in U's dtype."""
        return torch.sigmoid(self.scale * (qu @ ku.mT).to(self.u_buf.dtype))

    def add_lookahead(self, ku, vu):
        """Eq (13): the new token (k^U, v^U of position `length`, or `position` in a static step, (B, H, 1, D))
        joins the lookahead key of every owner it reaches that is held here: u_j += sigmoid(s q^U_j . k^U_t)
        v^U_t. In place."""
        if self.position is not None:
            return self._add_lookahead_static(ku, vu)
        owners = self.qu
        n = owners.shape[-2]
        if n:
            end = self.n_local
            self.u_buf[..., end - n: end, :].addcmul_(self._lookahead_weights(owners, ku), vu.to(self.u_buf.dtype))

    def _add_lookahead_static(self, ku, vu):
        """add_lookahead at the device-held position t, over the whole Q^U ring of R rows: ring row i holds the
        newest local row r_i < n (n: the rows held here of positions before t) with r_i = i mod R, so the last R
        rows held here are there, and with them every owner of t (CASTLE: R = capacity, r_i = i; SWL: R = W, and
        a rank holds at most W of the W positions before t). Rows with r_i < 0 hold none: their terms go to U
        rows at or past n (r_i mod capacity, distinct rows), which no step reads unmasked before append zeroes
        them (u_t = 0), so they need no mask. Sharded SWL: the ring's rows span R * world positions, so those
        before t - W, which the token no longer reaches, are masked."""
        R = self.qu_buf.shape[-2]
        if not R:                                                      # SWL with W = 0: no owners
            return
        w, vu = self._lookahead_weights(self.qu_buf, ku), vu.to(self.u_buf.dtype)      # (B, H, R, 1)
        rows = torch.arange(R, device=self.device)
        if R < self.capacity:
            last = self.rows_before(self.position) - 1
            rows = last - (last - rows) % R
        if self.world > 1 and self.window is not None:
            reached = self.rank + self.world * rows >= self.position - self.window
            w = w * reached.to(w.dtype)[:, None]
        if R == self.capacity:                                         # ring row i is U row i
            self.u_buf.addcmul_(w, vu)
        else:
            self.u_buf.index_add_(2, rows % self.capacity, w * vu)

    def append(self, qu, kc, vc):
        """Store position `length` on the rank that holds it: u = 0 (eq (13)), and q^U, k^C, v^C given as
        (B, H, 1, D) (kc None without causal keys); every rank counts it. Call after add_lookahead (which
        reads the owners' Q^U). A static step stores the position `position` (and counts nothing)."""
        if self.position is not None:
            return self._append_static(qu, kc, vc)
        t = self.length
        if self.owns(t):
            row = self.n_local
            self.reserve(row + 1)
            self.u_buf[..., row, :] = 0
            if self.causal_keys:
                self.kc_buf[..., row: row + 1, :] = kc
            self.vc_buf[..., row: row + 1, :] = vc
            self.push_qu(qu, written=False)
        self.length = t + 1

    def _append_static(self, qu, kc, vc):
        """append at the device-held position, on the rank that holds it: its U row zeroed, K^C, V^C at its
        row, q^U at its ring row (over the position t - R whose lookahead key t was the last token to reach)."""
        row = self.static_row()
        self.write_static(self.u_buf, row, torch.zeros_like(vc, dtype=self.u_buf.dtype))
        for buf, x in ((self.kc_buf, kc), (self.vc_buf, vc)):
            if buf is not None:
                self.write_static(buf, row, x)
        self.store_qu_static(qu)

    def store_qu_static(self, qu):
        """q^U (B, H, 1, D) of the device-held position t into its Q^U ring row, its local row mod the ring's
        rows (t mod R unsharded): after the step has read the owners, for the row held owner t - R (SWL: R = W)."""
        R = self.qu_buf.shape[-2]
        if R:
            self.write_static(self.qu_buf, self.static_row() % R, qu)

    def lookahead_bias(self, qc):
        """The lookahead part of the logits of query q^C (B, H, 1, D) for every row a step reads (`rows`),
        -SiLU(s q^C . u_j) (eqs (6), (7); -s q^C . u_j without the gate): (B, H, 1, rows) in U's dtype. In a
        static step the rows past the position are masked (-inf)."""
        bias = lookahead_logit(self.scale * (qc.to(self.u_buf.dtype) @ self.u.mT), self.silu)
        if self.position is not None:
            past = torch.arange(self.capacity, device=self.device) >= self.static_filled()
            bias = bias.masked_fill(past, float("-inf"))
        return bias

    def causal_operands(self, qc):
        """(query, keys) of the causal logits s q^C.k^C_j over the rows a step reads; without causal keys the
        logits are the lookahead bias alone, which a zero query against any keys (V^C's) leaves them."""
        return (qc, self.kc) if self.causal_keys else (torch.zeros_like(qc), self.vc)

    def extend(self, u, qu, kc, vc):
        """Append positions length .. length + T - 1 given as whole (B, H, T, D) tensors; the rank keeps
        its rows. u holds their lookahead keys as they stand after the last of them: extend fills a cache
        (castle_prefill, a benchmark's synthetic one), it does not add these positions to the keys of
        earlier ones."""
        T = vc.shape[-2]
        start, end = self.length, self.length + T
        chunk, rows = self.local_rows(start, T)
        self.reserve(rows.stop)
        for buf, x in ((self.u_buf, u), (self.kc_buf, kc), (self.vc_buf, vc)):
            if buf is not None:
                buf[..., rows, :] = x[..., chunk, :]
        # Q^U rows the next token reaches: the newest of those cached before and of this chunk's
        n, new = self._owner_rows(end), qu[..., chunk, :]
        older = n - new.shape[-2]
        if older <= 0:
            kept = new[..., new.shape[-2] - n:, :]
        else:
            kept = torch.cat([self.qu[..., self.qu.shape[-2] - older:, :], new], dim=-2)
        if n > self.qu_buf.shape[-2]:
            self.qu_buf = _grown(self.qu_buf, 0, n)
        self.qu_buf[..., :n, :] = kept
        self.qu_end, self.length = n, end


def castle_prefill(qc, kc, vc, qu, ku, vu, *, window=None, scale=None, silu=None, max_len=None, cache=None):
    """Attention over a prompt of L positions (B, H, L, D) and the UQ-KV cache after it (Algorithm 4).
    max_len: positions (prompt included) to preallocate the cache for; decoding past it still works (the
    buffers double). cache: a CastleCache to continue instead of a new one (its window, scale, silu and
    capacity apply); with a process group every rank computes the whole prompt and keeps its rows. kc None:
    no causal keys; silu: the gate (default on); both as in castle_attn.

    Into an empty cache the block forward (Triton on CUDA, blockwise PyTorch otherwise) runs once and also folds
    the last block into its U state, which then is U^L: Algorithm 4's U for free. A cache that holds positions
    (a prompt fed in chunks, sharded or not) takes the prompt in blocks of positions (_extend)."""
    if cache is not None and (window, scale, silu, max_len) != (None, None, None, None):
        raise ValueError("castle_prefill(cache=...) continues the cache with the window, scale, silu and capacity "
                         "it was made with; pass no window, scale, silu or max_len with it")
    if cache is not None and cache.position is not None:
        raise ValueError("this CASTLE cache takes static steps (to_static): feed it one position at a time "
                         "with castle_decode, not a prompt")
    check_inputs(qc, kc, vc, qu, ku, vu, window if cache is None else cache.window)
    B, H, L, D = qc.shape
    if cache is None:
        cache = CastleCache(B, H, D, max_len=max(L, max_len or 0), dtype=qc.dtype, device=qc.device,
                            window=window, scale=scale, causal_keys=kc is not None, silu=silu is not False)
    _check_variant(cache, kc)
    if cache.length:
        return _extend(cache, qc, kc, vc, qu, ku, vu), cache
    window, scale, silu = cache.window, cache.scale, cache.silu
    cdt = at_least_fp32(qc.dtype)
    if L == 0:
        out, u = torch.empty_like(qc), qc.new_zeros(B, H, 0, D, dtype=cdt)
    elif qc.is_cuda and triton is not None and qc.dtype != torch.float64:
        cfg = default_config(padded_head_dim(D), qc.dtype)
        out, _, u = triton_forward(qc, kc, vc, qu, ku, vu, window, scale, cfg, save_t=L, silu=silu)
        u = u.view(B, H, -1, u.shape[-1])[:, :, :L, :D]
    else:
        bs = 64
        blocks = [t if t is None else to_blocks(t.to(cdt), bs) for t in (qc, kc, vc, qu, ku, vu)]
        out, _, u = blockwise_forward(*blocks, window, scale, bs, keep_last=True, silu=silu)
        out, u = out.flatten(2, 3)[:, :, :L].to(qc.dtype), u.flatten(2, 3)[:, :, :L]
    cache.extend(u, qu, kc, vc)
    return out, cache


# The logits a block of new positions holds against the cached rows, (B x H x positions x local rows), in the
# lookahead keys' dtype: each of the block's few (B, H, positions, rows) temporaries stays under 256 MiB in fp32.
_EXTEND_LOGITS = 2 ** 26
_EXTEND_BLOCK = (16, 256)        # the fewest and most positions a block takes


def _extend(cache, qc, kc, vc, qu, ku, vu):
    """castle_prefill onto a cache that holds positions: the prompt in blocks (_extend_block), sized on the rows
    the largest shard will hold so that every rank of a group takes the same blocks (each makes one merge)."""
    B, H, L, _ = qc.shape
    low, high = _EXTEND_BLOCK
    block = max(low, min(high, _EXTEND_LOGITS // (B * H * cache.max_rows(cache.length + L))))
    xs = (qc, kc, vc, qu, ku, vu)
    return torch.cat([_extend_block(cache, *(x if x is None else x[..., i: i + block, :] for x in xs))
                      for i in range(0, L, block)], dim=-2)


def _extend_block(cache, qc, kc, vc, qu, ku, vu):
    """Positions p .. p + n - 1 (B, H, n, D) after the p the cache holds: their attention, then the cache extended.

    A new query i scores cached row j with the lookahead key j has at i, u_j (as cached, after p - 1) plus the
    terms of the block's contributors m <= i that reach j (eq (3); SWL: m <= j + W), so
        s^U[i, j] = s q^C_i.u_j + sum_m [m <= i] (s q^C_i.v^U_m) sigmoid(s q^U_j.k^U_m)
    (the owners j are the rows whose Q^U the cache keeps: cache.qu, the last rows held here), and the block's own
    positions as CASTLE over the block alone (their lookahead keys start at zero). The two parts are partial
    softmax states merged exactly (kernels/tree.py; sharded, the cached part over every rank's rows first). Then
    the block's contributors join the owners' keys and the block's rows are stored (extend)."""
    dt, s, n = cache.u_buf.dtype, cache.scale, qc.shape[-2]
    own_logits, a_u = parallel_logits(qc, kc, qu, ku, vu, cache.window, s, cache.silu)
    own_lse = torch.logsumexp(own_logits, dim=-1)
    own_out = torch.softmax(own_logits, dim=-1) @ vc.to(dt)
    q, owners, rows = qc.to(dt), cache.qu, cache.n_local
    s_u = s * q @ cache.u.mT
    if owners.shape[-2]:
        first = rows - owners.shape[-2]
        reach = torch.sigmoid(s * owners.to(dt) @ ku.to(dt).mT)               # (B, H, owner j, contributor m)
        if cache.window is not None:
            m = cache.length + torch.arange(n, device=qc.device)
            reach = reach * (m <= cache.key_positions(first)[:, None] + cache.window).to(dt)
        s_u[..., first:] += (s * q @ vu.to(dt).mT).tril() @ reach.mT
    bias = lookahead_logit(s_u, cache.silu)                                    # eqs (6), (7)
    out, lse = cache.merged_state(*cache.causal_operands(qc), cache.vc, scale=s, bias=bias)
    out, _ = merge_states(torch.stack([out, own_out]), torch.stack([lse, own_lse]))
    if owners.shape[-2]:
        cache.u_buf[..., first: rows, :] += reach @ vu.to(dt)                # eq (3)
    cache.extend(a_u @ vu.to(dt), qu, kc, vc)
    return out.to(qc.dtype)


def _check_variant(cache, kc):
    """kc must be None exactly when the cache has no causal keys."""
    if (kc is None) == cache.causal_keys:
        raise ValueError(f"kc is {'None' if kc is None else 'a tensor'}, but this CASTLE cache was made with "
                         f"causal_keys={cache.causal_keys}; pass kc=None exactly when the cache has no causal keys")


def castle_decode(cache, qc, kc, vc, qu, ku, vu, *, impl="auto"):
    """One new position (B, H, 1, D) -> (out, cache), eqs (5)-(8) and (13), O(T d) for T cached positions.

    The cache is updated in place (and returned): eq (13) adds the token to the lookahead keys of the
    owners it reaches (every cached row for CASTLE, the last W for SWL; older rows are not touched),
    then the position's own rows are written, then every cached position is scored.

    impl: "triton" does the whole step in two launches (_decode_triton), fp32 math on the cached
    operands; "torch" in PyTorch ops, the causal part through SDPA with the per-key bias -SiLU(s q^C u_j^T)
    (for 16-bit inputs the bias is rounded to the input dtype and q^U k^U is a 16-bit matmul), with a
    process group tree attention over the ranks' rows with that bias in fp32 (the kernel, sharded, merges its
    partial state the same way); "auto" takes "triton" on CUDA unless autograd would need the graph (the kernels
    keep none).
    A static cache (CastleCache.to_static) is decoded at its device-held position: the kernel reads it there
    and skips the rows past it; the torch step reads the whole buffers with those rows masked."""
    check_inputs(qc, kc, vc, qu, ku, vu, cache.window)
    _check_variant(cache, kc)
    if qc.shape[-2] != 1:
        raise ValueError(f"castle_decode takes one position at a time, got {qc.shape[-2]}; "
                         "feed a longer prompt to castle_prefill")
    held = cache.vc_buf
    if (qc.shape[:2], qc.shape[-1], qc.device) != (held.shape[:2], held.shape[-1], held.device):
        raise ValueError(f"the new position is (B, H, 1, D) = {tuple(qc.shape)} on {qc.device}, but the cache "
                         f"holds (B, H, D) = {(*held.shape[:2], held.shape[-1])} on {held.device}; decode with "
                         "the cache castle_prefill made for this layer and batch")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl={impl!r} is unknown; choose auto, torch or triton")
    if impl == "auto":
        tracked = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (qc, kc, vc, qu, ku, vu))
        fused = qc.is_cuda and triton is not None and qc.dtype != torch.float64 and not tracked
        impl = "triton" if fused else "torch"
    if impl == "triton":
        return _decode_triton(cache, qc, kc, vc, qu, ku, vu), cache
    cache.add_lookahead(ku, vu)                                              # eq (13)
    cache.append(qu, kc, vc)
    bias = cache.lookahead_bias(qc)                                          # eqs (6), (7)
    q, k = cache.causal_operands(qc)
    if cache.world == 1:
        out = decode_sdpa(q, k, cache.vc, attn_mask=_sdpa_mask(bias, qc.dtype), scale=cache.scale)
    else:
        out = cache.merged_attention(q, k, cache.vc, scale=cache.scale, bias=bias)
    return out, cache                                                        # eqs (5), (7), (8)


def _sdpa_mask(bias, dtype):
    """bias as an SDPA attn_mask in the query's dtype whose rows start 16-element aligned, as the
    memory-efficient CUDA kernel wants them (else SDPA copies the mask into a padded buffer itself, with a
    warning)."""
    n = bias.shape[-1]
    return bias.new_empty(*bias.shape[:-1], -(-n // 16) * 16, dtype=dtype)[..., :n].copy_(bias)


# ----------------------------------------------------------------------------------------------------
# The fused decode step (one rank's whole cache)

if triton is not None:
    @triton.jit(do_not_specialize=["t", "n_owners", "qu_shift", "qu_row", "per_split", "rank"])
    def _castle_decode_kernel(
        U, QUB, KCB, VCB, PART, QC, sqc_b, sqc_h, KC, skc_b, skc_h, VC, svc_b, svc_h, QU, squ_b, squ_h,
        KU, sku_b, sku_h, VU, svu_b, svu_h, H, cap, qu_rows, t, n_owners, qu_shift, qu_row, per_split, POS,
        world, rank, scale: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr,
        CAUSAL_KEYS: tl.constexpr, SILU: tl.constexpr, STATIC: tl.constexpr,
    ):
        """Program (head bh, split): the rows [split * per_split, ...) this rank holds of positions 0..t (t the
        new position), BT at a time; row j holds position rank + world * j (RoundRobinRows; row j is position
        j unsharded). Rows of the owners, the n_owners positions before t, take the token into their lookahead
        key, u_j += sigma(s q^U_j . k^U_t) v^U_t (eq 13, written back in place); then every row's score
        s q^C_t . k^C_j - SiLU(s q^C_t . u_j) (eqs 5-7) enters an online softmax whose state (m, l, acc), in
        log2 units, goes to PART for _castle_decode_combine_kernel (split-K over rows, as flash-decoding
        does). On the rank that holds t, the split holding its row writes the position's rows: u_t = 0, k^C_t,
        v^C_t, and q^U_t at qu_row (if >= 0). U, K^C, V^C buffers: contiguous (BH, cap, D); Q^U buffer (BH,
        qu_rows, D), row j at row j - qu_shift; the new position's six vectors come with their own (batch,
        head) strides (views of the model's projections, some rotated, need no copy). CAUSAL_KEYS, SILU: off
        for the ablations (module docstring); without causal keys KCB and KC are never read. STATIC (a static
        cache, CastleCache.to_static): t is read from POS on the device, n_owners = min(t, n_owners) and Q^U
        is a ring (row j at ring row j mod qu_rows) that the host writes q^U_t into after this kernel
        (qu_row = -1): that ring row's owner may still be read by another program. Its splits share the rows
        of positions 0..t (split_keys; per_split is ignored), so a cache far from full keeps every split at
        work. A split past the last row (a step early in the cache, or a rank that holds no row yet) writes
        an empty state (m = -inf, l = 0)."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        qc = _head_vector(QC, sqc_b, sqc_h, bh, H, offs_d, dmask).to(tl.float32) * scale
        if CAUSAL_KEYS:
            kc_t = _head_vector(KC, skc_b, skc_h, bh, H, offs_d, dmask).to(tl.float32)
        vc_t = _head_vector(VC, svc_b, svc_h, bh, H, offs_d, dmask).to(tl.float32)
        ku_t = _head_vector(KU, sku_b, sku_h, bh, H, offs_d, dmask).to(tl.float32) * scale
        vu_t = _head_vector(VU, svu_b, svu_h, bh, H, offs_d, dmask).to(tl.float32)
        c_base = bh.to(tl.int64) * cap * HEAD_DIM
        q_base = bh.to(tl.int64) * qu_rows * HEAD_DIM
        if STATIC:
            t = tl.load(POS).to(tl.int32)
            n_owners = tl.minimum(t, n_owners)
        # rows held here of positions before t, and of the owners; the row of t if held here, else -1
        before = (t - rank + world - 1) // world
        first_owner = (t - n_owners - rank + world - 1) // world
        new_row = tl.where(t % world == rank, before, -1)
        rows = tl.maximum(before, new_row + 1)
        if STATIC:
            per_split = split_keys(rows, tl.num_programs(1), BT)

        start = split * per_split
        end = tl.minimum(start + per_split, rows)
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        l = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        j0 = start
        while j0 < end:
            j = j0 + tl.arange(0, BT)
            cached = (j < before)[:, None] & dmask[None, :]
            ptr = c_base + j[:, None] * HEAD_DIM + offs_d[None, :]
            u = tl.load(U + ptr, mask=cached, other=0.0)
            if (j0 + BT > first_owner) & (j0 < before):
                owner = ((j >= first_owner) & (j < before))[:, None] & dmask[None, :]
                if STATIC:
                    qu_at = j % tl.maximum(qu_rows, 1)
                else:
                    qu_at = j - qu_shift
                qu = tl.load(QUB + q_base + qu_at[:, None] * HEAD_DIM + offs_d[None, :], mask=owner,
                             other=0.0).to(tl.float32)
                w = tl.sigmoid(tl.sum(qu * ku_t[None, :], 1))                             # eq (13)
                u = tl.where(owner, u + w[:, None] * vu_t[None, :], u)
                tl.store(U + ptr, u, mask=owner)
            new = (j == new_row)[:, None]
            if CAUSAL_KEYS:
                kc = tl.where(new, kc_t[None, :], tl.load(KCB + ptr, mask=cached, other=0.0).to(tl.float32))
            vc = tl.where(new, vc_t[None, :], tl.load(VCB + ptr, mask=cached, other=0.0).to(tl.float32))
            s_u = tl.sum(qc[None, :] * u, 1)                                                # eq (6)
            if CAUSAL_KEYS:
                sc = tl.sum(qc[None, :] * kc, 1)                                            # eq (5)
            else:
                sc = tl.zeros([BT], dtype=tl.float32)
            if SILU:
                sc = (sc - s_u * tl.sigmoid(s_u)) * LOG2E                                   # eq (7)
            else:
                sc = (sc - s_u) * LOG2E
            sc = tl.where(j < end, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 0))
            p = tl.exp2(sc - m_new)
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * vc, 0)
            m = m_new
            j0 += BT
        if (start <= new_row) & (new_row < end):         # the new position's own rows (eq (13))
            row = c_base + new_row * HEAD_DIM + offs_d
            tl.store(U + row, tl.zeros([BLOCK_D], dtype=tl.float32), mask=dmask)
            if CAUSAL_KEYS:
                tl.store(KCB + row, kc_t.to(KCB.dtype.element_ty), mask=dmask)
            tl.store(VCB + row, vc_t.to(VCB.dtype.element_ty), mask=dmask)
            if qu_row >= 0:
                qu_t = _head_vector(QU, squ_b, squ_h, bh, H, offs_d, dmask)
                tl.store(QUB + q_base + qu_row * HEAD_DIM + offs_d, qu_t, mask=dmask)
        part = PART + (bh * tl.num_programs(1) + split).to(tl.int64) * (BLOCK_D + 2)
        tl.store(part + offs_d, acc)
        tl.store(part + BLOCK_D + tl.arange(0, 1), m)
        tl.store(part + BLOCK_D + 1 + tl.arange(0, 1), l)

    @triton.jit
    def _head_vector(X, stride_b, stride_h, bh, H, offs_d, dmask):
        """The (D,) vector of head bh of a (B, H, 1, D) tensor with unit stride in D."""
        return tl.load(X + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h + offs_d,
                       mask=dmask, other=0.0)

    @triton.jit
    def _castle_decode_combine_kernel(PART, OUT, LSE, splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                      BLOCK_S: tl.constexpr, WITH_LSE: tl.constexpr):
        """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of head program_id(0); WITH_LSE
        (a rank's partial state for tree attention's merge) also its natural-log log-sum-exp, NEG (and out 0)
        where every split is empty."""
        bh = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        part = PART + (bh * splits + offs_s).to(tl.int64) * (BLOCK_D + 2)
        smask = offs_s < splits
        m = tl.load(part + BLOCK_D, mask=smask, other=float("-inf"))
        l = tl.load(part + BLOCK_D + 1, mask=smask, other=0.0)
        acc = tl.load(part[:, None] + offs_d[None, :], mask=smask[:, None], other=0.0)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)     # no row at all: every weight 0, not NaN
        w = tl.exp2(m - m_max)
        den = tl.sum(w * l, 0)
        out = tl.sum(w[:, None] * acc, 0) / tl.where(den > 0, den, 1.0)
        tl.store(OUT + bh.to(tl.int64) * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
        if WITH_LSE:
            lse = tl.where(den > 0, (m_max + tl.log2(tl.where(den > 0, den, 1.0))) / LOG2E, _NEG)
            tl.store(LSE + bh, lse)


_DECODE_PROGRAMS_PER_SM = 4


def _decode_tiles(rows, heads, block_d, device):
    """(rows per tile, rows per split, splits) of a decode step over `rows` cached rows (at least one split of
    one tile, also for a rank that holds none yet): enough programs to fill the GPU,
    each a whole number of row tiles of 4096 elements, 2 warps each: of the tiles a sweep over 16-128 rows
    and 2-8 warps timed (CASTLE and SWL, D = 64 and 128, long contexts), the one never far from the fastest,
    where others took up to twice as long at some shapes. Under the interpreter 16-row tiles and 4 "SMs", so
    that tiny tests cross tiles and splits."""
    if interpreting():
        tile, sms = 16, 4
    else:
        tile, sms = 4096 // block_d, torch.cuda.get_device_properties(device).multi_processor_count
    rows = max(rows, 1)
    splits = max(1, min(triton.cdiv(rows, tile), triton.cdiv(_DECODE_PROGRAMS_PER_SM * sms, heads)))
    return (tile, *deal_keys(rows, splits, tile))


def _decode_triton(cache, qc, kc, vc, qu, ku, vu):
    """castle_decode in two launches: the step kernel (U update, the position's rows, split softmax over the
    rows held here) and the combine; a sharded cache then merges the ranks' partial states (tree_merge). A
    dynamic cache's bookkeeping stays on the host; a static cache's position is read on the device, and the
    launch (its splits sized for the capacity, sharing the rows so far) is the same at every position."""
    require_triton("castle_decode(impl='triton')", "use impl='torch'")
    if qc.dtype == torch.float64:
        raise ValueError("castle_decode(impl='triton') computes in fp32; for fp64 inputs use impl='torch'")
    static = cache.position is not None
    if not static:
        cache.reserve(cache.rows_before(cache.length + 1))
    if not all(b is None or b.is_contiguous() for b in (cache.u_buf, cache.qu_buf, cache.kc_buf, cache.vc_buf)):
        raise ValueError("castle_decode(impl='triton') needs contiguous cache buffers (castle_prefill and "
                         "CastleCache make them); use impl='torch' for others")
    # without causal keys the kernel reads no K^C: any pointer stands in for kc and its buffer
    kc, kc_buf = (qc, cache.vc_buf) if kc is None else (kc, cache.kc_buf)
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in (qc, kc, vc, qu, ku, vu)]
    B, H, _, D = qc.shape
    block_d = padded_head_dim(D)
    if static:   # the kernel reads t and takes min(t, n) owners (n: every position a cache holds, or W), at Q^U ring
        t, n, shift, slot = 0, cache.owners(cache.capacity * cache.world), 0, None    # rows j mod its rows
        rows = cache.capacity
    else:
        t, n, shift = cache.length, cache.owners(cache.length), cache.n_local - cache.qu_end
        slot = cache.qu_slot() if cache.owns(t) else None
        rows = cache.rows_before(t + 1)
    tile, per_split, splits = _decode_tiles(rows, B * H, block_d, qc.device)
    part = torch.empty(B * H, splits, block_d + 2, dtype=torch.float32, device=qc.device)
    _castle_decode_kernel[(B * H, splits)](
        cache.u_buf, cache.qu_buf, kc_buf, cache.vc_buf, part, *[a for x in xs for a in (x, *x.stride()[:2])],
        H, cache.capacity, cache.qu_buf.shape[-2], t, n, shift, -1 if slot is None else slot, per_split,
        cache.position if static else part, cache.world, cache.rank, cache.scale, HEAD_DIM=D, BLOCK_D=block_d,
        BT=tile, CAUSAL_KEYS=cache.causal_keys, SILU=cache.silu, STATIC=static, num_warps=2,
    )
    if static:
        cache.store_qu_static(qu)
    else:
        if cache.owns(t):
            cache.push_qu(qu, written=slot is not None)
        cache.length = t + 1
    sharded = cache.world > 1
    out = torch.empty(B, H, 1, D, dtype=torch.float32 if sharded else qc.dtype, device=qc.device)
    lse = torch.empty(B, H, 1, dtype=torch.float32, device=qc.device) if sharded else out
    _castle_decode_combine_kernel[(B * H,)](part, out, lse, splits, HEAD_DIM=D, BLOCK_D=block_d,
                                            BLOCK_S=triton.next_power_of_2(splits), WITH_LSE=sharded)
    if sharded:
        out = tree_merge(out, lse, cache.group)[0].to(qc.dtype)
    return out
