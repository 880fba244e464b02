"""Training throughput of every variant: tokens/s, MFU and peak memory for one optimizer step
(forward, backward, AdamW) on one GPU, bf16 autocast, torch.compile.

    python -m scripts.bench_train                                   # the issue's table on one GPU
    python -m scripts.bench_train --models baseline_paper_S castle_paper_S --steps 20
    python -m scripts.bench_train --models baseline_paper_S --override model.mlp_multiple_of=64
    python -m scripts.bench_train --models baseline_paper_M baseline_paper_M:train.fp8=true --override model.mlp_multiple_of=16
    python -m scripts.bench_train --models fox_pro_125M --batch-tokens 16384 --profile 25 --sdpa-backend cudnn
    python -m scripts.bench_train --device cpu --models tiny --steps 2 --batch-tokens 128 --seq-len 64 --no-compile
    python -m scripts.bench_train --models transformer_pro_125M fox_pro_125M --rounds 3   # ratios under drift
    python -m scripts.bench_train --models compare_XS compare_XS:model=castle,model.castle_causal_keys=false
    python -m scripts.bench_train --models castle_paper_XL --batch-tokens 16384 --activation-checkpointing full
    python -m scripts.bench_train --models baseline_paper_S --fused none all --plain ../shared/bench/plain_llama_step.py
    python -m scripts.bench_train --models baseline_paper_S --fused loss=chunked loss=liger norm swiglu=packed swiglu

Each model is an experiment config (configs/experiment/*.yaml) or `tiny`, with optional Hydra overrides for
all (--override) or for one after a colon (`compare_XS:model=castle,model.castle_silu=false`); the micro-batch is `--batch-tokens` tokens, i.e. that many // context sequences of the
experiment's context (or --seq-len). Random tokens: throughput does not depend on the data. MFU uses
the model's own FLOP count (`GPT.flops_per_token`: 6N + each attention's FLOPs for the keys a causal
query really sees).

With --rounds R > 1 every model is compiled and warmed once and stays resident; then R rounds each time every
model for --steps steps, every other round in reverse order, so that clock and thermal drift hit the models
alike. Rows give the median tokens/s over the rounds and their range, and each model's tokens/s relative to
the first model, round by round (median and range). Peak memory then includes the other resident models.

--fused runs every model once per spec of the fused kernels (GPTConfig.fused_*; rows "MODEL +SPEC"): "default" (the
config's own settings: each option auto, i.e. all on CUDA), "none", "all" (loss=chunked,norm,swiglu=triton) or a comma list of
loss=chunked|liger, norm, swiglu=packed|triton (swiglu alone: triton); a spec other than default turns on only its
items (the others none / false). --plain PATH first runs that yardstick script (a plain PyTorch LLaMA, plain_llama_step.py) in a
subprocess at each distinct shape of the models (layers, width, width / head_dim heads, vocabulary, context,
micro-batch), prints its rows, and adds each model's tokens/s relative to the yardstick of its shape; with
--rounds > 1 the yardstick runs again after the models, and the ratio takes the mean of its two runs.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from kernels.fused import LOSS_IMPLS
from kernels.sdpa import prefer_sdpa_backend
from model.fp8 import check_fp8_config, check_fp8_device, convert_to_fp8
from model.gpt import ACTIVATION_CHECKPOINTING, FUSED_OFF, GPT, GPTConfig
from model.runtime import CONFIG_DIR

DEFAULT_MODELS = ["baseline_paper_S", "castle_paper_S", "castle_swl_paper_S", "baseline_paper_M",
                  "castle_paper_M", "castle_swl_paper_M", "transformer_llama_125M", "fox_llama_125M",
                  "transformer_pro_125M", "fox_pro_125M"]


def compose_config(overrides):
    """The resolved train.py config (configs/config.yaml) under these Hydra overrides."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def experiment_config(name, overrides=()):
    """The train.py config of an experiment config, or of the default tiny model; `name` may carry overrides of
    its own, "EXPERIMENT:KEY=VALUE,KEY=VALUE" (applied before `overrides`)."""
    name, _, own = name.partition(":")
    return compose_config(([] if name == "tiny" else [f"experiment={name}"]) + [o for o in own.split(",") if o]
                          + list(overrides))


