"""Tokenize local text files into train/val shards (GPT-2 BPE, EOT before each document).

    python -m data.prepare_text --source ../shared/data/text/wikipedia_en_wikiextractor --out data/cache/text

Run from the repository root. Sources: files, folders (searched recursively) or globs of .txt
(one document per file), .jsonl / .json lines and .parquet (a `text` field per document), any
of them but parquet .gz, and WikiExtractor output (`<doc ...>` blocks, e.g. wiki_00.gz).
Binary files, text that is not UTF-8 and unknown extensions are refused before any work.
Output: val_000000.bin (the first --val-tokens tokens), train_NNNNNN.bin and manifest.json;
running the same command again resumes an interrupted run (data/pipeline.py). An --out that
holds anything else is refused unless --overwrite.
"""
import argparse

from data.pipeline import add_prepare_args, prepare_from_args, run_main
from data.sources import expand_sources, list_units


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m data.prepare_text", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", nargs="+", required=True, help="input files, folders or globs")
    add_prepare_args(parser, val_tokens=1_000_000, shard_tokens=100_000_000)
    args = parser.parse_args(argv)
    files = expand_sources(args.source)
    return prepare_from_args(args, list_units(files), source=args.source)


if __name__ == "__main__":
    run_main(main)
