"""Loss curves of one or more training runs (their metrics.jsonl) in one PNG.

    python -m scripts.plot_runs runs/llama-4x128-sample runs/castle-4x128-sample --out curves.png
"""
import argparse

from evaluation.plots import plot_runs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories holding metrics.jsonl")
    p.add_argument("--out", default="loss_curves.png")
    args = p.parse_args()
    print(f"wrote {plot_runs(args.runs, args.out)}")


if __name__ == "__main__":
    main()
