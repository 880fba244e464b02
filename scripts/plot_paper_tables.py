"""Markdown tables comparing checkpoints in the papers' layout, from the results.json of each.

    python -m scripts.plot_paper_tables runs/baseline-S runs/castle-S runs/castle_swl-S
    python -m scripts.plot_paper_tables runs/*/results.json --preset castle

One row per checkpoint (its run directory and attention). lm-eval tables follow the preset's
columns (CASTLE Tables 2-3, FoX Tables 1-2): accuracies in %, perplexities as they are, "–" for a
task that was not run (then Avg is "–" too). Also: held-out loss (CASTLE Table 1), P(l) (FoX
§4.1) and needle-in-a-haystack exact-match rates, where results.json has them.
"""
import argparse
import json
from pathlib import Path

from evaluation.lm_eval_adapter import PRESETS


def load(path):
    path = Path(path)
    path = path / "results.json" if path.is_dir() else path
    results = json.loads(path.read_text())
    return f"{path.parent.name} ({results.get('attention', '?')})", results


def cell(value):
    return "–" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


def lm_eval_tables(runs, presets):
    out = []
    for name in presets:
        columns = [title for title, _, _ in PRESETS[name].columns] + (["Avg"] if PRESETS[name].average else [])
        shots = sorted({k for _, r in runs for k in r.get("lm_eval", {}).get(name, {}) if k.endswith("-shot")})
        for k in shots:
            rows = [[label] + [r["lm_eval"][name].get(k, {}).get("table", {}).get(c) for c in columns]
                    for label, r in runs if k in r.get("lm_eval", {}).get(name, {})]
            out.append(f"### {name}, {k}\n\n" + table(["Model"] + columns, rows))
    return out


def other_tables(runs):
    out = []
    held = [(label, r) for label, r in runs if "heldout" in r]
    if held:
        rows = [[label, f"{r['n_params'] / 1e6:.0f}M", r["heldout"]["loss"], r["heldout"]["perplexity"]]
                for label, r in held]
        out.append("### held-out\n\n" + table(["Model", "n_params", "Eval loss", "Eval PPL"], rows))
    long = [(label, r["long_context"]["perplexity"]) for label, r in runs if "long_context" in r]
    if long:
        lengths = sorted({int(l) for _, p in long for l in p}, reverse=True)
        out.append("### perplexity P(l)\n\n" + table(["Model"] + [f"P({l})" for l in lengths],
                                                    [[label] + [p.get(str(l)) for l in lengths] for label, p in long]))
    niah = [(label, r["niah"]) for label, r in runs if "niah" in r]
    if niah:
        out.append("### needle in a haystack (exact match, %; not the paper's GPT-4o judge)\n\n" + table(
            ["Model", "easy", "easy ≤ train len", "standard", "standard ≤ train len"],
            [[label] + [None if n.get(m, {}).get(key) is None else 100 * n[m][key]
                        for m in ("easy", "standard") for key in ("accuracy", "accuracy_within_train_len")]
             for label, n in niah]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="run directories or results.json files")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="only this preset's tables")
    args = parser.parse_args()
    runs = [load(path) for path in args.results]
    presets = [args.preset] if args.preset else [p for p in PRESETS if any(p in r.get("lm_eval", {}) for _, r in runs)]
    print("\n\n".join(lm_eval_tables(runs, presets) + ([] if args.preset else other_tables(runs))))


if __name__ == "__main__":
    main()
