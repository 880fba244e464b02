"""Per-token decode latency of a whole small model with every layer's cache sharded over N ranks.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=4 -m scripts.bench_sharded_decode \
        --attention baseline,fox,castle --ctx 131072,1048576 --n-layer 4 --n-embd 2048 --n-head 16
    torchrun --nproc_per_node=2 -m scripts.bench_sharded_decode --device cpu --ctx 4096 ...  # gloo

N = 1 (plain `python`, or torchrun with one process) is the single-device model: GPT.new_cache
then keeps the unsharded caches (SDPA / forgetting_decode / castle_decode). With N > 1 every
layer's cache is split round robin over the ranks and attention merges exactly (tree attention,
kernels/tree.py): the same path as `torchrun ... sample.py sharded=true`.

No prefill: every layer's cache is filled directly with `ctx` random positions (`fill_cache`),
written through the cache objects' own `store()` (CASTLE: `extend()`) at their global positions, so
the layout is the real one. Random values are drawn per chunk of global positions, the same on every rank and for
every world size (each rank keeps its share), so a filled cache holds the same sequence whatever
N is. FoX gets a random cumulative log forget gate c, CASTLE random U and Q^U. `--check M` first
verifies the filling: a real single-device prefill of M random tokens, then a sharded cache filled
from its contents must decode to the same logits.

A timed step is one token through the model with the cache: model(token, cache) under no_grad,
greedy argmax and (N > 1) the broadcast of the token from rank 0, as GPT.generate_stream does; the
cache grows by one position per step. Timing follows scripts/bench_tree.py: warm-up steps, then a
barrier before each step, CUDA events on GPU (perf_counter on CPU), a step lasts as long as its
slowest rank, median (p10, p90) over steps. `--graphs` also times the step as
`GPT.generate(cuda_graph=True)` replays it (a static step captured in a CUDA graph with its collectives).
`--prefill-chunk C` also times prompt chunks of C tokens fed onto the filled cache, as `sample.py sharded=true`
prefills (`--prefill-steps` chunks after the warm-up ones; ms/token is per prompt token). "peak GiB" is
torch.cuda.max_memory_allocated over the decode steps (weights + cache + transients; max over
ranks; "-" on CPU); "cache GiB" the cache tensors one rank holds.
"""
import argparse
import copy
import functools
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from kernels.castle import CastleCache
from model.cache import SoftmaxCache
from model.gpt import GPT, CastleAttention, GPTConfig
from model.runtime import Dist, choose_device, choose_dtype
from model.sampling import GraphedDecodeStep

