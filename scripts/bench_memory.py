"""The largest micro-batch that fits in memory under each activation-checkpointing mode
(train.activation_checkpointing), and the tokens/s of each at that micro-batch.

    python -m scripts.bench_memory --models baseline_paper_XL                    # none, selective, full
    python -m scripts.bench_memory --models castle_paper_XL --modes full --max-batch 64
    python -m scripts.bench_memory --models fox_pro_760M --batch 4               # every mode at one micro-batch
    python -m scripts.bench_memory --device cpu --models tiny --seq-len 64 --memory-gib 0.05 --no-compile \
        --override model.vocab_size=512

A training step is forward, backward and AdamW, bf16 autocast on CUDA, on random tokens of the
experiment's context (or --seq-len). For each model one eager model (no compile: cheap) is built and
stepped once, so that its AdamW state exists; then for every mode a search, doubling and then
bisecting, finds the largest micro-batch (sequences) up to --max-batch whose step fits --memory-gib:
on CUDA the step must run with the allocator capped there (set_per_process_memory_fraction, so a larger
card answers for a smaller one; default the whole card), on CPU the parameters, gradients, AdamW state
and the step's own allocations (the profiler's allocation records) must peak within it. A search
assumes that what fits at a micro-batch fits at every smaller one. Then every mode is compiled and
timed at its micro-batch (scripts.bench_train's step); where the compiled step does not fit there, it is
timed at 3/4 and then 1/2 of it instead (the row's "timed at"), since a compiled step can need more memory
than the eager one at the same micro-batch; "vs none" is the tokens/s against mode none's row (--modes
none first). Rows print as soon as measured.

Every measured peak stands next to the memory plan's estimate for the same step (model/memory_plan.py,
which train.py prints and checks before its first step), without its fixed CUDA-context allowance since
the measured peak is the allocator's (max_memory_allocated), and their ratio: "plan / peak" within
0.85 - 1.15 is the plan's target. The eager search compares with the plan of an eager step, the timed
compiled step with the plan of a compiled one.
"""
import argparse
import gc
import sys
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from kernels.sdpa import prefer_sdpa_backend
from model.gpt import ACTIVATION_CHECKPOINTING, GPT
from model.memory_plan import memory_plan
from scripts.bench_train import model_config, prepare, time_steps


def largest_fitting(fits, limit):
    """The largest b in [1, limit] with fits(b), or 0: doubling from 1 up to the first b that does not
    fit, then bisecting; fits must be monotone (true up to some b, false beyond)."""
    good, bad, b = 0, limit + 1, 1
    while b <= limit:
        if not fits(b):
            bad = b
            break
        good, b = b, 2 * b
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def cpu_peak_bytes(fn):
    """Peak of the CPU bytes that fn allocates and has not yet freed, over its run, from the
    allocator's records in the profiler (every allocation and free, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def state_bytes(model, opt):
    """Bytes that live across steps: the parameters and the AdamW state (gradients are made in every backward)."""
    tensors = list(model.parameters()) + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


class EagerProbe:
    """One eager model and optimizer; `peak(batch)` runs a training step at that micro-batch and returns its
    peak bytes (CUDA: max_memory_allocated; CPU: state_bytes + cpu_peak_bytes), or None when CUDA runs out
    of the memory it may use."""

    def __init__(self, name, args, device):
        self.config, self.T = model_config(name, args.seq_len, args.override)
        self.device = device
        torch.manual_seed(0)
        self.model = GPT(self.config).to(device)
        self.opt = torch.optim.AdamW(self.model.param_groups(0.1), lr=1e-4, fused=device.type == "cuda")
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        self.step(1)                          # AdamW allocates its state in its first step

    def step(self, batch):
        idx = torch.randint(0, self.config.vocab_size, (batch, self.T + 1), device=self.device)
        with self.autocast:
            _, loss = self.model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def peak(self, batch):
        if self.device.type != "cuda":
            return state_bytes(self.model, self.opt) + cpu_peak_bytes(lambda: self.step(batch))
        torch.cuda.reset_peak_memory_stats()
        try:
            self.step(batch)
            return torch.cuda.max_memory_allocated()
        except torch.OutOfMemoryError:
            self.opt.zero_grad(set_to_none=True)   # the gradients a failed backward left
            return None
        finally:
            torch.cuda.empty_cache()


def planned_bytes(config, T, batch, mode, args, device, compiled):
    """The memory plan's peak for one step of this model, less its CUDA-context allowance."""
    plan = memory_plan(config, micro_batch=batch, seq_len=T, activation_checkpointing=mode,
                       activation_checkpointing_every=args.activation_checkpointing_every,
                       autocast=device.type == "cuda", device_type=device.type, compiled=compiled)
    return plan["peak"] - plan["terms"]["context"]


