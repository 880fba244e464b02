"""Tokenize documents in a process pool and write train/val shards plus a manifest, resumably.

Every prepare script goes through `prepare()`. The units (data/sources.py) are tokenized in
order, each document as [EOT] + encode_ordinary(text), and the resulting token stream is cut
into shards: the first `val_tokens` tokens form `val_000000.bin`, the rest `train_NNNNNN.bin` of
exactly `shard_tokens` each (the last one shorter), until the sources or `max_tokens` train
tokens run out. After each shard, `manifest.json` records it (tokens, documents, sha256) and the
stream position (unit, token offset in it), both written atomically (temp file, fsync, rename).
So an interrupted run (even by kill -9) resumes exactly where its last shard ended, never leaves
a half shard under a shard's name, produces the same bytes as an uninterrupted one, and a
finished run re-run is a no-op; until it finishes, the manifest says `complete: false` and the
loader refuses the folder. A lock file serializes concurrent runs on one folder (e.g. several
ranks preparing the bundled sample at once): the others wait, then find the work done.

An output folder is only ever resumed or, with `overwrite`, emptied of shards: a folder holding
another preparation, a foreign manifest or shards without a manifest is refused, so shards of
two preparations never mix.
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
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.shards import MAX_SHARD_TOKENS, shard_num_tokens, write_shard
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
    this call (a later call resumes). A folder holding anything but this preparation, finished or
    not (see the module docstring), is an error, unless `overwrite`, which deletes its shards first.
    """
    if not 0 < shard_tokens <= MAX_SHARD_TOKENS or val_tokens < 0 or (max_tokens is not None and max_tokens <= 0):
        raise ValueError(f"need 0 < shard_tokens <= {MAX_SHARD_TOKENS}, val_tokens >= 0 and max_tokens > 0, "
                         f"got {shard_tokens}, {val_tokens} and {max_tokens}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"output folder {out_dir} is a file; name a folder (--out)")
    get_tokenizer(tokenizer, ranks_path)  # a missing ranks file fails here, not in every worker
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = dict(source=source, tokenizer=tokenizer, val_tokens=val_tokens, shard_tokens=shard_tokens,
                    max_tokens=max_tokens, min_int_score=min_int_score, units=len(units),
                    units_sha256=_fingerprint(units))
    with locked(out_dir):
        manifest = load_manifest(out_dir)
        problem = _folder_problem(out_dir, manifest, settings)
        if problem and not overwrite:
            raise ValueError(f"{out_dir} already holds {problem}; use another output folder (--out), or pass "
                             "--overwrite to delete its shards and start over")
        if problem or _recorded_nothing(manifest):
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
        if self.manifest["tokens"]["train"] == 0 and (self._split() == "val" or self.fill == 0):
            raise self._nothing_to_train_on()  # before a short val shard is written: a rerun starts clean
        if self.fill:
            self._flush(state=dict(unit=n_units, offset=0))
        self.manifest["complete"] = True
        save_manifest(self.out_dir, self.manifest)

    def _nothing_to_train_on(self):
        total = self.manifest["tokens"]["val"] + self.fill
        if total == 0:
            counts = collections.Counter(self.manifest["counts"]) + self.unit_stats
            return ValueError(f"the sources hold no documents ({dict(counts)}); check the source files "
                              "(and --min-int-score)")
        again = " and pass --overwrite" if self.manifest["shards"] else ""
        return ValueError(f"the sources gave {total:,} tokens, no more than the validation split takes "
                          f"(--val-tokens {self.settings['val_tokens']:,}): nothing is left for training; "
                          f"give --val-tokens a value below {total:,}{again}")

    def _flush(self, state):
        split, tokens = self._split(), self.buffer[:self.fill]
        index = sum(s["split"] == split for s in self.manifest["shards"])
        name = f"{split}_{index:06d}.bin"
        if not self.manifest["shards"]:  # recorded before the first shard, so a killed run leaves a folder it resumes
            save_manifest(self.out_dir, self.manifest)
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
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable manifest ({e}); the prepare scripts write it atomically, so it "
                         "was changed by hand or by another program: remove it, or use another folder") from e


