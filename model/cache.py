"""The inference caches of softmax and forgetting attention (model/gpt.py's SoftmaxAttention) and the cache of a
whole model: KVCache (keys and values), SoftmaxCache (plus FoX's gates and the Pro block's KV-shift state),
WindowCache (a ring of the last W positions), InferenceCache (every layer's cache and the position), and
attend_rows, the decode attention over a cache's rows.

A cache made with a process group holds only this rank's positions (round robin, kernels/tree.py's
RoundRobinRows) and merges its partial attention with the other ranks' by tree attention. A static step
(InferenceCache.to_static) keeps the position on the device, so a CUDA graph can replay it at every position;
CASTLE's layers (kernels.castle.CastleCache) and the recurrent ones (model.recurrent.RecurrentCache) take it too.
"""
import torch

from kernels.forgetting import fgate_cumsum
from kernels.tree import RoundRobinRows, mask_bias


class KVCache(RoundRobinRows):
    """Preallocated keys/values (B, H, rows, D) plus how many positions are filled.

    With a process `group` of p > 1 ranks this is one rank's share of a cache split along the
    sequence axis, round robin (kernels/tree.py's RoundRobinRows: global position j is stored by
    rank j % p in its local row j // p); every rank allocates ceil(max_len / p) rows. `length`
    counts the positions of all ranks (the same on every rank). Without a group row j is position j.

    A static step (`position` set: InferenceCache.to_static) writes its one position at its local row
    on the rank that holds it (write_static) and reads every row; its attention skips or masks the rows
    past the position.
    """

    def __init__(self, batch_size, n_head, max_len, head_dim, device, dtype, group=None):
        super().__init__(group, device)
        self.max_len = max_len
        rows = self.max_rows(max_len)
        self.k = torch.zeros(batch_size, n_head, rows, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self):
        """Local rows allocated."""
        return self.k.size(2)

    def store(self, **new):
        """Append T positions: each named buffer gets this rank's share of its (B, H, T, ...) tensor."""
        if self.position is not None:     # static step: one position at its device-held row
            row = self.static_row()
            for name, x in new.items():
                self.write_static(getattr(self, name), row, x)
            return
        T = next(iter(new.values())).size(2)
        if self.length + T > self.max_len:
            raise RuntimeError(f"KV cache overflow: {self.length + T} positions > capacity {self.max_len}")
        chunk, rows = self.local_rows(self.length, T)
        for name, x in new.items():
            getattr(self, name)[:, :, rows] = x[:, :, chunk]
        self.length += T

    def append(self, k, v):
        """Store T new positions; return the keys and values held here (all of them, unsharded)."""
        self.store(k=k, v=v)
        if self.position is not None:     # static step: every row; attention masks the unwritten ones
            return self.k, self.v
        n = self.n_local
        return self.k[:, :, :n], self.v[:, :, :n]


class SoftmaxCache(KVCache):
    """KV cache plus what FoX and the Pro block carry between steps: the cumulative log forget
    gate c of every cached position (float64, kernels.forgetting's precision policy), c of the
    newest position, and the last raw (unshifted) key and value. Sharded, the rows hold this
    rank's positions; c_last and the raw key/value belong to the stream, the same on every rank."""

    def __init__(self, batch_size, n_head, max_len, head_dim, device, dtype, group=None):
        super().__init__(batch_size, n_head, max_len, head_dim, device, dtype, group)
        self.log_fgate_cumsum = torch.zeros(self.k.shape[:3], device=device, dtype=torch.float64)
        self.c_last = torch.zeros(batch_size, n_head, 1, device=device, dtype=torch.float64)
        self.last_raw_k = torch.zeros(batch_size, n_head, 1, head_dim, device=device, dtype=dtype)
        self.last_raw_v = torch.zeros_like(self.last_raw_k)

    def append_gates(self, log_fgate):
        """Store c for the newest T positions (call after append); return c of the rows held here."""
        T = log_fgate.size(-1)
        c = fgate_cumsum(log_fgate, self.c_last)
        self.c_last.copy_(c[..., -1:])    # in place, as every buffer a static step writes
        if self.position is not None:
            self.write_static(self.log_fgate_cumsum, self.static_row(), c)
            return self.log_fgate_cumsum
        chunk, rows = self.local_rows(self.length - T, T)
        self.log_fgate_cumsum[:, :, rows] = c[:, :, chunk]
        return self.log_fgate_cumsum[:, :, :self.n_local]


