"""results.json: every evaluation of one checkpoint in one JSON file.

Results of earlier eval.py runs on the same checkpoint stay; new ones replace theirs (nested dicts
merge). A results file that belongs to another checkpoint is never overwritten: it is moved to
results_<its checkpoint's name>.json next to it first. Writes are atomic (a temporary file, then a
rename), so a crash leaves the previous file whole.
"""
import json
import os
from pathlib import Path

from model.checkpoint import atomic_write


def load(path, ckpt_path):
    """The results already in `path` for this checkpoint file, else a fresh dict."""
    old = read(path)
    return old if old and old.get("checkpoint") == os.path.abspath(ckpt_path) else {}


def read(path):
    """The dict in `path` (None when there is no file); a file that is not a JSON object is a user error."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            old = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a results file (invalid JSON: {e}); move it away or write the results "
                         "elsewhere with out=PATH") from None
    if not isinstance(old, dict):
        raise ValueError(f"{path} is not a results file (a JSON {type(old).__name__}, not an object); move it "
                         "away or write the results elsewhere with out=PATH")
    return old


def merge(old, new):
    """Nested dicts: the new values win, keys only the old one has stay."""
    for key, value in new.items():
        old[key] = merge(old[key], value) if isinstance(value, dict) and isinstance(old.get(key), dict) else value
    return old


def save(path, results):
    """Write `results` to `path` atomically; another checkpoint's results there are moved aside first.
    Returns the path they were moved to, or None."""
    old = read(path)
    moved = None
    if old is not None and old.get("checkpoint") != results["checkpoint"]:
        moved = free_name(path, Path(old.get("checkpoint") or "previous").stem)
        os.replace(path, moved)
        print(f"results: {path} held the results of {old.get('checkpoint')}; moved them to {moved}")
    atomic_write(str(path), lambda f: f.write(json.dumps(results, indent=2).encode()))
    return moved


def free_name(path, tag):
    """results_<tag>.json next to `path`, with a counter when that name is taken."""
    path = Path(path)
    candidate, n = path.with_name(f"{path.stem}_{tag}{path.suffix}"), 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.stem}_{tag}.{n}{path.suffix}"), n + 1
    return candidate
