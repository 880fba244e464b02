"""Multi-GPU scaling of train.py: tokens/s and loss curves on 1, 2, 4 ... GPUs, DDP and FSDP2, at one
global batch (so every run sees the same tokens per optimizer step and should follow the same curve).

    python -m scripts.bench_scaling --gpus 1 2 4 --parallel ddp fsdp --steps 20 --out runs/scaling -- \\
        experiment=baseline_paper_M data=text data.dir=.gpu_data/text train.micro_batch_size=16

Arguments after `--` go to every train.py run. The global batch defaults to max(gpus) x micro-batch x
context tokens, so the largest run has one micro-step per rank and the smaller ones accumulate. Prints
a markdown table (tokens/s = median over the steps after the first `--skip`, scaling efficiency
against the 1-GPU run, largest loss difference from the 1-GPU curve) and writes loss.png to --out.
On CPU (no CUDA) the runs use gloo and one process per "GPU".
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from scripts.bench_train import compose_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(n, parallel, args, extra, out_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           os.path.join(ROOT, "train.py"), *extra, f"train.out_dir={out_dir}", f"train.parallel={parallel}",
           f"train.max_steps={args.steps}", "train.log_interval=1", "train.resume=never",
           "train.if_exists=archive",
           f"train.eval_interval={10 * args.steps}", f"train.ckpt_interval={10 * args.steps}",
           "train.sample_tokens=0", f"train.global_batch_tokens={args.global_batch_tokens}"]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r and "tok_per_s" in r]


def plot(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("same global batch on 1 and more GPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--parallel", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the tokens/s median (compile, warm-up)")
    p.add_argument("--global-batch-tokens", type=int, default=None)
    p.add_argument("--out", default="runs/scaling")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.global_batch_tokens is None:
        train = compose_config(extra).train
        args.global_batch_tokens = max(args.gpus) * train.micro_batch_size * train.seq_len
    if args.skip >= args.steps:
        p.error(f"--skip {args.skip} leaves no timed steps out of --steps {args.steps}")

    curves, table = {}, []
    for parallel in args.parallel:
        for n in args.gpus:
            name = f"{n} GPU" if n == 1 else f"{n} GPUs {parallel.upper()}"
            if n == 1 and name in curves:      # one process: DDP and FSDP are the same single-device run
                continue
            rows = run_train(n, parallel, args, extra, os.path.join(args.out, f"{parallel}_{n}"))
            curves[name] = rows
            table.append((name, n, statistics.median(r["tok_per_s"] for r in rows[args.skip:])))

    single = next((tok for _, n, tok in table if n == 1), None)
    ref = curves.get("1 GPU")
    print(f"\nglobal batch {args.global_batch_tokens} tokens, {args.steps} steps; train.py {' '.join(extra)}\n")
    print("| run | tokens/s | tokens/s per GPU | scaling efficiency | final loss | max loss diff vs 1 GPU |")
    print("|---|---|---|---|---|---|")
    for name, n, tok in table:
        rows = curves[name]
        eff = f"{tok / (n * single):.0%}" if single else "-"
        diff = f"{max(abs(a['loss'] - b['loss']) for a, b in zip(rows, ref)):.4f}" if ref else "-"
        print(f"| {name} | {tok:,.0f} | {tok / n:,.0f} | {eff} | {rows[-1]['loss']:.4f} | {diff} |")
    os.makedirs(args.out, exist_ok=True)
    plot(curves, os.path.join(args.out, "loss.png"))
    print(f"\nloss curves: {os.path.join(args.out, 'loss.png')}")


if __name__ == "__main__":
    main()
