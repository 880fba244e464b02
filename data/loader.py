"""Deterministic distributed loading of token shards, and `build_loader` for the Hydra data configs.

The shards of a split form one token stream. Each micro-step consumes B*T tokens per rank: at
micro-step k, rank r reads stream chunk c = k*world_size + r, the tokens [c*B*T, c*B*T + B*T + 1)
(one extra token for the shifted targets), wrapping around at the end of the stream (a new
epoch). Ranks never overlap, and 2 ranks at step k read what 1 rank reads at steps 2k and 2k+1.
The only state is an integer, `position`: stream tokens consumed by all ranks together.
"""
import collections
from pathlib import Path

import numpy as np
import torch

from data import REPO_ROOT
from data.pipeline import prepare
from data.shards import read_shard, shard_num_tokens
from data.sources import expand_sources, list_units


class TokenLoader:
    """Batches from a list of shard files in the order above; `files` order is the stream order."""

    def __init__(self, files, batch_size, seq_len, rank=0, world_size=1):
        if not files:
            raise ValueError("TokenLoader needs at least one shard file")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.files = [str(f) for f in files]
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
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
            self._open[i] = read_shard(self.files[i])
            if len(self._open) > 4:
                self._open.popitem(last=False)
        self._open.move_to_end(i)
        return self._open[i]


def step_from_position(position, tokens_per_step):
    if position % tokens_per_step:
        raise ValueError(f"loader position {position} is not a multiple of the tokens one step of all ranks "
                         f"reads ({tokens_per_step}): resume with the batch size, sequence length and world "
                         "size of the run that saved it, or with ones that divide it evenly")
    return position // tokens_per_step


def resolve_path(path):
    """Config paths are relative to the repository root, not to the working directory."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def build_loader(data_cfg, split, batch_size, seq_len, rank=0, world_size=1):
    """The loader for `split` ("train" or "val") of a configs/data/*.yaml config."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if data_cfg["name"] == "longcrawl64":
        from data.longcrawl64 import build_longcrawl64_loader  # here: data.longcrawl64 imports this module
        return build_longcrawl64_loader(data_cfg, split, batch_size, seq_len, rank, world_size)
    shard_dir = resolve_path(data_cfg["dir"])
    if data_cfg.get("auto_prepare"):
        ensure_prepared(data_cfg)
    pattern = data_cfg[f"{split}_pattern"]
    files = sorted(shard_dir.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {split} shards matching {shard_dir / pattern}; prepare them first "
                                f"(data/prepare_*.py, see configs/data/{data_cfg['name']}.yaml)")
    return TokenLoader(files, batch_size, seq_len, rank, world_size)


def ensure_prepared(data_cfg):
    """Tokenize `auto_prepare.source` into `dir` unless already done (fast, idempotent, rank-safe)."""
    spec = data_cfg["auto_prepare"]
    sources = [str(resolve_path(s)) for s in spec["source"]]
    prepare(list_units(expand_sources(sources)), resolve_path(data_cfg["dir"]), source=sources,
            tokenizer=data_cfg["tokenizer"], ranks_path=data_cfg.get("ranks_path"), val_tokens=spec["val_tokens"],
            shard_tokens=spec["shard_tokens"], overwrite=True, progress=False)
