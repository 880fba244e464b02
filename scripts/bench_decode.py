"""Decode speed of one model: eager cached steps against CUDA-graph replays (GPT.generate_stream(cuda_graph=True)),
against the memory-bandwidth bound and, optionally, transformers' generate on the same weights.

    python -m scripts.bench_decode                                   # transformer_llama_360M, batch 1 16, ctx 4K 32K
    python -m scripts.bench_decode --model fox_pro_360M --batch 1 --ctx 4096 --compiled   # + the compiled step
    python -m scripts.bench_decode --export-hf hf/llama360M-random   # write the random model for transformers
    python -m scripts.bench_decode --hf hf/llama360M-random          # both sides load this directory's weights
    python -m scripts.bench_decode --batch 1 --ctx 4096 --compiled --fused   # + the single-launch LLaMA step
    python -m scripts.bench_decode --batch 1 --ctx 4096 --compiled --profile   # + where a step's time goes
    python -m scripts.bench_decode --batch 1 --ctx 4096 --compiled --inductor max_autotune=True   # Inductor options
    python -m scripts.bench_decode --batch 1 --ctx 4096 --capacity 32768 --fused   # 4K tokens of a 32K generation
    python -m scripts.bench_decode --device cpu --model tiny --ctx 64 --n 4 --batch 1   # smoke test

The model is an experiment config (configs/experiment/*.yaml) or `tiny`, random weights in bf16 (fp32 on CPU);
with --hf DIR (an export of scripts.export_hf) our model loads DIR's weights too. For each batch B and context
ctx a random prompt of ctx - n tokens is prefilled (--prefill-chunk tokens at a time; by default CASTLE's in one
pass: its block kernel prefills a whole prompt 11x faster than chunks scored against its cache), then n tokens are
decoded greedily (of a generation of --capacity - ctx + n tokens when given: the cache then holds --capacity
positions, as generate sizes it for a long generation, while the first n are timed): GPT.generate_stream without
and with cuda_graph (--compiled, --autotuned, --fused: also those modes), transformers' generate (max_new_tokens
= min_new_tokens = n, greedy) with its default and its static cache.
Each of ours is timed twice, after the first few steps (a graph's warm-up steps and capture): ms/token is the
mean time of the later steps when nothing reads them as they come (as GPT.generate: with a CUDA graph the host
launches each step without waiting for the one before), "waited" the median time between two tokens when the
host waits for each (as sample.py's printing does). transformers' generate waits for every token itself (its
stopping check), so both of its columns are the median gap between two of its tokens (after its compilation).
tokens/s = B / ms/token. "startup s" is the time from the first run's start to its first timed token: the
prefill, the warm-up steps, a graph's capture and whatever compiles on first use (torch.compile; Triton kernels
not in Triton's on-disk cache yet), what a fresh `sample.py` pays before its tokens come at the timed rate.

The bound is the time to read, once per step, the weights a step multiplies (an untied input embedding and
learned positions are lookups) and the whole cache at ctx positions, at --bandwidth-gbs (default 3350 GB/s:
an H100 SXM's HBM3); "x bound" is ms/token over it.

--profile (CUDA) traces PROFILED_STEPS of our steps per mode with torch.profiler and prints the GPU kernels a
step launches and their summed time: kernel time well below ms/token means the step waits on launches and
gaps between small kernels rather than on memory.
"""
import argparse
import ast
import functools
import gc
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from kernels.llama_step import MAX_BATCH as FUSED_MAX_BATCH
from model.gpt import GPT
from model.hf.convert import export_hf, read_hf_model, write_imported_run
from model.runtime import choose_device, choose_dtype
from scripts.bench_sharded_decode import cache_bytes
from scripts.bench_train import kernel_summary, model_config