def save_manifest(out_dir, manifest):
    tmp = out_dir / f"{MANIFEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())  # the manifest never points at data a crash could lose
    os.replace(tmp, out_dir / MANIFEST)


def _recorded_nothing(manifest):
    """A run of ours stopped before it recorded a shard: nothing to keep, whatever its settings.

    Shard files beside such a manifest are its own (its folder had none when it started), e.g. one
    renamed into place just before a kill -9 stopped the manifest's update."""
    return manifest is not None and isinstance(manifest.get("settings"), dict) and not manifest["shards"]


def _folder_problem(out_dir, manifest, settings):
    """What keeps `out_dir` from being resumed with `settings` ("" if nothing does)."""
    if _recorded_nothing(manifest):
        return ""
    if manifest is None:
        strays = sorted(p.name for p in _shard_files(out_dir))
        if not strays:
            return ""
        return f"shards without a {MANIFEST} ({', '.join(strays[:3])}{', ...' if len(strays) > 3 else ''})"
    if not isinstance(manifest.get("settings"), dict):
        return f"a {MANIFEST} that is not a shard preparation's (a LongCrawl64 copy?)"
    diff = _settings_diff(manifest["settings"], settings)
    if diff:
        return f"a preparation with other settings ({diff})"
    damage = manifest["complete"] and _shards_problem(out_dir, manifest)
    return f"a damaged preparation ({damage})" if damage else ""


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


def _shard_files(out_dir):
    return [*out_dir.glob("train_*.bin"), *out_dir.glob("val_*.bin")]


def _delete_outputs(out_dir):
    for path in [*_shard_files(out_dir), out_dir / MANIFEST]:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(out_dir):
    with open(out_dir / ".lock", "a") as f:  # "a": the lock file is never rewritten
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---- command line, shared by the prepare scripts ----

def parse_count(text):
    """'100M' -> 100_000_000; also K, G/B, plain ints and 1e8."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kKmMgGbB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (examples: 5000, 100M, 10B)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}[m[2].lower()]
    try:
        value = float(m[1]) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (examples: 5000, 100M, 10B)") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r} = {value}")
    return int(value)


def in_range(parse, low, high=None):
    """An argparse type: `parse`, then demand low <= value (<= high)."""
    def check(text):
        value = parse(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {'inf' if high is None else high}]")
        return value
    check.__name__ = parse.__name__  # argparse names it in "invalid int value: 'x'"
    return check


def add_prepare_args(parser, *, val_tokens, shard_tokens):
    parser.add_argument("--out", required=True, help="output folder for the shards and manifest.json")
    parser.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "gpt2_json"],
                        help="gpt2: tiktoken GPT-2 BPE; gpt2_json: the same on JSON-escaped text (LongCrawl64 style)")
    parser.add_argument("--ranks-path",
                        help="local r50k_base.tiktoken (default: $GPT2_RANKS_PATH, then the bundled copy)")
    parser.add_argument("--val-tokens", type=in_range(parse_count, 0), default=val_tokens,
                        help="tokens at the start of the stream that form the validation shard (default %(default)s)")
    parser.add_argument("--shard-tokens", type=in_range(parse_count, 1, MAX_SHARD_TOKENS), default=shard_tokens,
                        help="tokens per training shard (default %(default)s)")
    parser.add_argument("--max-tokens", type=in_range(parse_count, 1),
                        help="token budget: stop after this many training tokens (default: all of the source)")
    parser.add_argument("--workers", type=in_range(int, 1), default=len(os.sched_getaffinity(0)),
                        help="tokenizer processes (default: all cores, %(default)s)")
    parser.add_argument("--max-shards", type=in_range(int, 1),
                        help="stop after writing this many shards; running again resumes (to prepare in pieces)")
    parser.add_argument("--overwrite", action="store_true",
                        help="if --out holds anything but this preparation, finished or not (another preparation, "
                             "shards without manifest.json, damaged shards), delete its shards and start over")


def run_main(main):
    """Run a prepare script's `main` from the command line: a user error (ValueError, FileNotFoundError)
    prints as one line and exits 2, as argparse's own errors do; anything else is a bug and keeps its traceback."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


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
