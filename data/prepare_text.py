"""Tokenize local text files into train/val shards (GPT-2 BPE, EOT before each document).

    python data/prepare_text.py --source ../shared/data/text/wikipedia_en_wikiextractor --out data/cache/text

Sources: files, folders (searched recursively) or globs of .txt (one document per file),
.jsonl / .json lines and .parquet (a `text` field per document), any of them .gz, and
WikiExtractor output (`<doc ...>` blocks, e.g. wiki_00.gz). Output: val_000000.bin (the first
--val-tokens tokens), train_NNNNNN.bin and manifest.json; see data/pipeline.py for resuming.
"""
import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.pipeline import add_prepare_args, prepare_from_args  # noqa: E402
from data.sources import expand_sources, list_units  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", nargs="+", required=True, help="input files, folders or globs")
    add_prepare_args(parser, val_tokens=1_000_000, shard_tokens=100_000_000)
    args = parser.parse_args(argv)
    files = expand_sources(args.source)
    return prepare_from_args(args, list_units(files), source=args.source)


if __name__ == "__main__":
    main()
