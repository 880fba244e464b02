"""Deterministic distributed loading of token shards, and `build_loader` for the Hydra data configs.

The shards of a split form one token stream; sequence i of a stream is its tokens [i*T, i*T + T + 1)
(inputs and shifted targets). At micro-step k, rank r reads the global samples g = (k*world_size + r)*B
+ row, row < B, and data/order.py maps each g to a source (with data.mix) and a sequence of it (file
order or a seeded shuffle per epoch). Ranks never overlap, and 2 ranks at step k read what 1 rank
reads at steps 2k and 2k+1. In file order, one source, micro-step k reads the stream's chunk
k*world_size + r of B*T tokens (+1), wrapping around at the last whole chunk (a new epoch). The only
state is an integer, `position`: stream tokens consumed by all ranks together.

Token ids outside the tokenizer's vocabulary are refused (data/checks.py). In file order each shard
is scanned when the loader opens it: a numpy max over the memory-mapped file, i.e. one sequential
read of pages the ranks of a node read anyway, a small cost next to the training steps a shard
feeds; it names the shard's first bad id as soon as the shard comes into use (at the first step,
for data of one shard), not at whichever later step reaches the id. Shards are not scanned up front:
for a 50B-token dataset that would be a 100 GB read before the first step. A shuffled order touches
every shard within a few steps, so there each sequence is checked as it is read instead.
"""
import collections
import math
import numbers
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from data import resolve_path
from data.checks import first_out_of_vocab, out_of_vocab_error, step_from_position
from data.longcrawl64 import build_longcrawl64_loader
from data.order import MixSchedule, SequenceOrder, check_order
from data.pipeline import MANIFEST, load_manifest, prepare
from data.shards import HEADER_BYTES, read_shard, shard_num_tokens
from data.sources import expand_sources, list_units
from data.tokenizer import tokenizer_for

OPEN_SHARDS = 16  # memory maps kept open per stream: a shuffled batch reads from up to batch_size shards


class ShardStream:
    """The shards of one split of one folder as one token stream, read at any offset, token ids checked.

    `scan_on_open`: check each shard whole when first opened (file order); otherwise check each read.
    """

    def __init__(self, files, vocab_size, scan_on_open):
        self.files, self.vocab_size, self.scan_on_open = [str(f) for f in files], vocab_size, scan_on_open
        self.offsets = np.cumsum([0] + [shard_num_tokens(f) for f in self.files])  # stream start of each shard
        self.n_tokens = int(self.offsets[-1])
        self._open = collections.OrderedDict()  # a few memory-mapped shards, least recently used first

    def read(self, start, n):
        """Tokens [start, start + n) of the stream (uint16)."""
        out = np.empty(n, dtype=np.uint16)
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < n:
            lo = start + done - int(self.offsets[i])
            take = min(n - done, int(self.offsets[i + 1]) - int(self.offsets[i]) - lo)
            out[done:done + take] = piece = self._shard(i)[lo:lo + take]
            if not self.scan_on_open:
                self._check(i, piece, lo)
            done += take
            i += 1
        return out

    def _shard(self, i):
        if i not in self._open:
            tokens = read_shard(self.files[i])
            if self.scan_on_open:
                self._check(i, tokens, 0)
            self._open[i] = tokens
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        self._open.move_to_end(i)
        return self._open[i]

    def _check(self, i, tokens, first):
        bad = first_out_of_vocab(tokens, self.vocab_size)
        if bad is not None:
            where = f"{self.files[i]}: token {first + bad:,} (byte {HEADER_BYTES + 2 * (first + bad):,})"
            raise out_of_vocab_error(where, int(tokens[bad]), self.vocab_size)


