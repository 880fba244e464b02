"""Benchmark Forgetting Attention (kernels/forgetting/) against its peers on one GPU.

Side by side, median CUDA-event timings (triton.testing.do_bench) of the forward and of
forward+backward for:
  - ours: forgetting_attn(impl="triton");
  - the torch reference (materialized L x L), skipped when it would not fit in memory;
  - fla-core's parallel_forgetting_attn, when `fla` is importable (its native (B, L, H, D) layout);
  - FlexAttention (torch.compile) with the gate as a score_mod, score + c_i - c_j, c = cumsum(log f)
    in fp32 (a captured tensor that requires grad: flex's backward scatters its gradient);
  - SDPA causal with the FlashAttention backend: plain attention, no gate, the speed yardstick;
  - SDPA causal with the cuDNN backend, when it runs here: on Hopper faster than FlashAttention-2
    and SDPA's default there;
  - FlashAttention-4 causal, no gate (kernels/fa4.py, train.sdpa_backend=fa4), when `flash-attn-4` is
    installed: on Hopper faster than cuDNN.
TFLOP/s count the causal matmul FLOPs only, FlashAttention's convention: forward 2*B*H*L^2*D,
forward+backward 3.5x that, the same for every implementation.

    python -m scripts.bench_forgetting --L 2048 4096 8192 16384 --D 64 128 --dtype bf16

--window W times sliding-window attention (query i sees keys i-W+1 .. i; Transformer-SWA, FoX
arXiv:2503.02130 §F.4) instead: our kernels without the gate (softmax SWA, what model.attention_window
runs for the Transformer) and with it (FoX-SWA), each against FlexAttention with a sliding-window block
mask (and the gate as a score_mod for FoX), next to full causal attention: SDPA and our ungated kernels. A windowed row's TFLOP/s count
the FLOPs of the keys its window holds, 4*B*H*D*(L*W - W^2/2) forward.

    python -m scripts.bench_forgetting --window 2048 --L 4096 8192 16384 --D 64 128

The default shapes are the FoX issue's: 16 heads and B*L = 16384 tokens (B8 L2048 ... B1 L16384). The gate's
logits are randn + --gate-bias (0: f ~ 0.5, a fast decay; 6: f ~ 0.998, a slow one).

--prune-log-eps E adds our kernels with Adaptive Computation Pruning (prune_log_eps=E, arXiv:2504.06949) as
a row of its own, compared with the exact op, and prints the share of causal 128 x 128 blocks it keeps; what
it skips depends on the gate, so time it at the gate biases of interest:

    python -m scripts.bench_forgetting --D 64 --prune-log-eps -10 --gate-bias 0 4 8

One head dim over the four lengths takes minutes (compilation and autotuning of every
implementation included); `--show-tuning` prints every config's time.
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from kernels import fa4, forgetting
from kernels.forgetting.op import check_prune_log_eps
from kernels.forgetting.triton import acp_plan_of, bwd_tuned, fwd_tuned, padded_length, split_c

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OURS, REF, FLA, FLEX, SDPA, CUDNN, FA4 = (
    "FoX Triton (ours)", "FoX torch reference", "fla-core parallel_forgetting_attn",
    "FlexAttention, score_mod c_i - c_j", "SDPA flash causal (no gate)", "SDPA cuDNN causal (no gate)",
    "FlashAttention-4 causal (no gate)")
SWA, FLEX_SWA, FOX_SWA, FLEX_FOX_SWA, CAUSAL = (
    "SWA Triton, no gate (ours)", "FlexAttention SWA block mask", "FoX-SWA Triton (ours)",
    "FlexAttention SWA block mask, score_mod c_i - c_j", "causal Triton, no gate (ours, full)")


def load_fla():
    try:
        from fla.ops.forgetting_attn.parallel import parallel_forgetting_attn
        return parallel_forgetting_attn, None
    except Exception as e:  # not installed, or its imports fail: report and go on without it
        return None, f"{type(e).__name__}: {e}"


# one compiled graph per shape and grad mode: more than dynamo's default limit of 8 in one run
torch._dynamo.config.recompile_limit = 64


@torch.compile(dynamic=False)
def flex_fox(q, k, v, log_fgate, block_mask):
    """FoX as a researcher would write it with FlexAttention: the gate's cumsum as a score_mod."""
    c = torch.cumsum(log_fgate, -1)
    c_key = c.clone()  # flex's backward takes one index per tensor that requires grad (torch 2.11)
    return flex_attention(q, k, v, block_mask=block_mask,
                          score_mod=lambda s, b, h, i, j: s + c[b, h, i] - c_key[b, h, j])


