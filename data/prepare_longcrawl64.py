"""LongCrawl64 -> a checked local copy for the FoX recipes (`data=longcrawl64 data.dir=OUT`).

    gsutil -m cp -r gs://longcrawl64 /data/longcrawl64     # the official download, about 806 GB
    python -m data.prepare_longcrawl64 --source /data/longcrawl64 --out data/cache/longcrawl64
    python -m data.prepare_longcrawl64 --source gs://longcrawl64 --out /data/lc64 --splits val   # needs gcsfs

Run from the repository root. The zarr arrays are read directly by the loader, not converted (why: data/longcrawl64.py).
This script checks them (2-D, 65,536 columns, integer dtype, the official document counts
unless --any-rows, spot-checked token ids and no all-zero document) and makes --out hold them:
a local --source is linked (symlinks), a URL source (or --copy) is copied in blocks of whole
chunks. The copy is resumable: manifest.json records the documents copied after each block, a
re-run continues from there, and a finished run re-run only checks again. Until an array is
complete the loader refuses it (its missing chunks would read as zeros). An --out prepared from
another source, or holding shards of the other prepare scripts, is refused.
"""
import argparse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zarr

from data.longcrawl64 import ARRAYS, DOC_LEN, check_values, open_split
from data.pipeline import MANIFEST, in_range, load_manifest, locked, run_main, save_manifest

BLOCK_BYTES = 256 << 20  # copy granularity (rounded to whole chunks)


def copy_rows(src, dst_path, entry, save, workers, max_blocks):
    """Copy src into a zarr array at dst_path, resuming at entry["documents_done"]."""
    if entry["documents_done"] == 0:
        dst = zarr.create_array(dst_path, shape=src.shape, chunks=src.chunks, dtype=src.dtype, zarr_format=2,
                                compressors=src.compressors, filters=src.filters, overwrite=True)
    else:
        dst = zarr.open_array(dst_path, mode="r+")
    rows = src.shape[0]
    block = src.chunks[0] * max(1, BLOCK_BYTES // (src.chunks[0] * DOC_LEN * src.dtype.itemsize))
    starts = range(entry["documents_done"], rows, block)[:max_blocks]

    def copy(start):  # blocks are whole chunks, so threads never write the same chunk
        dst[start:start + block] = src[start:start + block]
        return min(start + block, rows)

    with ThreadPoolExecutor(workers) as pool:
        for end in pool.map(copy, starts):  # in order: documents_done is always a copied prefix
            entry["documents_done"] = end
            save()
    return entry["documents_done"] == rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m data.prepare_longcrawl64", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True,
                        help="folder or URL (gs://longcrawl64, needs gcsfs) holding train.zarr and heldout.zarr")
    parser.add_argument("--out", required=True, help="folder the loader reads (data.dir)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"], choices=["train", "val"],
                        help="val = heldout.zarr (default: both)")
    parser.add_argument("--copy", action="store_true", help="copy a local source instead of linking it")
    parser.add_argument("--any-rows", action="store_true", help="accept arrays with other document counts (subsets)")
    parser.add_argument("--check-docs", type=in_range(int, 1), default=64,
                        help="documents spot-checked per array (default %(default)s)")
    parser.add_argument("--workers", type=in_range(int, 1), default=8, help="copy threads (default %(default)s)")
    parser.add_argument("--max-blocks", type=in_range(int, 1),
                        help="stop after copying this many blocks; running again resumes")
    args = parser.parse_args(argv)

    remote = "://" in args.source
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a folder")
    out.mkdir(parents=True, exist_ok=True)
    with locked(out):
        manifest = load_manifest(out) or dict(source=args.source, tokenizer="gpt2_json", doc_len=DOC_LEN, arrays={})
        if "arrays" not in manifest:
            raise ValueError(f"{out / MANIFEST} is not a LongCrawl64 copy's (token shards of data.prepare_text?); "
                             "use another --out")
        if manifest["source"] != args.source:
            raise ValueError(f"{out} was prepared from {manifest['source']}, not {args.source}; use another --out")
        for split in args.splits:
            src = open_split(args.source, split, check_rows=not args.any_rows)
            check_values(f"{args.source}/{ARRAYS[split]}", src, args.check_docs)
            entry = manifest["arrays"].setdefault(split, dict(
                file=ARRAYS[split], shape=list(src.shape), dtype=str(src.dtype), chunks=list(src.chunks),
                documents=src.shape[0], tokens=src.shape[0] * DOC_LEN, documents_done=0, complete=False))
            dst = out / ARRAYS[split]
            if (remote or args.copy) and dst.is_symlink():  # an earlier link: writing through it would hit the source
                dst.unlink()
                entry.update(documents_done=0, complete=False)
            save_manifest(out, manifest)  # before dst changes, so the loader never takes a half-made dst for whole
            if remote or args.copy:
                if not copy_rows(src, dst, entry, lambda: save_manifest(out, manifest), args.workers, args.max_blocks):
                    print(f"{dst}: {entry['documents_done']:,} of {src.shape[0]:,} documents copied; "
                          "run again to resume")
                    return manifest
            elif not dst.is_symlink():
                if dst.exists():
                    raise ValueError(f"{dst} holds a copy made with --copy ({entry['documents_done']:,} of "
                                     f"{src.shape[0]:,} documents); pass --copy to continue it, or remove it to link "
                                     "the source instead")
                dst.symlink_to(Path(args.source, ARRAYS[split]).resolve(), target_is_directory=True)
            check_values(str(dst), open_split(out, split, check_rows=not args.any_rows), args.check_docs)
            entry.update(documents_done=src.shape[0], complete=True)
            save_manifest(out, manifest)
            print(f"{dst}: {src.shape[0]:,} documents x {DOC_LEN} tokens, {src.dtype}, chunks {src.chunks}: ok")
    return manifest


if __name__ == "__main__":
    run_main(main)
