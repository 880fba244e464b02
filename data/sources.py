"""Documents from files: turn source paths into an ordered list of work units, read one unit.

A unit is the piece of work one process tokenizes: a parquet row group, a byte range of a
.jsonl file (~64 MB), or a whole .txt / .gz / WikiExtractor file. Units are listed in a fixed
order (sorted paths), so the token stream, hence every shard, is the same on every run.

Formats: .parquet and .jsonl / .json (JSON lines, optionally .gz) with a `text` field (FineWeb
schema: text, id, score, int_score, ...); plain text (.txt, .text, .md or no extension, optionally
.gz) = one document per file; WikiExtractor output (`<doc id url title>` blocks, e.g. wiki_00 or
wiki_00.gz) = one document per block. Paths may be fsspec URLs (hf://...) for parquet.

Files are checked when listed, before any tokenizing: an unknown extension, a binary file (a NUL
byte) or text that is mostly not UTF-8 is refused, naming the file. A few invalid UTF-8 bytes (at
most 1%, as web text has) are repaired to U+FFFD and counted instead.
"""
import codecs
import glob
import gzip
import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

UNIT_BYTES = 64 << 20  # a .jsonl file is split into byte ranges of about this size
# what a folder is searched for; not *.json, which folders hold as metadata (a .json file named itself is read)
DIR_PATTERNS = ("*.parquet", "*.jsonl", "*.jsonl.gz", "*.txt", "*.txt.gz", "wiki_*")
TEXT_SUFFIXES = ("", ".txt", ".text", ".md")  # "": WikiExtractor's wiki_00 and other plain names
JSON_SUFFIXES = (".jsonl", ".json")
FORMATS = (".txt/.text/.md or no extension (one document per file), .jsonl/.json and .parquet (a 'text' field per "
           "document), each but parquet optionally .gz, and WikiExtractor output (wiki_00, ...)")
HEAD_BYTES = 1 << 16  # how much of each file is checked when it is listed
MAX_INVALID_UTF8 = 0.01  # share of invalid UTF-8 bytes above which a file is not taken for text
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # surrogateescape decodes each invalid byte to one of these


class Unit(NamedTuple):
    kind: str  # "parquet" | "jsonl" | "text" | "wiki"
    path: str
    part: tuple = ()  # parquet: (row_group,); uncompressed jsonl: (start_byte, end_byte)


def expand_sources(sources):
    """Files named by paths, directories (searched recursively for DIR_PATTERNS) and globs, sorted."""
    files = set()
    for source in sources:
        matches = glob.glob(os.path.expanduser(source), recursive=True) or [source]
        for match in matches:
            p = Path(match)
            if p.is_dir():
                files.update(str(f) for pattern in DIR_PATTERNS for f in p.rglob(pattern) if f.is_file())
            elif p.is_file():
                files.add(str(p))
            else:
                raise FileNotFoundError(f"source {source!r}: no such file or directory; check the path")
    if not files:
        raise FileNotFoundError(f"no input files found in {list(sources)} (looked for {', '.join(DIR_PATTERNS)}); "
                                "name the files or the folder that holds them")
    files = sorted(files)
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"the sources hold no data: all {len(files)} input files are empty ({files[0]}, ...); "
                         "name files that hold documents")
    return files


def list_units(files, min_int_score=None, threads=16):
    """Units of all files, in file order. Parquet footers are read here (threads: remote files)."""
    with ThreadPoolExecutor(threads) as pool:
        return [u for units in pool.map(lambda f: _file_units(f, min_int_score), files) for u in units]


def _file_units(path, min_int_score):
    kind = file_kind(path)
    if kind == "parquet":
        pf = _parquet_file(path)
        _check_columns(path, pf.schema_arrow.names, min_int_score)
        return [Unit("parquet", path, (i,)) for i in range(pf.num_row_groups)]
    head = _read(path, HEAD_BYTES)
    check_text(path, head, final=False)
    if kind == "jsonl":
        if path.lower().endswith(".gz"):
            return [Unit("jsonl", path)]
        size = os.path.getsize(path)
        return [Unit("jsonl", path, (start, min(start + UNIT_BYTES, size))) for start in range(0, size, UNIT_BYTES)]
    return [Unit("wiki" if head.lstrip().startswith(b"<doc ") else "text", path)]


def file_kind(path):
    """"parquet", "jsonl" or "text", from the file name; an unknown extension is an error."""
    name = path.lower()
    if name.endswith(".parquet"):
        return "parquet"
    suffix = os.path.splitext(os.path.basename(name.removesuffix(".gz")))[1]
    if suffix in JSON_SUFFIXES:
        return "jsonl"
    if suffix in TEXT_SUFFIXES:
        return "text"
    raise ValueError(f"{path}: unknown file type {suffix!r}; the sources can be {FORMATS}. "
                     "Convert the file, rename it to .txt if it is plain UTF-8 text, or leave it out")


