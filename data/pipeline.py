"""Tokenize documents in a process pool and write train/val shards plus a manifest, resumably.

Every prepare script goes through `prepare()`. The units (data/sources.py) are tokenized in
order, each document as [EOT] + encode_ordinary(text), and the resulting token stream is cut
into shards: the first `val_tokens` tokens form `val_000000.bin`, the rest `train_NNNNNN.bin` of
exactly `shard_tokens` each (the last one shorter), until the sources or `max_tokens` train
tokens run out. After each shard, `manifest.json` records it (tokens, documents, sha256) and the
stream position (unit, token offset in it), both written atomically. So an interrupted run
resumes exactly where its last shard ended, never leaves a half shard, produces the same bytes
as an uninterrupted one, and a finished run re-run is a no-op. A lock file serializes
concurrent runs on one folder (e.g. several ranks preparing the bundled sample at once).
"""
import argparse
import collections
import contextlib
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import re
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.shards import shard_num_tokens, write_shard
from data.sources import read_documents
from data.tokenizer import EOT, get_tokenizer

MANIFEST = "manifest.json"


def tokenize_unit(unit, tokenizer="gpt2", ranks_path=None, min_int_score=None):
    """Tokens of one unit as uint16, [EOT] before each document, and the unit's counters."""
    enc = get_tokenizer(tokenizer, ranks_path)
    stats = collections.Counter()
    ids = []
    for text in read_documents(unit, stats, min_int_score):
        ids.append(enc.eot_token)
        ids.extend(enc.encode_ordinary(text))
        stats["documents_kept"] += 1
    tokens = np.array(ids, dtype=np.int64)
    if tokens.size and tokens.max() > 65535:
        raise ValueError(f"{unit.path}: token id {tokens.max()} does not fit a uint16 shard")
    return tokens.astype(np.uint16), stats


def prepare(units, out_dir, *, source, tokenizer="gpt2", ranks_path=None, val_tokens, shard_tokens,
            max_tokens=None, min_int_score=None, workers=1, max_shards=None, overwrite=False, progress=True):
    """Tokenize `units` into shards in `out_dir`; returns the manifest (a dict).

    `source` is recorded in the manifest. `max_shards` stops after writing that many shards in
    this call (a later call resumes). A folder holding a different preparation is an error,
    unless `overwrite`, which deletes its shards first.
    """
    if shard_tokens <= 0 or val_tokens < 0:
        raise ValueError(f"need shard_tokens > 0 and val_tokens >= 0, got {shard_tokens} and {val_tokens}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = dict(source=source, tokenizer=tokenizer, val_tokens=val_tokens, shard_tokens=shard_tokens,
                    max_tokens=max_tokens, min_int_score=min_int_score, units=len(units),
                    units_sha256=_fingerprint(units))
    with locked(out_dir):
        manifest = load_manifest(out_dir)
        problem = manifest and (_settings_diff(manifest["settings"], settings) or
                                (manifest["complete"] and _shards_problem(out_dir, manifest)))
        if problem and not overwrite:
            raise ValueError(f"{out_dir} already holds a different or damaged preparation ({problem}); "
                             "use another output folder or pass --overwrite")
        if problem:
            _delete_outputs(out_dir)
            manifest = None
        if manifest and manifest["complete"]:
            return manifest
        for stale in out_dir.glob("*.tmp*"):  # left by a crash in the middle of a write
            stale.unlink()
        manifest = manifest or _new_manifest(settings)
        options = dict(tokenizer=tokenizer, ranks_path=ranks_path, min_int_score=min_int_score)
        _run(units, ShardWriter(out_dir, manifest), options, workers, max_shards, progress)
    return manifest