class WindowCache(RoundRobinRows):
    """The cache of a sliding-window layer (model.attention_window = W): only the positions a later query
    can still see, so its memory is O(W) however long the stream. A ring of min(ceil(W / p), ceil(max_len / p))
    rows per rank: global position j lives on rank j % p (round robin, as in KVCache) in row (j // p) % rows,
    which keeps every rank's last W // p or so positions; `pos` holds each row's global position (-1: empty)
    and attention masks whatever lies outside a query's window (kernels.tree.mask_bias). FoX keeps c of each
    row (float64, as SoftmaxCache); c_last and the last raw key and value belong to the stream."""

    def __init__(self, batch_size, n_head, max_len, head_dim, device, dtype, window, gated, group=None):
        super().__init__(group, device)
        self.window = window
        rows = min(self.max_rows(window), self.max_rows(max_len))
        self.k = torch.zeros(batch_size, n_head, rows, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.c = torch.zeros(self.k.shape[:3], device=device, dtype=torch.float64) if gated else None
        self.c_last = torch.zeros(batch_size, n_head, 1, device=device, dtype=torch.float64)
        self.last_raw_k = torch.zeros(batch_size, n_head, 1, head_dim, device=device, dtype=dtype)
        self.last_raw_v = torch.zeros_like(self.last_raw_k)

    @property
    def capacity(self):
        """Local rows allocated."""
        return self.k.size(2)

    def gates(self, log_fgate):
        """c of the T new positions, continuing the stream's (None without a gate)."""
        if log_fgate is None:
            return None
        c = fgate_cumsum(log_fgate, self.c_last)
        self.c_last.copy_(c[..., -1:])
        return c

    def _owned(self, T):
        """The new positions length .. length + T - 1 held here: (strided slice of the chunk, global positions)."""
        chunk, _ = self.local_rows(self.length, T)
        return chunk, torch.arange(self.length, self.length + T, device=self.device)[chunk]

    def store(self, k, v, c):
        """Append T positions: this rank's share, of which the ring keeps the newest `capacity`."""
        if self.position is not None:     # static step: one position at its device-held ring row
            row = self.static_row() % self.capacity
            for buf, x in ((self.k, k), (self.v, v), (self.c, c)):
                if x is not None:
                    self.write_static(buf, row, x)
            self.write_static(self.pos, row, self.position, dim=0)
            return
        chunk, pos = self._owned(k.size(2))
        keep = slice(max(0, pos.numel() - self.capacity), None)
        rows = (pos[keep] // self.world) % self.capacity
        self.k[:, :, rows] = k[:, :, chunk][:, :, keep]
        self.v[:, :, rows] = v[:, :, chunk][:, :, keep]
        if c is not None:
            self.c[:, :, rows] = c[:, :, chunk][:, :, keep]
        self.pos[rows] = pos[keep]
        self.length += k.size(2)

    def attend(self, q, k, v, c):
        """The T new queries (k, v, c: theirs) over the cached rows and the new positions held here, merged
        with the other ranks' by tree attention (kernels/tree.py); the new positions are then stored."""
        T = q.size(2)
        q_pos = self.position if self.position is not None else torch.arange(self.length, self.length + T,
                                                                               device=self.device)
        if T == 1:
            # the new position overwrites one at least W older, which its query no longer sees
            self.store(k, v, c)
            keys, values, c_keys, k_pos = self.k, self.v, self.c, self.pos
        else:   # earlier queries of the chunk may still see the rows it overwrites: attend first
            chunk, new_pos = self._owned(T)
            keys, values = torch.cat([self.k, k[:, :, chunk]], 2), torch.cat([self.v, v[:, :, chunk]], 2)
            c_keys = torch.cat([self.c, c[:, :, chunk]], 2) if c is not None else None
            k_pos = torch.cat([self.pos, new_pos])
            self.store(k, v, c)
        gate = (c_keys, self.c_last) if c_keys is not None else None   # relative to the newest c, as in attend_rows
        return self.merged_attention(q, keys, values, bias=mask_bias(q_pos, k_pos, window=self.window), gate=gate)


def attend_rows(q, k, v, c, cache):
    """The T new queries over the rows k, v (FoX: their c) of a cache, masks as an additive bias and FoX's
    gates as attn_partial's gate (the kernel computes their logits), by tree attention's split-KV step (kernels/tree.py). A sharded cache: this rank's
    rows, merged exactly with every other rank's. A static step: the whole buffer, with the count of
    filled rows read on the device (attn_partial's length; static_filled), so its shapes never change. Positions are
    global; a single new token sees every cached position, a prefill chunk is causal inside itself
    (mask_bias). FoX's logits are -c_j taken relative to the stream's newest c, a shift common to all keys
    that keeps recent keys exact."""
    T = q.size(2)
    bias, length = None, None
    if cache.position is not None:  # the rows of positions 0 .. position: the kernel skips the tiles past them
        length = cache.static_filled()
    elif T > 1:
        q_pos = torch.arange(cache.length - T, cache.length, device=q.device)
        bias = mask_bias(q_pos, cache.key_positions())
    gate = (c, cache.c_last) if c is not None else None
    return cache.merged_attention(q, k, v, bias=bias, length=length, gate=gate)


class InferenceCache:
    """Per-layer attention caches for max_len positions plus the number of positions already processed.

    `to_static` makes every later step a static one, the step a CUDA graph replays (GPT.forward with one
    token): the next position lives on the device, in `position`, which every layer cache shares and the step
    advances itself, and each layer attends over its whole preallocated buffer with the rows past the position
    masked (a recurrent layer keeps its fixed-size state in fixed buffers). Shapes, buffers and Python state
    then never change from step to step, so one captured step serves every position. `pos` and the layers'
    `length` keep counting only the dynamic steps before, and the caller keeps the steps below max_len (a step
    cannot check a position it does not read on the host).
    """

    def __init__(self, layers, max_len):
        self.layers, self.max_len = layers, max_len
        self.pos = 0
        self.position = None

    def to_static(self):
        """Continue with static steps from position `pos`: every layer cache turns static on the shared
        device-held position (a CastleCache also rearranges its buffers, a RecurrentCache moves its state into
        fixed ones)."""
        position = torch.tensor([self.pos], device=self.layers[0].device)
        for layer in self.layers:
            layer.to_static(position)
        self.position = position

    def advance(self, T):
        if self.position is not None:
            self.position.add_(T)
        else:
            self.pos += T
