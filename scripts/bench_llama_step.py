"""Times the single-launch LLaMA decode step (kernels/llama_step) alone, replayed in a CUDA graph, against the
memory-bandwidth bound, with its grid barriers alone next to it (the floor the phases' barriers set).

    python -m scripts.bench_llama_step --ctx 4096 32768 --bandwidth-gbs 4800
    python -m scripts.bench_llama_step --ctx 4096 --variants "" programs=264 "stages=4 num_warps=8"
    python -m scripts.bench_llama_step --ctx 4096 32768 --gluon      # the Gluon kernel (gluon.py) after them
    python -m scripts.bench_llama_step --ctx 4096 --capacity 32768   # a 4K context in a cache of 32K rows

Random bf16 weights at the Transformer (LLaMA) 360M shapes (24 layers, d 1024, 16 heads of 64, F 2816, vocabulary
50304), batch 1, the cache filled to ctx rows (of --capacity, default ctx: a step should cost what its
context does, not what its cache could hold). A variant is decode_step_triton keyword arguments (space-separated
KEY=VALUE, Python literals); "" is the defaults. The bound reads every weight and the whole cache once.
"""
import argparse
import ast

import torch

from kernels.llama_step import LlamaStepWeights
from kernels.llama_step.gluon import decode_step_gluon
from kernels.llama_step.triton import _grid_sync, decode_step_triton, tl, triton
from model.gpt import rope_tables

SHAPE = dict(L=24, d=1024, H=16, D=64, F=2816, V=50304)


@triton.jit
def _barriers_kernel(BAR, N):
    """N grid barriers and nothing else."""
    for i in range(N):
        _grid_sync(BAR, (i + 1) * tl.num_programs(0))


def replay_ms(fn, reps=50):
    """Median ms of one replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def parse_variant(text):
    """'stages=4 num_warps=8' -> {'stages': 4, 'num_warps': 8}; a clear error for anything else."""
    try:
        return {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in text.split())}
    except (ValueError, SyntaxError):
        raise SystemExit(f"--variants {text!r}: write space-separated KEY=VALUE pairs with Python literals, "
                         f"e.g. \"stages=4 num_warps=8\" (\"\" for the defaults)") from None


def parse(argv=None):
    """(the options, the variants as (text, keyword arguments)); a bad option exits with its fix, before any work."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768], help="cache rows filled")
    p.add_argument("--variants", nargs="+", default=[""], help="decode_step_triton keyword sets, e.g. stages=4")
    p.add_argument("--bandwidth-gbs", type=float, default=3350, help="HBM bandwidth of the bound, GB/s")
    p.add_argument("--gluon", action="store_true", help="also time kernels/llama_step/gluon.py (Hopper or newer)")
    p.add_argument("--capacity", type=int, help="cache rows allocated (default: ctx)")
    args = p.parse_args(argv)
    variants = [(text, parse_variant(text)) for text in args.variants]
    if args.capacity is not None and args.capacity < max(args.ctx):
        raise SystemExit(f"--capacity {args.capacity} is below --ctx {max(args.ctx)}: the cache must hold the context")
    return args, variants


def main():
    args, variants = parse()
    if not torch.cuda.is_available():
        raise SystemExit("bench_llama_step times a CUDA kernel: no GPU here")
    dev = torch.device("cuda")
    s = SHAPE
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    phases = 5 * s["L"]
    print(f"{torch.cuda.get_device_name(dev)}, {programs} programs, {phases + 1} phases")
    bar = torch.zeros(1, device=dev, dtype=torch.int32)
    ms = replay_ms(lambda: (bar.zero_(), _barriers_kernel[(programs,)](bar, phases, launch_cooperative_grid=True)))
    print(f"{phases} grid barriers alone: {ms:.3f} ms ({1000 * ms / phases:.2f} us each)")
    for ctx in args.ctx:
        cos, sin = rope_tables(s["D"], ctx, 10000.0, dev)
        w = LlamaStepWeights.random(s["L"], s["H"], s["D"], s["d"], s["F"], s["V"], cos, sin, torch.bfloat16,
                                    torch.Generator(dev).manual_seed(0), scale=0.02)
        capacity = ctx if args.capacity is None else args.capacity
        k = torch.randn(s["L"], 1, s["H"], capacity, s["D"], device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        x = torch.randn(1, s["d"], device=dev, dtype=torch.bfloat16)   # the launcher copies it to fp32
        position = torch.tensor([ctx - 1], device=dev)
        matrices = (w.wqkv, w.wo, w.wgu, w.wd, w.head)
        nbytes = sum(t.numel() * t.element_size() for t in (*matrices, k[:, :, :, :ctx], v[:, :, :, :ctx]))
        bound = nbytes / args.bandwidth_gbs / 1e6
        print(f"ctx {ctx} (cache of {capacity}): bound {bound:.3f} ms ({nbytes / 1e9:.2f} GB at "
              f"{args.bandwidth_gbs:.0f} GB/s)")
        for text, kw in variants:
            ms = replay_ms(lambda: decode_step_triton(x, position, w, k, v, 1e-5, **kw))
            print(f"  {text or 'defaults':28s} {ms:.3f} ms ({ms / bound:.2f}x the bound)")
        if args.gluon:
            ms = replay_ms(lambda: decode_step_gluon(x, position, w, k, v, 1e-5))
            print(f"  {'gluon':28s} {ms:.3f} ms ({ms / bound:.2f}x the bound)")
        del w, k, v


if __name__ == "__main__":
    main()