@torch.compile(dynamic=False)
def flex_swa(q, k, v, block_mask):
    return flex_attention(q, k, v, block_mask=block_mask)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def pruned_name(log_eps):
    return f"FoX Triton, ACP log eps {log_eps:g} (ours)"


def acp_kept_share(q, k, log_fgate, log_eps):
    """The share of the causal 128 x 128 blocks that pruning with log_eps keeps on these inputs."""
    L = q.shape[2]
    c_parts = split_c(log_fgate.detach(), padded_length(L))
    skip, _ = acp_plan_of(q.detach(), k.detach(), c_parts, q.shape[-1] ** -0.5, log_eps, L)
    blocks = torch.arange(skip.shape[-1], device=q.device)
    return ((blocks - skip + 1).sum() / ((blocks + 1).sum() * skip.shape[0] * skip.shape[1])).item()


def implementations(q, k, v, log_fgate, fla, prune_log_eps=None):
    """name -> (forward callable, its inputs, upstream-gradient layout transposed?), and the pairs of
    names whose outputs and gradients are compared."""
    B, H, L, D = q.shape
    impls = {OURS: (lambda: forgetting.forgetting_attn(q, k, v, log_fgate, impl="triton"),
                    (q, k, v, log_fgate), False)}
    if prune_log_eps is not None:
        impls[pruned_name(prune_log_eps)] = (
            lambda: forgetting.forgetting_attn(q, k, v, log_fgate, prune_log_eps=prune_log_eps, impl="triton"),
            (q, k, v, log_fgate), False)
    ref_bytes = B * H * L * L * 40  # fp64 bias, fp32 logits/probabilities and their gradients
    if ref_bytes < 0.6 * torch.cuda.get_device_properties(0).total_memory:
        impls[REF] = (
            lambda: forgetting.forgetting_attn(q, k, v, log_fgate, impl="torch"), (q, k, v, log_fgate), False)
    causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device=q.device)
    impls[FLEX] = (lambda: flex_fox(q, k, v, log_fgate, causal), (q, k, v, log_fgate), False)
    if fla is not None and q.dtype != torch.float32:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        gt = log_fgate.detach().transpose(1, 2).contiguous().requires_grad_()
        impls[FLA] = (lambda: fla(qt, kt, vt, gt), (qt, kt, vt, gt), True)
    impls.update(sdpa_causal(q, k, v))
    pruned = [] if prune_log_eps is None else [(pruned_name(prune_log_eps), OURS)]
    return impls, [(OURS, name) for name in (REF, FLA, FLEX) if name in impls] + pruned


def window_implementations(q, k, v, log_fgate, window):
    """As implementations, for the sliding window: ours and FlexAttention, without and with the gate."""
    L = q.shape[2]
    band = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < window), None, None, L, L, device=q.device)
    impls = {
        SWA: (lambda: forgetting.forgetting_attn(q, k, v, None, window=window, impl="triton"), (q, k, v), False),
        FLEX_SWA: (lambda: flex_swa(q, k, v, band), (q, k, v), False),
        FOX_SWA: (lambda: forgetting.forgetting_attn(q, k, v, log_fgate, window=window, impl="triton"),
                  (q, k, v, log_fgate), False),
        FLEX_FOX_SWA: (lambda: flex_fox(q, k, v, log_fgate, band), (q, k, v, log_fgate), False),
        CAUSAL: (lambda: forgetting.forgetting_attn(q, k, v, None, impl="triton"), (q, k, v), False)}
    impls.update(sdpa_causal(q, k, v))
    return impls, [(SWA, FLEX_SWA), (FOX_SWA, FLEX_FOX_SWA)]


