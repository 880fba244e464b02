"""Decode-step latency of one attention layer against a KV cache sharded over p GPUs.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 -m scripts.bench_tree --ctx 131072,1048576

Methods (Tree Attention, arXiv:2408.04093 §6), one decode query per sequence, random bf16 cache made on the GPU:
  single/sdpa    one GPU holds the whole cache; F.scaled_dot_product_attention (the peer)
  single/kernel  one GPU holds the whole cache; attn_partial (our split-KV Triton kernel)
  local          attn_partial over one shard only: the compute part of tree decoding
  combine        tree_merge alone on a partial state: the communication part
  tree/<c>       tree_decode over p GPUs, combine c = gather | packed | paper
  ring-kv        ring_decode: K/V shards passed around the ring (the paper's baseline)
  allgather-kv   allgather_decode: the whole cache gathered onto every GPU
"+graph" rows replay the step captured in a CUDA graph (no launch overhead).
Latency: CUDA events around each step after a barrier; a step of a multi-GPU method counts the
slowest rank; we report the median, p10 and p90 over steps, in microseconds. "extra MiB" is the
peak memory a step allocates beyond the cache (max over ranks).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels import tree


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="131072,1048576,4194304", help="total cached tokens, comma list")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--queries", type=int, default=1, help="query tokens per step")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--budget", type=float, default=0.5, help="max seconds of timed steps per row")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time Triton configs of the local kernel")
    ap.add_argument("--out", default=None, help="write rows as JSON here (rank 0)")
    return ap.parse_args()


# ----------------------------------------------------------------------------- timing

def barrier():
    dist.barrier(device_ids=[torch.cuda.current_device()])
    torch.cuda.synchronize()


def timed(fn, args, everywhere):
    """(median, p10, p90) in µs of fn's CUDA-event time; everywhere: all ranks run it, and a step
    lasts as long as its slowest rank."""
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = torch.tensor(int(min(args.iters, max(5, args.budget / (time.perf_counter() - t0)))), device="cuda")
    if everywhere:
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = torch.empty(int(n), device="cuda")
    for i in range(int(n)):
        if everywhere:
            barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times[i] = start.elapsed_time(end) * 1e3
    if everywhere:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    q = torch.quantile(times, torch.tensor([0.5, 0.1, 0.9], device="cuda")).tolist()
    return q


def extra_mib(fn, everywhere):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    mib = torch.tensor((torch.cuda.max_memory_allocated() - base) / 2**20, device="cuda")
    if everywhere:
        dist.all_reduce(mib, op=dist.ReduceOp.MAX)
    return mib.item()


def graphed(fn):
    """fn captured in a CUDA graph (NCCL collectives included); returns the replay function."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# ----------------------------------------------------------------------------- data