VARIANTS = ("baseline", "fox", "castle", "castle_swl")
PRO = dict(qk_norm=True, kv_shift=True, output_gate=True, output_norm=True)
GRAPH_WARMUP = 3   # untimed calls of a graphed step: eager warm-ups, then the capture


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", default="131072,1048576", help="cached tokens before decoding, comma list")
    ap.add_argument("--attention", default="baseline", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--pro", action="store_true",
                    help="Pro block (QK-norm, KV-shift, output gate and norm) for baseline and fox")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=None, help="default n_embd // n_head")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--mlp", default="swiglu", choices=("swiglu", "gelu"))
    ap.add_argument("--pos", default="auto", choices=("auto", "rope", "none"),
                    help="auto: none for fox (FoX's recipe), rope otherwise")
    ap.add_argument("--window", type=int, default=512, help="castle_swl window W")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per row")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "fp64"),
                    help="weights and cache; auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--graphs", action="store_true", help="also time the step replayed as a CUDA graph")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="C",
                    help="also time prompt chunks of C tokens fed onto the filled cache (0: off)")
    ap.add_argument("--prefill-steps", type=int, default=5, help="timed prompt chunks per --prefill-chunk row")
    ap.add_argument("--check", type=int, default=0, metavar="M",
                    help="first check the cache filling against a real prefill of M tokens (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = ap.parse_args(argv)
    args.ctx = [int(x) for x in args.ctx.split(",")]
    args.attention = args.attention.split(",")
    if args.prefill_chunk < 0 or args.prefill_steps < 1:
        ap.error(f"--prefill-chunk {args.prefill_chunk} --prefill-steps {args.prefill_steps}: give a chunk of tokens "
                 "(0: no prefill rows) and at least one timed chunk")
    bad = set(args.attention) - set(VARIANTS)
    if bad:
        ap.error(f"unknown attention {sorted(bad)}; choose from {VARIANTS}")
    return args


def model_config(args, attention):
    pos = args.pos if args.pos != "auto" else ("none" if attention == "fox" else "rope")
    pro = PRO if args.pro and attention in ("baseline", "fox") else {}
    return GPTConfig(vocab_size=args.vocab, block_size=1024, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, head_dim=args.head_dim, mlp=args.mlp, pos=pos,
                     attention=attention, castle_window=args.window if attention == "castle_swl" else None,
                     tie_embeddings=False, **pro)


def variant_name(config):
    pro = config.qk_norm and config.attention in ("baseline", "fox")
    return config.attention + ("-pro" if pro else "")


# ----------------------------------------------------------------------------- filling the cache
#
# A layer's cache content is described by chunks: dicts of tensors (B, H, T, ...) over consecutive
# global positions, in order from position 0:
#   softmax caches: k, v (as attention stores them: after KV-shift, QK-norm and RoPE) and for FoX
#                   c, the global cumulative log forget gate (float64);
#   CASTLE:         k, v (= K^C, V^C), qu (Q^U) and u (the lookahead keys U).
# plus a stream dict of what the replicated stream carries (FoX-Pro: the last raw key and value).

def fill_layer(layer, chunks, ctx, stream=None):
    """Append `ctx` positions, given as chunks, to one empty layer cache (sharded or not)."""
    assert isinstance(layer, (SoftmaxCache, CastleCache)) and layer.length == 0, type(layer)
    if isinstance(layer, CastleCache):  # kernels.castle's UQ-KV cache keeps this rank's rows itself
        for chunk in chunks:
            layer.extend(chunk["u"], chunk["qu"], chunk["k"], chunk["v"])
        assert layer.length == ctx, (layer.length, ctx)
        return
    rename = {"c": "log_fgate_cumsum"}
    c_last = None
    for chunk in chunks:
        layer.store(**{rename.get(name, name): x for name, x in chunk.items()})  # this rank's rows
        if "c" in chunk:
            c_last = chunk["c"][:, :, -1:]
    assert layer.length == ctx, (layer.length, ctx)
    if c_last is not None:
        layer.c_last = c_last.to(torch.float64).clone()
    for name, x in (stream or {}).items():
        setattr(layer, name, x.clone())


def fill_cache(model, cache, ctx, source):
    """Fill every layer of a fresh InferenceCache (GPT.new_cache, sharded or not) with positions
    0 .. ctx - 1; source(i, attn) -> (chunks, stream) of layer i. The next token is position ctx."""
    assert cache.pos == 0, "fill an empty cache"
    for i, (block, layer) in enumerate(zip(model.blocks, cache.layers, strict=True)):
        chunks, stream = source(i, block.attn)
        fill_layer(layer, chunks, ctx, stream)
    cache.pos = ctx


def chunk_len(batch, n_head, head_dim):
    """Positions per random chunk: about 2**25 elements per tensor. Independent of the world size,
    so every N draws the same sequence."""
    return max(1, 2 ** 25 // (batch * n_head * head_dim))


def random_source(batch, ctx, device, dtype, seed=0):
    """Random content for every layer: normal K, V (and Q^U, U for CASTLE); for FoX log forget
    gates of mean about -0.02 summed into c. Drawn chunk by chunk of global positions with a
    generator seeded by (seed, layer, chunk), so every rank draws the same values."""
    device = torch.device(device)

    def source(i, attn):
        H, D = attn.n_head, attn.head_dim
        is_castle = isinstance(attn, CastleAttention)
        fox = not is_castle and attn.fgate is not None
        step = chunk_len(batch, H, D)
        cdt = torch.float64 if dtype == torch.float64 else torch.float32

        def chunks():
            c_prev = torch.zeros(batch, H, 1, device=device, dtype=torch.float64)
            for j, start in enumerate(range(0, ctx, step)):
                gen = torch.Generator(device=device).manual_seed((seed << 40) + (i << 24) + j)
                shape = (batch, H, min(step, ctx - start), D)

                def normal(dt=dtype, shape=shape, gen=gen):
                    return torch.randn(shape, generator=gen, device=device, dtype=dt)
                chunk = dict(k=normal(), v=normal())
                if is_castle:
                    chunk.update(qu=normal(), u=normal(cdt))
                if fox:
                    log_f = torch.nn.functional.logsigmoid(normal(torch.float32, shape[:3]) + 4)
                    chunk["c"] = c_prev + log_f.to(torch.float64).cumsum(-1)
                    c_prev = chunk["c"][:, :, -1:]
                yield chunk

        stream = None
        if getattr(attn, "shift", None) is not None:  # Pro: the last raw key and value
            gen = torch.Generator(device=device).manual_seed((seed << 40) + (i << 24) + (1 << 23))
            stream = {name: torch.randn(batch, H, 1, D, generator=gen, device=device, dtype=dtype)
                      for name in ("last_raw_k", "last_raw_v")}
        return chunks(), stream
    return source


def contents_source(cache):
    """The content of a single-device (unsharded) cache after a real prefill, as chunks: to fill
    another cache, sharded or not, with exactly what the prefill computed. CASTLE-SWL keeps only
    the last W rows of Q^U (the only ones read again); older rows are given as zeros."""
    def source(i, attn):
        layer = cache.layers[i]
        if isinstance(layer, CastleCache):
            qu = torch.zeros_like(layer.kc)   # rows before the last W (SWL) are never read again
            qu[:, :, layer.length - layer.qu.size(2):] = layer.qu
            return [dict(k=layer.kc, v=layer.vc, qu=qu, u=layer.u)], None
        n = layer.length
        chunk = dict(k=layer.k[:, :, :n], v=layer.v[:, :, :n])
        if attn.fgate is not None:
            chunk["c"] = layer.log_fgate_cumsum[:, :, :n]
        stream = (dict(last_raw_k=layer.last_raw_k, last_raw_v=layer.last_raw_v)
                  if attn.shift is not None else None)
        return [chunk], stream
    return source


def cache_bytes(cache):
    """Bytes of the cache tensors this rank holds."""
    total = 0
    for layer in cache.layers:
        total += sum(x.numel() * x.element_size() for x in vars(layer).values() if isinstance(x, torch.Tensor))
    return total


# ----------------------------------------------------------------------------- one decode step

def greedy_token(logits, group):
    """(B, T, V) logits -> the (B,) greedy tokens of the last position, rank 0's on every rank."""
    nxt = logits[:, -1].argmax(-1)
    if group is not None:
        dist.broadcast(nxt, dist.get_global_rank(group, 0), group=group)
    return nxt


def decode_step(model, cache, tokens, group):
    """Tokens (B, n) through the model with the cache, greedy, as GPT.generate_stream: the next token is
    written into each of `tokens`' n slots (a decode step's one; a prompt chunk's whole)."""
    logits, _ = model(tokens, cache=cache, last_only=True)
    tokens.copy_(greedy_token(logits, group)[:, None].expand_as(tokens))


def graphed_step(model, cache, token, group):
    """The same step as GPT.generate_stream(cuda_graph=True) replays it: static (InferenceCache.to_static, the
    position on the device), captured with its collectives in a CUDA graph that also picks the token
    (model/sampling.py GraphedDecodeStep); each call decodes the next position. Its first GRAPH_WARMUP calls
    run eagerly, then it captures."""
    step = GraphedDecodeStep(model, cache, token.size(0), warmup=GRAPH_WARMUP - 1,
                             choose=functools.partial(greedy_token, group=group))
    step.token.copy_(token)
    return step


# ----------------------------------------------------------------------------- timing

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(group, device):
    if group is not None:
        dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
    sync(device)


def max_over_ranks(values, group, device):
    """Elementwise max over the group's ranks of a list of floats."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def time_steps(step, steps, warmup, group, device):
    """(median, p10, p90) seconds per step; a step lasts as long as its slowest rank."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        barrier(group, device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    times = torch.tensor(max_over_ranks(times, group, device), dtype=torch.float64)
    return torch.quantile(times, torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64)).tolist()


# ----------------------------------------------------------------------------- check and rows

def check_fill(model, args, group, device):
    """Fill a cache (sharded over `group`) from the contents of a real single-device prefill of
    args.check random tokens and decode a few tokens from both, teacher-forced with the
    single-device greedy tokens: the logits must agree. Returns (max |diff|, max |logit|).
    Run it in fp32 or fp64 (check_model): in bf16 a misplaced position hides in the rounding."""
    B, M, n = args.batch, args.check, 3
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, model.config.vocab_size, (B, M), generator=gen).to(device)
    ref = model.new_cache(B, M + n)
    logits_ref = [model(prompt, cache=ref, last_only=True)[0][:, -1]]
    filled = model.new_cache(B, M + n, group=group)
    fill_cache(model, filled, M, contents_source(ref))
    logits_got = []
    for _ in range(n):
        token = logits_ref[-1].argmax(-1, keepdim=True)
        logits_got.append(model(token, cache=filled, last_only=True)[0][:, -1])
        logits_ref.append(model(token, cache=ref, last_only=True)[0][:, -1])
    got, want = torch.stack(logits_got).float(), torch.stack(logits_ref[1:]).float()
    return (got - want).abs().max().item(), want.abs().max().item()


