"""Side-by-side timings of CASTLE implementations on one GPU, with causal FlashAttention (SDPA) as yardstick.

    python -m scripts.bench_castle --L 2048 --D 64 --B 8 --H 16 --dtype bf16 [--window 512] [--sweep]

Rows: our Triton kernels (kernels/castle/), the materialised parallel form (impl="torch", O(L^3); in fp32
and, for 16-bit inputs, under autocast: 16-bit cuBLAS matmuls),
the blockwise PyTorch path (impl="blockwise"), the PyPI peer `lookahead-keys-attention` when importable,
and SDPA causal attention at the same shape. Times are medians of CUDA-event timings after warm-up
(triton.testing.do_bench). TFLOP/s count the block algorithm's FLOPs (CASTLE arXiv:2509.07301 App. 8):
8 block matmuls, ~16 B^2 d FLOPs per block pair forward, i.e. 8 L^2 d per head over the causal half (4x
FlashAttention's 2 L^2 d); the backward, counted from Algorithm 3 (24 block matmuls per pair), 24 L^2 d.
For SWL the same dense count is used (an "effective" rate). --sweep times the Triton kernels over tile
configs instead: every backward variant (CASTLE_BWD_VARIANT) x backward tile, and with --sweep-fwd the
forward tiles; the default variant and tiles are those of kernels/castle/triton.py.

--decode times one decode step per token instead, on a GPU both castle_decode paths (the fused kernel and
the PyTorch ops) against a KV-cache step (runs on CPU too, PyTorch ops only; see decode_bench):

    python -m scripts.bench_castle --decode --contexts 4096,32768 --windows none,512 --B 1 --H 16 --D 64
"""
import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kernels.castle import CastleCache, castle_attn, castle_decode
from kernels.castle.op import attn_triton
from kernels.castle.triton import BWD_VARIANTS, TritonConfig, default_config
from kernels.sdpa import decode_sdpa
from kernels.triton_utils import at_least_fp32, padded_head_dim, triton

if triton is not None:  # --decode runs without triton (CPU)
    from triton.testing import do_bench

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def castle_flops(B, H, L, D, backward):
    fwd = 8 * L * L * D * B * H
    return fwd * (4 if backward else 1)  # fwd + bwd = 8 + 24 per L^2 d


def sdpa_flops(B, H, L, D, backward):
    fwd = 2 * L * L * D * B * H
    return fwd * (3.5 if backward else 1)  # FlashAttention's count: bwd = 2.5 x fwd


def peer_fn():
    """The PyPI peer's functional Triton entry point (computes in fp16 internally), or None."""
    try:
        from lookahead_keys_attention.lookahead_keys_attention_triton import castle_attention_triton
    except Exception as e:  # noqa: BLE001 (any import failure means "not available")
        print(f"peer lookahead-keys-attention not importable: {e!r}")
        return None
    return lambda qc, kc, vc, qu, ku, vu, scale: castle_attention_triton(qc, kc, vc, qu, ku, vu, scale, False)


def time_ms(fn, inputs, backward, budget_s=1.0):
    """Median ms of fn (and its backward); a single timed call when one call takes longer than budget_s."""
    xs = [x for x in inputs if isinstance(x, torch.Tensor)]
    go = torch.randn_like(fn(*inputs))  # also the warm-up / compile call

    def step():
        out = fn(*inputs)
        if backward:
            out.backward(go)

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    single = time.perf_counter() - t0
    if single > budget_s:
        return single * 1e3, "single run"
    return do_bench(step, warmup=25, rep=100, grad_to_none=xs, return_mode="median"), ""


def run(name, fn, inputs, flops, results):
    for backward in (False, True):
        torch.cuda.reset_peak_memory_stats()
        try:
            ms, note = time_ms(fn, inputs, backward)
            mem = torch.cuda.max_memory_allocated() / 2**30
            tf = flops(backward) / ms / 1e9
            results.append((name, "fwd+bwd" if backward else "fwd", f"{ms:.3f}", f"{tf:.1f}", f"{mem:.2f}", note))
        except torch.OutOfMemoryError:
            results.append((name, "fwd+bwd" if backward else "fwd", "OOM", "", "", ""))
        except Exception as e:  # noqa: BLE001 (report and go on with the other rows)
            results.append((name, "fwd+bwd" if backward else "fwd", "error", "", "", repr(e)[:80]))
        print(results[-1], flush=True)
        torch.cuda.empty_cache()


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    print("\n".join(lines))