def check_text(where, raw, final=True):
    """Refuse bytes that are not UTF-8 text: a NUL byte (text has none, binary files do) or more than
    MAX_INVALID_UTF8 invalid bytes (another encoding, or binary). `final=False`: `raw` is the head of
    a file and may end inside a character."""
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{where}: not a text file (a NUL byte at byte {nul:,}); leave binary files out of the "
                         "sources")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
        return
    except UnicodeDecodeError as e:
        first = e.start
    text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(raw, final=final)
    invalid = len(_ESCAPED_BYTE.findall(text))
    if invalid > MAX_INVALID_UTF8 * len(raw):
        checked = "" if final else " at its start"
        raise ValueError(f"{where}: not UTF-8 text ({invalid:,} of {len(raw):,} bytes{checked} are invalid UTF-8, "
                         f"the first at byte {first:,}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or "
                         "leave it out of the sources")


def read_documents(unit, stats, min_int_score=None):
    """Yield the unit's non-empty documents; `stats` (a Counter) counts what was skipped or repaired."""
    docs = {"parquet": _parquet_docs, "jsonl": _jsonl_docs, "text": _text_docs, "wiki": _wiki_docs}[unit.kind]
    try:
        for text, int_score in docs(unit, stats, min_int_score):
            if text is None or not text.strip():
                stats["skipped_empty"] += 1
            elif min_int_score is not None and int_score < min_int_score:
                stats["skipped_below_min_int_score"] += 1
            else:
                yield text
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise _unreadable(unit.path, e) from e


def _open(path):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _read(path, n=-1):
    """The first `n` bytes of a file (all: -1), decompressed if .gz."""
    try:
        with _open(path) as f:
            return f.read(n)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise _unreadable(path, e) from e


def _unreadable(path, e):
    return ValueError(f"{path}: cannot decompress it ({type(e).__name__}: {e}); a truncated or corrupt .gz file: "
                      "replace it or leave it out of the sources")


def _decode(raw, stats):
    """UTF-8 text; invalid bytes become U+FFFD and are counted, never silently kept as garbage."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats["repaired_invalid_utf8"] += 1
        return raw.decode("utf-8", errors="replace")


def _parquet_file(path):
    if "://" in path:
        import fsspec  # remote (hf://, s3://, ...): ranged reads through fsspec
        return pq.ParquetFile(fsspec.open(path, "rb").open())
    try:
        return pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise ValueError(f"{path}: not a readable parquet file ({e}); replace it or leave it out of the sources") from e


def _check_columns(where, columns, min_int_score):
    needed = ["text"] + (["int_score"] if min_int_score is not None else [])
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(f"{where}: no {' or '.join(repr(c) for c in missing)} column "
                         f"(found: {', '.join(map(str, columns)) or 'none'})")


def _parquet_docs(unit, stats, min_int_score):
    columns = ["text"] + (["int_score"] if min_int_score is not None else [])
    table = _parquet_file(unit.path).read_row_group(unit.part[0], columns=columns)
    scores = table.column("int_score").to_pylist() if min_int_score is not None else [None] * table.num_rows
    yield from zip(table.column("text").to_pylist(), scores, strict=True)


def _jsonl_docs(unit, stats, min_int_score):
    with _open(unit.path) as f:
        start, end = unit.part or (0, None)
        if start > 0:  # a line belongs to the unit holding its first byte
            f.seek(start - 1)
            f.readline()
        while end is None or f.tell() < end:
            where = f"{unit.path} (byte {f.tell()})"
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(_decode(line, stats))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON line: {e}") from e
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a JSON line must be an object with a 'text' field")
            _check_columns(where, list(row), min_int_score)
            yield row["text"], row.get("int_score")


def _text_docs(unit, stats, min_int_score):
    raw = _read(unit.path)
    check_text(unit.path, raw)  # all of it: listing checked only the head
    yield _decode(raw, stats), None


def _wiki_docs(unit, stats, min_int_score):
    """WikiExtractor blocks: `<doc ...>`, the title line, the body, `</doc>`. Title-only stubs count as empty."""
    raw = _read(unit.path)
    check_text(unit.path, raw)
    text = _decode(raw, stats)
    for block in text.split("</doc>"):
        start = block.find("<doc ")
        if start < 0:
            continue
        title, _, body = block[block.find(">", start) + 1:].strip().partition("\n")
        yield (f"{title}\n{body}".strip() if body.strip() else None), None
