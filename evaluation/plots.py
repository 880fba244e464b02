"""Loss curves of training runs (their metrics.jsonl) in one PNG: train.py draws loss.png of every
run with `plot_runs([out_dir], out_dir/loss.png)`; `python -m scripts.plot_runs RUN...` overlays runs."""
import json
import os

from model.checkpoint import atomic_write


def read_metrics(run_dir):
    """(train [(tokens, loss)], val [(tokens, val_loss)]) of a run directory."""
    train, val, tokens_at = [], [], {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for record in map(json.loads, f):
            if "loss" in record:
                tokens_at[record["step"]] = record["tokens"]
                train.append((record["tokens"], record["loss"]))
            if "val_loss" in record:
                val.append((record["step"], record["val_loss"]))
    # validation records carry the step only; place them at that step's token count
    val = [(tokens_at.get(step, step), loss) for step, loss in val]
    return train, val


def plot_runs(run_dirs, out_path):
    """Train loss (line) and validation loss (dots) per run, one colour and one legend entry per run. The y axis
    stops at 1.15x the highest final train loss: the runs' early losses, seen in every run alike, would
    otherwise squeeze the tenths they end apart into a few pixels."""
    # imported here: it takes seconds, which every train.py start (a refused bad option too) would pay
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    many = len(run_dirs) > 4
    fig, ax = plt.subplots(figsize=(9 if many else 7, 4.5))
    colors = plt.get_cmap("tab20" if len(run_dirs) > 10 else "tab10").colors
    finals = []
    for i, run_dir in enumerate(run_dirs):
        train, val = read_metrics(run_dir)
        color = colors[i % len(colors)]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.6, label=os.path.basename(os.path.normpath(run_dir)))
            finals.append(train[-1][1])
        if val:
            ax.plot(*zip(*val), "o", color=color, markersize=4)
    if finals:
        ax.set_ylim(top=1.15 * max(finals))
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (line: train, dots: validation)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small") if many else ax.legend()
    fig.tight_layout()
    atomic_write(out_path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
    return out_path