def check_model(model, dtype):
    """The model for check_fill: itself in fp64, an fp32 copy otherwise."""
    return model if dtype in (torch.float64, torch.float32) else copy.deepcopy(model).float()


def check_tol(dtype, device):
    """Tolerance on max |logits diff| / max(max |logit|, 1), as tests/test_sharded_decode.py: fp64
    (the FoX and CASTLE biases pass through fp32), fp32 on CPU, fp32 on GPUs (TF32 in kernels)."""
    if dtype == torch.float64:
        return 1e-7
    return 1e-2 if device.type == "cuda" else 1e-4


def run_row(model, args, ctx, group, device, dtype, mode):
    """Fill a cache of ctx positions and time steps of `mode` (eager, graph: decode steps; prefill: prompt chunks
    of --prefill-chunk tokens): the row (the same on every rank). A cache that does not fit on some rank (out of
    memory while filling) gives a row with a note instead of numbers."""
    world = dist.get_world_size(group) if group is not None else 1
    if mode == "prefill":          # a prompt chunk per step, one chunk of warm-up
        chunk, steps, warmup = args.prefill_chunk, args.prefill_steps, 1
    else:
        chunk, steps, warmup = 1, args.steps, max(args.warmup, GRAPH_WARMUP if mode == "graph" else 0)
    row = dict(ranks=world, ctx=ctx, variant=variant_name(model.config),
               mode=f"prefill {chunk}" if mode == "prefill" else mode, ms=None)
    max_len = ctx + (warmup + steps) * chunk + 16  # the steps, graph warm-up and capture
    cache = None
    try:
        cache = model.new_cache(args.batch, max_len, device, dtype, group=group)
        fill_cache(model, cache, ctx, random_source(args.batch, ctx, device, dtype, args.seed))
        model._rope(ctx, max_len - ctx, device)  # grow the RoPE tables now, not inside a step
        short = 0.0
    except torch.OutOfMemoryError:  # filling is local: no rank waits in a collective
        cache, short = None, 1.0
    if max_over_ranks([short], group, device)[0] > 0:
        return free(device, row, note="does not fit")
    token = torch.zeros(args.batch, chunk, dtype=torch.long, device=device)
    step = functools.partial(decode_step, model, cache, token, group)
    if mode == "graph":
        step = graphed_step(model, cache, token, group)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        med, p10, p90 = (t / chunk for t in time_steps(step, steps, warmup, group, device))
    except torch.OutOfMemoryError:  # safe with one rank; with several the others would hang
        del cache, step
        return free(device, row, note="out of memory in a step")
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    peak, held = max_over_ranks([peak, cache_bytes(cache) / 2 ** 30], group, device)
    del cache, step
    return free(device, row, ms=med * 1e3, p10=p10 * 1e3, p90=p90 * 1e3, tok_s=args.batch / med,
                peak_gib=peak, cache_gib=held)


