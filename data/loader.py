"""Deterministic distributed loading of token shards, and `build_loader` for the Hydra data configs.

The shards of a split form one token stream. Each micro-step consumes B*T tokens per rank: at
micro-step k, rank r reads stream chunk c = k*world_size + r, the tokens [c*B*T, c*B*T + B*T + 1)
(one extra token for the shifted targets), wrapping around at the end of the stream (a new
epoch). Ranks never overlap, and 2 ranks at step k read what 1 rank reads at steps 2k and 2k+1.
The only state is an integer, `position`: stream tokens consumed by all ranks together.

Every shard is scanned for token ids outside the tokenizer's vocabulary when the loader opens it
(data/checks.py): a numpy max over the memory-mapped file, i.e. one sequential read of pages the
ranks of a node read anyway, a small cost next to the training steps a shard feeds. It names the
shard's first bad id as soon as the shard comes into use (at the first step, for data of one
shard), not at whichever later step reaches the id. Shards are not scanned up front: for a
50B-token dataset that would be a 100 GB read before the first step.
"""
import collections

import numpy as np
import torch

from data import resolve_path
from data.checks import first_out_of_vocab, out_of_vocab_error, step_from_position
from data.longcrawl64 import build_longcrawl64_loader
from data.pipeline import MANIFEST, load_manifest, prepare
from data.shards import HEADER_BYTES, read_shard, shard_num_tokens
from data.sources import expand_sources, list_units
from data.tokenizer import tokenizer_for


class TokenLoader:
    """Batches from a list of shard files in the order above; `files` order is the stream order.

    `vocab_size` is the tokenizer's vocabulary: a shard holding an id >= it is refused when opened.
    """

    def __init__(self, files, batch_size, seq_len, rank=0, world_size=1, *, vocab_size):
        if not files:
            raise ValueError("TokenLoader needs at least one shard file")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.files = [str(f) for f in files]
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.vocab_size = vocab_size
        self.offsets = np.cumsum([0] + [shard_num_tokens(f) for f in self.files])  # stream start of each shard
        self.chunk = batch_size * seq_len
        self.n_chunks = (int(self.offsets[-1]) - 1) // self.chunk  # chunks per epoch
        if self.n_chunks < 1:
            raise ValueError(f"{len(self.files)} shard(s) hold {self.offsets[-1]} tokens, fewer than one batch "
                             f"of {batch_size}x{seq_len}+1; use a smaller batch or more data")
        self.step = 0  # micro-steps taken
        self._open = collections.OrderedDict()  # a few memory-mapped shards, least recently used first

    def next_batch(self):
        """(x, y): int64 CPU tensors of shape (batch_size, seq_len); y[:, t] is the token after x[:, t]."""
        c = (self.step * self.world_size + self.rank) % self.n_chunks
        buf = torch.from_numpy(self._read(c * self.chunk, self.chunk + 1).astype(np.int64))
        self.step += 1
        return buf[:-1].view(self.batch_size, self.seq_len), buf[1:].view(self.batch_size, self.seq_len)

    def state_dict(self):
        return {"position": self.step * self.world_size * self.chunk}

    def load_state_dict(self, state):
        self.step = step_from_position(state["position"], self.world_size * self.chunk)

    def _read(self, start, n):
        out = np.empty(n, dtype=np.uint16)
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < n:
            lo = start + done - int(self.offsets[i])
            take = min(n - done, int(self.offsets[i + 1]) - int(self.offsets[i]) - lo)
            out[done:done + take] = self._shard(i)[lo:lo + take]
            done += take
            i += 1
        return out

    def _shard(self, i):
        if i not in self._open:
            tokens = read_shard(self.files[i])
            bad = first_out_of_vocab(tokens, self.vocab_size)
            if bad is not None:
                where = f"{self.files[i]}: token {bad:,} (byte {HEADER_BYTES + 2 * bad:,})"
                raise out_of_vocab_error(where, int(tokens[bad]), self.vocab_size)
            self._open[i] = tokens
            if len(self._open) > 4:
                self._open.popitem(last=False)
        self._open.move_to_end(i)
        return self._open[i]


def build_loader(data_cfg, split, batch_size, seq_len, rank=0, world_size=1):
    """The loader for `split` ("train" or "val") of a configs/data/*.yaml config."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if data_cfg["name"] == "longcrawl64":
        return build_longcrawl64_loader(data_cfg, split, batch_size, seq_len, rank, world_size)
    shard_dir = resolve_path(data_cfg["dir"])
    if data_cfg.get("auto_prepare"):
        ensure_prepared(data_cfg)
    check_finished(shard_dir)
    pattern = data_cfg[f"{split}_pattern"]
    files = sorted(shard_dir.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {split} shards matching {shard_dir / pattern}; prepare them first "
                                f"(python -m data.prepare_*, see configs/data/{data_cfg['name']}.yaml)")
    return TokenLoader(files, batch_size, seq_len, rank, world_size, vocab_size=tokenizer_for(data_cfg).n_vocab)


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
