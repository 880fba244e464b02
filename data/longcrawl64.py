"""LongCrawl64: open and check its zarr arrays; the loader of the FoX recipes.

FoX (arXiv:2503.02130) §4.1 trains on LongCrawl64 and validates on its held-out set in
sequences of 65,536 tokens. The dataset is two zarr v2 arrays of GPT-2 tokens of JSON-escaped
text (tokenizer "gpt2_json"): `train.zarr` (6,609,334 x 65,536) and `heldout.zarr` (52,131 x
65,536), one pre-rolled document per row (FoX App. C). We read them in place instead of
converting them to shards: zarr decodes far faster than training consumes tokens, while a
conversion would cost a full pass over ~800 GB and as much disk again.

Sample order. With R documents per column pass (whole global batches) and C = 65536 // T chunks
of length T per document, sample j of an epoch is the chunk (document j mod R, column j // R):
column-major, so every document's first chunk comes before any second chunk, in file order.
At micro-step k rank r reads samples [g*B, g*B + B) with g = k*world_size + r, so each global
batch is a block of consecutive documents split between ranks, as in the loader of the FoX code
release (batch b = documents [G*b, G*b + G) at column 0 for the paper's whole 45B-token run).
"shuffled" instead visits each column pass in its own random document order and the columns
in a random order per epoch (deterministic from the seed). Each sample's targets are its T raw
tokens and its inputs the same tokens shifted right behind a BOS (50256).

Each batch is checked for ids outside the tokenizer's vocabulary as it is read (data/checks.py):
the arrays hold ~433B tokens, compressed, so no scan ahead of use is affordable.
"""
import numpy as np
import torch
import zarr

from data import resolve_path
from data.checks import first_out_of_vocab, out_of_vocab_error, step_from_position
from data.pipeline import MANIFEST, load_manifest
from data.tokenizer import EOT, tokenizer_for

DOC_LEN = 65536
VOCAB_SIZE = 50257
ARRAYS = {"train": "train.zarr", "val": "heldout.zarr"}
OFFICIAL_DOCS = {"train": 6_609_334, "val": 52_131}


def open_split(root, split, check_rows=True):
    """The zarr array of `split` ("train" or "val") under `root` (a folder or an fsspec URL), checked."""
    path = f"{str(root).rstrip('/')}/{ARRAYS[split]}"
    options = {"token": "anon"} if path.startswith("gs://") else None  # the official bucket is public
    try:
        array = zarr.open_array(path, mode="r", storage_options=options)
    except Exception as e:  # missing folder, not zarr, no gcsfs, ...: all end here with the path named
        raise ValueError(f"{path}: cannot open as a zarr array ({type(e).__name__}: {e}); expected LongCrawl64's "
                         f"{ARRAYS[split]} (gsutil -m cp -r gs://longcrawl64 DIR; python -m data.prepare_longcrawl64)"
                         ) from e
    check_array(path, array, split, check_rows)
    return array


def check_array(path, array, split, check_rows=True):
    """Shape and dtype as LongCrawl64's; `check_rows` also demands the official document count."""
    if array.ndim != 2 or array.shape[1] != DOC_LEN:
        raise ValueError(f"{path}: shape {array.shape}, but LongCrawl64 arrays are (documents, {DOC_LEN})")
    if array.dtype.kind not in "ui":
        raise ValueError(f"{path}: dtype {array.dtype}, but LongCrawl64 holds integer token ids")
    if check_rows and array.shape[0] != OFFICIAL_DOCS[split]:
        raise ValueError(f"{path}: {array.shape[0]:,} documents, the official {ARRAYS[split]} has "
                         f"{OFFICIAL_DOCS[split]:,}; to use a subset, set data.check_rows=false (--any-rows)")


def check_values(path, array, n_docs=16):
    """Spot-check documents spread over the array: GPT-2 token ids, and not all zeros."""
    for d in np.unique(np.linspace(0, array.shape[0] - 1, n_docs).round().astype(np.int64)):
        doc = np.asarray(array[int(d)])
        if not doc.any():
            raise ValueError(f"{path}: document {d} is all zeros: a broken copy? (the Hub mirror "
                             "clankur/longcrawl64 is all zeros after its first 4096 documents)")
        if doc.min() < 0 or doc.max() >= VOCAB_SIZE:
            raise ValueError(f"{path}: document {d} holds token ids outside [0, {VOCAB_SIZE}): not GPT-2 tokens")