def sdpa_causal(q, k, v):
    """The rows without a gate (16-bit only): full causal attention through SDPA with FlashAttention, cuDNN
    where it runs, and FlashAttention-4 where it is installed."""
    impls = {}

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.dtype != torch.float32:
        impls[SDPA] = (sdpa, (q, k, v), False)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            cudnn()
            impls[CUDNN] = (cudnn, (q, k, v), False)
        except RuntimeError as e:  # no cuDNN attention for this GPU / shape: report and go on
            print(f"SDPA cuDNN backend unavailable: {e}".splitlines()[0], file=sys.stderr)
        try:
            fa4.fa4_interface()
            impls[FA4] = (lambda: fa4.fa4_causal_attention(q, k, v), (q, k, v), False)
        except ImportError as e:  # not installed: report and go on
            print(f"{FA4} skipped: {e}".splitlines()[0], file=sys.stderr)
    return impls


def forward_flops(B, H, L, D, window=None):
    """Matmul FLOPs of a causal forward over the keys each query sees: 4*B*H*D per (query, key) pair,
    L^2 / 2 pairs causal (FlashAttention's convention), L*W - W^2/2 with a window W."""
    W = L if window is None else min(window, L)
    return 4.0 * B * H * D * (L * W - W * W / 2)


def bench_shape(B, H, L, D, dtype, fla, window=None, gate_bias=0.0, prune_log_eps=None):
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    log_fgate = F.logsigmoid(torch.randn(B, H, L, device="cuda") + gate_bias).requires_grad_()
    do = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
    do_t = do.transpose(1, 2).contiguous()
    if window is None:
        impls, compared = implementations(q, k, v, log_fgate, fla, prune_log_eps)
    else:
        impls, compared = window_implementations(q, k, v, log_fgate, window)
    windowed = {SWA, FLEX_SWA, FOX_SWA, FLEX_FOX_SWA}
    outputs, setup = {}, {}
    for name, (fn, inputs, transposed) in list(impls.items()):
        t0 = time.time()  # the first forward+backward compiles and autotunes
        try:
            out = fn()
            grads = torch.autograd.grad(out, inputs, do_t if transposed else do)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as e:  # a peer that needs more memory: report and go on
            print(f"L={L} D={D}: {name} skipped, {e}".splitlines()[0], file=sys.stderr)
            del impls[name]
            continue
        setup[name] = time.time() - t0
        back = (lambda x: x.transpose(1, 2)) if transposed else (lambda x: x)
        outputs[name] = [back(x) for x in (out.detach(), *grads)]
        del out, grads
        torch.cuda.empty_cache()
    # timed once everything is compiled, in two passes, each implementation's faster median kept: at
    # L = 2048 a forward takes ~0.3 ms, so the timing is close to host-bound, and a transient slowdown
    # of the host (seen right after autotuning in the same process) made single passes up to 2x slow
    times = {name: [] for name in impls}
    for _ in range(2):
        for name, (fn, inputs, transposed) in impls.items():
            grad = do_t if transposed else do
            with torch.no_grad():
                t_fwd = triton.testing.do_bench(fn, return_mode="median")
            t_all = triton.testing.do_bench(lambda: fn().backward(grad), grad_to_none=list(inputs),
                                            return_mode="median")
            times[name].append((t_fwd, t_all))
    rows = []
    for name, runs in times.items():
        t_fwd, t_all = (min(t) for t in zip(*runs))
        flops_fwd = forward_flops(B, H, L, D, window if name in windowed else None)
        rows.append((name, t_fwd, flops_fwd / t_fwd * 1e-9, t_all, 3.5 * flops_fwd / t_all * 1e-9))
    # the same function as the peers? (SDPA has no gate, nor a window)
    notes = [f"{ours} vs {peer}: rel err of o, dq, dk, dv[, d log f] "
             + ", ".join(f"{rel_err(a, b):.1e}" for a, b in zip(outputs[ours], outputs[peer]))
             for ours, peer in compared if ours in outputs and peer in outputs]
    if prune_log_eps is not None:
        notes.append(f"ACP log eps {prune_log_eps:g}: keeps {acp_kept_share(q, k, log_fgate, prune_log_eps):.1%} of "
                     f"the causal 128 x 128 blocks (gate bias {gate_bias:g})")
    notes.append("first fwd+bwd call (compile, autotune) s: " + ", ".join(f"{n} {t:.1f}" for n, t in setup.items()))
    return rows, notes