FWD_TILES = {64: [(64, 32, 4), (64, 16, 4), (64, 64, 4), (128, 64, 8), (64, 32, 8)],
             128: [(64, 32, 8), (64, 16, 4), (32, 16, 4), (64, 32, 4), (128, 64, 8)]}   # (m, n, warps)
BWD_TILES = {64: [(64, 32, 4, 1), (32, 32, 4, 1), (32, 16, 4, 1), (64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 8, 1),
                  (64, 16, 4, 1)],
             128: [(64, 32, 4, 1), (64, 64, 4, 1), (16, 16, 4, 1), (32, 16, 4, 1), (32, 32, 4, 1), (64, 16, 4, 1),
                   (64, 32, 8, 1), (64, 64, 8, 1)]}          # (m, n, warps, stages of the sigma pass)


def sweep_configs(D, dtype, variants, fwd_tiles):
    """Backward tiles x backward variants (BWD_VARIANTS) with the default forward; with fwd_tiles also the
    forward tiles with the default backward."""
    default = default_config(padded_head_dim(D), dtype)
    d = 64 if D <= 64 else 128
    cfgs = [dataclasses.replace(default, m_bwd=m, n_bwd=n, warps_bwd=w, stages_bwd=st, bwd_variant=v)
            for v in variants for m, n, w, st in BWD_TILES[d] if default.m_fwd % m == 0]
    if fwd_tiles:
        cfgs += [dataclasses.replace(default, m_fwd=m, n_fwd=n, warps_fwd=w, m_bwd=min(m, default.m_bwd),
                                     n_bwd=min(n, default.n_bwd)) for m, n, w in FWD_TILES[d]]
    return list(dict.fromkeys(cfgs))


def _compile(cfg, H, L, D, dtype, window):
    """Run one config once on a one-sequence batch: fills Triton's disk cache (same specialisation)."""
    try:
        xs = [torch.randn(1, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(6)]
        attn_triton(*xs, window, D ** -0.5, cfg).sum().backward()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 (reported by the timing pass)
        return repr(e)[:200]


def sweep(args, xs, scale):
    """Time the Triton kernels over backward variants x tile configs (and, with --sweep-fwd, forward
    tiles). Configs compile in parallel processes first. "bwd ms" = fwd+bwd - fwd."""
    variants = args.variants.split(",") if args.variants else BWD_VARIANTS
    cfgs = sweep_configs(args.D, xs[0].dtype, variants, args.sweep_fwd)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        list(pool.map(_compile, cfgs, *zip(*[(args.H, args.L, args.D, xs[0].dtype, args.window)] * len(cfgs))))
    # every config's output and six gradients against the fp32 blockwise torch path (O(L d) memory)
    go = torch.randn_like(xs[0])
    xs32 = [x.detach().float().requires_grad_() for x in xs]
    ref = castle_attn(*xs32, window=args.window, impl="blockwise")
    ref = [ref.detach(), *torch.autograd.grad(ref, xs32, go.float())]
    rows = []
    for cfg in cfgs:
        fn = lambda: attn_triton(*xs, args.window, scale, cfg)  # noqa: E731
        try:
            out = fn()
            got = [out, *torch.autograd.grad(out, xs, go)]
            err = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, ref))
            fwd = do_bench(fn, warmup=10, rep=50, return_mode="median")
            both = do_bench(lambda: fn().backward(go), warmup=10, rep=50, grad_to_none=xs, return_mode="median")
            rows.append((*cfg.__dict__.values(), f"{fwd:.3f}", f"{both:.3f}", f"{both - fwd:.3f}", f"{err:.1e}"))
        except Exception as e:  # noqa: BLE001 (a config that does not compile or fit is just reported)
            rows.append((*cfg.__dict__.values(), "error", repr(e)[:60], "", ""))
        print(rows[-1], flush=True)
    table([*TritonConfig.__dataclass_fields__, "fwd ms", "fwd+bwd ms", "bwd ms", "max rel err (out, grads)"], rows)


# ----------------------------------------------------------------------------------------------------
# --decode: per-token latency of one decode step at a given context length