SKIPPED_STEPS = 3   # GraphedDecodeStep's two eager warm-up steps and its capture; transformers compiles here
PROFILED_STEPS = 8  # --profile: steps traced after the skipped ones
TOP_KERNELS = 8


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="transformer_llama_360M", help="experiment config name, or tiny")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768], help="tokens in the cache after decoding")
    p.add_argument("--n", type=int, default=64, help="decoded tokens per row")
    p.add_argument("--capacity", type=int, default=None, help="positions the cache holds (default: each ctx): "
                   "the timed tokens are the first n of a generation that fills it")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill step, 0: the whole prompt at once (default 4096; CASTLE: 0)")
    p.add_argument("--bandwidth-gbs", type=float, default=3350.0, help="memory bandwidth of the bound, GB/s")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--hf", default=None, metavar="DIR", help="a scripts.export_hf directory: time transformers' "
                   "generate on it, and load its weights into our model too")
    p.add_argument("--export-hf", default=None, metavar="DIR", help="write the random model as a transformers "
                   "directory DIR (bf16) and exit")
    p.add_argument("--compiled", action="store_true", help="also time cuda_graph='compiled' (the step "
                   "torch.compile'd, then captured; compiling takes a minute per batch and context)")
    p.add_argument("--autotuned", action="store_true", help="also time cuda_graph='autotuned' (the compiled step "
                   "with max-autotune; tuning takes minutes per batch and context)")
    p.add_argument("--fused", action="store_true", help="also time cuda_graph='fused' (LLaMA blocks: the whole "
                   f"step as one kernel launch; batches up to {FUSED_MAX_BATCH})")
    p.add_argument("--profile", action="store_true", help=f"trace {PROFILED_STEPS} steps of each of our modes "
                   "(CUDA): kernels per step, their time, the costliest kernels")
    p.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                   help="torch._inductor.config settings for the compiled step, e.g. max_autotune=True "
                   "combo_kernels=True triton.enable_pdl=True (values are Python literals)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.inductor = inductor_settings(args.inductor)
    except ValueError as e:
        p.error(f"--inductor: {e}")
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        p.error(f"--prefill-chunk {args.prefill_chunk}: give a chunk of tokens, or 0 for the whole prompt at once")
    if args.n < SKIPPED_STEPS + 2:
        p.error(f"--n must be >= {SKIPPED_STEPS + 2}: the first {SKIPPED_STEPS + 1} tokens are not timed")
    if args.profile and args.n <= SKIPPED_STEPS + 1 + PROFILED_STEPS:
        p.error(f"--profile traces steps {SKIPPED_STEPS + 2}..{SKIPPED_STEPS + 1 + PROFILED_STEPS}: "
                f"--n must exceed {SKIPPED_STEPS + 1 + PROFILED_STEPS}")
    bad = [c for c in args.ctx if c <= args.n]
    if bad:
        p.error(f"--ctx {bad} must exceed --n {args.n}: the prompt is ctx - n tokens")
    if args.capacity is not None and args.capacity < max(args.ctx):
        p.error(f"--capacity {args.capacity} must be at least every --ctx (largest {max(args.ctx)})")
    return args


def inductor_settings(items):
    """{key: value} of KEY=VALUE strings, each key a torch._inductor.config setting (dotted for its
    sub-configs, e.g. triton.enable_pdl)."""
    known = inductor_config.get_config_copy()
    settings = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"{item!r} is not KEY=VALUE with KEY a torch._inductor.config setting")
        try:
            settings[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"{item!r}: the value must be a Python literal (True, 4, 'name')") from None
    return settings


def build_model(args, device, dtype):
    """(model, name): random weights of the experiment config, or the weights of --hf DIR."""
    if args.hf:
        config, state = read_hf_model(args.hf)
        model = GPT(config)
        model.load_state_dict(state)
        name = Path(args.hf).name
    else:
        config, _ = model_config(args.model, max(args.ctx))   # block_size = the longest context
        torch.manual_seed(args.seed)
        model = GPT(config)
        name = args.model
    return model.to(device=device, dtype=dtype).eval(), name


def export_random(model, out):
    """Write the model as a transformers directory through a temporary checkpoint (scripts.export_hf's path)."""
    with tempfile.TemporaryDirectory() as tmp:
        state = {k: v.float() for k, v in model.state_dict().items()}
        ckpt = write_imported_run(Path(tmp) / "run", model.config, state, {})
        arch = export_hf(ckpt, out, dtype=torch.bfloat16)
    print(f"wrote {out} ({arch}); time it with --hf {out}")


def weight_bytes(model):
    """Bytes of the weights a decode step reads in full: all but an untied input embedding and learned positions."""
    lookups = [] if model.config.tie_embeddings else [model.wte.weight]
    lookups += [model.wpe.weight] if model.wpe is not None else []
    return sum(p.numel() * p.element_size() for p in model.parameters()) - sum(
        p.numel() * p.element_size() for p in lookups)


def per_token_ms(stamps):
    """Median gap between consecutive token times (s) after the first steps, in ms."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1e3 * statistics.median(gaps[min(SKIPPED_STEPS, len(gaps) - 1):])


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return f"{torch.cuda.max_memory_allocated(device) / 2 ** 30:.2f}" if device.type == "cuda" else "-"


def time_ours(model, prompt, n, total, cuda_graph, prefill_chunk):
    """(ms/token with nothing waiting for the tokens, ms/token with the host waiting for each, startup s) over the
    first n tokens of a generation of `total`."""
    def stream():
        return itertools.islice(model.generate_stream(prompt, total, temperature=0, prefill_chunk=prefill_chunk,
                                                      cuda_graph=cuda_graph), n)

    stamps = []
    begin = time.perf_counter()
    for _ in stream():
        synchronize(prompt.device)
        stamps.append(time.perf_counter())
    tokens = stream()
    for _ in range(SKIPPED_STEPS + 1):
        next(tokens)
    synchronize(prompt.device)
    start = time.perf_counter()
    count = sum(1 for _ in tokens)
    synchronize(prompt.device)
    return 1e3 * (time.perf_counter() - start) / count, per_token_ms(stamps), stamps[SKIPPED_STEPS] - begin


def profile_ours(model, prompt, total, cuda_graph, prefill_chunk):
    """The GPU kernels of PROFILED_STEPS decode steps after the skipped ones (bench_train.kernel_summary)."""
    from torch.profiler import ProfilerActivity, profile
    stream = model.generate_stream(prompt, total, temperature=0, prefill_chunk=prefill_chunk, cuda_graph=cuda_graph)
    for _ in range(SKIPPED_STEPS + 1):
        next(stream)
    synchronize(prompt.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            next(stream)
        synchronize(prompt.device)
    stream.close()
    return kernel_summary(prof, PROFILED_STEPS, TOP_KERNELS)


def time_hf(hf_model, prompt, n, cache_implementation):
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        """The time of every put: the prompt's, then one per new token (generate moves each to the CPU)."""
        def __init__(self):
            self.times = []

        def put(self, value):
            synchronize(prompt.device)
            self.times.append(time.perf_counter())

        def end(self):
            pass

    stamps = Stamps()
    begin = time.perf_counter()
    out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, streamer=stamps, cache_implementation=cache_implementation)
    assert out.size(1) == prompt.size(1) + n, out.shape
    ms = per_token_ms(stamps.times[1:])       # the first put is the prompt, before the prefill
    return ms, ms, stamps.times[1 + SKIPPED_STEPS] - begin