def tuning_report(shape):
    """Median ms of every config the autotuners tried for the latest new shape."""
    lines = []
    for name, tuner in (("fwd", fwd_tuned), ("bwd", bwd_tuned)):
        timings = sorted(getattr(tuner, "configs_timings", {}).items(), key=lambda kv: kv[1][0])
        lines += [f"tuning {shape} {name}: {t[0]:.3f} ms  {cfg}" for cfg, t in timings]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--L", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--D", type=int, nargs="+", default=[64, 128])
    p.add_argument("--B", type=int, default=None, help="batch; default 16384 // L (at least 1)")
    p.add_argument("--H", type=int, default=None, help="heads; default 16")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--window", type=int, default=None,
                   help="time sliding-window attention over the last W positions instead (ours vs FlexAttention)")
    p.add_argument("--gate-bias", type=float, nargs="+", default=[0.0],
                   help="log f = logsigmoid(randn + bias), one table block per bias; larger: slower decay")
    p.add_argument("--prune-log-eps", type=float, default=None,
                   help="also time our kernels with Adaptive Computation Pruning at this log(eps) < 0")
    p.add_argument("--show-tuning", action="store_true", help="print every autotuned config's time")
    args = p.parse_args()
    if args.window is not None and args.window < 1:
        p.error(f"--window {args.window}: the window must be >= 1")
    try:
        check_prune_log_eps(args.prune_log_eps, "--prune-log-eps")
    except ValueError as e:
        p.error(str(e))
    if args.prune_log_eps is not None and args.window is not None:
        p.error("--prune-log-eps times the full causal op; leave out --window")

    t0 = time.time()
    fla, fla_error = load_fla()
    print(f"command: python {' '.join(sys.argv)}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("fla-core: " + (f"imported in {time.time() - t0:.0f} s" if fla else f"not available ({fla_error})"))
    if args.window is not None:
        print(f"sliding window W = {args.window}: query i sees keys i-W+1 .. i (SDPA rows: full causal)")
    print()
    print("| gate bias | B | H | L | D | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
          "| time / SDPA fwd, fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for gate_bias, D, L in ((g, D, L) for g in args.gate_bias for D in args.D for L in args.L):
        B = args.B or max(1, 16384 // L)
        H = args.H or 16
        rows, notes = bench_shape(B, H, L, D, DTYPES[args.dtype], fla, args.window, gate_bias, args.prune_log_eps)
        sdpa = {r[0]: r for r in rows}.get(SDPA)
        for name, t_fwd, tf_fwd, t_all, tf_all in rows:
            ratio = f"{t_fwd / sdpa[1]:.2f}, {t_all / sdpa[3]:.2f}" if sdpa else "-"
            print(f"| {gate_bias:g} | {B} | {H} | {L} | {D} | {name} | {t_fwd:.3f} | {tf_fwd:.0f} | {t_all:.3f} "
                  f"| {tf_all:.0f} | {ratio} |", flush=True)
        # side notes go to stderr, keeping the table on stdout in one piece
        notes = [f"L={L} D={D}: {n}" for n in notes]
        notes += tuning_report(f"L={L} D={D}") if args.show_tuning else []
        print("\n".join(notes), file=sys.stderr, flush=True)
    print()
    for name, tuner in (("forward", fwd_tuned), ("backward", bwd_tuned)):
        for key, cfg in tuner.cache.items():
            print(f"autotuned {name} {key}: {cfg}")


if __name__ == "__main__":
    main()