def config_of(cfg, seq_len):
    """(GPTConfig, context length: seq_len, else the experiment's) of a composed train.py config."""
    return GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True)), seq_len or cfg.train.seq_len


def model_config(name, seq_len, overrides=()):
    """config_of(experiment_config(name, overrides), seq_len)."""
    return config_of(experiment_config(name, overrides), seq_len)


FUSED_ALL = "loss=chunked,norm,swiglu=triton"
# --fused item -> (GPTConfig field, its values; the last one is taken when the item has none, "loss" needs one)
FUSED_ITEMS = {"loss": ("fused_loss", LOSS_IMPLS[1:]), "norm": ("fused_norm", ("true",)),
               "swiglu": ("fused_swiglu", ("packed", "triton"))}
UNFUSED = {field: str(value).lower() for field, value in FUSED_OFF.items()}   # overrides; not the defaults' auto


def fused_overrides(spec):
    """The model overrides of a --fused spec (see the module docstring): none for "default", else every
    fused kernel off (UNFUSED, not the defaults' auto) but the spec's items; ValueError on an
    unknown item."""
    if spec == "default":
        return []
    chosen = dict(UNFUSED)
    for item in ([] if spec == "none" else (FUSED_ALL if spec == "all" else spec).split(",")):
        key, _, value = item.partition("=")
        field, values = FUSED_ITEMS.get(key, (None, ()))
        value = value or (values[-1] if key != "loss" and values else "")
        if value not in values:
            raise ValueError(f"--fused item {item!r} is unknown; use none, all, or a comma list of "
                             "loss=chunked|liger, norm, swiglu=packed|triton")
        chosen[field] = value
    return [f"model.{field}={value}" for field, value in chosen.items()]


