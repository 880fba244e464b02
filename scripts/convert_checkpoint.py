"""Convert a sharded checkpoint (train.ckpt_format=dcp) into the single-file format (ckpt_format=full).

    python -m scripts.convert_checkpoint --src runs/castle-24x2048-fineweb_edu --out castle_xl.pt
    python -m scripts.convert_checkpoint --src runs/castle-24x2048-fineweb_edu/ckpt_5000.dcp --out castle_xl.pt

--src: a ckpt_<step>.dcp directory, or a run directory (its newest readable checkpoint). The shards of
every rank are stitched together in this one process, whatever world size wrote them, so it needs
memory for the whole model and optimizer state. The file holds what a full checkpoint holds (model,
optimizer, loader position, RNG states, configs): sample.py, eval.py and train.py (train.resume=FILE)
read it. Written under a temporary name and renamed at the end; an existing --out is refused.
"""
import argparse
import os

from model.checkpoint import disk_bytes, load_checkpoint, write_checkpoint_file
from model.runtime import user_errors


def convert(src, out):
    """-> the checkpoint converted (a .pt is copied as it is)."""
    if os.path.exists(out):
        raise ValueError(f"--out {out} exists; pass a new file name (nothing is overwritten)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise FileNotFoundError(f"--out {out}: its folder does not exist; create it first")
    file, ckpt = load_checkpoint(src)
    write_checkpoint_file(out, ckpt)
    return file


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="ckpt_<step>.dcp directory, or run directory (its newest checkpoint)")
    p.add_argument("--out", required=True, help="the .pt file to write (must not exist)")
    args = p.parse_args(argv)
    with user_errors():
        file = convert(args.src, args.out)
    print(f"wrote {args.out} ({disk_bytes(args.out) / 1e6:,.1f} MB) from {file}")


if __name__ == "__main__":
    main()
