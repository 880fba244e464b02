"""Overlay the per-token loss L(i) of several checkpoints (FoX Fig. 2) and print their P(l).

    python -m scripts.plot_long_context runs/fox-llama runs/transformer-llama --out long_context.png
    python -m scripts.plot_long_context a/long_context.csv b/long_context.csv --labels FoX Transformer --smooth 1001

Each argument is a run directory, or the long_context.csv in it, written by
`python eval.py ckpt=RUN eval.tasks=[long_context]`. P(l) comes from the unsmoothed L(i).
"""
import argparse
from pathlib import Path

from evaluation.long_context import perplexity_by_length, plot_curves, read_csv


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or long_context.csv files")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the run directory name)")
    parser.add_argument("--out", default="long_context.png")
    parser.add_argument("--smooth", type=int, default=101, help="moving-average window in tokens (Fig. 7: 1001)")
    parser.add_argument("--train-len", type=int, help="draw a dashed line at the training context length")
    parser.add_argument("--min-len", type=int, default=512, help="smallest l in the P(l) table")
    args = parser.parse_args()
    runs = [Path(r) for r in args.runs]
    labels = args.labels or [r.name if r.is_dir() else r.parent.name for r in runs]
    if len(labels) != len(runs):
        parser.error(f"{len(runs)} runs but {len(labels)} labels")
    curves = {label: read_csv(run) for label, run in zip(labels, runs)}
    plot_curves(curves, args.out, args.smooth, args.train_len)
    tables = {label: perplexity_by_length(losses, args.min_len) for label, (_, losses) in curves.items()}
    lengths = sorted({l for table in tables.values() for l in table}, reverse=True)
    print("| model | " + " | ".join(f"P({l})" for l in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    for label, table in tables.items():
        print(f"| {label} | " + " | ".join(f"{table[l]:.2f}" if l in table else "–" for l in lengths) + " |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
