"""GPT-2 BPE tokenizers that work offline.

`get_tokenizer("gpt2")` is a tiktoken Encoding built from a local ranks file when one is found, so
machines without internet work; `get_tokenizer("gpt2_json")` wraps it the way LongCrawl64 was
tokenized for FoX (arXiv:2503.02130): on JSON-escaped text, as the FoX code release's tokenizer
(zhixuan-lin/longcrawl64-json-gpt2-tokenizer on the Hugging Face Hub) does.

Where the GPT-2 ranks come from, first hit wins:

1. the `ranks_path` argument, 2. the `GPT2_RANKS_PATH` environment variable,
3. the bundled `data/sample/r50k_base.tiktoken`, 4. tiktoken's own download (needs network;
   set `GPT2_RANKS_OFFLINE=1` to forbid it, e.g. to test the offline error).

A relative path is looked up in the working directory, then in the repository root. Every local
file is checked against the published sha256 of r50k_base, so all of them give the same
tokenizer; a missing file named in 1 or 2 only warns and the search goes on.
"""
import base64
import functools
import hashlib
import json
import os
import re
import warnings
from pathlib import Path

import tiktoken

from data import REPO_ROOT

EOT = 50256  # <|endoftext|>: document separator and BOS
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
BUNDLED_RANKS = REPO_ROOT / "data" / "sample" / "r50k_base.tiktoken"
# tiktoken's r50k_base split regex (the GPT-2 pattern with possessive quantifiers)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def get_tokenizer(name="gpt2", ranks_path=None):
    """Tokenizer with `encode_ordinary(text)`, `decode(ids)`, `eot_token` (50256) and `n_vocab`."""
    if name == "gpt2":
        return _gpt2_encoding(ranks_path)
    if name == "gpt2_json":
        return JSONGPT2Tokenizer(_gpt2_encoding(ranks_path))
    raise ValueError(f"unknown tokenizer {name!r}: expected 'gpt2' or 'gpt2_json'")


def _gpt2_encoding(ranks_path):
    tried = []
    for origin, path in (("ranks_path", ranks_path), ("$GPT2_RANKS_PATH", os.environ.get("GPT2_RANKS_PATH"))):
        if not path:
            continue
        found = [p for p in (Path(path).expanduser(), REPO_ROOT / path) if p.is_file()]  # CWD, then repo root
        if found:
            return _encoding_from_file(str(found[0].resolve()))
        warnings.warn(f"GPT-2 ranks file {path} (from {origin}) does not exist; looking elsewhere", stacklevel=3)
        tried.append(f"{path} (from {origin}): missing")
    if BUNDLED_RANKS.is_file():
        return _encoding_from_file(str(BUNDLED_RANKS))
    tried.append(f"{BUNDLED_RANKS} (bundled): missing")
    if os.environ.get("GPT2_RANKS_OFFLINE", "") not in ("", "0"):
        tried.append("tiktoken download: disabled by GPT2_RANKS_OFFLINE")
    else:
        try:
            return tiktoken.get_encoding("r50k_base")
        except Exception as e:  # any network / cache failure ends up in the message below
            tried.append(f"tiktoken download: failed ({type(e).__name__}: {e})")
    raise FileNotFoundError(
        "cannot load the GPT-2 tokenizer ranks (r50k_base.tiktoken). Tried:\n  - " + "\n  - ".join(tried)
        + f"\nFix: put r50k_base.tiktoken (sha256 {GPT2_RANKS_SHA256[:8]}…) at {BUNDLED_RANKS}, or set "
        "GPT2_RANKS_PATH=/path/to/r50k_base.tiktoken (data.ranks_path in the Hydra config), or allow "
        "network access so tiktoken can download it.")


@functools.lru_cache(maxsize=None)
def _encoding_from_file(path):
    """Build the r50k_base Encoding from a local ranks file (one `base64-token rank` per line)."""
    contents = Path(path).read_bytes()
    digest = hashlib.sha256(contents).hexdigest()
    if digest != GPT2_RANKS_SHA256:
        raise ValueError(f"{path}: sha256 {digest} is not the GPT-2 r50k_base ranks file "
                         f"({GPT2_RANKS_SHA256}); the file is corrupt or a different vocabulary")
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in contents.splitlines() if line)}
    return tiktoken.Encoding(name="r50k_base", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=EOT + 1)


# One JSON string escape: \" \\ \/ \b \f \n \r \t or \uXXXX (surrogate halves are paired up after).
_JSON_ESCAPE = re.compile(r'\\(?:u[0-9a-fA-F]{4}|["\\/bfnrt])')
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def json_unescape(s):
    """Undo `json.dumps(text)[1:-1]`, also on a slice of it: broken escapes at the cut stay as they are."""
    out = _JSON_ESCAPE.sub(lambda m: chr(int(m[0][2:], 16)) if m[0][1] == "u" else _SIMPLE_ESCAPES[m[0][1]], s)
    # json.dumps writes characters above U+FFFF as two \u surrogates; join them, keep lone halves visible
    return out.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class JSONGPT2Tokenizer:
    """GPT-2 BPE applied to the JSON-escaped text, as LongCrawl64 was built (see the module docstring).

    A newline is encoded as the two characters `\\` `n`, quotes as `\\"`, non-ASCII as `\\uXXXX`;
    `decode` turns them back. Evaluation prompts on LongCrawl64 models must go through this.
    """

    def __init__(self, encoding):
        self.encoding = encoding
        self.name = "gpt2_json"
        self.eot_token = encoding.eot_token
        self.n_vocab = encoding.n_vocab

    def encode_ordinary(self, text):
        return self.encoding.encode_ordinary(json.dumps(text)[1:-1])

    def decode(self, ids):
        return json_unescape(self.encoding.decode(ids))


def tokenizer_for(data_cfg):
    """The tokenizer a data config (configs/data/*.yaml, or a checkpoint's saved copy) was built with."""
    return get_tokenizer(data_cfg.get("tokenizer", "gpt2"), data_cfg.get("ranks_path"))