def free(device, row, **fields):
    """Give the memory of a finished row back (the caller dropped its cache) and complete the row."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {**row, **fields}


def table(rows):
    """Markdown table, one line per (variant, ctx, mode)."""
    lines = ["| ranks | ctx | variant | ms/token | tokens/s | peak GiB | mode | p10-p90 ms | cache GiB/rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ms"] is None:
            lines.append(f"| {r['ranks']} | {r['ctx']} | {r['variant']} | {r['note']} | - | - | "
                         f"{r['mode']} | - | - |")
            continue
        peak = "-" if math.isnan(r["peak_gib"]) else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['ranks']} | {r['ctx']} | {r['variant']} | {r['ms']:.3f} | {r['tok_s']:.1f} | "
                     f"{peak} | {r['mode']} | {r['p10']:.3f}-{r['p90']:.3f} | {r['cache_gib']:.3f} |")
    return "\n".join(lines)


def resolve(args):
    """(device type, dtype) from the options (Dist picks each local rank's device of that type)."""
    device = choose_device(args.device)
    dtype = torch.float64 if args.dtype == "fp64" else choose_dtype(args.dtype, device)
    return device.type, dtype


def main(argv=None):
    args = parse(argv)
    device, dtype = resolve(args)
    ranks = Dist(device)        # one GPU per local rank, NCCL (NCCL_NVLS_ENABLE=0 stays set) or gloo
    group, rank, device = (dist.group.WORLD if ranks.world > 1 else None), ranks.rank, ranks.device
    if args.graphs and device.type != "cuda":
        raise SystemExit("--graphs needs CUDA")
    world = dist.get_world_size(group) if group is not None else 1
    if rank == 0:
        env = f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '(unset)')} " if device.type == "cuda" else ""
        print(f"command: {env}torchrun --nproc_per_node={world} -m scripts.bench_sharded_decode "
              + " ".join(sys.argv[1:] if argv is None else argv))
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
        backend = dist.get_backend(group) if group is not None else "none"
        print(f"device: {world} x {name}, torch {torch.__version__}, backend {backend}, {dtype}", flush=True)
    rows = []
    for attention in args.attention:
        torch.manual_seed(args.seed)  # the same weights on every rank
        model = GPT(model_config(args, attention)).to(device, dtype).eval()
        name = variant_name(model.config)
        with torch.no_grad():
            if args.check:
                checked = check_model(model, dtype)
                err, scale = check_fill(checked, args, group, device)
                ok = err <= check_tol(next(checked.parameters()).dtype, device) * max(scale, 1.0)
                del checked
                if rank == 0:
                    print(f"check {name}: filled from a {args.check}-token prefill, {world} rank(s): "
                          f"max|logits diff| {err:.3g} (max|logit| {scale:.3g}) {'ok' if ok else 'FAILED'}",
                          flush=True)
                if not ok:  # the same verdict on every rank: tree results are bitwise replicated
                    raise SystemExit(f"check failed for {name}")
            for ctx in args.ctx:
                for mode in ["eager"] + ["graph"] * args.graphs + ["prefill"] * (args.prefill_chunk > 0):
                    r = run_row(model, args, ctx, group, device, dtype, mode)
                    rows.append(r)
                    if rank == 0:
                        done = f"{r['ms']:.3f} ms/token" if r["ms"] is not None else r["note"]
                        print(f"  {name} ctx={ctx} {r['mode']}: {done}", flush=True)
        del model
    if rank == 0:
        print()
        print(table(rows), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(argv=sys.argv, world=world, device=str(device), dtype=str(dtype), rows=rows),
                          f, indent=1)
    if group is not None:
        barrier(group, device)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
