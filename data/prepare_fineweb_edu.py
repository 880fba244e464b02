"""FineWeb-Edu -> GPT-2 token shards (the data of the CASTLE recipes).

    python -m data.prepare_fineweb_edu --config sample-10BT --out data/cache/fineweb_edu           # stream from the Hub
    python -m data.prepare_fineweb_edu --source /mirror/fineweb-edu/sample/10BT --out data/cache/fineweb_edu

Run from the repository root. --source is a Hugging Face dataset name, owner/name (default
HuggingFaceFW/fineweb-edu), whose --config
(sample-10BT, sample-100BT, sample-350BT, a CC dump such as CC-MAIN-2024-10, ...) the `datasets`
library resolves to parquet files; those are streamed with ranged reads, or fetched to the
Hugging Face cache first with --download. Or --source is a local folder of the dataset's
parquet / jsonl files (same schema: text, id, score, int_score, ...) for mirrored or offline use.

Documents are tokenized in file order ([EOT] + tiktoken encode_ordinary), the first --val-tokens
tokens form val_000000.bin and the rest train_NNNNNN.bin of --shard-tokens each, recorded in
manifest.json (tokens, documents, skipped documents, source, tokenizer, sha256 per shard).
An interrupted run resumes at its last complete shard when run again; a finished run is a no-op.
An --out that holds anything else is refused unless --overwrite.
"""
import argparse
import re
from pathlib import Path

from data.pipeline import add_prepare_args, in_range, prepare_from_args, run_main
from data.sources import expand_sources, list_units

HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name; anything else --source names must be a local path


def hub_files(name, config, download):
    """The parquet files of a Hub dataset config, as hf:// URLs or (download) local cached paths."""
    import datasets
    from huggingface_hub import HfFileSystem, snapshot_download

    try:
        urls = sorted(datasets.load_dataset_builder(name, config).config.data_files["train"])
        if not download:
            return urls
        paths = [HfFileSystem().resolve_path(url) for url in urls]
        local = snapshot_download(paths[0].repo_id, repo_type="dataset", revision=paths[0].revision,
                                  allow_patterns=[p.path_in_repo for p in paths])
    except Exception as e:  # offline, unknown dataset or config, ...: all end here with the names
        raise ValueError(f"--source {name} --config {config}: cannot get the Hub dataset's files "
                         f"({type(e).__name__}: {e}); check both names and the network, or pass a local folder of "
                         "its parquet files as --source") from e
    return [str(Path(local) / p.path_in_repo) for p in paths]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m data.prepare_fineweb_edu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="HuggingFaceFW/fineweb-edu",
                        help="Hub dataset name, or a local folder/files of parquet or jsonl (default %(default)s)")
    parser.add_argument("--config", default="sample-10BT", help="Hub dataset config (default %(default)s)")
    parser.add_argument("--download", action="store_true",
                        help="download the Hub files to the Hugging Face cache before reading (default: stream)")
    parser.add_argument("--min-int-score", type=in_range(int, 0, 5),
                        help="keep only documents with int_score >= this (the educational score 0-5; "
                             "FineWeb-Edu itself keeps >= 3)")
    add_prepare_args(parser, val_tokens=40_000_000, shard_tokens=100_000_000)
    args = parser.parse_args(argv)
    if Path(args.source).expanduser().exists():
        files, source = expand_sources([args.source]), args.source
    elif HUB_NAME.fullmatch(args.source):
        files, source = hub_files(args.source, args.config, args.download), f"{args.source} ({args.config})"
    else:
        raise FileNotFoundError(f"--source {args.source}: no such file or folder (a Hub dataset is named owner/name, "
                                "e.g. HuggingFaceFW/fineweb-edu)")
    units = list_units(files, min_int_score=args.min_int_score)
    return prepare_from_args(args, units, source=source, min_int_score=args.min_int_score)


if __name__ == "__main__":
    run_main(main)