class TokenLoader:
    """Batches from one or more sources, each a list of shard files (its stream, in list order).

    `weights` (one per source, default equal) set a mix's proportions; `order` ("file" or "shuffled")
    and `seed` the order of every source's sequences (data/order.py). `vocab_size` is the tokenizer's
    vocabulary: an id >= it is refused with its shard and position. `names` label the sources in
    `source_counts` (default: each source's folder).
    """

    def __init__(self, sources, batch_size, seq_len, rank=0, world_size=1, *, vocab_size, weights=None,
                 order="file", seed=0, names=None):
        if not sources or not all(sources):
            raise ValueError("TokenLoader needs at least one shard file per source")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.names = list(names or [str(Path(files[0]).parent) for files in sources])
        weights = weights or [1] * len(sources)
        if len(weights) != len(sources) or len(self.names) != len(sources):
            raise ValueError(f"{len(sources)} sources, but {len(weights)} weights and {len(self.names)} names")
        self.streams = [ShardStream(files, vocab_size, scan_on_open=order == "file") for files in sources]
        self.orders = []
        for s, stream in enumerate(self.streams):
            if stream.n_tokens - 1 < batch_size * seq_len:
                raise ValueError(f"{len(stream.files)} shard(s) in {self.names[s]} hold {stream.n_tokens} tokens, "
                                 f"fewer than one batch of {batch_size}x{seq_len}+1; use a smaller batch or more data")
            self.orders.append(SequenceOrder((stream.n_tokens - 1) // seq_len, order, seed, s, batch_size))
        self.schedule = MixSchedule(weights)
        self.step = 0  # micro-steps taken

    def next_batch(self):
        """(x, y): int64 CPU tensors of shape (batch_size, seq_len); y[:, t] is the token after x[:, t]."""
        first = (self.step * self.world_size + self.rank) * self.batch_size
        source, index = np.array([self.schedule.assign(g) for g in range(first, first + self.batch_size)]).T
        rows = np.empty((self.batch_size, self.seq_len + 1), dtype=np.uint16)
        for s in np.unique(source):
            mine = np.flatnonzero(source == s)
            for row, sequence in zip(mine, self.orders[s](index[mine]), strict=True):
                rows[row] = self.streams[s].read(int(sequence) * self.seq_len, self.seq_len + 1)
        self.step += 1
        return (torch.from_numpy(np.ascontiguousarray(rows[:, :-1], dtype=np.int64)),
                torch.from_numpy(np.ascontiguousarray(rows[:, 1:], dtype=np.int64)))

    def state_dict(self):
        return {"position": self.step * self.world_size * self.batch_size * self.seq_len}

    def load_state_dict(self, state):
        self.step = step_from_position(state["position"], self.world_size * self.batch_size * self.seq_len)

    def distinct_tokens(self):
        """Tokens served before any source wraps around: a source with a share p of the samples and n
        tokens lasts n / p tokens of the mixed stream (one source: all of its tokens)."""
        remaining, overall = 1, []
        for share in self.schedule.shares:          # each source's share of what the earlier ones leave
            overall.append(remaining * share)
            remaining *= 1 - share
        overall.append(remaining)
        return int(min(stream.n_tokens / p for stream, p in zip(self.streams, overall) if p > 0))

    def source_counts(self):
        """{source name: sequences all ranks have read from it so far}: the realised mix, e.g. to log."""
        consumed = self.step * self.world_size * self.batch_size
        return dict(zip(self.names, self.schedule.counts(consumed), strict=True))


def build_loader(data_cfg, split, batch_size, seq_len, rank=0, world_size=1):
    """The loader for `split` ("train" or "val") of a configs/data/*.yaml config.

    Validation always reads in file order; with data.mix, from every source's val split, mixed by the
    same weights (a fixed set of batches whose loss weighs the sources as training does).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if data_cfg["name"] == "longcrawl64":
        if data_cfg.get("mix"):
            raise ValueError("data.mix is not supported with data=longcrawl64 (its zarr arrays are not token "
                             "shards); mix token-shard folders made by python -m data.prepare_*")
        return build_longcrawl64_loader(data_cfg, split, batch_size, seq_len, rank, world_size)
    order, seed = data_cfg.get("order", "file"), data_cfg.get("seed", 0)
    check_order(order)
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"data.seed must be a non-negative integer, got {seed!r}")
    sources = mix_sources(data_cfg)
    if data_cfg.get("auto_prepare"):
        ensure_prepared(data_cfg)
    tokenizer = data_cfg.get("tokenizer", "gpt2")
    pattern = data_cfg[f"{split}_pattern"]
    files = []
    for option, shard_dir, _ in sources:
        if not shard_dir.is_dir():
            raise FileNotFoundError(f"{option}: {shard_dir} is not a folder; prepare it first (python -m data.prepare_*"
                                    f" --out FOLDER, see configs/data/{data_cfg['name']}.yaml)")
        check_finished(shard_dir)
        check_tokenizer(shard_dir, tokenizer, option)
        files.append(sorted(shard_dir.glob(pattern)))
        if not files[-1]:
            raise FileNotFoundError(f"no {split} shards matching {shard_dir / pattern} ({option}); prepare them "
                                    f"first (python -m data.prepare_*, see configs/data/{data_cfg['name']}.yaml)")
    return TokenLoader(files, batch_size, seq_len, rank, world_size, vocab_size=tokenizer_for(data_cfg).n_vocab,
                       weights=[weight for _, _, weight in sources], order=order if split == "train" else "file",
                       seed=seed, names=[str(shard_dir) for _, shard_dir, _ in sources])


def mix_sources(data_cfg):
    """[(option, folder, weight)]: data.mix's entries checked, or data.dir with weight 1 without a mix."""
    mix = data_cfg.get("mix")
    if mix is None:
        return [("data.dir", resolve_path(data_cfg["dir"]), 1)]
    if isinstance(mix, (str, Mapping)) or not len(mix):
        raise ValueError(f"data.mix must be a non-empty list of {{dir: FOLDER, weight: NUMBER}}, got {mix!r}")
    sources = []
    for i, entry in enumerate(mix):
        option = f"data.mix[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"dir", "weight"}:
            raise ValueError(f"{option} must be {{dir: FOLDER, weight: NUMBER}}, got {entry!r}")
        weight = entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not 0 < weight < math.inf:
            raise ValueError(f"{option}.weight must be a positive number, got {weight!r}")
        shard_dir = resolve_path(entry["dir"])
        if shard_dir in [d for _, d, _ in sources]:
            raise ValueError(f"{option}.dir: {shard_dir} is already in data.mix; list each folder once")
        sources.append((f"{option}.dir", shard_dir, weight))
    return sources


def check_tokenizer(shard_dir, tokenizer, option):
    """Refuse shards whose manifest names another tokenizer than data.tokenizer (mixed sources must agree).

    Shards without a manifest (e.g. llm.c's) are taken to use data.tokenizer.
    """
    settings = (load_manifest(shard_dir) or {}).get("settings") or {}
    made_with = settings.get("tokenizer", tokenizer)
    if made_with != tokenizer:
        raise ValueError(f"{option}: {shard_dir} was prepared with tokenizer {made_with!r}, but data.tokenizer is "
                         f"{tokenizer!r}; every source must use data.tokenizer (prepare it again with "
                         f"--tokenizer {tokenizer}, or set data.tokenizer={made_with} if all sources use it)")


def check_finished(shard_dir):
    """Refuse shards of a prepare run that has not finished: they hold only part of the data.

    A folder without manifest.json (shards from elsewhere, e.g. llm.c's) is taken as it is.
    """
    manifest = load_manifest(shard_dir)
    if manifest is not None and not manifest.get("complete", True):
        raise ValueError(f"{shard_dir / MANIFEST}: the preparation of these shards has not finished "
                         f"({len(manifest['shards'])} shards so far); run the same prepare command again, "
                         "it resumes where it stopped (use --max-tokens for a smaller data set)")


def ensure_prepared(data_cfg):
    """Tokenize `auto_prepare.source` into `dir` unless already done (fast, idempotent, rank-safe)."""
    spec = data_cfg["auto_prepare"]
    sources = [str(resolve_path(s)) for s in spec["source"]]
    prepare(list_units(expand_sources(sources)), resolve_path(data_cfg["dir"]), source=sources,
            tokenizer=data_cfg["tokenizer"], ranks_path=data_cfg.get("ranks_path"), val_tokens=spec["val_tokens"],
            shard_tokens=spec["shard_tokens"], overwrite=True, progress=False)