def versus_plan(measured, planned):
    """'plan GiB | plan / peak |' cells."""
    if not measured:
        return f" {planned / 2**30:.2f} | - |"
    return f" {planned / 2**30:.2f} | {planned / measured:.2f} |"


def search(name, args, device, limit_bytes):
    """{mode: (blocks recomputed, micro-batch, peak bytes at it)} for every mode of args.modes, from one eager model."""
    probe = EagerProbe(name, args, device)
    found = {}
    for mode in args.modes:
        recomputed = probe.model.checkpoint_activations(mode, args.activation_checkpointing_every)
        peaks = {}

        def fits(batch):
            peaks[batch] = probe.peak(batch)
            return peaks[batch] is not None and peaks[batch] <= limit_bytes

        if args.batch:
            fits(args.batch)
        batch = args.batch or largest_fitting(fits, args.max_batch)
        found[mode] = (recomputed, batch, peaks.get(batch))
        planned = planned_bytes(probe.config, probe.T, max(batch, 1), mode, args, device, compiled=False)
        print(f"{name}: activation checkpointing {mode}: micro-batch {batch}"
              + (" (given)" if args.batch else f" of <= {args.max_batch} fits, eager")
              + (f", peak {peaks[batch] / 2**30:.2f} GiB, plan {planned / 2**30:.2f} GiB "
                 f"({planned / peaks[batch]:.2f}x)" if peaks.get(batch) else ""), flush=True)
    return found