def load_hf(path, device, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=True).to(device).eval()


def main(argv=None):
    args = parse(argv)
    for key, value in args.inductor.items():     # process-wide: every compiled step of this run
        *parents, name = key.split(".")
        setattr(functools.reduce(getattr, parents, inductor_config), name, value)
    device = choose_device(args.device)
    graph = device.type == "cuda"
    if args.profile and not graph:
        raise SystemExit("--profile traces GPU kernels: it needs a CUDA GPU (--device cuda)")
    dtype = choose_dtype("auto", device)
    model, name = build_model(args, device, dtype)
    if args.export_hf:
        return export_random(model, args.export_hf)
    print(f"{name}: {model.num_params() / 1e6:.1f}M parameters, {str(dtype).removeprefix('torch.')} on {device}; "
          f"bound at {args.bandwidth_gbs:g} GB/s (--bandwidth-gbs; 3350 GB/s: H100 SXM)"
          + (f"; a cache of {args.capacity} positions" if args.capacity else "")
          + "".join(f"; inductor {k}={v!r}" for k, v in args.inductor.items()))
    if not graph:
        print(f"no CUDA graph on {device.type}: eager rows only")
    hf_model = None
    if args.hf:
        try:
            hf_model = load_hf(args.hf, device, dtype)
        except Exception as e:                       # the table goes on without the transformers rows
            print(f"skip transformers rows: loading {args.hf} failed: {type(e).__name__}: {e}")
    n_tokens = model.config.tokenizer_vocab_size or model.config.vocab_size
    prefill_chunk = args.prefill_chunk
    if prefill_chunk is None:
        prefill_chunk = 0 if model.config.attention.startswith("castle") else 4096
    rows = []
    for B in args.batch:
        for ctx in args.ctx:
            bound_ms = 1e3 * (weight_bytes(model) + cache_bytes(model.new_cache(B, ctx, device="meta"))) / (
                args.bandwidth_gbs * 1e9)
            prompt = torch.randint(0, n_tokens, (B, ctx - args.n), device=device)
            total = (args.capacity or ctx) - prompt.shape[1]          # tokens the generation would decode
            fused = args.fused and B <= FUSED_MAX_BATCH
            if args.fused and not fused:
                print(f"skip cuda_graph=fused at batch {B}: it takes up to {FUSED_MAX_BATCH} rows")
            ours = [False] + ([True] + ["compiled"] * args.compiled + ["autotuned"] * args.autotuned
                              + ["fused"] * fused if graph else [])                   # cuda_graph values
            runs = [("eager" if not g else f"cuda_graph={g}", g,
                     lambda g=g: time_ours(model, prompt, args.n, total, g, prefill_chunk)) for g in ours]
            if hf_model is not None:
                runs += [(f"transformers {impl} cache", None, lambda impl=impl: time_hf(hf_model, prompt, args.n, impl))
                         for impl in ("dynamic", "static")]
            for mode, cuda_graph, run in runs:
                fresh_memory(device)
                try:
                    ms, waited_ms, startup_s = run()
                except Exception as e:
                    if not mode.startswith("transformers"):
                        raise
                    print(f"skip {mode} at batch {B}, ctx {ctx}: {type(e).__name__}: {e}")
                    continue
                rows.append((B, ctx, name, mode, f"{ms:.3f}", f"{waited_ms:.3f}", f"{1e3 * B / ms:.1f}",
                             f"{bound_ms:.3f}", f"{ms / bound_ms:.2f}", peak_gib(device), f"{startup_s:.2f}"))
                print(f"batch {B} ctx {ctx} {mode}: {ms:.3f} ms/token ({waited_ms:.3f} waited)", flush=True)
                if args.profile and cuda_graph is not None:
                    print(profile_ours(model, prompt, total, cuda_graph, prefill_chunk), flush=True)
    header = ("batch", "ctx", "model", "mode", "ms/token", "waited ms/token", "tokens/s", "bound ms", "x bound",
              "peak GiB", "startup s")
    print("\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
                    ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]))


if __name__ == "__main__":
    main()