class ShardWriter:
    """Cuts the token stream into the val shard and train shards, updating the manifest."""

    def __init__(self, out_dir, manifest):
        self.out_dir, self.manifest, self.settings = out_dir, manifest, manifest["settings"]
        self.unit_stats = collections.Counter()  # of units finished since the last manifest write
        self.buffer = np.empty(max(self._capacity(), 1), dtype=np.uint16)
        self.fill = 0
        self.written = 0  # shards written by this process

    def _split(self):
        return "val" if self.manifest["tokens"]["val"] < self.settings["val_tokens"] else "train"

    def _capacity(self):
        if self._split() == "val":
            return self.settings["val_tokens"]
        budget = self.settings["max_tokens"]
        room = budget - self.manifest["tokens"]["train"] if budget is not None else self.settings["shard_tokens"]
        return min(self.settings["shard_tokens"], room)

    @property
    def budget_spent(self):
        return self._capacity() == 0

    def add(self, tokens, pos, unit):
        """Take tokens[pos:] until the current shard is full; returns the new position."""
        take = min(len(tokens) - pos, len(self.buffer) - self.fill)
        self.buffer[self.fill:self.fill + take] = tokens[pos:pos + take]
        self.fill += take
        pos += take
        if self.fill == len(self.buffer):
            self._flush(state=dict(unit=unit, offset=pos))
        return pos

    def unit_done(self, stats):
        self.unit_stats.update(stats)

    def finish(self, n_units):
        if self.fill:
            self._flush(state=dict(unit=n_units, offset=0))
        if self.manifest["tokens"]["train"] == 0:
            raise ValueError(f"the sources gave {self.manifest['tokens']['val']} tokens, all used by the "
                             f"validation split (val_tokens={self.settings['val_tokens']}); nothing for training")
        self.manifest["complete"] = True
        save_manifest(self.out_dir, self.manifest)

    def _flush(self, state):
        split, tokens = self._split(), self.buffer[:self.fill]
        index = sum(s["split"] == split for s in self.manifest["shards"])
        name = f"{split}_{index:06d}.bin"
        sha256 = write_shard(self.out_dir / name, tokens)
        documents = int(np.count_nonzero(tokens == EOT))  # one EOT starts each document
        self.manifest["shards"].append(dict(file=name, split=split, tokens=len(tokens), documents=documents,
                                            sha256=sha256))
        self.manifest["tokens"][split] += len(tokens)
        self.manifest["documents"][split] += documents
        counts = collections.Counter(self.manifest["counts"])
        counts.update(self.unit_stats)
        self.manifest["counts"], self.manifest["state"] = dict(counts), state
        self.unit_stats.clear()
        save_manifest(self.out_dir, self.manifest)
        self.written += 1
        self.buffer = np.empty(max(self._capacity(), 1), dtype=np.uint16)
        self.fill = 0


def _run(units, writer, options, workers, max_shards, progress):
    state = writer.manifest["state"]
    todo = units[state["unit"]:]
    work = functools.partial(tokenize_unit, **options)
    budget = writer.settings["max_tokens"]
    bar = tqdm(total=budget and budget + writer.settings["val_tokens"], initial=sum(writer.manifest["tokens"].values()),
               unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True)
    t0, docs = time.perf_counter(), 0
    with _pool(workers) as pool:
        results = _ordered_map(pool, work, todo, window=2 * workers) if pool else map(work, todo)
        for i, (tokens, stats) in enumerate(results, start=state["unit"]):
            start = pos = state["offset"] if i == state["unit"] else 0  # resuming inside the first unit
            while pos < len(tokens) and not writer.budget_spent:
                pos = writer.add(tokens, pos, i)
                if max_shards is not None and writer.written >= max_shards:
                    return bar.close()
            writer.unit_done(stats)
            docs += stats["documents_kept"]
            bar.update(pos - start)
            bar.set_postfix(docs_s=f"{docs / (time.perf_counter() - t0):.0f}", units=f"{i + 1}/{len(units)}")
            if writer.budget_spent:
                break
    bar.close()
    writer.finish(len(units))


def _pool(workers):
    return multiprocessing.Pool(workers) if workers > 1 else contextlib.nullcontext()


