"""Token shard format: a 1024-byte header (256 little-endian int32: magic 20240520, version 1,
token count, rest zero) followed by the tokens as uint16.

This is the layout llm.c and modded-nanogpt use for their FineWeb shards, so their published
shards load as they are. The int32 count caps one shard at 2**31 - 1 tokens.
"""
import errno
import hashlib
import os
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_SHARD_TOKENS = 2**31 - 1
MAGIC_BYTES = np.array(MAGIC, dtype="<i4").tobytes()


def write_shard(path, tokens):
    """Write tokens (ints in [0, 65535]) atomically: a temp file in the same folder, then rename.

    Returns the sha256 of the file. A disk that fills mid-write leaves no file behind.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "ui"):
        raise ValueError(f"{path}: tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
    if tokens.size > MAX_SHARD_TOKENS:
        raise ValueError(f"{path}: {tokens.size} tokens is more than one shard holds ({MAX_SHARD_TOKENS})")
    if tokens.size and (tokens.min() < 0 or tokens.max() > 65535):
        raise ValueError(f"{path}: token ids must lie in [0, 65535] for a uint16 shard, "
                         f"got [{tokens.min()}, {tokens.max()}] (is the vocabulary larger than 65536?)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, VERSION, tokens.size
    payload = (header.tobytes(), tokens.astype("<u2", copy=False).tobytes())
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for part in payload:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise OSError(e.errno, f"disk full while writing shard {path}; the partial file was removed") from e
        raise
    digest = hashlib.sha256()
    for part in payload:
        digest.update(part)
    return digest.hexdigest()


def shard_num_tokens(path):
    """Token count of a shard, after checking its header and its size; ValueError says what is wrong."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if raw[:4] != MAGIC_BYTES:
        raise ValueError(f"{path}: not a token shard (it starts with {raw[:8]!r}, a shard with the int32 "
                         f"magic {MAGIC}); a foreign file, or a raw token dump without header?")
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"{path}: truncated shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[1] != VERSION:
        raise ValueError(f"{path}: shard format version {header[1]}, this code reads version {VERSION}")
    n = int(header[2])
    expected = HEADER_BYTES + 2 * n
    if n < 0 or size < expected:
        raise ValueError(f"{path}: truncated shard: the header says {n} tokens ({expected} bytes) "
                         f"but the file has {size} bytes; re-run the prepare script to rewrite it")
    if size > expected:
        raise ValueError(f"{path}: corrupt shard: the header says {n} tokens ({expected} bytes) "
                         f"but the file has {size} bytes")
    return n


def read_shard(path):
    """The tokens of a shard as a read-only uint16 array (memory-mapped)."""
    n = shard_num_tokens(path)
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))