def castle_cache(B, H, T, D, window, dtype, device, room):
    """A UQ-KV cache holding T positions of random values (the timing does not depend on them), with
    room for `room` more before a buffer grows (so the timed steps never reallocate)."""
    cache = CastleCache(B, H, D, max_len=T + room, dtype=dtype, device=device, window=window)
    cdt = at_least_fp32(dtype)
    u, qu, kc, vc = (torch.randn(B, H, T, D, dtype=dt, device=device) for dt in (cdt, dtype, dtype, dtype))
    u[..., T - 1, :] = 0                                            # u_{T-1} = 0 (eq (13))
    cache.extend(u, qu, kc, vc)
    return cache


def kv_cache_step(k_buf, v_buf, t, scale):
    """The standard decode step the CASTLE rows are compared with: write k, v of position t into a
    preallocated KV cache, then SDPA of the one query over the t + 1 cached positions (without cuDNN,
    which would build a new plan for every length: kernels/sdpa.py)."""
    def step(qc, kc, vc, *_):
        k_buf[:, :, t[0]: t[0] + 1] = kc
        v_buf[:, :, t[0]: t[0] + 1] = vc
        t[0] += 1
        return decode_sdpa(qc, k_buf[:, :, : t[0]], v_buf[:, :, : t[0]], scale=scale)
    return step