def prepare(name, args, device, extra_overrides=(), label=None):
    """A compiled, warmed-up model of experiment `name` (Hydra overrides: args.override + extra_overrides):
    a dict with its one-step function, sizes, and its row's label (default: name). train.fp8=true among the
    overrides converts the model's linear layers as train.py does."""
    cfg = experiment_config(name, list(args.override) + list(extra_overrides))
    config, T = config_of(cfg, args.seq_len)
    fp8 = cfg.train.fp8
    if fp8:
        check_fp8_config(config)
        check_fp8_device(device)
    batch = max(1, args.batch_tokens // T)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    if fp8:
        convert_to_fp8(model)
    model.checkpoint_activations(args.activation_checkpointing, args.activation_checkpointing_every)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, fused=device.type == "cuda")
    run = torch.compile(model, mode=args.compile_mode) if args.compile else model
    idx = torch.randint(0, config.vocab_size, (batch, T + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            _, loss = run(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    breaks = sum(counters["graph_break"].values())
    for _ in range(args.warmup):            # compilation and autotuning happen here
        step()
    return {"name": label or name, "model": model, "step": step, "T": T, "batch": batch, "tok_s": [],
            "graph_breaks": sum(counters["graph_break"].values()) - breaks, "shape": plain_shape(config, T, batch)}


def time_steps(bench, args, device):
    """Run args.steps timed steps of a prepared model; appends its tokens/s to bench["tok_s"]."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        bench["step"]()
    sync()
    bench["tok_s"].append(bench["batch"] * bench["T"] * args.steps / (time.perf_counter() - t0))
    if device.type == "cuda":
        bench["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30


def table_row(bench, args, device, ratios=(), plain=None):
    """The markdown row of a measured model: median tokens/s over its rounds; with several rounds also their
    range and the median (range) of its per-round ratio to the first model; with `plain` (the yardstick runs
    by shape) its ratio to the yardstick of its shape."""
    model, T, tok_s = bench["model"], bench["T"], bench["tok_s"]
    median = statistics.median(tok_s)
    mfu = f"{model.flops_per_token(T) * median / args.peak_flops:.1%}" if device.type == "cuda" else "-"
    mem = f"{bench['peak_GiB']:.1f}" if "peak_GiB" in bench else "-"
    row = (f"| {bench['name']} | {model.num_params() / 1e6:.1f}M | {T} x {bench['batch']} | {median:,.0f} | {mfu} "
           f"| {mem} |")
    if len(tok_s) > 1:
        row += (f" {min(tok_s):,.0f} - {max(tok_s):,.0f} | {statistics.median(ratios):.3f}x "
                f"({min(ratios):.3f} - {max(ratios):.3f}) |")
    if plain is not None:
        row += f" {median / statistics.mean(run['tok_s'] for run in plain[bench['shape']]):.3f}x |"
    return row


# ----------------------------------------------------------------------------- the plain-PyTorch yardstick

def plain_shape(config, T, batch):
    """The yardstick's arguments for a model: its layers, width, heads of its head_dim, vocabulary, context and
    micro-batch (CASTLE's matched head count maps back to the baseline's)."""
    return (("--L", config.n_layer), ("--d", config.n_embd), ("--h", config.n_embd // config.head_dim),
            ("--V", config.vocab_size), ("--T", T), ("--mb", batch))


def run_plain(script, shape, steps):
    """One run of the yardstick script in a subprocess (its own compile and memory): tokens/s and peak GiB."""
    cmd = [sys.executable, script, "--steps", str(steps)] + [str(a) for pair in shape for a in pair]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"([\d,]+) tokens/s, peak ([\d.]+) GiB", proc.stdout)
    if proc.returncode or not found:
        raise RuntimeError(f"the yardstick {' '.join(cmd)} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}")
    return {"tok_s": float(found[1].replace(",", "")), "peak_GiB": float(found[2])}


def measure_plain(args, shapes, plain):
    """Run the yardstick once at each shape, appending to plain[shape]; print its rows."""
    torch.cuda.empty_cache()                 # memory this process caches is memory the yardstick cannot have
    for shape in dict.fromkeys(shapes):
        run = run_plain(args.plain, shape, args.steps)
        plain.setdefault(shape, []).append(run)
        dims = " ".join(f"{k[2:]}={v}" for k, v in shape)
        print(f"| plain PyTorch ({dims}) | - | - | {run['tok_s']:,.0f} | - | {run['peak_GiB']:.1f} |"
              + (" - | - |" if args.rounds > 1 else "") + " - |", flush=True)


def model_shapes(args):
    """The yardstick shape of every model, from its config alone."""
    shapes = []
    for name in args.models:
        config, T = model_config(name, args.seq_len, args.override)
        shapes.append(plain_shape(config, T, max(1, args.batch_tokens // T)))
    return shapes


def variants(args):
    """(experiment, overrides, row label) of every model under every --fused spec."""
    label = lambda name, spec: name if spec == "default" and len(args.fused) == 1 else f"{name} +{spec}"  # noqa: E731
    return [(name, fused_overrides(spec), label(name, spec)) for name in args.models for spec in args.fused]


def kernel_summary(prof, steps, top):
    """The GPU kernels of a profile of `steps` steps: a line with the kernels per step and their summed time per
    step, then the `top` costliest (launches per step, ms per step, share of the kernel time, name)."""
    from torch.autograd import DeviceType
    by_name = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            launches, us = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (launches + 1, us + e.time_range.elapsed_us())
    total_us = sum(us for _, us in by_name.values()) or 1.0
    lines = [f"{sum(c for c, _ in by_name.values()) / steps:.0f} kernels per step, {total_us / 1e3 / steps:.3f} ms "
             f"of kernel time per step; costliest (launches per step, ms per step, share):"]
    lines += [f"  {c / steps:6.1f}  {us / 1e3 / steps:8.4f}  {100 * us / total_us:5.1f}%  {name[:100]}"
              for name, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]
    return "\n".join(lines)


def print_profile(bench, rows, device):
    """Where one step's time goes: the costliest kernels (GPU; ops on CPU) over two profiled steps, and
    the graph breaks torch.compile took (each one splits the model into separately compiled pieces)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            bench["step"]()
        if cuda:
            torch.cuda.synchronize()
    listed = "kernels" if cuda else "CPU ops"
    print(f"\n== {bench['name']}: graph breaks {bench['graph_breaks']}, {listed} of 2 steps")
    print(kernel_summary(prof, 2, rows) if cuda else
          prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70),
          flush=True)


def run_one_by_one(args, device, plain):
    """Each model compiled, timed and freed before the next; its row printed as soon as it is measured."""
    for name, overrides, label in variants(args):
        torch._dynamo.reset()                # a fresh compile per model (else the recompile limit hits)
        bench = prepare(name, args, device, overrides, label)
        time_steps(bench, args, device)
        if args.profile:
            print_profile(bench, args.profile, device)
        print(table_row(bench, args, device, plain=plain), flush=True)
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_alternating(args, device, plain):
    """--rounds: every model compiled once and kept; rounds time them in turn, every other round reversed."""
    torch._dynamo.reset()
    benches = [prepare(name, args, device, overrides, label) for name, overrides, label in variants(args)]
    for r in range(args.rounds):
        for bench in benches if r % 2 == 0 else benches[::-1]:
            time_steps(bench, args, device)
    for bench in benches if args.profile else []:
        print_profile(bench, args.profile, device)
    if plain is not None:                    # the yardstick again, now that the GPU has run a while
        measure_plain(args, [b["shape"] for b in benches], plain)
    for bench in benches:
        ratios = [t / first for t, first in zip(bench["tok_s"], benches[0]["tok_s"])]
        print(table_row(bench, args, device, ratios, plain), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    p.add_argument("--batch-tokens", type=int, default=32768, help="tokens per step (sequences = this // context)")
    p.add_argument("--override", nargs="*", default=[],
                   help="Hydra overrides for every model, e.g. model.mlp_multiple_of=64")
    p.add_argument("--seq-len", type=int, default=None, help="override the experiment's context")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="none",
                   help="blocks that recompute their forward in the backward (train.activation_checkpointing)")
    p.add_argument("--activation-checkpointing-every", type=int, default=2, metavar="K",
                   help="selective: every K-th block (train.activation_checkpointing_every)")
    p.add_argument("--peak-flops", type=float, default=989e12)
    p.add_argument("--sdpa-backend", default="auto",
                   help="backend SDPA tries first: auto, cudnn, flash, ...; fa4: FlashAttention-4 (kernels/fa4.py)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print the top ROWS kernels of each model (CUDA)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the models (all resident) this many times, alternating; median, range and ratios")
    p.add_argument("--fused", nargs="+", default=["default"], metavar="SPEC",
                   help="fused kernels, one row per spec: default, none, all, or e.g. loss=chunked,norm,swiglu=packed")
    p.add_argument("--plain", metavar="SCRIPT", default=None,
                   help="yardstick script run at each model's shape, e.g. ../shared/bench/plain_llama_step.py")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.activation_checkpointing_every < 1:
        p.error(f"--activation-checkpointing-every must be >= 1, got {args.activation_checkpointing_every}")
    if args.plain and (args.device == "cpu" or not os.path.isfile(args.plain)):
        p.error(f"--plain {args.plain}: the yardstick needs a CUDA device and an existing script file")
    for spec in args.fused:
        try:
            fused_overrides(spec)
        except ValueError as e:
            p.error(str(e))
    alternate = args.rounds > 1
    if alternate and len(args.models) * len(args.fused) > 4:
        p.error("--rounds keeps every model compiled at once: at most 4 models x --fused specs (dynamo's recompile "
                "limit)")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    print(f"command: python -m scripts.bench_train {' '.join(sys.argv[1:])}")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"activation checkpointing {args.activation_checkpointing}\n")
    print("| model | params | context x batch | tokens/s | MFU | peak GiB |"
          + (" tokens/s range | vs the first model |" if alternate else "") + (" vs plain |" if args.plain else ""))
    print("|---|---|---|---|---|---|" + ("---|---|" if alternate else "") + ("---|" if args.plain else ""), flush=True)
    plain = None
    if args.plain:                           # before any model takes GPU memory in this process
        plain = {}
        measure_plain(args, model_shapes(args), plain)
    with prefer_sdpa_backend(args.sdpa_backend):
        (run_alternating if alternate else run_one_by_one)(args, device, plain)


if __name__ == "__main__":
    main()