def backoff_batches(batch):
    """The micro-batches a compiled timing tries, largest first: the eager search's maximum, then 3/4 and 1/2
    of it (a compiled step can need more memory than the eager step the search measured)."""
    return sorted({batch, -(-3 * batch // 4), -(-batch // 2)}, reverse=True)


def compiled_timing(name, mode, batches, args, device):
    """(micro-batch, bench) of the first of `batches` whose compiled (unless --no-compile) step fits, or
    (None, None)."""
    T = model_config(name, args.seq_len, args.override)[1]
    for batch in batches:
        torch._dynamo.reset()
        timing = SimpleNamespace(**{**vars(args), "batch_tokens": batch * T, "activation_checkpointing": mode})
        try:
            bench = prepare(name, timing, device)
            time_steps(bench, timing, device)
            return batch, bench
        except torch.OutOfMemoryError:
            pass
        bench = None      # free the failed attempt's model and optimizer (outside the except: its traceback
        gc.collect()      # holds the frames that made them) before the next, smaller one
        torch.cuda.empty_cache()
    return None, None


def timed_row(name, mode, recomputed, batch, eager_peak, args, device, none_tok_s=None):
    """(markdown row, tokens/s or None): this mode timed at its micro-batch, or a smaller one
    (backoff_batches) when the compiled step does not fit there; `none_tok_s` gives the 'vs none' cell."""
    config, T = model_config(name, args.seq_len, args.override)
    gib = f"{eager_peak / 2**30:.2f}" if eager_peak else "-"
    row = f"| {name} | {mode} | {recomputed}/{config.n_layer} | {T} | {batch} | {gib} |"
    if batch == 0:
        return row + " - |" * 9, None
    eager_vs_plan = versus_plan(eager_peak, planned_bytes(config, T, batch, mode, args, device, compiled=False))
    timed_batch, bench = compiled_timing(name, mode, [batch] if args.batch else backoff_batches(batch), args, device)
    if bench is None:
        planned = planned_bytes(config, T, batch, mode, args, device, compiled=args.compile)
        return row + " - | does not fit compiled | - | - | - |" + eager_vs_plan + versus_plan(None, planned), None
    planned = planned_bytes(config, T, timed_batch, mode, args, device, compiled=args.compile)
    tok_s = bench["tok_s"][-1]
    none_tok_s = tok_s if mode == "none" else none_tok_s
    versus_none = f"{tok_s / none_tok_s:.2f}x" if none_tok_s else "-"
    mfu = f"{bench['model'].flops_per_token(T) * tok_s / args.peak_flops:.1%}" if device.type == "cuda" else "-"
    peak = f"{bench['peak_GiB']:.2f}" if "peak_GiB" in bench else "-"
    return (row + f" {timed_batch} | {tok_s:,.0f} | {versus_none} | {mfu} | {peak} |" + eager_vs_plan
            + versus_plan(bench["peak_GiB"] * 2**30 if "peak_GiB" in bench else None, planned)), tok_s


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True, help="experiment configs (configs/experiment/) or tiny")
    p.add_argument("--modes", nargs="+", choices=ACTIVATION_CHECKPOINTING, default=list(ACTIVATION_CHECKPOINTING))
    p.add_argument("--activation-checkpointing-every", type=int, default=2, metavar="K",
                   help="selective: every K-th block (train.activation_checkpointing_every)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory a step may use (CUDA default: the whole card; required on CPU)")
    p.add_argument("--max-batch", type=int, default=256, help="the search's largest micro-batch")
    p.add_argument("--batch", type=int, default=None,
                   help="no search: measure and time every mode at this micro-batch")
    p.add_argument("--override", nargs="*", default=[], help="Hydra overrides for every model")
    p.add_argument("--seq-len", type=int, default=None, help="override the experiment's context")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (compilation happens here)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--peak-flops", type=float, default=989e12)
    p.add_argument("--sdpa-backend", default="auto",
                   help="backend SDPA tries first: auto, cudnn, flash, ...; fa4: FlashAttention-4 (kernels/fa4.py)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:      # the memory cap needs an explicit index
        device = torch.device("cuda", torch.cuda.current_device())
    for flag, value, low in [("--activation-checkpointing-every", args.activation_checkpointing_every, 1),
                             ("--max-batch", args.max_batch, 1), ("--batch", args.batch or 1, 1),
                             ("--steps", args.steps, 1), ("--warmup", args.warmup, 0)]:
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        total = torch.cuda.get_device_properties(device).total_memory
        if args.memory_gib is not None and args.memory_gib * 2**30 > total:
            p.error(f"--memory-gib {args.memory_gib} exceeds the card's {total / 2**30:.1f} GiB")
        limit = total if args.memory_gib is None else args.memory_gib * 2**30
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
    elif args.memory_gib is None:
        p.error("--memory-gib is required on CPU (it has no card whose size bounds the search)")
    else:
        limit = args.memory_gib * 2**30
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"command: python -m scripts.bench_memory {' '.join(sys.argv[1:])}")
    print(f"device: {name}, torch {torch.__version__}, memory limit {limit / 2**30:.2f} GiB\n", flush=True)
    with prefer_sdpa_backend(args.sdpa_backend):
        for model in args.models:
            found = search(model, args, device, limit)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            timed = "compiled" if args.compile else "eager"
            print("\n| model | activation checkpointing | blocks recomputed | context | micro-batch | "
                  f"peak GiB (eager) | timed at | tokens/s | vs none | MFU | peak GiB (timed, {timed}) | "
                  f"plan GiB (eager) | plan / peak (eager) | plan GiB ({timed}) | plan / peak ({timed}) |\n"
                  + "|---" * 15 + "|", flush=True)
            none_tok_s = None
            for mode, (recomputed, batch, peak) in found.items():
                row, tok_s = timed_row(model, mode, recomputed, batch, peak, args, device, none_tok_s)
                none_tok_s = tok_s if mode == "none" else none_tok_s
                print(row, flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print()


if __name__ == "__main__":
    main()