def shard(args, rank, t):
    """Rank `rank`'s K/V shard, reproducible on any GPU (so rank 0 can rebuild the whole cache)."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    shape = (args.batch, args.kv_heads, t, args.dim)
    return [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2)]


def query(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(args.batch, args.heads, args.queries, args.dim, generator=gen, device="cuda",
                       dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- one context length

def run_ctx(args, N, graphs, rows):
    rank, p = dist.get_rank(), dist.get_world_size()
    t = N // p
    q, (k, v) = query(args), shard(args, rank, t)
    kv_bytes = 2 * k.numel() * k.element_size()  # per rank
    state = tree.attn_partial(q, k, v)

    def row(method, ranks, fn, everywhere=True, bytes_read=None):
        if graphs:
            try:
                fn = graphed(fn)
            except Exception as e:  # every rank fails the same capture, so none is left waiting
                if rank == 0:
                    print(f"  {method}: capture failed: {type(e).__name__}: {e}", flush=True)
                return
            method += "+graph"
        med, p10, p90 = timed(fn, args, everywhere)
        mib = extra_mib(fn, everywhere)
        r = dict(N=N, p=ranks, method=method, us=med, p10=p10, p90=p90, extra_mib=mib)
        if bytes_read:
            r["GB/s"] = bytes_read / med / 1e3
        rows.append(r)
        if rank == 0:
            print(f"  {method:<16} p={ranks} {med:10.1f} us  (p10 {p10:.1f}, p90 {p90:.1f})  "
                  f"+{mib:.0f} MiB", flush=True)

    # multi-GPU methods: every rank
    row("local", 1, lambda: tree.attn_partial(q, k, v), bytes_read=kv_bytes)
    row("combine", p, lambda: tree.tree_merge(*state, combine="gather"))
    for c in tree.COMBINES:
        row(f"tree/{c}", p, lambda c=c: tree.tree_decode(q, k, v, combine=c))
    if not graphs:  # a host sync on the shard lengths keeps these out of graphs
        row("ring-kv", p, lambda: tree.ring_decode(q, k, v))
        row("allgather-kv", p, lambda: tree.allgather_decode(q, k, v))
    out_tree = tree.tree_decode(q, k, v)
    out_ring = None if graphs else tree.ring_decode(q, k, v)
    barrier()

    # one GPU with the whole cache: rank 0 alone, the others wait
    if rank == 0:
        del k, v
        full = [torch.cat(x, 2) for x in zip(*(shard(args, r, t) for r in range(p)), strict=True)]
        row("single/kernel", 1, lambda: tree.attn_partial(q, *full), everywhere=False,
            bytes_read=kv_bytes * p)
        gqa = args.heads != args.kv_heads
        row("single/sdpa", 1, lambda: F.scaled_dot_product_attention(q, *full, enable_gqa=gqa),
            everywhere=False)
        if not graphs:  # correctness on the real sizes (bf16 tolerance)
            ref = tree.attn_partial(q.float(), *(x.float() for x in full), impl="torch")[0] \
                if N <= 1 << 20 else tree.attn_partial(q, *full)[0]
            sdpa = F.scaled_dot_product_attention(q, *full, enable_gqa=gqa)
            errs = {name: (x.float() - ref).abs().max().item()
                    for name, x in dict(tree=out_tree, ring=out_ring, sdpa=sdpa).items()}
            rows.append(dict(N=N, p=p, method="check", **errs))
            print(f"  max|diff| vs {'fp32' if N <= 1 << 20 else 'single/kernel'} reference: {errs}",
                  flush=True)
        del full
    torch.cuda.empty_cache()
    barrier()


def sweep(args, rows):
    """Rank 0: Triton configs of the local kernel on the largest shard (to pick the defaults)."""
    N = max(int(x) for x in args.ctx.split(","))
    q, (k, v) = query(args), shard(args, 0, N // dist.get_world_size())
    bytes_read = 2 * k.numel() * k.element_size()
    for block_n, warps, stages, splits_per_sm in [(64, 4, 3, 4), (32, 4, 3, 4), (128, 4, 3, 4),
                                                  (128, 8, 3, 4), (64, 4, 3, 2), (64, 4, 3, 8),
                                                  (64, 8, 3, 4), (64, 2, 3, 4), (64, 4, 4, 4), (64, 4, 5, 4),
                                                  (128, 4, 4, 4), (128, 8, 4, 4), (64, 4, 4, 8)]:
        splits = -(-splits_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
                   // (args.batch * args.kv_heads))
        kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
        med, p10, p90 = timed(lambda kw=kw: tree.attn_partial_triton(q, k, v, args.dim ** -0.5, None, **kw),
                              args, everywhere=False)
        cfg = f"BLOCK_N={block_n} warps={warps} stages={stages} splits/SM={splits_per_sm}"
        rows.append(dict(N=N // dist.get_world_size(), method="sweep", cfg=cfg, us=med,
                         **{"GB/s": bytes_read / med / 1e3}))
        print(f"  {cfg:<48} {med:10.1f} us  {bytes_read / med / 1e3:7.0f} GB/s", flush=True)


def table(rows):
    """Markdown: one row per context length, one column per method."""
    timed_rows = [r for r in rows if "us" in r and r["method"] != "sweep"]
    methods = list(dict.fromkeys(r["method"] for r in timed_rows))
    lines = ["| N | " + " | ".join(methods) + " | single/sdpa ÷ tree/gather | ring-kv ÷ tree/gather |",
             "|---" * (len(methods) + 3) + "|"]
    for N in sorted({r["N"] for r in timed_rows}):
        at = {r["method"]: r["us"] for r in timed_rows if r["N"] == N}
        cells = [f"{at[m]:.1f}" if m in at else "-" for m in methods]
        cells += [f"{at[a] / at['tree/gather']:.2f}x" if a in at and "tree/gather" in at else "-"
                  for a in ("single/sdpa", "ring-kv")]
        lines.append(f"| {N} | " + " | ".join(cells) + " |")
    mem = {(r["N"], r["method"]): r["extra_mib"] for r in timed_rows}
    lines += ["", "extra peak MiB per GPU: " + "; ".join(
        f"N={N} {m}={v:.0f}" for (N, m), v in mem.items() if m in ("tree/gather", "ring-kv", "allgather-kv"))]
    return "\n".join(lines)


def report(args, rows, p):
    print()
    print(table(rows), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(argv=sys.argv, world=p, device=torch.cuda.get_device_name(), rows=rows), f,
                      indent=1)


def main():
    args = parse()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print("command: NCCL_NVLS_ENABLE=%s torchrun --nproc_per_node=%d %s" % (
            os.environ.get("NCCL_NVLS_ENABLE", "(unset)"), p, " ".join(sys.argv)))
        print(f"device: {p} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    rows = []
    for graphs in ([False] if args.no_graphs else [False, True]):
        for N in (int(x) for x in args.ctx.split(",")):
            if rank == 0:
                print(f"N={N} p={p} B={args.batch} n={args.queries} heads={args.heads}/"
                      f"{args.kv_heads}x{args.dim} {'graphs' if graphs else 'eager'}", flush=True)
            run_ctx(args, N, graphs, rows)
        if rank == 0:  # after each phase, so a later failure loses nothing
            report(args, rows, p)
    if args.sweep and rank == 0:
        sweep(args, rows)
        report(args, rows, p)
    barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