def per_token_ms(step, xs, device):
    """Median ms of step(*xs[i]) over the timed steps (xs[0] is warm-up): CUDA events on GPU,
    perf_counter on CPU. Each step appends one position, so the context grows by len(xs) in all."""
    times = []
    for i, x in enumerate(xs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step(*x)
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            out = step(*x)
            times.append(time.perf_counter() - t0)
    assert torch.isfinite(out).all()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in times]
    else:
        times = [t * 1e3 for t in times]
    return statistics.median(times[len(times) // 10 + 1:])          # the first ~10% are warm-up


IMPL_LABELS = {"triton": "fused kernel", "torch": "PyTorch ops + SDPA"}


def graph_ms(step, x, device):
    """Median ms of one more step captured in a CUDA graph and replayed (each replay re-does that position):
    the GPU time of a step without the host's launch overhead, which the eager timing includes. None on CPU."""
    if device.type != "cuda":
        return None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*x)
    return triton.testing.do_bench(graph.replay)


def decode_bench(args):
    """Per-token latency of castle_decode (CASTLE and SWL) against a standard KV-cache decode step at
    each context length T: the cache holds T positions, then steps time appending one more each (eager),
    then one more step is captured in a CUDA graph and replayed (GPU time alone)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dname = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dname]
    B, H, D, n = args.B, args.H, args.D, args.steps
    scale = D ** -0.5
    contexts = [int(c) for c in args.contexts.split(",")]
    impls = ("triton", "torch") if device.type == "cuda" else ("torch",)
    windows = [None if w.lower() == "none" else int(w) for w in args.windows.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"$ python {' '.join(sys.argv)}")
    print(f"device: {name}, torch {torch.__version__}; B={B} H={H} D={D} dtype={dname}, "
          f"median of {n - n // 10 - 1} steps per row")
    torch.manual_seed(0)
    rows = []

    def row(T, label, window, ms, graph, kv, mib):
        """kv: the KV-cache step's (eager, graph) ms, the yardstick of the x KV columns."""
        graphs = ("-", "-") if graph is None else (f"{graph:.4f}", f"{graph / kv[1]:.2f}")
        rows.append((T, label, "" if window is None else window, f"{ms:.4f}", f"{ms / kv[0]:.2f}", *graphs,
                     f"{mib:.1f}"))
        print(rows[-1], flush=True)

    for T in contexts:
        xs = [[torch.randn(B, H, 1, D, dtype=dtype, device=device) for _ in range(6)] for _ in range(n + 1)]
        k_buf, v_buf = (torch.randn(B, H, T + n + 1, D, dtype=dtype, device=device) for _ in range(2))
        kv_step = kv_cache_step(k_buf, v_buf, [T], scale)
        kv = per_token_ms(kv_step, xs[:n], device), graph_ms(kv_step, xs[n], device)
        kv_mib = 2 * k_buf.numel() * k_buf.element_size() / 2**20                  # T + steps positions
        row(T, "KV cache + SDPA (standard)", None, *kv, kv, kv_mib)
        del k_buf, v_buf
        for window in windows:
            for impl in impls:
                cache = castle_cache(B, H, T, D, window, dtype, device, n + 1)
                step = lambda *x, c=cache, i=impl: castle_decode(c, *x, impl=i)[0]  # noqa: E731
                ms, graph = per_token_ms(step, xs[:n], device), graph_ms(step, xs[n], device)
                captured = device.type == "cuda"                                    # one more step
                assert cache.length == T + n + captured and cache.capacity == T + n + 1  # none reallocated
                mib = sum(v.numel() * v.element_size() for v in (cache.u, cache.qu, cache.kc, cache.vc)) / 2**20
                label = ("CASTLE" if window is None else "CASTLE-SWL") + f" decode ({IMPL_LABELS[impl]})"
                row(T, label, window, ms, graph, kv, mib)
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    table(["context T", "decode step", "W", "ms / token eager", "x KV", "ms / token CUDA graph", "x KV",
           "cache MiB / layer"], rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--L", type=int, default=2048)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--window", type=lambda s: None if s.lower() == "none" else int(s), default=None)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default bf16 (--decode on CPU: fp32)")
    p.add_argument("--skip", default="", help="comma list of rows to skip: torch,blockwise,peer,sdpa")
    p.add_argument("--sweep", action="store_true", help="time Triton backward variants x tiles instead")
    p.add_argument("--variants", default="", help="--sweep: comma list of backward variants (default all)")
    p.add_argument("--sweep-fwd", action="store_true", help="--sweep: forward tiles too")
    p.add_argument("--jobs", type=int, default=8, help="parallel compiles for --sweep")
    p.add_argument("--decode", action="store_true", help="time one decode step per token instead")
    p.add_argument("--contexts", default="4096,32768", help="--decode: comma list of context lengths")
    p.add_argument("--windows", default="none,512", help="--decode: comma list of W (none = CASTLE)")
    p.add_argument("--steps", type=int, default=100, help="--decode: steps per row (the first 10%% warm up)")
    p.add_argument("--device", default=None, help="--decode: cuda or cpu (default: cuda if available)")
    args = p.parse_args()
    if args.decode:
        return decode_bench(args)
    B, H, L, D, dtype = args.B, args.H, args.L, args.D, DTYPES[args.dtype or "bf16"]
    scale = D ** -0.5
    torch.manual_seed(0)
    xs = [torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(6)]

    print(f"$ python {' '.join(sys.argv)}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"shape B={B} H={H} L={L} D={D} window={args.window} dtype={args.dtype or 'bf16'}")
    if args.sweep:
        return sweep(args, xs, scale)

    skip = set(args.skip.split(","))
    cf = lambda bwd: castle_flops(B, H, L, D, bwd)  # noqa: E731
    results = []
    run("castle triton (ours)", lambda *a: castle_attn(*a, window=args.window, impl="triton"), xs, cf, results)
    if "sdpa" not in skip:
        run("SDPA causal (default backend), yardstick", lambda q, k, v, *_: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), xs, lambda bwd: sdpa_flops(B, H, L, D, bwd), results)
    if "blockwise" not in skip:
        run("castle blockwise torch (ours)", lambda *a: castle_attn(*a, window=args.window, impl="blockwise"),
            xs, cf, results)
    if "torch" not in skip:
        run("castle parallel torch, materialised", lambda *a: castle_attn(*a, window=args.window, impl="torch"),
            xs, cf, results)
        if dtype != torch.float32:  # the same form with every matmul in 16 bits on cuBLAS (what autocast does)
            def materialised_16bit(*a):
                with torch.autocast("cuda", dtype=dtype):
                    return castle_attn(*a, window=args.window, impl="torch")
            run("castle parallel torch, materialised, autocast 16-bit matmuls", materialised_16bit, xs, cf,
                results)
    peer = None if "peer" in skip else peer_fn()
    if peer is not None and args.window is None:
        small = [x[:1, :2, :256].detach().clone() for x in xs]
        ours = castle_attn(*small, impl="torch").float()
        err = ((peer(*small, scale).float() - ours).norm() / ours.norm()).item()
        print(f"peer vs our reference at B=1 H=2 L=256: rel err {err:.2e}")
        run("lookahead-keys-attention (PyPI)", lambda *a: peer(*a, scale), xs, cf, results)
    table(["implementation", "pass", "ms (median)", "TFLOP/s", "peak GiB", "note"], results)


if __name__ == "__main__":
    main()
