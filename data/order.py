"""Which sequence each training sample reads: file order, a seeded shuffle per epoch, a weighted mix.

The loader numbers the samples of a whole run 0, 1, 2, ... over micro-steps, ranks and rows (global
sample g = (step * world_size + rank) * batch_size + row). Everything here is a pure function of g,
the sizes, the weights and the seed, so a loader's only state is how many samples it has consumed,
and resuming from that count gives exactly the batches of an uninterrupted run, under any world size
whose global batch divides it.

A source (one prepared folder) of N tokens holds S = (N - 1) // T sequences of length T: sequence i
is the tokens [i*T, i*T + T + 1), inputs and shifted targets. Its samples j = 0, 1, 2, ... run
through epochs:
  file      epoch = S rounded down to whole micro-batches, sequences in file order (the stream read
            front to back, as always);
  shuffled  epoch = all S sequences, in the order of a pseudo-random permutation drawn from
            (seed, source, epoch): a new order each epoch, every sequence exactly once per epoch.
The permutation is a keyed Feistel bijection evaluated per sample, not a stored array: O(1) memory
and no pause at an epoch boundary for any S (a stored permutation of 25M sequences, 50B tokens at
T = 2048, holds 191 MiB per rank and source, drawn anew every epoch).

A mix interleaves sources by weight deterministically (MixSchedule): after any g samples, each
source has given its share of g to within about one sample, so every global batch holds the
weights' proportions, and each source keeps its own epochs.
"""
from fractions import Fraction

import numpy as np

ORDERS = ("file", "shuffled")
FEISTEL_ROUNDS = 6  # 4 already make a pseudo-random permutation (Luby-Rackoff); 2 more for margin


def check_order(order):
    if order not in ORDERS:
        raise ValueError(f"data.order must be one of {', '.join(ORDERS)} for token shards, got {order!r}")


def _mix64(z):
    """The splitmix64 finalizer: a bijection of uint64 arrays whose every output bit depends on every input bit."""
    z = (z ^ (z >> 30)) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> 27)) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> 31)


def feistel_permutation(i, n, keys):
    """pi(i) for each entry of the int array `i` (all in [0, n)): the permutation pi of [0, n) that `keys`
    (uint64 round keys, e.g. from round_keys) select.

    A balanced Feistel network permutes [0, 4**h) for the least h with 4**h >= n; applying it again to
    values that land outside [0, n) (cycle walking) leaves a permutation of [0, n). As 4**h < 4n, an
    index takes fewer than 4 passes on average.
    """
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    x = np.array(i, dtype=np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= n
    return x.astype(np.int64)


def round_keys(seed, source, epoch):
    """The Feistel round keys of one source's epoch: independent streams for every (seed, source, epoch)."""
    return np.random.SeedSequence([seed, source, epoch]).generate_state(FEISTEL_ROUNDS, np.uint64)


class SequenceOrder:
    """A source's sample index j (counting on across epochs) -> the sequence it reads."""

    def __init__(self, n_sequences, order, seed=0, source=0, batch_size=1):
        check_order(order)
        self.order, self.seed, self.source = order, seed, source
        self.epoch_len = n_sequences - n_sequences % batch_size if order == "file" else n_sequences
        if self.epoch_len < 1:
            raise ValueError(f"{n_sequences} sequences, fewer than one batch of {batch_size}")
        self._keys = (None, None)  # (epoch, its round keys)

    def __call__(self, j):
        """Sequence indices (int64 array) of the source's samples `j` (int array)."""
        epoch, pos = np.divmod(np.asarray(j, dtype=np.int64), self.epoch_len)
        if self.order == "file":
            return pos
        out = np.empty_like(pos)
        for e in np.unique(epoch):  # one epoch, or two where a batch crosses a boundary
            here = epoch == e
            out[here] = feistel_permutation(pos[here], self.epoch_len, self._round_keys(int(e)))
        return out

    def _round_keys(self, epoch):
        if self._keys[0] != epoch:
            self._keys = (epoch, round_keys(self.seed, self.source, epoch))
        return self._keys[1]


class MixSchedule:
    """Global sample g -> (source, the source's own sample index): a deterministic weighted interleave.

    Source 0 takes share q0 = w0 / sum(w) of the stream: among the first n samples it takes
    round(q0 * n) (rounding halves up), so sample n is its iff that count grows at n + 1. The samples
    it leaves form a stream that source 1 splits the same way with share w1 / (w1 + ... + w_last), and
    so on; the last source takes what remains. Each count is within one half of its share at its
    level, so source s's count after g samples is within (s + 1) / 2 of w_s / sum(w) * g. Exact
    rational arithmetic: no rounding drift, whatever g.
    """

    def __init__(self, weights):
        weights = [Fraction(w) for w in weights]
        self.shares = [w / sum(weights[s:]) for s, w in enumerate(weights[:-1])]

    def assign(self, g):
        """(source, index within the source) of global sample g."""
        n = g
        for source, share in enumerate(self.shares):
            taken = _round_half_up(share * n)
            if _round_half_up(share * (n + 1)) > taken:
                return source, taken
            n -= taken
        return len(self.shares), n

    def counts(self, g):
        """Samples each source gives among the first g."""
        counts = []
        for share in self.shares:
            counts.append(_round_half_up(share * g))
            g -= counts[-1]
        return counts + [g]


def _round_half_up(x):
    return (2 * x.numerator + x.denominator) // (2 * x.denominator)