def _ordered_map(pool, fn, items, window):
    """pool.imap with at most `window` results in flight, so a slow writer cannot fill the memory."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _fingerprint(units):
    """Hash of the unit list and the local files' sizes: resuming on changed inputs is refused."""
    sizes = {u.path: os.path.getsize(u.path) for u in units if "://" not in u.path}
    blob = json.dumps([[u.kind, u.path, list(u.part), sizes.get(u.path)] for u in units])
    return hashlib.sha256(blob.encode()).hexdigest()


def _new_manifest(settings):
    return dict(settings=settings, complete=False, state=dict(unit=0, offset=0), tokens=dict(val=0, train=0),
                documents=dict(val=0, train=0), counts={}, shards=[])


def load_manifest(out_dir):
    path = out_dir / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def save_manifest(out_dir, manifest):
    tmp = out_dir / f"{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out_dir / MANIFEST)


def _settings_diff(old, new):
    return ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k])


def _shards_problem(out_dir, manifest):
    for shard in manifest["shards"]:
        path = out_dir / shard["file"]
        try:
            n = shard_num_tokens(path)
        except (OSError, ValueError) as e:
            return str(e)
        if n != shard["tokens"]:
            return f"{path} has {n} tokens, the manifest says {shard['tokens']}"
    return ""


def _delete_outputs(out_dir):
    for path in [*out_dir.glob("train_*.bin"), *out_dir.glob("val_*.bin"), out_dir / MANIFEST]:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(out_dir):
    with open(out_dir / ".lock", "a") as f:  # "a": the lock file is never rewritten
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---- command line, shared by the prepare_*.py scripts ----

def parse_count(text):
    """'100M' -> 100_000_000; also K, G/B, plain ints and 1e8."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kKmMgGbB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (examples: 5000, 100M, 10B)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}[m[2].lower()]
    return int(float(m[1]) * scale)


def add_prepare_args(parser, *, val_tokens, shard_tokens):
    parser.add_argument("--out", required=True, help="output folder for the shards and manifest.json")
    parser.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "gpt2_json"],
                        help="gpt2: tiktoken GPT-2 BPE; gpt2_json: the same on JSON-escaped text (LongCrawl64 style)")
    parser.add_argument("--ranks-path",
                        help="local r50k_base.tiktoken (default: $GPT2_RANKS_PATH, then the bundled copy)")
    parser.add_argument("--val-tokens", type=parse_count, default=val_tokens,
                        help="tokens at the start of the stream that form the validation shard (default %(default)s)")
    parser.add_argument("--shard-tokens", type=parse_count, default=shard_tokens,
                        help="tokens per training shard (default %(default)s)")
    parser.add_argument("--max-tokens", type=parse_count,
                        help="token budget: stop after this many training tokens (default: all of the source)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="tokenizer processes (default: all cores, %(default)s)")
    parser.add_argument("--max-shards", type=int,
                        help="stop after writing this many shards; running again resumes (to prepare in pieces)")
    parser.add_argument("--overwrite", action="store_true",
                        help="if --out holds a preparation with other settings, delete its shards and start over")


def prepare_from_args(args, units, source, min_int_score=None):
    manifest = prepare(units, args.out, source=source, tokenizer=args.tokenizer, ranks_path=args.ranks_path,
                       val_tokens=args.val_tokens, shard_tokens=args.shard_tokens, max_tokens=args.max_tokens,
                       min_int_score=min_int_score, workers=args.workers, max_shards=args.max_shards,
                       overwrite=args.overwrite)
    status = "complete" if manifest["complete"] else "stopped early; run again to resume"
    print(f"{args.out}: {len(manifest['shards'])} shards, {manifest['tokens']['train']:,} train + "
          f"{manifest['tokens']['val']:,} val tokens, {sum(manifest['documents'].values()):,} documents, "
          f"counts {manifest['counts']} ({status})")
    return manifest