class LongCrawl64Loader:
    """next_batch / state_dict / load_state_dict as data.loader.TokenLoader, over a zarr (docs, 65536) array.

    `vocab_size` is the tokenizer's vocabulary: a batch holding an id >= it is refused.
    """

    def __init__(self, array, batch_size, seq_len, rank=0, world_size=1, order="paper", seed=0, *, vocab_size):
        if order not in ("paper", "shuffled"):
            raise ValueError(f"data.order must be 'paper' or 'shuffled' for LongCrawl64, got {order!r}")
        if not 0 < seq_len <= DOC_LEN:
            raise ValueError(f"seq_len {seq_len} must lie in [1, {DOC_LEN}]: samples are chunks of one document")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.array, self.order, self.seed, self.vocab_size = array, order, seed, vocab_size
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        group = batch_size * world_size
        self.rows = array.shape[0] - array.shape[0] % group  # documents per column pass, whole global batches
        self.cols = DOC_LEN // seq_len  # chunks per document; a remainder (seq_len not dividing 65536) is unused
        if self.rows == 0:
            raise ValueError(f"{array.shape[0]} documents, fewer than one global batch of {group}")
        self.step = 0
        self._perm = (None, None)  # (column pass, its document permutation), for "shuffled"

    def next_batch(self):
        """(x, y): int64 CPU tensors (batch_size, seq_len); y = the raw chunk, x = BOS + y[:, :-1]."""
        first = (self.step * self.world_size + self.rank) * self.batch_size
        column_pass, d0 = divmod(first, self.rows)  # passes count on across epochs
        epoch, col = divmod(column_pass, self.cols)
        if self.order == "paper":
            docs = slice(d0, d0 + self.batch_size)
        else:
            docs = self._doc_permutation(column_pass)[d0:d0 + self.batch_size]
            col = np.random.default_rng([self.seed, 0, epoch]).permutation(self.cols)[col]
        cols = slice(col * self.seq_len, (col + 1) * self.seq_len)
        y = np.asarray(self.array.oindex[docs, cols], dtype=np.int64)  # zarr: slices or rows
        self._check_ids(y, docs, cols.start)
        y = torch.from_numpy(y)
        x = torch.roll(y, 1, dims=1)
        x[:, 0] = EOT
        self.step += 1
        return x, y

    def state_dict(self):
        return {"position": self.step * self.world_size * self.batch_size * self.seq_len}

    def load_state_dict(self, state):
        self.step = step_from_position(state["position"], self.world_size * self.batch_size * self.seq_len)

    def source_counts(self):
        """{array path: sequences all ranks have read}, as TokenLoader.source_counts (one source)."""
        return {self._path(): self.step * self.world_size * self.batch_size}

    def _path(self):
        return str(self.array.store_path).removeprefix("file://")

    def _check_ids(self, y, docs, first_col):
        bad = first_out_of_vocab(y.reshape(-1), self.vocab_size)
        if bad is not None:
            row, col = divmod(bad, y.shape[1])
            doc = docs.start + row if isinstance(docs, slice) else int(docs[row])
            where = f"{self._path()}: document {doc:,}, token {first_col + col:,}"
            raise out_of_vocab_error(where, int(y[row, col]), self.vocab_size)

    def _doc_permutation(self, column_pass):
        if self._perm[0] != column_pass:
            self._perm = (column_pass, np.random.default_rng([self.seed, 1, column_pass]).permutation(self.rows))
        return self._perm[1]


def build_longcrawl64_loader(data_cfg, split, batch_size, seq_len, rank=0, world_size=1):
    """Loader of configs/data/longcrawl64.yaml; validation always reads in file order."""
    remote = "://" in data_cfg["dir"]
    root = data_cfg["dir"] if remote else resolve_path(data_cfg["dir"])
    if not remote:
        check_copied(root, split)
    array = open_split(root, split, data_cfg.get("check_rows", True))
    order = data_cfg.get("order", "paper") if split == "train" else "paper"
    return LongCrawl64Loader(array, batch_size, seq_len, rank, world_size, order, data_cfg.get("seed", 0),
                             vocab_size=tokenizer_for(data_cfg).n_vocab)


def check_copied(root, split):
    """Refuse an array whose copy by data.prepare_longcrawl64 has not finished: its missing chunks read as zeros.

    A folder without manifest.json (e.g. the gsutil download itself) is taken as it is.
    """
    entry = ((load_manifest(root) or {}).get("arrays") or {}).get(split)
    if entry is not None and not entry.get("complete", True):
        raise ValueError(f"{root / MANIFEST}: {ARRAYS[split]} is only partly copied ({entry['documents_done']:,} of "
                         f"{entry['documents']:,} documents); run the same python -m data.prepare_longcrawl64 "
                         "command again, it resumes where it stopped")
